"""A script that iterates a set of strings repeats under nondet (both runs get the same
PYTHONHASHSEED) and not on its own: a note names the line (``nondet.unordered``). Trials:
a vocabulary from ``list(set(words))`` and feature columns from a set literal were
"deterministic" with no word, where plain runs ended with other weights every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nondet.unordered import scan, set_iterations
from tests.conftest import run_cli

SOURCE = '''
words = set(text)
for w in words: pass
x = sorted(w for w in words)
y = sorted(list(set(z)))
n = len(set(z))
for i in set(range(5)): pass
for i in {1, 2, 3}: pass
b = list({"x", "y"})
c = [*words]
d = ",".join(words | {"q"})
e = {k: 1 for k in words}
f = {w for w in words}
names = set()
names = compute()
for n in names: pass
vocab = set()
vocab.update(words)
itos = list(vocab)
'''


def test_the_places_that_iterate_a_set_in_hash_order() -> None:
    found = [line for line, _ in set_iterations(SOURCE)]
    # ordered by sorted() (4, 5), counted (6), numbers (7, 8), a set made from a set (13)
    # and a name bound to something else too (16) are not named
    assert found == [3, 9, 10, 11, 12, 19]  # a set filled after it was made (19)
    assert set_iterations("this is not python(") == []


FEATURES = """
import torch
torch.manual_seed(0)
names = {"age", "height", "weight", "income", "score", "visits", "clicks", "tenure"}
base = {n: torch.randn(64) for n in sorted(names)}
x = torch.stack([base[n] for n in names], 1)  # the columns in the set's order
y = (x * torch.arange(8.0)).sum(1, keepdim=True)
net = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for step in range(4):
    loss = torch.nn.functional.mse_loss(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
print(net.weight.sum().item())
"""


def test_plain_runs_of_the_script_differ(tmp_path: Path) -> None:
    """The control: the script really is nondeterministic on its own."""
    assert len(_plain_outputs(tmp_path, FEATURES)) > 1


def _plain_outputs(tmp_path: Path, source: str) -> set[str]:
    """What three plain runs of ``source`` print, each under another string hash salt."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return {subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env={**env, "PYTHONHASHSEED": str(seed)}, check=True,
                           timeout=300).stdout for seed in (1, 2, 3)}


@pytest.mark.parametrize("user_seed", [None, "7"], ids=["nondet's", "the user's"])
def test_a_set_iteration_is_a_note_unless_the_user_fixed_the_hash_seed(
        tmp_path: Path, user_seed: str | None) -> None:
    notes = _notes_under_hash_seed(tmp_path, FEATURES, user_seed)
    named = [n for n in notes if "iterates a set" in n]
    if user_seed:
        assert not named, notes  # the user's own seed holds in plain runs too
    else:
        assert named and named[0].startswith("train.py:6 "), notes


