"""Graph op capture for TensorFlow: instrumenting ops while a ``tf.function`` is traced,
and reading what the instrumented graph wrote after each call.

Note [Graph instrumentation]
At trace time, every graph op whose outputs must be hashed gets, next to it, an in-graph
fingerprint of each output written into a slot of one int64 buffer variable
(``content + 1``, so 0 means "did not run"), guarded by an ``If`` op on a boolean
variable that is true only during steps with op-level capture: graphs are traced once but
run every step, and outside the op window the guard skips all the work. The guard's two
branches are functions traced once per dtype and plan (word size and chunking, from the
output's static shape: ``hashing.static_plan``) and shared by all ops (``tf.cond`` would
trace two graphs per op: tracing a Keras CNN took 20 s instead of 4; a branch that chose
the word size and chunking itself held three nested ``tf.cond``s, which made TensorFlow's
first call of an instrumented step seconds dearer). Only the slots
leave the device. When a traced function has run (its eager call shows up in the eager
callback), nondet reads the slots, zeroes them, and turns the graph's op table (built at
trace time, in creation order, which is deterministic unlike execution order) into
records. Data entering the graph (``IteratorGetNext``) and optimizer updates are recorded
outside the guard, because step boundaries and the step's data need them every step.

The guard must stay a real ``If`` op, not the ``Switch``/``Merge`` that ``tf.cond`` is
lowered to by default: lowered, the hashed tensor's buffer is held by the dead branch for a
timing-dependent while, so whether the next op may reuse that buffer in place varies from
run to run, and ``AddN`` sums its inputs starting from whichever buffer it reuses. Measured
on bench/model_tf.py: with lowered guards, two captured runs of the same seeded script
differed within six steps; with ``If`` ops, they match (as plain runs do). The identity
that consumers see depends on the guard, so the guard has let go of the tensor before any
consumer runs. Data ops, hashed every step, are not guarded.

Outputs that are pure functions of their inputs (``DERIVED_OPS``) are not hashed: their
fingerprints are derived from their inputs' (Note [Derived fingerprints] in
torch/cache.py), on the host. The inputs of a graph op are known from the graph, so an
input's fingerprint is its producer's: nothing extra is hashed for inputs. A variable read
right after a recorded write through the same handle is derived too (Note [Reads after a
write] in reads.py), and a variable's first read in a graph traced at the top level takes
the content nondet knows of the variable when the call starts, with no guard (Note [First
reads] in first_reads.py).

Limitations
- Ops inside ``tf.cond``/``tf.while_loop`` bodies are not recorded one by one: the
  control-flow op that runs them is (``If``, ``While``), so a difference made inside is
  attributed to it. Running the functions eagerly (``tf.config.run_functions_eagerly(True)``)
  shows every op. Nested ``tf.function`` graphs are recorded like top-level ones.
- Ops of graphs compiled with XLA (``jit_compile=True``) are not recorded one by one: tf2xla
  refuses the guards (``graph.xla_compiled``); a capture note says so. Batches read outside
  the XLA function and the step-level state are recorded as usual.
- Ops in graphs traced before nondet's hooks were installed are not seen.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.ops import gen_functional_ops

from nondet.fingerprint import MASK64, name_code
from nondet.frameworks.base import RecorderHost
from nondet.frameworks.fp import Fp
from nondet.frameworks.tensorflow.entries import TraceOrder
from nondet.frameworks.tensorflow.first_reads import FirstReads
from nondet.frameworks.tensorflow.graph import (
    CAPACITY,
    DATA_OPS,
    DERIVED_OPS,
    ENTRY_KINDS_OF,
    GUARD_SCOPE,
    LATE_OPS,
    PFOR_NOTE,
    SKIPPED_OPS,
    SLOT_MARGIN,
    XLA_NOTE,
    GraphOp,
    OpKeys,
    RecorderVariables,
    backward_graph,
    describe,
    entry_label,
    joined,
    numel,
    pfor_converting,
    under_strategy,
    xla_compiled,
)
from nondet.frameworks.tensorflow.hashing import hashable, static_plan
from nondet.frameworks.tensorflow.loops import loop_producer
from nondet.frameworks.tensorflow.reads import READ, RepeatReads
from nondet.frameworks.tensorflow.state import TrackedVariable
from nondet.records import INIT_STEP, NODE_SEP, Kind, Phase


def handed_on(outputs: Any) -> Any:
    """What an op callback returns when it leaves an op's outputs alone: None (TensorFlow
    keeps them), or, when the script registered op callbacks of its own, the outputs
    themselves: TensorFlow hands each callback what the one before returned, so a None
    reached ``enable_check_numerics`` as the op's outputs (TensorFlow round 12)."""
    return outputs if len(context.context().op_callbacks) > 1 else None


