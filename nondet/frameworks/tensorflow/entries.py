"""Data entering a TensorFlow run, named in the step rows with its line.

A step outside the op window (the first pair declines step 0 once it traces: docs/
architecture.md, "The first pair") still has data rows, so that a difference that entered
as data is named from the first pair's rows, with no narrowing pair, as torch names its
DataLoader batches and NumPy-made tensors. The entries are those the op records of a
re-run would record as entries, named as it names them (Note [Entries named like the op
records]):

- a graph input made from host data: an eager tensor converted from a NumPy array or a
  Python value (``HostTensors``: ``tf.constant``, ``tf.convert_to_tensor``, TensorFlow's
  own conversion of a NumPy array passed straight into a ``tf.function``), passed to a
  traced function that reads its values: "external:graph input @ <the graph input's line>"
  (``call_entries``, taken when ``ConcreteFunction._call_flat`` starts);
- a batch read inside a traced function (``IteratorGetNext``, Keras ``fit``): "tf_data:
  <op> @ <line>" (traced.py hashes it every step; this module places it);
- while the step is clean, the eager entries (``ops.TFOpRecorder._eager_in_clean_step``):
  a tensor made from host data at its first use ("external:tensor"), an eager batch or an
  optional's value ("tf_data:IteratorGetNext", "tf_data:OptionalGetValue").

A tensor computed by eager ops or by another traced function is not an entry: it is never
named from the rows, and a difference in it is narrowed to the op that made it.

Note [Entries named like the op records]
A data row is named "kind:what @ line" (placed) only when the op-level records of a re-run
would name the same entry, at the same line, as the first difference of the step whenever
it differs; otherwise it is named without a line, and the pipeline narrows as before
(``pipeline._explain``: ``unplaced_entry``). The step row lists data first, but data is the
first difference in time only if nothing earlier in the step made one. So an entry is placed
only when nothing ran before it in its step that a re-run records as an op that could make
a difference, or as an entry that is no row:

- at trace time (``TraceOrder``), per graph: the position of each graph input's first read
  by a recorded op (where the re-run records it: ``traced.GraphRecorder._producer``) and of
  each data op, and whether an op that can make a difference was traced in the graph (or a
  function it calls, or, for a nested function, its callers) before it. Variable reads,
  derived ops (a function of their inputs: ``graph.DERIVED_OPS``), skipped ops and other
  entries cannot: the variables were compared at the previous step's end.
- at run time (``StepOrder``), per step: whether an eager op the re-run records as an op,
  or a call of a graph that may make a difference, ran before. Eager ops the re-run does
  not record (no numeric input or output: ``VarHandleOp``, ``MakeIterator``) leave the step
  clean, and so do those that pass on, read or write values that are covered (made by such
  ops in the step, or in a data row of it: ``INERT_EAGER_OPS``: a ``tf.function``'s first
  call checks its variables with ``VarIsInitializedOp`` and packs the answers; Keras' fit
  resets its metrics with ``assign(0)``).
- the variables a step makes are initialized by eager ops not judged one by one (an
  optimizer's slots in a first trace, Keras' lazily built layers with seeded random
  initializers): their values are a row without a line ("variable:initial values") before
  the next placed row, so a difference in one is narrowed to the op that made it; a row
  that would come before they are initialized is not placed.
- host memory that a graph reads only for its shape (``ZerosLike`` of an ``np.empty``) is no
  row (unread memory is no evidence), and nothing after it in the step is placed (a re-run
  records it).

The entries of one call are ordered by trace position, as the re-run's records are; a row
whose label differs between the runs is not placed (``finding._data_entry_divergence``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph

from nondet.frameworks.base import Sources
from nondet.frameworks.fp import Fp
from nondet.frameworks.tensorflow.graph import (
    DATA_OPS,
    DERIVED_OPS,
    LATE_OPS,
    SKIPPED_OPS,
)
from nondet.frameworks.tensorflow.hashing import hashable
from nondet.frameworks.tensorflow.stage_lines import user_line

#: Graph ops that cannot make a difference in a step whose variables matched at its start:
#: they read a variable, pass on or combine their inputs (derived), carry nothing, or are
#: entries themselves (ordered by position). A graph input is read at such an op too.
INERT_GRAPH_OPS = SKIPPED_OPS | DERIVED_OPS | DATA_OPS | {"ReadVariableOp", "Placeholder"}
#: Ops that use only their input's shape and dtype: not a read of its values (an array of
#: uninitialized memory used for its shape is no evidence).
SHAPE_ONLY_OPS = frozenset({"ZerosLike", "OnesLike", "Shape", "ShapeN", "Size", "Rank"})
#: Eager ops that cannot make a difference from inputs that are all covered (made by such
#: ops earlier in the step, or in a data row of it): they pass on, combine or move values,
#: read variables (compared at the previous step's end) or write covered values into them.
#: A tf.function's first call checks its variables with ``VarIsInitializedOp`` and packs the
#: answers; Keras' ``fit`` resets its metrics with ``assign(0)``.
INERT_EAGER_OPS = DERIVED_OPS | {
    "Pack", "VarIsInitializedOp", "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp", "StridedSlice", "Slice", "ConcatV2", "Unpack",
}

GRAPH_INPUT = "external:graph input"


# -- host data ---------------------------------------------------------------------------------
class HostTensors:
    """Eager tensors made from host data: every conversion of a NumPy array or Python value
    to an eager tensor (``tf.constant``, ``tf.convert_to_tensor``, a NumPy array passed to a
    ``tf.function``) goes through ``constant_op.convert_to_eager_tensor``. Each keeps its
    fingerprint once taken (eager tensors are immutable)."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[weakref.ref[Any], list[Fp]]] = {}

    def install(self) -> None:
        from tensorflow.python.framework import constant_op

        original = constant_op.convert_to_eager_tensor
        made = self._made

        @functools.wraps(original)
        def convert_to_eager_tensor(value: Any, ctx: Any, dtype: Any = None) -> Any:
            t = original(value, ctx, dtype)
            if t is not value:  # an eager tensor passed in is returned as it is
                key = id(t)
                try:
                    made[key] = (weakref.ref(t, functools.partial(_forget, made, key)), [])
                except TypeError:  # not weak-referenceable: not remembered
                    pass
            return t

        constant_op.convert_to_eager_tensor = convert_to_eager_tensor

    def cached_fp(self, t: Any) -> list[Fp] | None:
        """The fingerprint holder of ``t`` (empty until taken) if it was made from host data,
        else None."""
        hit = self._made.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[1]


