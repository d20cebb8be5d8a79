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
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

READ = "ReadVariableOp"


class RepeatReads:
    """The reads of the graph being traced that a later read of the same handle may reuse:
    per graph (a weak reference guards against a reused ``id``), per captured handle, the
    earlier read's op table index and description."""

    def __init__(self) -> None:
        self._graphs: dict[int, tuple[weakref.ref[Any], dict[str, tuple[int, Any]]]] = {}

    def _reads(self, graph: Any) -> dict[str, tuple[int, Any]] | None:
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
        reads: dict[str, tuple[int, Any]] = {}
        self._graphs[id(graph)] = (ref, reads)
        return reads

    def note(self, op_type: str, inputs: Any, graph: Any) -> None:
        """An op is being traced: forget the reads it may invalidate (module docstring)."""
        if op_type == READ:
            return
        resources = [t for t in (inputs or ()) if getattr(t, "dtype", None) == tf.resource]
        if not resources:
            return
        reads = self._reads(graph)
        if not reads:
            return
        captured = _captured(graph)
        for t in resources:
            if id(t) in captured:
                reads.pop(t.name, None)
            else:
                reads.clear()
                return

    def earlier(self, inputs: Any, graph: Any, meta: Any) -> int | None:
        """The table index of an earlier read this ``ReadVariableOp`` repeats (same captured
        handle, same description, no possible write since), else None."""
        handle = _handle(inputs)
        if handle is None:
            return None
        reads = self._reads(graph)
        hit = reads.get(handle.name) if reads else None
        return hit[0] if hit is not None and hit[1] == meta else None

    def remember(self, inputs: Any, graph: Any, index: int, meta: Any) -> None:
        """A hashed read at table ``index``: later reads of its handle may reuse it."""
        handle = _handle(inputs)
        if handle is None or id(handle) not in _captured(graph):
            return
        reads = self._reads(graph)
        if reads is not None:
            reads[handle.name] = (index, meta)


def _handle(inputs: Any) -> Any:
    got = list(inputs or ())
    return got[0] if len(got) == 1 and getattr(got[0], "dtype", None) == tf.resource else None


def _captured(graph: Any) -> set[int]:
    """Ids of the graph's placeholders for captured tensors (variables' handles among them)."""
    try:
        return {id(t) for t in graph.internal_captures}
    except Exception:  # not a FuncGraph, or the API moved: nothing counts as captured
        return set()