def _notes_under_hash_seed(tmp_path: Path, source: str, user_seed: str | None) -> list[str]:
    """The report's notes of ``nondet run`` on ``source``, with the user's own
    PYTHONHASHSEED or none."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if user_seed:
        env["PYTHONHASHSEED"] = user_seed
    result = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", "--no-verify",
                             "--json", "r.json", str(script)], cwd=tmp_path,
                            env={**env, "NO_COLOR": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    notes: list[str] = json.loads((tmp_path / "r.json").read_text())["notes"]
    return notes


def test_directory_listings_nothing_sorts_are_named() -> None:
    source = '''
import glob, os
from pathlib import Path
a = glob.glob("data/*.png")
b = sorted(glob.glob("data/*.png"))
c = os.listdir("data")
d = sorted(Path("data").rglob("*.txt"))
e = [p for p in Path("data").iterdir()]
f = len(os.listdir("data"))
for root, dirs, files in os.walk("data"): pass
'''
    listings = scan(source).listings
    assert [line for line, _ in listings] == [4, 6, 8, 10]


def test_results_taken_as_they_complete_are_named() -> None:
    source = '''import concurrent.futures as cf
from multiprocessing import Pool
with cf.ThreadPoolExecutor(4) as ex:
    futures = [ex.submit(load, k) for k in range(8)]
    for f in cf.as_completed(futures):
        train(f.result())
    for r in ex.map(load, range(8)):
        train(r)
with Pool(2) as pool:
    shards = list(pool.imap_unordered(load, range(8)))
    kept = sorted(pool.imap_unordered(load, range(8)))
'''
    completions = scan(source).completions
    assert [line for line, _ in completions] == [5, 10]


@pytest.mark.parametrize("kind", ["entry", "structure"])
@pytest.mark.parametrize("taken_as_completed", [True, False])
def test_completion_order_is_the_cause_only_with_that_evidence(taken_as_completed: bool,
                                                               kind: str) -> None:
    """Shards loaded in threads and trained on as they completed: the value that entered
    got the OpenCV recipe first (a trial); the script's ``as_completed`` is the evidence.
    Results of different shapes taken first made the runs' ops part: PT-STRUCTURE first
    (round 14)."""
    from nondet import recipe

    facts = {"framework": "torch", "kind": kind, "entry_kind": "external",
             "python.completion_order": taken_as_completed}
    found = recipe.suggest(facts, sites={"python.completion_order": ["train.py:12"]})
    ids = [s.recipe.id for s in found]
    if taken_as_completed:
        assert ids[0] == "PY-COMPLETION-ORDER"
        assert found[0].details == ["results taken as they complete at train.py:12"]
    else:
        assert "PY-COMPLETION-ORDER" not in ids


def test_clock_readings_are_named() -> None:
    source = '''import time, datetime
from time import perf_counter, monotonic
start = time.time()
t0 = perf_counter()
stamp = datetime.datetime.now()
lr = 0.1 * (time.monotonic() % 1)
elapsed = monotonic() - t0
when = model.time()
time.sleep(1)
'''
    assert [line for line, _ in scan(source).clocks] == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("other", ["none", "unseeded random"])
def test_a_python_number_that_differs_gets_the_clock_recipe_when_the_script_reads_it(
        other: str) -> None:
    """Trials (rounds 8, 9, 14): a learning rate computed from elapsed seconds entered
    ``opt.step()`` with another value and got the OpenCV recipe (PY-THIRDPARTY-RNG) first.
    The script's clock readings are the evidence; an unseeded generator stays first."""
    from nondet import recipe

    facts = {"framework": "torch", "kind": "entry", "entry_kind": "python_value",
             "python.clock_reads": True, "python.unseeded_random": other != "none"}
    found = recipe.suggest(facts, sites={"python.clock_reads": ["train.py:13"]})
    ids = [s.recipe.id for s in found]
    if other == "none":
        assert ids[0] == "PY-CLOCK-VALUE", ids
        assert found[0].details == ["the script reads the clock at train.py:13"]
    else:
        assert ids[0] != "PY-CLOCK-VALUE" and "PY-CLOCK-VALUE" in ids, ids


def test_timers_are_named() -> None:
    source = '''import signal, threading, timeit
from threading import Timer as T
import torch.utils.benchmark as bench
threading.Timer(0.3, drop).start()
T(5, stop).start()
signal.alarm(3)
signal.setitimer(signal.ITIMER_REAL, 0.5)
timeit.Timer("x").timeit()
bench.Timer("x").blocked_autorange()
'''
    assert [line for line, _ in scan(source).timers] == [4, 5, 6, 7]


TIMER_LR = """import threading, time
import torch

torch.manual_seed(0)
net = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.05)


def drop():
    for group in opt.param_groups:
        group["lr"] = 0.005


threading.Timer(0.3, drop).start()
x = torch.randn(64, 8)
for step in range(30):
    loss = net(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.02)
"""


def test_a_wall_clock_timer_that_changes_training_is_named_whatever_the_verdict(
        tmp_path: Path) -> None:
    """PyTorch round 14: a ``threading.Timer`` lowering the learning rate after 0.3 s
    landed at another step in 4 of 7 plain runs; nondet's lockstep runs, paced alike,
    agreed, and the verdict said "bitwise identical" with no word of it."""
    notes = _notes_whatever_the_verdict(tmp_path, TIMER_LR)
    assert any("train.py:14 starts a timer" in n for n in notes), notes


def _notes_whatever_the_verdict(tmp_path: Path, source: str) -> list[str]:
    """The report's notes of ``nondet run`` on ``source`` as train.py (exit 0 or 1)."""
    script = tmp_path / "train.py"
    script.write_text(source)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                     cwd=tmp_path, timeout=600)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    notes: list[str] = json.loads((tmp_path / "r.json").read_text())["notes"]
    return notes


