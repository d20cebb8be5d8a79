"""Seeding calls: recorded in the child with value and line (``seeding``, ``pyhooks``,
``frameworks/torch/seeding``), compared in the parent (``seed_diff``), and run b's clock
moved ahead (``clock``). Hooks are installed on a fake session and removed afterwards."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nondet import analysis, clock, frameworks, pyhooks, seed_diff, seeding
from nondet import session as session_module
from nondet.records import Flag
from nondet.session import SourceLocator
from nondet.store import open_capture
from tests.conftest import OpStream, step_rows, write_capture


class FakeSession:
    """What the hooks use of ``session.Session``: config, step, strings, sources, facts."""

    def __init__(self, script: Path) -> None:
        self.config = type("Config", (), {"script": str(script), "seed": 0})()
        self.step = -1
        self._strings: list[str] = []
        self.sources = SourceLocator(self)  # type: ignore[arg-type]
        self.facts: dict[str, Any] = {}
        self.meta: list[dict[str, Any]] = []
        self.step_listeners: list[Any] = []

    def intern(self, text: str) -> int:
        if text not in self._strings:
            self._strings.append(text)
        return self._strings.index(text)

    def string(self, sid: int) -> str:
        return self._strings[sid]

    def send_facts(self, facts: dict[str, Any]) -> None:
        self.facts.update(json.loads(json.dumps(facts)))  # as the parent receives them

    def send_meta(self, meta: dict[str, Any]) -> None:
        self.meta.append(meta)

    def seeds(self) -> list[tuple[str, str, str, list[str]]]:
        return [(v["api"], v["site"], v["library"], [c[2] for c in v["calls"]])
                for k, v in sorted(self.facts.items()) if k.startswith(seeding.SEED_FACT_PREFIX)]


def _restore_keras_seed_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keras' ``set_random_seed`` is wrapped in every module holding it (pyhooks): put each
    back after the test."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and "set_random_seed" in namespace \
                and module.__name__.partition(".")[0] in pyhooks.KERAS_SEED_SOURCES:
            monkeypatch.setattr(module, "set_random_seed", namespace["set_random_seed"])


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> FakeSession:
    """A session whose hooks are all undone after the test (monkeypatch restores)."""
    for owner, name in ((np.random, "default_rng"), (np.random, "seed"),
                        (np.random, "RandomState"), (np.random, "SeedSequence"),
                        *((np.random, name) for name in pyhooks._BIT_GENERATORS),
                        (random, "seed")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(random.Random, "__init__", random.Random.__init__)
    monkeypatch.setattr(frameworks, "_watchers", {})  # pyhooks waits for keras there
    _restore_keras_seed_after(monkeypatch)  # imported by an earlier test: wrapped at once
    fake = FakeSession(Path(__file__))  # the user's "script" lives in tests/
    monkeypatch.setattr(session_module, "_CURRENT", fake)
    monkeypatch.setattr(seeding, "_LOG", None)
    pyhooks.install(fake)  # type: ignore[arg-type]
    return fake


def _line_of(text: str) -> str:
    """"tests/test_seeding.py:N" of the line in this file that contains ``text``."""
    lines = Path(__file__).read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)
    return f"{Path(__file__).relative_to(Path.cwd())}:{number}"


def test_python_and_numpy_seeding_calls_are_recorded_with_value_and_line(
        session: FakeSession) -> None:
    random.seed(11)  # seed-call-1
    np.random.seed(12)  # seed-call-2
    np.random.default_rng(13)  # seed-call-3
    np.random.RandomState(14)  # seed-call-4
    random.Random(15)  # seed-call-5
    random.seed(b"\x01\x02")  # seed-call-6
    assert session.seeds() == [
        ("random.seed", _line_of("seed-call-1"), "", ["11"]),
        ("np.random.seed", _line_of("seed-call-2"), "", ["12"]),
        ("np.random.default_rng", _line_of("seed-call-3"), "", ["13"]),
        ("np.random.RandomState", _line_of("seed-call-4"), "", ["14"]),
        ("random.Random", _line_of("seed-call-5"), "", ["15"]),
        ("random.seed", _line_of("seed-call-6"), "", [seeding.seed_value(b"\x01\x02")]),
    ]
    assert not session.meta  # no hook error


def test_repeated_calls_at_one_site_keep_their_order(session: FakeSession) -> None:
    for args, kwargs in (((3,), {}), ((1,), {}), ((), {"a": 2})):
        random.seed(*args, **kwargs)
    [(api, _, _, values)] = session.seeds()
    assert api == "random.seed" and values == ["3", "1", "2"]


def test_odd_arguments_raise_only_the_functions_own_error(session: FakeSession) -> None:
    with pytest.raises(TypeError):
        random.seed(object())  # random's own TypeError: the script's to handle
    with pytest.raises((TypeError, ValueError)):
        np.random.seed("not a seed")
    assert not session.meta  # nondet itself did not fail
    # an object of an unknown type is recorded by type, never by its (address-bearing) repr
    assert session.seeds()[0][3] == ["<builtins.object>"]


def test_a_failing_hook_never_reaches_the_script(session: FakeSession,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(facts: dict[str, Any]) -> None:
        raise RuntimeError("pipe gone")

    monkeypatch.setattr(session, "send_facts", broken)
    random.seed(5)  # must not raise
    assert random.random() == random.Random(5).random()  # and still seeded
    assert any("pipe gone" in m.get("hook_error", "") for m in session.meta)


def test_unseeded_calls_are_notes_not_seeds(session: FakeSession) -> None:
    np.random.default_rng()  # unseeded-here
    random.Random()
    assert session.seeds() == []
    assert session.facts["numpy.unseeded_generator"] == [_line_of("unseeded-here")]


def test_isinstance_still_holds_for_every_random_state(session: FakeSession) -> None:
    assert isinstance(np.random.mtrand._rand, np.random.RandomState)
    made = np.random.RandomState(3)
    assert isinstance(made, np.random.mtrand.RandomState)
    assert made.randint(1000) == np.random.mtrand.RandomState(3).randint(1000)


def _library(tmp_path: Path, body: str) -> Any:
    """A module outside the script's directory (a library), imported from there."""
    folder = tmp_path / "somelib"
    folder.mkdir()
    (folder / "__init__.py").write_text(textwrap.dedent(body))
    sys.path.insert(0, str(tmp_path))
    try:
        import somelib  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("somelib", None)
    return somelib


