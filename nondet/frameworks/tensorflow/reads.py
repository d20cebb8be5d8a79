"""Repeated reads of a variable in one traced graph, with no write between them: the
later read's fingerprint is the earlier one's, so it needs no guarded hash of its own.

Why it is exact: inside a ``tf.function``, TensorFlow orders every op that uses a resource
(a variable's handle) after the writes to it that come before it in program order and
before those that come after (automatic control dependencies). Two ``ReadVariableOp``s of
the same handle with no op between them (in trace order) that could write through it
therefore return the same value, and the same value, dtype, device and shape make the
same fingerprint (Note [Fingerprint definition]): the later record carries the earlier
one's value, the number hashing it would give. On the narrow benchmark model 32 of the 121
variable reads per step are such repeats (Adam reads the learning rate, the step count
and each variable again after the forward pass read them).

What could write between two reads is judged conservatively, op by op as the graph is
traced (``note``): any op other than a read that takes a resource input may write through
it. Reads are remembered only through a handle the graph captured from outside: one
placeholder per variable, so the same handle tensor throughout (TensorFlow traces a
variable passed as an argument as that variable, through the same placeholder as a
closure's capture of it: checked in tests/frameworks/test_tf_repeat_reads.py); a
possible write through any other resource tensor (a handle made or passed on inside the
graph) forgets every read of that graph. Writes from
outside the graph while it runs (another thread's function) are not seen; nondet refuses
scripts that train in two threads at once.

Note [Reads after a write]
A read of a captured handle right after a write to it (``AssignVariableOp``,
``AssignAddVariableOp``, ``AssignSubVariableOp`` through the same handle, nothing that
could write since) reads what the write left: the value written, or the earlier read's
value plus or minus it (an elementwise kernel on every device, bitwise deterministic). Its
fingerprint is then *derived* (Note [Derived fingerprints] in torch/cache.py) from those
recorded fingerprints and the write's op type, with no guarded hash: Adam reads each
moment again after adding to it, 32 of the narrow benchmark model's 89 hashed reads per
step (docs/benchmarks.md, TensorFlow, "Eighth round"). Only when every value involved is
recorded: the earlier read (for an add or subtract) and the written tensor's producer in
the same graph; a constant or otherwise unrecorded value leaves the read hashed, so the
fingerprint is always a function of the values that made it. Fingerprint scheme 4.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from nondet.fingerprint import name_code

READ = "ReadVariableOp"
#: Writes a later read can derive its fingerprint from (Note [Reads after a write]): per
#: op type, whether the result depends on the value before (add, subtract) or replaces it.
WRITES = {"AssignVariableOp": False, "AssignAddVariableOp": True,
          "AssignSubVariableOp": True}
#: Where a graph tensor was recorded: (op table index, output position), or None.
Where = Callable[[Any], tuple[int, int] | None]


@dataclass(frozen=True)
class Written:
    """What a captured handle holds after a write: a read of it is derived from
    ``sources`` (the earlier read's and the written value's records) and ``code``."""

    code: int
    sources: tuple[tuple[int, int], ...]
    meta: Any  # the earlier read's description (an add or subtract keeps it)


class _GraphReads:
    """Per graph: the last read of each captured handle (table index, description), and
    what a write through it left."""

    __slots__ = ("cleared", "reads", "touched", "written")

    def __init__(self) -> None:
        self.reads: dict[str, tuple[int, Any]] = {}
        self.written: dict[str, Written] = {}
        self.touched: set[str] = set()  # handles any op of this graph used so far
        self.cleared = False  # a possible write through an unknown handle was traced

    def clear(self) -> None:
        self.reads.clear()
        self.written.clear()
        self.cleared = True


class RepeatReads:
    """The reads of the graph being traced that a later read of the same handle may reuse:
    per graph (a weak reference guards against a reused ``id``), per captured handle, the
    earlier read's op table index and description."""

    def __init__(self) -> None:
        self._graphs: dict[int, tuple[weakref.ref[Any], _GraphReads]] = {}

    def _reads(self, graph: Any) -> _GraphReads | None:
        """The remembered reads of ``graph`` (made empty for a graph not seen before;
        None: the graph cannot be weakly referenced, so nothing is remembered)."""
        got = self._graphs.get(id(graph))
        if got is not None and got[0]() is graph:
            return got[1]
        try:
            ref = weakref.ref(graph)
        except TypeError:
            return None
        self._graphs = {k: v for k, v in self._graphs.items() if v[0]() is not None}
        reads = _GraphReads()
        self._graphs[id(graph)] = (ref, reads)
        return reads

    def note(self, op_type: str, inputs: Any, graph: Any, where: Where) -> None:
        """An op is being traced: forget the reads it may invalidate (module docstring),
        and remember what a write through a captured handle left (Note [Reads after a
        write]); ``where`` finds a tensor's record in this graph."""
        if op_type == READ:
            return
        inputs = list(inputs or ())
        resources = [t for t in inputs if getattr(t, "dtype", None) == tf.resource]
        if not resources:
            return
        reads = self._reads(graph)
        if reads is None:
            return
        reads.touched.update(t.name for t in resources)
        if not (reads.reads or reads.written or op_type in WRITES):
            return
        captured = _captured(graph)
        for t in resources:
            if id(t) not in captured:
                reads.clear()
                return
            earlier = reads.reads.pop(t.name, None)
            reads.written.pop(t.name, None)
            if op_type in WRITES and len(inputs) == 2 and inputs[0] is t:
                written = _written(op_type, earlier, where(inputs[1]))
                if written is not None:
                    reads.written[t.name] = written

    def earlier(self, inputs: Any, graph: Any, meta: Any) -> int | None:
        """The table index of an earlier read this ``ReadVariableOp`` repeats (same captured
        handle, same description, no possible write since), else None."""
        handle = _handle(inputs)
        if handle is None:
            return None
        reads = self._reads(graph)
        hit = reads.reads.get(handle.name) if reads else None
        return hit[0] if hit is not None and hit[1] == meta else None

    def after_write(self, inputs: Any, graph: Any, meta: Any) -> Written | None:
        """What this ``ReadVariableOp`` reads if it is the first read after a write its
        fingerprint can be derived from (Note [Reads after a write]), else None."""
        handle = _handle(inputs)
        if handle is None:
            return None
        reads = self._reads(graph)
        written = reads.written.get(handle.name) if reads else None
        if written is None or (written.meta is not None and written.meta != meta):
            return None
        return written

    def first(self, inputs: Any, graph: Any) -> Any:
        """The captured handle this ``ReadVariableOp`` reads if it is the first op of
        ``graph`` to use it (nothing in the graph could have written it before), else None."""
        handle = _handle(inputs)
        if handle is None or id(handle) not in _captured(graph):
            return None
        reads = self._reads(graph)
        if reads is None or reads.cleared or handle.name in reads.touched:
            return None
        return handle

    def remember(self, inputs: Any, graph: Any, index: int, meta: Any) -> None:
        """A read at table ``index`` (hashed, or derived after a write): later reads of its
        handle may reuse it."""
        handle = _handle(inputs)
        if handle is None or id(handle) not in _captured(graph):
            return
        reads = self._reads(graph)
        if reads is not None:
            reads.touched.add(handle.name)
            reads.reads[handle.name] = (index, meta)
            reads.written.pop(handle.name, None)


def _written(op_type: str, earlier: tuple[int, Any] | None,
             value: tuple[int, int] | None) -> Written | None:
    """What a write of a recorded ``value`` leaves, when a read can be derived from it."""
    if value is None:
        return None
    code = name_code(op_type)
    if not WRITES[op_type]:
        return Written(code, (value,), None)
    if earlier is None:
        return None
    return Written(code, ((earlier[0], 0), value), earlier[1])


def _handle(inputs: Any) -> Any:
    got = list(inputs or ())
    return got[0] if len(got) == 1 and getattr(got[0], "dtype", None) == tf.resource else None


def _captured(graph: Any) -> set[int]:
    """Ids of the graph's placeholders for captured tensors (variables' handles among them)."""
    try:
        return {id(t) for t in graph.internal_captures}
    except Exception:  # not a FuncGraph, or the API moved: nothing counts as captured
        return set()