def _forget(made: dict[int, Any], key: int, ref: weakref.ref[Any]) -> None:
    hit = made.get(key)
    if hit is not None and hit[0] is ref:
        del made[key]


# -- trace time ------------------------------------------------------------------------------
@dataclass
class FirstRead:
    """A graph input's first read by a recorded op: where a re-run records it."""

    position: int  # TraceOrder position: orders the entries of one call
    source: int  # string id of its line (-1: none: never placed)
    first: bool  # nothing that can make a difference was traced before it (its graph, callers)
    values: bool = False  # some op reads its values (not only its shape)


@dataclass
class GraphOrder:
    """What ``TraceOrder`` learnt of one graph."""

    busy: bool = False  # an op that can make a difference was traced in it (or a callee)
    placeable: bool = True  # False: traced where a re-run records no op (XLA, a strategy)
    reads: dict[str, FirstRead] = field(default_factory=dict)  # graph input name -> read
    #: (argument position, read) of the graph inputs a recorded op reads, worked out at the
    #: first call (the trace is over then): a call looks at these arguments only
    read_inputs: list[tuple[int, FirstRead]] | None = None
    n_inputs = 0

    def inputs_read(self, graph: Any) -> list[tuple[int, FirstRead]]:
        if self.read_inputs is None:
            inputs = list(getattr(graph, "inputs", ()))
            self.n_inputs = len(inputs)
            self.read_inputs = [(i, read) for i, p in enumerate(inputs)
                                if (read := self.reads.get(getattr(p, "name", ""))) is not None]
        return self.read_inputs