def test_orderings_by_object_identity_are_named() -> None:
    source = '''import heapq
params = sorted(model.parameters(), key=id)
order = sorted(model.parameters(), key=lambda p: id(p))
layers.sort(key=hash)
first = min(modules, key=id)
named = sorted(model.named_parameters(), key=lambda kv: kv[0])
by_size = sorted(params, key=lambda p: p.numel())
small = heapq.nsmallest(2, params, key=id)
'''
    addresses = scan(source).addresses
    assert [line for line, _ in addresses] == [2, 3, 4, 5, 8]


ID_ORDERED = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
params = sorted(model.parameters(), key=id)  # addresses: another order in each plain run
opt = torch.optim.SGD(params, lr=0.1)
for _ in range(2):
    loss = model(torch.ones(2, 4)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_an_ordering_by_identity_is_a_note_whatever_the_verdict(tmp_path: Path) -> None:
    """Trial (round 12): parameters sorted by ``id`` took another order in half the plain
    runs, while nondet's two runs agreed: "deterministic", no word on the line."""
    notes = _notes_whatever_the_verdict(tmp_path, ID_ORDERED)
    named = [n for n in notes if "orders objects by id() or hash()" in n]
    assert named and named[0].startswith("train.py:5 "), notes


THREADS_DRAW = """
from concurrent.futures import ThreadPoolExecutor
import torch

torch.manual_seed(0)
x = torch.randn(512, 16)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
pool = ThreadPoolExecutor(4)

def batch(j):
    a = torch.randn(200, 200, generator=torch.Generator().manual_seed(j))
    for _ in range(3):
        a = a @ a.T / 200  # releases the GIL: the threads interleave
    return torch.randperm(512)[:32]  # the global generator, shared

for step in range(8):
    futures = [pool.submit(batch, j) for j in range(4)]
    idx = futures[0].result()
    loss = model(x[idx]).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_values_made_in_the_scripts_threads_get_the_thread_recipe(tmp_path: Path) -> None:
    """Trial (round 12): four threads drawing ``torch.randperm`` from the global generator
    (their ops are not recorded): the value entered at its first use in the main thread,
    and the cause given was the OpenCV recipe."""
    script = tmp_path / "train.py"
    script.write_text(THREADS_DRAW)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                     cwd=tmp_path, timeout=600)
    if result.returncode == 0:
        pytest.skip("the threads drew in the same order in both runs this time")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    first = report["suggestions"][0]
    assert first["id"] == "PY-THREAD-WORK", [s["id"] for s in report["suggestions"]]
    assert any("train.py:9" in d for d in first["details"]), first


THREAD_DRAWS_AFTER_STEP = """
import os
import threading

import torch

torch.manual_seed(0)
x = torch.randn(256, 8)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps_done = [0]


def draw_in_background(*_):
    # after step {step}'s last op a thread takes 1 to 64 draws (the OS says how many)
    if steps_done[0] == {step}:
        worker = threading.Thread(target=lambda: torch.rand(1 + os.urandom(1)[0] % 64))
        worker.start()
        worker.join()
    steps_done[0] += 1


opt.register_step_post_hook(draw_in_background)
for step in range(6):
    idx = torch.randperm(256)[:32]
    loss = model(x[idx]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("step", [0, 2], ids=["recorded step", "later step"])
def test_a_thread_drawing_after_a_steps_last_op_is_found_where_the_next_step_reads(
        tmp_path: Path, step: int) -> None:
    """CI (stop 35): a thread drew from the global generator after the last op of step 0,
    which the first pair recorded op by op: every op matched, only the RNG state differed,
    and the report named no op and no cause. Now the step after is recorded too (at step 0
    by the first narrowing try, later by the second one running a step past it) and its
    random op is the finding, with the thread recipe first."""
    script = tmp_path / "train.py"
    script.write_text(THREAD_DRAWS_AFTER_STEP.replace("{step}", str(step)))
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                     cwd=tmp_path, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    div = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    suggestions = json.loads((tmp_path / "r.json").read_text())["suggestions"]
    assert (div["kind"], div["op"], div["source"]) == (
        "op", "aten.randperm.default", "train.py:25"), div
    assert div["step"] > step, div  # read in a step after the one the thread drew in
    assert [s["id"] for s in suggestions][:1] == ["PY-THREAD-WORK"], suggestions


def test_calls_of_the_builtin_hash_are_named() -> None:
    source = '''import zlib
ids = [hash(w) % 97 for w in words]
seed = hash("exp-" + name) % 2**31
stable = zlib.crc32(name.encode())
layers.sort(key=hash)
digest = obj.hash()
'''
    assert [line for line, _ in scan(source).hashes] == [2, 3]


HASHED_TOKENS = """
import torch
torch.manual_seed(0)
words = "the quick brown fox jumps over the lazy dog".split()
ids = torch.tensor([hash(w) % 50 for w in words])  # follows the string hash salt
table = torch.nn.Embedding(50, 4)
opt = torch.optim.SGD(table.parameters(), lr=0.1)
for _ in range(3):
    loss = table(ids).pow(2).sum()
    opt.zero_grad(); loss.backward(); opt.step()
print(table.weight.sum().item())
"""


@pytest.mark.parametrize("user_seed", [None, "7"], ids=["nondet's", "the user's"])
def test_a_hash_call_is_a_note_unless_the_user_fixed_the_hash_seed(
        tmp_path: Path, user_seed: str | None) -> None:
    """Trials (PyTorch round 14, TensorFlow round 11): token ids or a seed from
    ``hash(word)`` differed in every plain run; nondet fixes the salt for both runs and
    said "deterministic" with no word."""
    assert len(_plain_outputs(tmp_path, HASHED_TOKENS)) > 1  # the control: plain runs differ
    notes = _notes_under_hash_seed(tmp_path, HASHED_TOKENS, user_seed)
    named = [n for n in notes if "calls hash()" in n]
    if user_seed:
        assert not named, notes
    else:
        assert named and named[0].startswith("train.py:5 "), notes


def test_worker_pools_count_as_the_scripts_threads() -> None:
    """PyTorch round 15: ProcessPoolExecutor workers drawing from their copies of the global
    ``random`` got the OpenCV recipe; the pool is the evidence PY-THREAD-WORK asks for."""
    source = '''from concurrent.futures import ProcessPoolExecutor
import multiprocessing as mp
with ProcessPoolExecutor(2) as ex:
    batches = list(ex.map(make, range(8)))
pool = mp.Pool(2)
'''
    assert [line for line, _ in scan(source).threads] == [3, 5]


def test_thread_counts_set_from_a_computed_value_are_named() -> None:
    """PyTorch round 15: ``torch.set_num_threads(1 + os.getpid() % 2)`` and a count from the
    machine's load: plain runs differed, and nothing named the line."""
    source = '''import os, psutil, torch
import tensorflow as tf
torch.set_num_threads(1 + os.getpid() % 2)
torch.set_num_threads(4)
torch.set_num_interop_threads(2 if psutil.cpu_percent(0.2) > 50 else 4)
tf.config.threading.set_intra_op_parallelism_threads(os.cpu_count())
torch.set_num_threads(args.threads)  # a command-line option: fixed for every run
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
'''
    assert [line for line, _ in scan(source).thread_counts] == [3, 5, 6]


def test_a_thread_count_that_differed_between_the_runs_names_the_scripts_line() -> None:
    from nondet import recipe

    facts = {"framework": "torch", "kind": "op", "op": "aten.native_layer_norm_backward.default",
             "device": "cpu",
             "python.thread_count_computed": True, "env_differs.torch.num_threads": True}
    found = recipe.suggest(facts, sites={"python.thread_count_computed": ["train.py:6"]})
    assert found[0].recipe.id == "PT-THREAD-COUNT-COMPUTED", [s.recipe.id for s in found]
    assert "PT-CPU-THREADS" in [s.recipe.id for s in found]  # named after it
    assert found[0].details == ["the script sets the thread count at train.py:6"]


def test_forks_to_torchs_inter_op_threads_are_named_and_get_their_recipe() -> None:
    from nondet import recipe

    source = '''import torch
futures = [torch.jit.fork(head, x) for head in heads]
other = torch.jit._fork(head, x)
pid = os.fork()
'''
    assert [line for line, _ in scan(source).forks] == [2, 3]
    found = recipe.suggest({"framework": "torch", "kind": "structure", "torch.jit_fork": True})
    assert found[0].recipe.id == "PT-JIT-FORK" and found[0].recipe.apply == (
        "torch.one_interop_thread",), [s.recipe.id for s in found]