def test_a_library_generator_names_library_and_user_frames(session: FakeSession,
                                                           tmp_path: Path) -> None:
    lib = _library(tmp_path, """
        import numpy as np

        class Aug:
            def __init__(self):
                self.rng = np.random.default_rng()

        def seed_everything(seed):
            np.random.seed(seed)
    """)
    lib.Aug()  # made-from-here
    lib.seed_everything(4)  # seed-everything-here
    user = _line_of("made-from-here")
    assert session.facts[pyhooks.LIBRARY_UNSEEDED] == [
        f"somelib/__init__.py:6 in somelib, made from {user}"]
    assert session.facts[f"{pyhooks.LIBRARY_UNSEEDED}.somelib"] is True
    assert "numpy.unseeded_generator" not in session.facts
    assert session.seeds() == [("np.random.seed", _line_of("seed-everything-here"),
                                "somelib/__init__.py:9", ["4"])]


def test_library_generators_let_go_without_a_draw_are_left_out(session: FakeSession,
                                                              tmp_path: Path) -> None:
    """Albumentations' shape: every transform makes its own unseeded generators and Compose
    replaces them at once with ones seeded from its own: only Compose's can matter."""
    lib = _library(tmp_path, """
        import random
        import numpy as np

        class Transform:
            def __init__(self):
                self.rng = np.random.default_rng()
                self.py = random.Random()

        class Compose:
            def __init__(self, transforms):
                self.rng = np.random.default_rng()
                for t in transforms:
                    t.rng = np.random.default_rng(int(self.rng.integers(1 << 31)))
                    t.py = random.Random(0)
    """)
    compose = lib.Compose([lib.Transform(), lib.Transform()])  # compose-here
    for listener in session.step_listeners:
        listener(-1)  # the init step ends
    made = session.facts[pyhooks.LIBRARY_UNSEEDED]
    assert len(made) == 3, made  # two lines in Transform, one in Compose
    kept, left_out = seed_diff.library_generators(session.facts)
    assert kept == [f"somelib/__init__.py:12 in somelib, made from {_line_of('compose-here')}"]
    assert left_out == 2
    assert compose.rng is not None