class TraceOrder:
    """Trace-time bookkeeping for Note [Entries named like the op records], fed every op
    traced into a recordable graph (``traced.GraphRecorder._trace``, before it decides what
    to instrument)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self.position = 0
        self.graphs: weakref.WeakKeyDictionary[Any, GraphOrder] = weakref.WeakKeyDictionary()

    def of(self, graph: Any) -> GraphOrder | None:
        try:
            return self.graphs.get(graph)
        except TypeError:
            return None

    def _order(self, graph: Any) -> GraphOrder | None:
        try:
            order = self.graphs.get(graph)
            if order is None:
                order = self.graphs[graph] = GraphOrder()
        except TypeError:  # not weak-referenceable: nothing is placed in it
            return None
        return order

    def note(self, op_type: str, inputs: Iterable[Any] | None, graph: Any,
             placeable: bool) -> tuple[int, bool]:
        """An op traced into ``graph``: its position, and whether nothing that can make a
        difference was traced before it there or in a caller whose trace encloses it
        (``placeable``: the re-run records this graph's ops)."""
        order = self._order(graph)
        self.position += 1
        if order is None:
            return self.position, False
        if not placeable:
            order.placeable = False
        first = not order.busy and order.placeable and self._unpreceded(
            getattr(graph, "outer_graph", None))
        if op_type not in SKIPPED_OPS and op_type not in LATE_OPS:
            for t in inputs or ():
                if not hashable(t):
                    continue
                op = getattr(t, "op", None)
                if op is None or op.type != "Placeholder":
                    continue
                read = order.reads.get(t.name)
                if read is None:
                    source = user_line(self.sources, _traceback(op))
                    read = order.reads[t.name] = FirstRead(self.position, source, first)
                if op_type not in SHAPE_ONLY_OPS:
                    read.values = True
        if op_type not in INERT_GRAPH_OPS:
            self._busy(graph)
        return self.position, first

    def _unpreceded(self, graph: Any) -> bool:
        """Nothing that can make a difference was traced before now in ``graph`` (the
        caller of a nested tf.function, whose trace encloses the callee's), nor in the
        functions enclosing it: the ops a caller traced before calling run before the
        callee's (the mirror of ``_busy``). Only traced functions count: the eager
        context's default graph, at the end of the chain, is marked busy by every
        function's ops."""
        while isinstance(graph, FuncGraph):
            order = self.of(graph)
            if order is not None and (order.busy or not order.placeable):
                return False
            graph = getattr(graph, "outer_graph", None)
        return True

    def _busy(self, graph: Any) -> None:
        """An op that can make a difference was traced in ``graph``: it runs within every
        function that calls ``graph`` too (a nested tf.function is traced inside its
        caller's trace), so they are busy from here on as well."""
        while graph is not None:
            order = self._order(graph)
            if order is not None:
                order.busy = True
            graph = getattr(graph, "outer_graph", None)


def _traceback(op: Any) -> Any:
    try:
        return op.traceback
    except Exception:  # an internal API: no line, so never placed
        return None


# -- run time ----------------------------------------------------------------------------------
class StepOrder:
    """Whether anything that could make a difference ran earlier in the current step, at
    run time (Note [Entries named like the op records]). Reset at every step boundary."""

    def __init__(self) -> None:
        self.clean = True
        self._inert: dict[int, weakref.ref[Any]] = {}  # outputs of inert eager ops
        self.creating = 0  # variables being made (their initializers run)
        #: the script's variables made since their values were last taken (``made_values``)
        self.made: list[weakref.ref[Any]] = []

    def reset(self) -> None:
        """A step begins: the variables made so far are in the state the last step row
        compared."""
        self.clean = True
        if self._inert:
            self._inert = {}
        self.made = []

    def made_variable(self, variable: Any) -> None:
        """A variable of the script's was made: its initial value is checked by value
        before the next call's entries (``made_values``), not op by op."""
        try:
            self.made.append(weakref.ref(variable))
        except TypeError:
            self.clean = False

    def made_values(self, fingerprint: Callable[[Any], Fp]) -> list[Fp] | None:
        """The fingerprints of the variables made since they were last taken that are
        initialized now (the others stay in ``made``: a tf.function initializes what its
        first trace made in a call of its own); None if one cannot be read. Called quiet."""
        from tensorflow.python.eager import record

        fps: list[Fp] = []
        waiting = []
        try:
            # in the order of their names, not of their making, as the state hash (Note
            # [Variables in the order of their names] in backend.py)
            made = sorted(((ref, v) for ref in self.made if (v := ref()) is not None),
                          key=lambda pair: (str(pair[1].name), str(pair[1].dtype),
                                            str(pair[1].shape)))
            with record.stop_recording():  # an eager tape must not see nondet's reads
                for ref, variable in made:
                    if not bool(variable.is_initialized()):
                        waiting.append(ref)
                        continue
                    value = tf.raw_ops.ReadVariableOp(resource=variable.handle,
                                                      dtype=variable.dtype)
                    if hashable(value):
                        fps.append(fingerprint(value))
        except Exception:  # a variable of another kind: its value is not known here
            self.made = []
            return None
        self.made = waiting
        return fps

    def covered(self, tensors: Iterable[Any]) -> None:
        """``tensors`` were made in this step by ops that cannot make a difference, or are
        in a data row of it: an eager op reading only such values cannot either."""
        for t in tensors:
            try:
                self._inert[id(t)] = weakref.ref(t)
            except TypeError:
                self.clean = False

    def is_covered(self, t: Any) -> bool:
        ref = self._inert.get(id(t))
        return ref is not None and ref() is t


@dataclass
class CallEntry:
    """A graph input of one traced call that was made from host data."""

    position: int
    label: str
    fps: list[Fp]
    numel: int


@dataclass
class Call:
    """A traced call about to run, as seen from ``ConcreteFunction._call_flat``."""

    graph: Any
    clean: bool  # the step was clean when it started
    busy: bool  # its graph may make a difference (unknown graphs: True)
    entries: list[CallEntry]
    #: variables made before it were not initialized yet (the call initializing what a
    #: first trace made): rows of this call would come before their values were checked
    waiting: bool = False


#: The data row of the variables made in a step before a call (``StepOrder.made_values``):
#: never placed, so that a difference in an initial value is narrowed to its op.
MADE_VARIABLES = "variable:initial values"


def call_entries(graph: Any, order: GraphOrder | None, args: list[Any], step: StepOrder,
                 host: HostTensors, string: Callable[[int], str],
                 fingerprint: Callable[[Any], Fp]) -> Call:
    """The entries of a traced call of ``graph`` with flat arguments ``args`` (its inputs and
    captures, in the order of ``graph.inputs``): each argument made from host data whose
    graph input some recorded op reads the values of, after the initial values of the
    variables made since the last call. ``fingerprint(t)`` takes an eager tensor's ``Fp``
    (called quiet)."""
    clean = step.clean
    entries = []
    if step.made:
        made = step.made_values(fingerprint)
        if made is None:
            clean = False
        elif made:
            entries.append(CallEntry(-1, MADE_VARIABLES, made, -1))
    waiting = bool(step.made)  # its rows are placed only if none is (backend._add_call_data)
    if order is None:
        return Call(graph, clean, True, entries, waiting)
    read_inputs = order.inputs_read(graph)
    if order.n_inputs != len(args):  # not the graph's inputs: nothing is known of them
        return Call(graph, clean, True, entries, waiting)
    inputs = []
    for position, read in read_inputs:
        t = args[position]
        holder = host.cached_fp(t)
        if holder is None or not hashable(t):
            continue
        if not read.values:
            # Host memory used only for its shape (``np.empty``) is no data: no row. A
            # re-run records it at its read all the same, so nothing after it is placed.
            clean = False
            continue
        inputs.append((t, read, holder))
    for t, read, holder in inputs:
        if not holder:
            holder.append(fingerprint(t))
        placed = clean and not waiting and read.first and order.placeable and read.source >= 0
        where = string(read.source) if placed else ""
        label = f"{GRAPH_INPUT} @ {where}" if where else GRAPH_INPUT
        entries.append(CallEntry(read.position, label, list(holder),
                                 t.shape.num_elements() or 0))
    return Call(graph, clean, order.busy or not order.placeable or not clean, entries,
                waiting)
