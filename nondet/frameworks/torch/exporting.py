"""A strict ``torch.export`` runs with nondet's global module hooks set aside.

Strict export (``torch.export.export(..., strict=True)``) traces the model with Dynamo in
full-graph mode, and refuses any global module hook: with one registered, ``Module.__call__``
takes its hooked path into ``ModuleToTrace.forward``, which Dynamo will not trace ("Attempted
to inline function marked as skipped"), and the script "failed" under nondet only (PyTorch
round 14). An export traces; it trains nothing and nondet records nothing of it, so the
hooks are removed for the call and registered again after it. The exported module is then
trained eagerly, hooks on. Non-strict export (the default) needs none of this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


def install(set_aside: Callable[[], AbstractContextManager[None]]) -> None:
    """Wrap ``torch.export.export`` so a strict export runs inside ``set_aside()``."""
    try:
        import torch.export as torch_export
    except ImportError:  # a torch without torch.export
        return
    original = getattr(torch_export, "export", None)
    if original is None or getattr(original, "_nondet_wrapped", False):
        return

    @functools.wraps(original)
    def export(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("strict"):
            return original(*args, **kwargs)
        with set_aside():
            return original(*args, **kwargs)

    export._nondet_wrapped = True  # type: ignore[attr-defined]
    torch_export.export = export
