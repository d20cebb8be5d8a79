"""Note [Errors in the recorder]: an exception in nondet's op recorder never reaches the
script (it is reported as nondet's own, the op's result returned, the op run once); the op's
own exception still does, unchanged."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nondet.frameworks.torch.ops import CaptureMode  # noqa: E402
from nondet.frameworks.torch.testing import recorder  # noqa: E402


def _failing(where: str) -> tuple[Any, list[str]]:
    rec = recorder()
    failures: list[str] = []
    rec.backend.hook_failed = lambda: failures.append(where)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in nondet")

    if where == "nowhere":
        pass
    elif where == "before":  # while looking the op up, before it runs
        rec.infos.clear()
        rec.info = broken
    else:  # while fingerprinting what it wrote, after it ran
        rec.fingerprint = broken
        rec.derive_output = broken
    rec.open_window()
    return rec, failures


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_error_in_the_recorder_is_nondets_and_the_op_runs_once(where: str) -> None:
    rec, failures = _failing(where)
    x = torch.zeros(3)
    with CaptureMode(rec):
        y = x.add_(1)  # in place: run twice, it would hold 2s
        z = torch.mm(torch.ones(2, 3), torch.ones(3, 2))
    assert y is x and torch.equal(x, torch.ones(3))
    assert torch.equal(z, torch.full((2, 2), 3.0))
    assert failures[:1] == [where]


def test_the_ops_own_error_reaches_the_script_unchanged() -> None:
    rec, failures = _failing("nowhere")
    with CaptureMode(rec), pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(torch.ones(2, 3), torch.ones(2, 3))
    assert failures == []
