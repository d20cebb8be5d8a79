"""Entries dropped unread: a tensor made from outside data that dies inside the expression
that made it, having given up only its metadata, e.g. MONAI's dtype lookup
``torch.from_numpy(np.empty([], dtype)).dtype``. Its values (uninitialized NumPy memory,
which differs between processes) were never read by anything, so they are no evidence of
nondeterminism: the step's data row leaves them out.

Proven statically, with no per-op cost: at creation, the bytecode of the calling frame after
the creating call is read; if it holds only metadata attribute loads and ``POP_TOP`` (no
call, no store, no jump: nothing can see the tensor but those), the death offsets it allows
are noted. A weakref callback then checks that the tensor died in that frame at one of them.
Any other death (kept, passed on, consumed by ``.float()``, dropped later) counts as read.
"""

from __future__ import annotations

import dis
import sys
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch

#: Tensor attributes that describe a tensor without reading its values (C getters on a
#: plain tensor, never dispatched).
METADATA = frozenset({"dtype", "shape", "ndim", "device", "layout", "is_cuda",
                      "requires_grad"})

#: (code, offset of the creating call) -> offsets at which the tensor may die unread.
_ALLOWED: dict[tuple[CodeType, int], frozenset[int]] = {}


def allowed_deaths(code: CodeType, call_offset: int) -> frozenset[int]:
    """Offsets after ``call_offset`` at which a value the call returned can be dropped having
    been used only for its metadata (empty: it is stored, passed or called on)."""
    key = (code, call_offset)
    found = _ALLOWED.get(key)
    if found is None:
        offsets = []
        for ins in dis.get_instructions(code):
            if ins.offset <= call_offset:
                continue
            if ins.opname == "POP_TOP" or (ins.opname == "LOAD_ATTR"
                                            and ins.argrepr in METADATA):
                offsets.append(ins.offset)
                if ins.opname == "POP_TOP":
                    break  # dropped here at the latest
                continue
            break
        found = _ALLOWED[key] = frozenset(offsets)
    return found


def watch(t: torch.Tensor, caller: FrameType, on_unread: Callable[[], None]) -> Any:
    """Call ``on_unread`` if ``t`` dies unread in the expression of ``caller`` that made it
    (see the module docstring). Returns the weakref that must be kept alive while watching,
    or None when the bytecode lets ``t`` escape (nothing to watch)."""
    code, offset, frame_id = caller.f_code, caller.f_lasti, id(caller)
    allowed = allowed_deaths(code, offset)
    if not allowed:
        return None

    def died(_: Any) -> None:
        try:
            # the frame whose instruction dropped the last reference runs the callback
            frame = sys._getframe(1)
            if id(frame) == frame_id and frame.f_code is code and frame.f_lasti in allowed:
                on_unread()
        except Exception:  # never raise into the user's program
            pass

    try:
        return weakref.ref(t, died)
    except TypeError:
        return None