@contextmanager
def others_callbacks_off() -> Iterator[None]:
    """The graph ops nondet traces in here are not handed to any op callback (TensorFlow's
    ``invoking_op_callbacks``, thread-local): the script's own (``enable_check_numerics``)
    put a NaN check on nondet's hash words, read as floats (TensorFlow round 12)."""
    runtime = context.context()
    was = runtime.invoking_op_callbacks
    runtime.invoking_op_callbacks = True
    try:
        yield
    finally:
        runtime.invoking_op_callbacks = was


class TFHost(RecorderHost, Protocol):
    """What the recorder asks of the TensorFlow backend (it never imports the backend)."""

    evaluating: bool
    started: bool  # training has started (the init row was sent)

    def own_variables(self) -> AbstractContextManager[None]: ...

    def after_function(self) -> None: ...

    def add_data(self, label: str, fps: list[Fp], numel: int) -> None: ...

    def tracing(self) -> None: ...

    def graph_origin(self, op_name: str, output: Any) -> tuple[int, int]: ...

    def tracked_variables(self) -> list[TrackedVariable]: ...

    def variable_contents(self, needed: list[TrackedVariable]
                          ) -> list[tuple[TrackedVariable, int]]: ...


class GraphRecorder:
    """Graph records: the op table built at trace time and the slots read after each call
    (module Note). ``ops.TFOpRecorder`` adds the eager side and the callback."""

    def __init__(self, backend: TFHost) -> None:
        self.backend = backend
        self.session = backend.session
        self._vars: RecorderVariables | None = None
        self.full = False  # no slot left: see _stop_instrumenting
        self.loss_meta: tuple[int, ...] | None = None  # set once a traced graph carries a loss
        self.instrument = backend.session.config.op_steps != []
        self.table: list[GraphOp] = []
        self.where: dict[tuple[int, str], tuple[int, int]] = {}  # (graph, tensor) -> producer
        self.next_slot = 0
        self.slot_graphs: list[int] = []  # per slot: the id of the graph that writes it
        self.records: list[tuple[Any, ...]] = []
        self.active = False
        self.updates_seen = 0
        self.carried: tuple[int, float] | None = None  # loss hash + 1 and value, see collect
        self.reordering_stage = -1  # source of the last tf.data stage built unordered
        self.unordered_stage = -1  # source of the last one given deterministic=False
        self.repeats = RepeatReads()
        self.trace_order = TraceOrder(self.session.sources)
        self._local = threading.local()
        #: the thread whose op callbacks nondet sees (``TFOpRecorder`` adds them in it: they
        #: are per thread): Note [Calls from other threads] in hooks.py
        self.thread = threading.get_ident()
        self.firsts = FirstReads(lambda: backend.tracked_variables(),
                                 lambda needed: backend.variable_contents(needed),
                                 lambda: backend.hook_failed())
        self.firsts.busy = lambda: getattr(self._local, "busy", False)
        if self.instrument:
            self.firsts.install()

    @property
    def vars(self) -> RecorderVariables:
        if self._vars is None:
            with self.backend.own_variables():
                self._vars = RecorderVariables(self.active)
        return self._vars

    @property
    def busy(self) -> bool:
        """Inside nondet's own work (``quiet``, or the op callback itself) in this thread."""
        return bool(getattr(self._local, "busy", False))

    def foreign(self) -> bool:
        """Called from a thread other than the one whose op callbacks nondet sees."""
        return threading.get_ident() != self.thread

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Ops made in here are nondet's own: the callback leaves them alone, and so do the
        script's own op callbacks (``others_callbacks_off``)."""
        was = getattr(self._local, "busy", False)
        self._local.busy = True
        try:
            with others_callbacks_off():
                yield
        finally:
            self._local.busy = was

    # -- graph ops (trace time) ----------------------------------------------------------------
    def _trace(self, op_type: str, inputs: Any, outputs: Any, op_name: str,
               graph: Any) -> list[Any] | None:
        """Record a graph op being traced; returns its outputs with the hashed ones replaced
        by identities that depend on their fingerprint's write, so the write always runs
        (ops nothing depends on may be pruned from a function)."""
        outputs = list(outputs or ())
        gid = id(graph)
        # before any return: writes count
        self.repeats.note(op_type, inputs, graph, lambda t: self._valued(gid, t))
        strategy = under_strategy()
        xla = xla_compiled(graph)
        # where a re-run's records would name an entry (entries.py), whatever this run records
        order, unpreceded = self.trace_order.note(op_type, inputs, graph,
                                             placeable=not (strategy or xla))
        if op_type in SKIPPED_OPS or op_type in LATE_OPS:
            return None
        if op_type not in DATA_OPS and (not self._window_ahead() or strategy):
            return None  # traced after the last op-captured step: a guard would never open
        if op_type not in DATA_OPS and xla:
            self.backend.note_once("xla", XLA_NOTE)
            return None
        if pfor_converting():
            self.backend.note_once("pfor", PFOR_NOTE)
            return None
        if self.next_slot + len(outputs) + SLOT_MARGIN > CAPACITY:
            self._stop_instrumenting()
            return None
        backend = self.backend
        numeric = [t for t in outputs if hashable(t)]
        late: list[Any] = []
        producers = [self._producer(gid, t, late) for t in (inputs or ()) if hashable(t)]
        module, source = backend.graph_origin(op_name, outputs[0] if outputs else None)
        index = len(self.table)
        data = op_type in DATA_OPS
        loop = None if data or op_type in ENTRY_KINDS_OF else _control_flow_variant(inputs)
        if loop is not None:  # Note [Readers of a loop's lists]
            module, source = backend.graph_origin(loop.name, loop.outputs[0]
                                                  if loop.outputs else None)
        if data and self.reordering_stage >= 0:
            source = self.reordering_stage
        entry = op_type in ENTRY_KINDS_OF or data
        node = getattr(getattr(outputs[0], "op", None), "name", op_name) if outputs else op_name
        name = (f"tf_data:{op_type}" if data else
                f"{ENTRY_KINDS_OF[op_type]}:{entry_label(op_type)}" if entry else
                f"{loop.type}{NODE_SEP}{loop.name}" if loop is not None else
                f"{op_type}{NODE_SEP}{node}")
        op = GraphOp(
            kind=Kind.ENTRY if entry else Kind.OP,
            phase=int(Phase.DATA if data else
                      Phase.BACKWARD if backward_graph(graph) else backend.phase),
            name_id=self.session.intern(name), module=module, source=source, slots=[],
            meta=[describe(t) for t in numeric], producers=producers,
            derived=op_type in DERIVED_OPS and not entry, code=name_code(op_type),
            numel=numel(numeric[0]) if numeric else -1, data=data, graph=gid,
            order=order, unpreceded=unpreceded,
        )
        if op.derived:
            op.valued = any(self._valued(gid, t) is not None for t in inputs or ()
                            if hashable(t))
        for position, t in enumerate(numeric):  # positions count hashed outputs, as op.values
            self.where[(gid, t.name)] = (index, position)
        if not numeric:
            return None
        self.table.append(op)
        if op_type == READ:  # a repeated read takes the earlier one's value (reads.py)
            first = self.repeats.first(inputs, graph)  # before ``remember`` below
            op.alias = self.repeats.earlier(inputs, graph, op.meta)
            if op.alias is None:
                written = self.repeats.after_write(inputs, graph, op.meta)
                if written is not None and all(self.table[i].valued
                                               for i, _ in written.sources):
                    # Note [Reads after a write] in reads.py
                    op.derived, op.code, op.bases = True, written.code, list(written.sources)
                elif first is not None:  # Note [First reads] in first_reads.py
                    op.first = self.firsts.read(first, graph)
                self.repeats.remember(inputs, graph, index, op.meta)
        if (op.derived or op.alias is not None or op.first is not None) and not late:
            return None
        replaced = []
        position = 0
        for t in outputs:
            if hashable(t):
                writes = list(late)
                if not op.derived:
                    slot = self._slot(gid)
                    op.slots.append(slot)
                    writes.append(self._write(t, slot, always=data))
                with tf.control_dependencies(writes):
                    t = tf.identity(t)
                # consumers see the identity, not the op's own output
                self.where[(gid, t.name)] = (index, position)
                position += 1
            replaced.append(t)
        return replaced

    # Note [Readers of a loop's lists]
    # A loop (``tf.while_loop``, ``tf.map_fn``) hands out what its iterations wrote as a
    # ``TensorList``, a variant that cannot be hashed; the op that reads it
    # (``TensorListStack`` of ``ta.stack()``) then has no recorded input for it, and a
    # difference the loop's body made would be blamed on that reader, as if it created a
    # difference from inputs that matched. Its record is named after the loop, at the
    # loop's line, as a difference made inside any control-flow body is (module
    # docstring): the cause is looked for there (loops.py). Scheme 7.

    def _producer(self, gid: int, t: Any, late: list[Any]) -> tuple[int, int]:
        """Where an input comes from; the outputs of LATE_OPS are recorded here, the first
        time something reads them."""
        known = self.where.get((gid, t.name))
        if known is not None:
            return known
        op = getattr(t, "op", None)
        if op is None or op.type not in LATE_OPS:
            return (-1, 0)
        backend = self.backend
        module, source = backend.graph_origin(op.name, t)
        entry = op.type == "Placeholder"
        record = GraphOp(
            kind=Kind.ENTRY if entry else Kind.OP, phase=int(backend.phase),
            name_id=self.session.intern("external:graph input" if entry
                                        else f"{op.type}{NODE_SEP}{op.name}"),
            module=module, source=source, slots=[], meta=[],
            producers=[self.where.get((gid, i.name), (-1, 0)) for i in op.inputs
                       if hashable(i)], code=name_code(op.type), graph=gid)
        index = len(self.table)
        self.table.append(record)
        for position, output in enumerate(o for o in op.outputs if hashable(o)):
            slot = self._slot(gid)
            record.slots.append(slot)
            record.meta.append(describe(output))
            late.append(self._write(output, slot, always=False))
            self.where[(gid, output.name)] = (index, position)
        record.numel = numel(op.outputs[0]) if op.outputs else -1
        return self.where.get((gid, t.name), (-1, 0))

    def _valued(self, gid: int, t: Any) -> tuple[int, int] | None:
        """Where ``t`` was recorded in graph ``gid``, if that record has a value whenever it
        runs (``GraphOp.valued``), else None."""
        place = self.where.get((gid, str(getattr(t, "name", ""))))
        return place if place is not None and self.table[place[0]].valued else None

    def _window_ahead(self) -> bool:
        """Op-level capture is on now or at a later step: ops traced now need guards. A
        graph traced after the last op-captured step is instrumented for its data only, so
        it runs as a plain one (module Note)."""
        steps = self.session.config.op_steps
        return steps is None or max(steps, default=INIT_STEP - 1) >= self.session.step

    def _slot(self, graph: int) -> int:
        if self.next_slot >= CAPACITY:  # SLOT_MARGIN makes this a nondet bug
            raise RuntimeError(f"more than {CAPACITY} graph outputs traced")
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.slot_graphs.append(graph)
        return slot

    def _stop_instrumenting(self) -> None:
        """The slot buffer is full (a function retraced again and again, e.g. one called
        with a new Python number each step): graphs traced from now on run uninstrumented."""
        self.full = True
        self.backend.note_once("graph_capacity", (
            f"op-level capture stopped instrumenting new TensorFlow graphs after {CAPACITY} "
            "traced outputs: a tf.function is probably retraced on every call (pass tensors, "
            "not Python numbers, or give it an input_signature)"))

    def _write(self, t: Any, slot: int, always: bool) -> Any:
        """The in-graph write of ``t``'s fingerprint into ``slot``: an ``If`` op on the
        window flag over the shared guard functions (module Note); ``always``: unguarded.
        Even a run whose window never closes (``--ops all``) keeps the ``If``: written
        inline, the hashes made TensorFlow's trace and first call of the step ~3 ms dearer
        per output, which ~16 us saved per output and step repays only after about 200
        steps; re-measured on the narrow model (sixth round, one process, alternating):
        inline saved 0.5-3.6 ms of the ~18-20 ms of CPU the hashes add per step and cost
        1.3-1.4 s more CPU in the trace and first call: 400 steps or more to repay
        (docs/benchmarks.md, TensorFlow)."""
        with tf.name_scope(GUARD_SCOPE):  # a failure here is nondet's (graph.own_op_failed)
            return self._write_scoped(t, slot, always)

    def _write_scoped(self, t: Any, slot: int, always: bool) -> Any:
        t = _as_declared(t)
        if always:
            plan = static_plan(t)
            hasher = self.vars.hasher
            value = (hasher.content(tf.stop_gradient(t)) if plan is None
                     else hasher.content_planned(tf.stop_gradient(t), plan)) + 1
            write = tf.raw_ops.ResourceScatterUpdate(resource=self.vars.buffer.handle,
                                                     indices=tf.constant(slot, tf.int32),
                                                     updates=value)
            with tf.control_dependencies([write]):
                return tf.constant(True)
        then, otherwise = self.vars.guard(t.dtype, static_plan(t))
        inputs = [tf.stop_gradient(t), tf.constant(slot, tf.int32), *then.captured_inputs]
        return gen_functional_ops._if(self.vars.window_flag, inputs, [tf.bool],
                                      then_branch=then, else_branch=otherwise)[0]

    def count_update(self, grads: Any = ()) -> None:
        """In a graph being traced: count an optimizer update when the graph runs.

        Counted after ``grads`` are computed: the count touches only nondet's variable, so
        unordered it may run in a call that fails before the update (fit's extra call at
        the end of a dataset of unknown length), and the next call would count two steps."""
        with self.quiet():
            after = [g for g in tf.nest.flatten(grads, expand_composites=True)
                     if tf.is_tensor(g)]
            with tf.control_dependencies(after):
                self.vars.updates.assign_add(1)

    def carry_loss(self, target: Any) -> None:
        """In a graph being traced: the loss ``tape.gradient`` differentiates is symbolic, so
        assignments (which a tf.function always runs) carry its hash and value to the step
        end, where ``take_loss`` reads them."""
        if not hashable(target):
            return
        with self.quiet():
            t = tf.stop_gradient(target)
            self.vars.loss_hash.assign(self.vars.hasher.content(t) + 1)
            scalar = t.shape.is_fully_defined() and t.shape.num_elements() == 1
            self.vars.loss_value.assign(tf.cast(tf.reshape(t, []) if scalar else math.nan,
                                           tf.float64))
            self.loss_meta = describe(t)

    def take_loss(self) -> tuple[Fp, float] | None:
        """The loss carried out of the function that just ran, if it computed one (read by
        ``collect``, with everything else the call wrote)."""
        carried, self.carried = self.carried, None
        if self.loss_meta is None or carried is None:
            return None
        return self._from_slot(carried[0], self.loss_meta), carried[1]

    # -- after a traced function ran -----------------------------------------------------------
    def collect(self) -> tuple[list[tuple[GraphOp, list[Fp]]], int]:
        """Read the slots of the function that just ran: the data ops of this call with
        their fingerprints, and how many optimizer updates it made. Op records are added if
        in the window.

        Graph fingerprints are final here (their contents came back with the slots), so
        they are worked out as plain integers, each op's description packed once
        (``OpKeys``): an ``Fp`` object per output and a masking pass per combination were
        half of this loop's time, ~650 records per step on the narrow benchmark model
        (docs/benchmarks.md). The values are those ``Fp.finalize`` gives."""
        try:
            return self._collect()
        finally:
            self.firsts.called()  # the call may have written any variable

    def _collect(self) -> tuple[list[tuple[GraphOp, list[Fp]]], int]:
        if self._vars is None:
            return [], 0
        updates, loss_hash, loss_value, values = self._vars.drain(self.next_slot)
        new_updates, self.updates_seen = updates - self.updates_seen, updates
        self.carried = (loss_hash, loss_value) if loss_hash else None
        if self.next_slot == 0:
            return [], new_updates
        data: list[tuple[GraphOp, list[Fp]]] = []
        active = self.active
        table = self.table
        stored_all = values.tolist()
        # Graphs that wrote nothing did not run in this call (a tf.function's first trace,
        # which made its variables, runs once; Keras traces graphs it never runs): none of
        # their ops can have a value, since producers and aliases are in the op's own graph.
        # Skipping them whole halved this loop on the narrow benchmark model, whose
        # first trace is half the table (docs/benchmarks.md).
        slot_graphs = self.slot_graphs
        live = {slot_graphs[s] for s in np.flatnonzero(values).tolist()}
        firsts = self.firsts
        entry = firsts.entry_graph()
        if entry is not None:  # ran, though its first reads wrote no slot
            live.add(entry)
        for op in table:
            op.values = ()
            if op.graph not in live:
                continue
            keys = op.keys
            if keys is None:
                keys = op.keys = OpKeys(op, table)
            ins = None
            if op.alias is not None:  # a repeated read: the earlier read's value (reads.py)
                op.values = table[op.alias].values
                if not op.values:
                    continue  # did not run
            elif op.first is not None:  # Note [First reads] in first_reads.py
                content = firsts.value(op.graph, op.first)
                if content is None:
                    continue  # not known in this call: left out, as if it did not run
                op.values = keys.hashed([content + 1])  # the number its slot would hold
            elif op.derived:
                if not active:
                    continue
                ins = keys.inputs()
                bases = ins if keys.bases is None else keys.inputs(keys.bases)
                if not bases or (keys.bases is not None and len(bases) < len(keys.bases)):
                    continue
                op.values = keys.derive(bases)
            else:
                stored = [stored_all[s] for s in op.slots]
                if not any(stored):
                    continue  # did not run
                op.values = keys.hashed(stored)
            if op.data:
                data.append((op, [Fp(v) for v in op.values]))
            if active:
                if ins is None:
                    ins = keys.inputs()
                self.records.append((*keys.record, joined(op.values), joined(ins), op.numel))
        return data, new_updates

    @staticmethod
    def _from_slot(stored: int, meta: tuple[int, ...]) -> Fp:
        fp = Fp()
        fp.content, fp.meta = (stored - 1) & MASK64, meta
        fp.finalize()
        return fp


def _as_declared(t: Any) -> Any:
    """``t`` as hashed: an output whose static shape holds no element is hashed empty, as the
    graph declares it. oneDNN's kernels (the default on x86 CPUs) return
    FusedBatchNormGradV2/V3's unused reserve spaces, shaped (0,) in the graph, with one
    value: the guard planned for an empty tensor refused to reshape it, and the captured run
    failed inside the script's step ("the script failed": a tf_keras or Sonnet BatchNorm
    under op-level capture); hashed as made, the value is whatever the kernel left there."""
    if t.shape.is_fully_defined() and t.shape.num_elements() == 0:
        # not a slice of ``t``: grappler drops a slice it sees take the whole (empty) input
        with tf.control_dependencies([t]):  # the write still waits for the op
            return tf.zeros(t.shape, t.dtype)
    return t


def _control_flow_variant(inputs: Any) -> Any:
    """The control-flow op (a loop, a branch) a variant input comes from, or None: see
    Note [Readers of a loop's lists]."""
    for t in inputs or ():
        if getattr(t, "dtype", None) == tf.variant:
            op = loop_producer(t)
            if op is not None:
                return op
    return None
