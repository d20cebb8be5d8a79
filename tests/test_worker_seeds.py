"""Seeding calls made in forked worker processes (a DataLoader's ``worker_init_fn``) reach
the run's facts (``nondet/worker_seeds.py``), compared as a multiset per call site."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from nondet import clock, seeding, worker_seeds
from nondet import session as session_module
from tests.test_seeding import FakeSession, session  # noqa: F401 (fixture)


def _line_of(text: str) -> str:
    """"tests/test_worker_seeds.py:N" of the line in this file that contains ``text``."""
    lines = Path(__file__).read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)
    return f"{Path(__file__).relative_to(Path.cwd())}:{number}"


def _in_worker(action: object) -> None:
    """Run ``action`` in a forked process that has no session, as a DataLoader worker."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            session_module._CURRENT = None  # what boot's at-fork hook does
            action()  # type: ignore[operator]
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def run_dir(session: FakeSession, tmp_path: Path) -> Path:  # noqa: F811
    session.config.children_dir = str(tmp_path)
    session.config.label = "a"
    return tmp_path


def test_a_seeding_call_in_a_forked_worker_becomes_a_fact_of_the_run(
        session: FakeSession, run_dir: Path) -> None:  # noqa: F811
    np.random.seed(3)  # the main process's own call (creates the run's seed log)
    _in_worker(lambda: np.random.seed(1234))  # worker-seed-call
    seeding.collect_workers(session)  # type: ignore[arg-type]
    worker = [v for k, v in session.facts.items() if v.get("worker")]
    assert [(v["api"], v["site"], [c[2] for c in v["calls"]]) for v in worker] == [
        ("np.random.seed", _line_of("worker-seed-call"), ["1234"])]
    assert not list(run_dir.glob("*.worker-seeds"))  # nondet's file, removed once read
    assert not session.meta  # no hook error


def test_a_worker_seed_read_from_the_clock_names_the_reading_line(
        session: FakeSession, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    t = 1795454799.123456
    monkeypatch.setattr(clock, "_READS", {(__file__, 7): (t, None)})
    np.random.seed(3)
    _in_worker(lambda: np.random.seed(int(t * 1000) % 2**32))
    seeding.collect_workers(session)  # type: ignore[arg-type]
    [worker] = [v for v in session.facts.values() if v.get("worker")]
    assert worker["clock"]["how"] == "ms % 4294967296"
    assert worker["clock"]["site"].endswith("test_worker_seeds.py:7")


def _facts_from(lines: list[dict[str, object]], folder: Path, label: str) -> dict[str, object]:
    fake = FakeSession(Path(__file__))
    fake.config.children_dir = str(folder)
    fake.config.label = label
    Path(worker_seeds.path_for(fake) or "").write_text(  # type: ignore[arg-type]
        "".join(json.dumps(line) + "\n" for line in lines))
    return worker_seeds.collect(fake, 0, seeding.SEED_FACT_PREFIX)  # type: ignore[arg-type]


def test_workers_that_seed_in_another_order_are_the_same_calls(tmp_path: Path) -> None:
    """``np.random.seed(base + worker_id)``: which worker writes first is the scheduler's
    choice, never a difference between the runs."""
    def call(value: str) -> dict[str, object]:
        return {"api": "np.random.seed", "file": __file__, "line": 5, "library": "",
                "package": "", "step": 0, "value": value, "clock": None}

    a = _facts_from([call("1001"), call("1000")], tmp_path, "a")
    b = _facts_from([call("1000"), call("1001")], tmp_path, "b")
    assert a == b and a


def test_lines_that_do_not_parse_are_left_out(tmp_path: Path) -> None:
    good = {"api": "random.seed", "file": __file__, "line": 5, "library": "",
            "package": "", "step": 0, "value": "7", "clock": None}
    facts = _facts_from([good, {**good, "line": "5"}, {**good, "clock": [1, 2]}], tmp_path, "a")
    [(_, data)] = facts.items()
    assert [c[2] for c in data["calls"]] == ["7"]  # type: ignore[index]


class _Noise:
    """A dataset that draws its samples from NumPy's global generator."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return int(np.random.randint(2**30))


def _seed_from_pid(worker_id: int) -> None:
    session_module._CURRENT = None  # what boot's at-fork hook does in a worker
    np.random.seed(os.getpid())  # pid-seeded-worker


def test_the_pin_seeds_fix_gives_each_dataloader_worker_its_own_seed(
        session: FakeSession, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Trial round 18: a ``worker_init_fn`` seeding from the pid got the constant-seed fix,
    verified by pinning every worker's call to one constant: both workers then drew the
    same numbers (duplicated augmentations), and the fix the report gave would do the
    same. Under the fix a DataLoader worker now seeds from the seed torch gave it
    (``torch.initial_seed()`` there), as DATA-PT-WORKER-SEED-VARIES says: the workers
    differ, and each repeats between runs."""
    import torch

    monkeypatch.setattr(seeding, "PINNED", 1000)
    np.random.seed(3)  # the main process's own call (creates the run's seed log)

    def batches() -> list[int]:
        torch.manual_seed(0)  # the run's seed: each worker's seed is drawn from it
        loader = torch.utils.data.DataLoader(_Noise(), batch_size=4, num_workers=2,  # type: ignore[arg-type]
                                             worker_init_fn=_seed_from_pid)
        return [int(x) for batch in loader for x in batch]

    first, again = batches(), batches()
    assert first == again  # repeats from run to run
    assert first[:4] != first[4:]  # the two workers' samples differ
    seeding.collect_workers(session)  # type: ignore[arg-type]
    worker = [v for v in session.facts.values() if v.get("worker")]
    assert [(v["site"], v["loader_worker"]) for v in worker] == [
        (_line_of("pid-seeded-worker"), True)]
    assert len({c[2] for c in worker[0]["calls"]}) == 2  # two seeds, each twice
    assert not session.meta  # no hook error


def test_a_worker_that_is_no_dataloader_worker_keeps_the_pinned_constant(
        session: FakeSession, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(seeding, "PINNED", 1000)
    np.random.seed(3)
    _in_worker(lambda: np.random.seed(os.getpid()))  # a Pool worker, say
    seeding.collect_workers(session)  # type: ignore[arg-type]
    worker = [v for v in session.facts.values() if v.get("worker")]
    assert [(v["loader_worker"], [c[2] for c in v["calls"]]) for v in worker] == [
        (False, ["1001"])]