@pytest.mark.parametrize("workers", [0, 2])
def test_library_generators_that_never_moved_count_only_where_workers_may_draw(
        session: FakeSession, tmp_path: Path, workers: int) -> None:
    """PyTorch round 15: generators sympy and more_itertools make at import (module level,
    never drawn) came first as PY-LIB-GENERATOR for a clock value the script passed to a
    library. Alive and never moved in the main process, they fed nothing; with DataLoader
    workers they may have been drawn where nondet's follower does not look."""
    lib = _library(tmp_path, """
        import random
        RNG = random.Random()  # module level, at import, never drawn
    """)
    assert lib.RNG is not None
    for listener in session.step_listeners:
        listener(0)  # a step ends: the generator's state is read
    facts = dict(session.facts)
    if workers:
        facts["dataloader#0"] = {"loader.num_workers": workers}
    kept, _ = seed_diff.library_generators(facts)
    assert len(kept) == (1 if workers else 0), kept


def test_calls_by_frameworks_and_nondet_are_not_recorded(session: FakeSession) -> None:
    for package in ("torch.utils.data.sampler", "nondet.boot"):
        exec("import random; random.seed(3); import numpy; numpy.random.default_rng()",
             {"__name__": package})
    assert session.seeds() == [] and "numpy.unseeded_generator" not in session.facts


def test_a_framework_seeding_with_the_users_clock_reading_is_recorded(
        session: FakeSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # Trial round 13: ``SobolEngine(seed=int(time.time()))`` and PowerSGD's
    # ``random_seed=time.time_ns()`` hand the user's clock reading to torch, which seeds
    # with it: no RNG state covers that number. It was left out as a framework's own call,
    # and the finding named the first random op with "torch.manual_seed" as its fix.
    monkeypatch.setattr(clock, "_READS", {("train.py", 3): (1795454799.25, None)})
    framework_call = "import random; random.seed(SEED)"
    for package in ("torch.quasirandom", "numpy.random", "nondet.boot"):
        exec(framework_call.replace("SEED", "1795454799"), {"__name__": package})  # torch-clock
    for package in ("torch.quasirandom", "nondet.boot"):
        exec(framework_call.replace("SEED", "4242"), {"__name__": package})  # its own seed
    seeds = session.seeds()
    assert [(api, site, values) for api, site, _, values in seeds] == [
        ("random.seed", _line_of("torch-clock"), ["1795454799", "1795454799"])], seeds
    assert seeds[0][2].startswith("<string>:")  # the framework's frame that made the call
    monkeypatch.setattr(seeding, "PINNED", 1000)  # the pin_seeds fix pins it too
    exec(framework_call.replace("SEED", "1795454799"), {"__name__": "torch.quasirandom"})
    pinned = random.getstate()
    monkeypatch.setattr(seeding, "PINNED", None)
    exec(framework_call.replace("SEED", "1000"), {"__name__": "nondet.boot"})
    assert random.getstate() == pinned


def test_forked_children_record_nothing(session: FakeSession,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "_CURRENT", None)  # as boot._forget_session leaves it
    random.seed(3)
    assert session.seeds() == []


def test_torch_seeding_calls_are_recorded(session: FakeSession,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from nondet.frameworks.torch import seeding as torch_seeding

    for owner, name in ((torch, "manual_seed"), (torch.random, "manual_seed"),
                        (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"),
                        (torch, "Generator")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    torch_seeding.install(session)  # type: ignore[arg-type]
    torch.manual_seed(21)  # torch-seed-here
    g = torch.Generator().manual_seed(22)  # generator-seed-here
    assert session.seeds() == [
        ("torch.manual_seed", _line_of("torch-seed-here"), "", ["21"]),
        ("torch.Generator.manual_seed", _line_of("generator-seed-here"), "", ["22"])]
    assert isinstance(torch.default_generator, torch.Generator) and g.initial_seed() == 22
    with pytest.raises(ValueError, match="invalid literal"):
        torch.manual_seed("x")  # torch's own error
    assert not session.meta


def test_pinned_seeds_reach_random_and_random_state_instances(
        session: FakeSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``random.Random(seed)`` and ``np.random.RandomState(seed)`` are recorded seeding calls:
    # the pin_seeds fix must pin them as it pins ``random.seed`` (a number; a string seed
    # is left as it is).
    want = (random.Random(500).random(), random.Random("text").random(),
            np.random.RandomState(501).rand())  # before the pin: as given
    monkeypatch.setattr(seeding, "PINNED", 500)
    got = (random.Random(987654).random(), random.Random("text").random(),
           np.random.RandomState(13579).rand())
    assert got == want
    recorded = [value for site in session.seeds() for value in site[3]]
    assert recorded.count("500") == 2 and recorded.count("501") == 2  # the pinned, recorded
    assert "987654" not in recorded and "13579" not in recorded


def test_pinned_seeds_reach_a_torch_generator_too(session: FakeSession,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The pin_seeds fix verifies a seed read from the clock; a generator seeded with one
    # (``torch.Generator().manual_seed(int(time.time()))``) must get the pinned seed too,
    # else the fix "did not help" (found by h-kernreal on a plain GPT-2 loop).
    torch = pytest.importorskip("torch")
    from nondet.frameworks.torch import seeding as torch_seeding

    for owner, name in ((torch, "manual_seed"), (torch.random, "manual_seed"),
                        (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"),
                        (torch, "Generator")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    torch_seeding.install(session)  # type: ignore[arg-type]
    monkeypatch.setattr(seeding, "PINNED", 1000)
    torch.manual_seed(123456)
    g = torch.Generator().manual_seed(654321)
    assert torch.initial_seed() == 1000 and g.initial_seed() == 1001
    assert [s[3] for s in session.seeds()] == [["1000"], ["1001"]]


# -- the parent: comparing two captures -----------------------------------------------------
STEPS = [{"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "loss_fp": 7, "params_fp": 3},
         {"step": 1, "loss": 0.25, "loss_fp": 8, "params_fp": 5}]


def _seed_fact(values: list[str], site: str = "train.py:4", step: int = -1,
               api: str = "torch.manual_seed") -> dict[str, Any]:
    return {"api": api, "site": site, "library": "", "package": "",
            "calls": [[i + 1, step, v] for i, v in enumerate(values)]}


def _report(tmp_path: Path, facts_a: dict[str, Any], facts_b: dict[str, Any],
            b_params: int = 3, rng: bool = True) -> Any:
    """Two captures whose step-0 op (a random draw, or a plain op if not ``rng``) differs
    when ``b_params`` != 3."""
    steps_b = step_rows(*STEPS)
    steps_b[1]["params_fp"] = b_params
    name, flags = ("aten.normal_.default", int(Flag.RNG)) if rng else ("aten.mm.default", 0)
    ops = OpStream().add(0, name, out=10, source="train.py:9", flags=flags)
    ops_b = OpStream().add(0, name, out=10 if b_params == 3 else 11, source="train.py:9",
                           flags=flags)
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS), ops, facts=facts_a,
                      attrs={"op_steps": [0]})
    b = write_capture(tmp_path / "b.h5", steps_b, ops_b, facts=facts_b,
                      attrs={"op_steps": [0]})
    return analysis.compare_captures(open_capture(a), open_capture(b))


def test_a_differing_seed_is_the_finding_at_its_line(tmp_path: Path) -> None:
    report = _report(tmp_path, {"seed#0": _seed_fact(["100"])},
                     {"seed#0": _seed_fact(["105"]), clock.CLOCK_FACT: 5.5}, b_params=4)
    found = report.first_divergence
    assert report.verdict == "nondeterministic"
    assert (found.kind, found.step, found.phase, found.op, found.source) == (
        "seed", None, "init", "torch.manual_seed", "train.py:4")
    assert any("100 in run a and 105 in run b" in n for n in found.notes)
    assert any("5.5 s ahead" in n for n in found.notes)
    suggested = analysis.compare_captures(open_capture(tmp_path / "a.h5"),
                                          open_capture(tmp_path / "b.h5"), suggest=True)
    assert suggested.suggestions[0].recipe.id == "PY-SEED-VARIES"


def test_an_op_that_differs_on_its_own_stays_the_finding(tmp_path: Path) -> None:
    """A race (output differs, inputs equal, no random draw) is a cause of its own: a seed
    that differs too (say, one used only to name the run) is a note, not the finding."""
    report = _report(tmp_path, {"seed#0": _seed_fact(["1"])}, {"seed#0": _seed_fact(["2"])},
                     b_params=4, rng=False)
    found = report.first_divergence
    assert found.kind == "op" and found.op == "aten.mm.default"
    assert any("also received different seeds" in n for n in found.notes)


def test_equal_seeds_leave_the_op_finding(tmp_path: Path) -> None:
    same = {"seed#0": _seed_fact(["100", "7"])}
    report = _report(tmp_path, same, same, b_params=4)
    assert report.first_divergence.kind == "op"


def test_the_earliest_differing_call_wins(tmp_path: Path) -> None:
    a = {"seed#0": _seed_fact(["1", "2"], site="train.py:8"),
         "seed#1": {**_seed_fact(["5"], site="train.py:3", api="random.seed"),
                    "calls": [[3, -1, "5"]]}}
    b = {"seed#0": _seed_fact(["1", "9"], site="train.py:8"),
         "seed#1": {**_seed_fact(["6"], site="train.py:3", api="random.seed"),
                    "calls": [[3, -1, "6"]]}}
    report = _report(tmp_path, a, b, b_params=4)
    assert report.first_divergence.source == "train.py:8"  # seq 2 before seq 3


def test_a_seed_after_the_first_difference_is_not_blamed(tmp_path: Path) -> None:
    report = _report(tmp_path, {"seed#0": _seed_fact(["1"], step=1)},
                     {"seed#0": _seed_fact(["2"], step=1)}, b_params=4)
    assert report.first_divergence.kind == "op" and report.first_divergence.step == 0


def test_a_seed_made_during_training_does_not_explain_a_difference_at_init(
        tmp_path: Path) -> None:
    steps_b = step_rows(*STEPS)
    steps_b[0]["params_fp"] = 2  # the initial weights already differ
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS),
                      facts={"seed#0": _seed_fact(["1"], step=0)})
    b = write_capture(tmp_path / "b.h5", steps_b, facts={"seed#0": _seed_fact(["2"], step=0)})
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.first_divergence.kind == "init"


def test_malformed_seed_facts_are_ignored(tmp_path: Path) -> None:
    bad = {"seed#0": {"api": 3, "calls": "x"}, "seed#1": {**_seed_fact(["1"]),
                                                          "calls": [["a", 1, 2]]}}
    report = _report(tmp_path, bad, {"seed#0": _seed_fact(["9"])}, b_params=4)
    assert report.first_divergence.kind == "op"


def test_a_seed_difference_that_never_reaches_training_is_a_note(tmp_path: Path) -> None:
    report = _report(tmp_path, {"seed#0": _seed_fact(["1"])}, {"seed#0": _seed_fact(["2"])})
    assert report.verdict == "deterministic"


def test_seed_values() -> None:
    assert seeding.seed_value(np.int64(7)) == "7" and seeding.seed_value(True) == "1"
    assert seeding.seed_value(1.5) == "1.5"
    assert seeding.seed_value(b"ab") != seeding.seed_value(b"ac")
    assert seeding.seed_value(np.random.SeedSequence(3)) == seeding.seed_value(
        np.random.SeedSequence(3))
    assert seeding.seed_value(np.random.SeedSequence()) != seeding.seed_value(
        np.random.SeedSequence())  # fresh entropy: differs
    assert seeding.seed_value(object()) == seeding.seed_value(object())
    assert seed_diff.seed_calls.__doc__  # the parent reads what the child writes


# -- run b's clock ------------------------------------------------------------------------------
def test_clock_offsets_per_run() -> None:
    assert clock.offset_for("a") == 0 and clock.offset_for("a-ops") == 0
    assert clock.offset_for("b") == clock.offset_for("b-dump") == clock.OFFSET_SECONDS
    assert clock.offset_for("r2") == 2 * clock.OFFSET_SECONDS
    assert clock.offset_for("baseline") == 0


def test_the_shifted_clock_reads_ahead_and_keeps_datetime_working() -> None:
    code = textwrap.dedent("""
        import datetime, pickle, time
        real, real_dt = time.time(), datetime.datetime.now()
        from nondet import clock
        clock.shift(5.5)
        ahead = time.time() - real
        dt = datetime.datetime.now()
        print(round(ahead), round((dt - real_dt).total_seconds()),
              round(time.time_ns() / 1e9 - real), 4 < time.mktime(time.localtime()) - real < 6,
              isinstance(real_dt, datetime.datetime), type(dt) is datetime.datetime,
              pickle.loads(pickle.dumps(dt)) == dt, repr(datetime.datetime(2020, 1, 2)),
              5 < (datetime.datetime.utcnow() - real_dt.utcnow()).total_seconds() < 6)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["6", "6", "6", "True", "True", "True", "True",
                   "datetime.datetime(2020,", "1,", "2,", "0,", "0)", "True"]



def test_the_shifted_clock_functions_do_not_bind_as_methods() -> None:
    """``logging.Formatter.converter = time.localtime`` (a class attribute, set when logging is
    imported) and ``class Timer: now = time.time``: a Python function there binds as a method.
    Before, every log line with ``%(asctime)s`` in a run was a "--- Logging error ---"
    traceback ("at() takes from 0 to 1 positional arguments but 2 were given")."""
    code = textwrap.dedent("""
        import io, time
        real = time.time()
        from nondet import clock
        clock.shift(5.5)
        import logging
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log = logging.getLogger("t")
        log.addHandler(handler)
        log.warning("step 3")

        class Timer:
            now, now_ns, local = time.time, time.time_ns, time.localtime
            gm, text, stamp = time.gmtime, time.ctime, time.strftime

        t = Timer()
        print(stream.getvalue().split()[-2:], 4 < t.now() - real < 7,
              4 < t.now_ns() / 1e9 - real < 7, 4 < time.mktime(t.local()) - real < 7,
              t.gm().tm_year > 2000, len(t.text()) > 10, t.stamp("%Y") == str(t.local().tm_year),
              time.time.__name__, time.localtime.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "Logging error" not in out.stderr, out.stderr
    assert out.stdout.split() == ["['step',", "'3']"] + ["True"] * 6 + ["time", "localtime"], (
        out.stdout)


def test_tensorflow_and_keras_seeding_calls_are_recorded(session: FakeSession,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from tensorflow.python.ops import stateful_random_ops

    from nondet.frameworks.tensorflow import seeding as tf_seeding

    monkeypatch.setattr(tf.random, "set_seed", tf.random.set_seed)
    monkeypatch.setattr(tf.compat.v1, "set_random_seed", tf.compat.v1.set_random_seed)
    monkeypatch.setattr(tf.compat.v1.random, "set_random_seed",
                        tf.compat.v1.random.set_random_seed)
    monkeypatch.setattr(stateful_random_ops.Generator, "from_seed",
                        stateful_random_ops.Generator.__dict__["from_seed"])
    _restore_keras_seed_after(monkeypatch)
    tf_seeding.install(session)  # type: ignore[arg-type]
    for callback in frameworks._watchers.pop("keras", []):
        callback()  # what the import hook does once keras is imported (pyhooks' wrapper)
    tf.random.set_seed(31)  # tf-seed-here
    g = tf.random.Generator.from_seed(32)  # tf-generator-here
    keras.utils.set_random_seed(33)  # keras-seed-here: seeds 4 RNGs, recorded once
    # (libraries Keras imports on first use may seed their own generators, e.g. scipy.stats
    # under scikit-learn when installed: those name a library frame and are left out here)
    assert [s for s in session.seeds() if s[2] == ""] == [
        ("tf.random.set_seed", _line_of("tf-seed-here"), "", ["31"]),
        ("tf.random.Generator.from_seed", _line_of("tf-generator-here"), "", ["32"]),
        ("keras.utils.set_random_seed", _line_of("keras-seed-here"), "", ["33"])]
    assert int(g.normal([]).shape.rank) == 0 and not session.meta


def test_pinned_seeds_reach_a_tensorflow_generator_too(session: FakeSession,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # As torch.Generator above: ``tf.random.Generator.from_seed(int(time.time()))`` must get
    # the pinned seed in the pin_seeds fix's runs, else the fix "did not help".
    tf = pytest.importorskip("tensorflow")
    from tensorflow.python.framework import random_seed
    from tensorflow.python.ops import stateful_random_ops

    from nondet.frameworks.tensorflow import seeding as tf_seeding

    monkeypatch.setattr(tf.random, "set_seed", tf.random.set_seed)
    monkeypatch.setattr(tf.compat.v1, "set_random_seed", tf.compat.v1.set_random_seed)
    monkeypatch.setattr(tf.compat.v1.random, "set_random_seed",
                        tf.compat.v1.random.set_random_seed)
    original = stateful_random_ops.Generator.__dict__["from_seed"]
    monkeypatch.setattr(stateful_random_ops.Generator, "from_seed", original)
    monkeypatch.setattr(random_seed, "get_seed", random_seed.get_seed)
    tf_seeding.install(session)  # type: ignore[arg-type]
    monkeypatch.setattr(seeding, "PINNED", 1000)
    tf.random.set_seed(123456)
    g = tf.random.Generator.from_seed(654321)
    expected = original.__func__(stateful_random_ops.Generator, 1001)
    assert g.normal([4]).numpy().tolist() == expected.normal([4]).numpy().tolist()
    assert [s[3] for s in session.seeds() if s[2] == ""] == [["1000"], ["1001"]]


def test_a_class_derived_from_a_stand_in_keeps_its_own_isinstance() -> None:
    code = textwrap.dedent("""
        import datetime
        from nondet import clock
        plain = datetime.datetime(2020, 1, 1)
        clock.shift(0.0)

        class Mine(datetime.datetime):
            pass

        print(isinstance(plain, datetime.datetime), isinstance(plain, Mine),
              isinstance(Mine(2020, 1, 1), Mine), issubclass(datetime.datetime, Mine))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["True", "False", "True", "False"]


def test_stand_ins_keep_the_c_layout_of_the_class_they_replace(session: FakeSession) -> None:
    # Cython modules check the size of datetime.datetime & co. when imported ("size changed,
    # may indicate binary incompatibility"): a stand-in with a __dict__ was 8 bytes larger
    import datetime

    import torch

    from nondet.frameworks.torch import seeding as torch_seeding

    stand_ins = [(datetime.datetime, clock._shifted_datetime()),
                 (np.random.RandomState, pyhooks._recording_random_state(
                     seeding.SeedLog(session), lambda *_: None, None)),  # type: ignore[arg-type]
                 (torch.Generator, torch_seeding._recording_generator(
                     seeding.SeedLog(session)))]  # type: ignore[arg-type]
    for original, stand_in in stand_ins:
        assert stand_in.__basicsize__ == original.__basicsize__, original
        assert "__dict__" not in dir(stand_in), original


def test_extension_modules_initialize_with_the_original_classes() -> None:
    # pandas' Timestamp (Cython) subclasses the datetime.datetime it finds when imported: on
    # the stand-in, `import pandas` killed every run with SIGSEGV. The loader is faked (no
    # such extension is installed for the tests); what matters is what it sees.
    code = textwrap.dedent("""
        import datetime
        import importlib.machinery as machinery
        seen = []

        def fake_create(self, spec):
            seen.append(datetime.datetime)
            self.exec_module(None)  # an extension importing another while it initializes
            seen.append(datetime.datetime)

        machinery.ExtensionFileLoader.create_module = fake_create
        machinery.ExtensionFileLoader.exec_module = lambda self, m: seen.append(
            datetime.datetime)
        real = datetime.datetime
        from nondet import clock
        clock.shift(5.5)
        seen.clear()  # (extensions imported with nondet above went through the fakes too)
        machinery.ExtensionFileLoader("fake", "/nowhere/fake.so").create_module(None)
        print(seen == [real, real, real], datetime.datetime is not real,
              issubclass(datetime.datetime, real))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["True", "True", "True"]


def test_pandas_imports_under_the_shifted_clock() -> None:
    # the real case behind the two tests above: its Timestamp is a Cython type on datetime
    if importlib.util.find_spec("pandas") is None:
        pytest.fail("pandas is not installed (pip install -e '.[test]')")
    code = "from nondet import clock; clock.shift(5.5); import pandas; print(pandas.Timestamp(0))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["1970-01-01", "00:00:00"]


def test_a_library_generator_from_an_unseeded_seed_sequence_is_named(
        session: FakeSession) -> None:
    """gymnasium's ``seeding.np_random(None)`` (every action space's ``sample()`` draws
    from one until ``space.seed(n)``): ``SeedSequence(None)`` + ``PCG64``, no
    ``default_rng``. The gym_dqn trial (h-realtorch3) got PY-THIRDPARTY-RNG (cv2)."""
    gym_seeding = pytest.importorskip("gymnasium.utils.seeding")
    rng, _ = gym_seeding.np_random(None)  # made-in-gymnasium
    gym_seeding.np_random(3)  # seeded: not named
    sites = session.facts.get("library.unseeded_generator")
    assert sites and len(sites) == 1 and "gymnasium" in sites[0], sites
    assert _line_of("made-in-gymnasium") in sites[0]
    assert isinstance(rng.bit_generator.seed_seq, np.random.SeedSequence)
    assert np.random.SeedSequence(5).entropy == 5 and not session.meta


def test_the_same_seeds_in_another_order_are_no_seed_finding(tmp_path: Path) -> None:
    """Threads that each seed a generator with their shard's id finish in another order
    from run to run (a trial blamed ``random.Random(k)`` for "a different seed")."""
    a = {"seed#0": _seed_fact(["0", "1", "2"], site="train.py:8", api="random.Random")}
    b = {"seed#0": _seed_fact(["2", "0", "1"], site="train.py:8", api="random.Random")}
    assert _report(tmp_path, a, b, b_params=4).first_divergence.kind == "op"
    # one seed really differs: still the finding
    b = {"seed#0": _seed_fact(["2", "0", "7"], site="train.py:8", api="random.Random")}
    found = _report(tmp_path, a, b, b_params=4).first_divergence
    assert (found.kind, found.source) == ("seed", "train.py:8")


def test_a_seed_sequence_made_with_a_seed_is_a_seeding_call(session: FakeSession) -> None:
    """PyTorch round 16: ``env.reset(seed=int(time.time()))``; gymnasium's
    ``seeding.np_random(seed)`` makes ``Generator(PCG64(SeedSequence(seed)))`` in Python,
    no ``default_rng``: the clock seed was never seen and the observation that entered
    with it got the OpenCV recipe. The seed is recorded at the script's line, gymnasium
    named as the library that made the call."""
    gym_seeding = pytest.importorskip("gymnasium.utils.seeding")
    np.random.SeedSequence(16)  # seed-sequence-here
    gym_seeding.np_random(17)  # gymnasium-seeds-here
    sites = session.seeds()
    assert sites[0] == ("np.random.SeedSequence", _line_of("seed-sequence-here"), "", ["16"])
    api, site, library, values = sites[1]
    assert (api, site, values) == ("np.random.SeedSequence", _line_of("gymnasium-seeds-here"),
                                   ["17"]) and "gymnasium" in library, sites
    assert not session.meta


def test_pinned_seeds_reach_a_seed_sequence(session: FakeSession,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the pin_seeds fix verifies a clock seed handed to gymnasium (PY-SEED-VARIES)
    want = np.random.Generator(np.random.PCG64(np.random.SeedSequence(700))).random()
    monkeypatch.setattr(seeding, "PINNED", 700)
    got = np.random.Generator(np.random.PCG64(np.random.SeedSequence(1796005507))).random()
    assert got == want


def test_seed_texts_of_ordinary_seeds_are_those_earlier_captures_hold() -> None:
    # a baseline written before huge seeds were handled must compare equal to a new run
    assert seeding.seed_value(np.random.SeedSequence(5)) == \
        f"SeedSequence:{seeding._digest(repr((5, ())).encode())}"
    assert seeding.seed_value([1, 2]) == f"ints:{seeding._digest(repr([1, 2]).encode())}"
    assert seeding.seed_value(10**5000).startswith("int:")


def test_a_bit_generator_made_with_a_seed_is_a_seeding_call(session: FakeSession) -> None:
    """``np.random.Generator(np.random.PCG64(int(time.time())))``: the bit generator makes
    its SeedSequence in C, so the clock seed was never seen and the value it drew got the
    OpenCV recipe (stop 37's PyTorch round left it). Made from a SeedSequence, the seed is
    the sequence's own record; made with none, the OS seeds it: a note."""
    np.random.PCG64(18)  # bit-generator-here
    np.random.Generator(np.random.MT19937(19))  # under-a-generator
    np.random.PCG64(np.random.SeedSequence(20))  # from-a-sequence
    np.random.Philox()  # from-the-os
    assert session.seeds() == [
        ("np.random.PCG64", _line_of("bit-generator-here"), "", ["18"]),
        ("np.random.MT19937", _line_of("under-a-generator"), "", ["19"]),
        ("np.random.SeedSequence", _line_of("from-a-sequence"), "", ["20"]),
    ]
    assert session.facts.get("numpy.unseeded_generator") == [_line_of("from-the-os")]
    assert not session.meta


PICKLED = """
    import copy, datetime, pickle
    import numpy as np
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.ones(1, 2)).sum()
        opt.zero_grad(); loss.backward(); opt.step()
    made = [datetime.datetime(2020, 1, 2), np.random.RandomState(1),
            torch.Generator().manual_seed(3), np.random.SeedSequence(1), np.random.PCG64(1),
            np.random.MT19937(2), np.random.Generator(np.random.PCG64(5))]
    for x in made:
        for copied in (pickle.loads(pickle.dumps(x)), copy.deepcopy(x), copy.copy(x)):
            state = getattr(copied, "get_state", getattr(copied, "__getstate__", None))
            print(type(x).__qualname__, isinstance(copied, type(x)), repr(state())[:60])
"""


def test_what_nondet_stands_in_for_pickles_and_copies_as_without_it(tmp_path: Path) -> None:
    """A ``SeedSequence``, a bit generator, a ``Generator`` over one and a ``torch.Generator``
    made under nondet could not be pickled or deep-copied ("it's not the same object as
    numpy.random.bit_generator.SeedSequence"): the script failed under nondet only. The
    classes nondet stands in for pickle as the originals."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PICKLED))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    done = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", "--no-verify",
                           str(script)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    log = next((tmp_path / ".nondet").glob("*/run-a.log")).read_text()
    assert [line for line in log.splitlines() if "Warning" not in line] == \
        plain.stdout.splitlines()
