"""Op-level capture for TensorFlow, through TF's op callbacks (the mechanism behind
Debugger V2): eager ops are fingerprinted as they run; graph ops (``tf.function``, Keras
``fit``) are instrumented when the graph is traced.

Graph instrumentation is described in ``traced.py`` (Note [Graph instrumentation]).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

from nondet.fingerprint import name_code
from nondet.frameworks.fp import Fp, combined, resolve
from nondet.frameworks.tensorflow.data import (
    STAGE_ORDER_FACT,
    STATEFUL_STAGE_NOTE,
    UNORDERED_STAGE_NOTE,
    op_determinism_enabled,
    stage_function,
    stateful_parallel_stage,
)
from nondet.frameworks.tensorflow.entries import (
    INERT_EAGER_OPS,
    MADE_VARIABLES,
    SHAPE_ONLY_OPS,
    Call,
    HostTensors,
    StepOrder,
)
from nondet.frameworks.tensorflow.graph import (
    DATA_OPS,
    DERIVED_OPS,
    ENTRY_KINDS_OF,
    FUNCTION_CALLS,
    HOST,
    describe,
    entry_label,
    numel,
    recordable_graph,
    to_host,
)
from nondet.frameworks.tensorflow.hashing import hashable, host, on_host_and_small
from nondet.frameworks.tensorflow.loops import LOOP_OPS, PARALLEL_DRAWS_NOTE, parallel_random_draws
from nondet.frameworks.tensorflow.loops import NOTE_KEY as LOOPS_NOTE_KEY
from nondet.frameworks.tensorflow.reads import READ
from nondet.frameworks.tensorflow.stage_lines import StageLines, traced_user_line
from nondet.frameworks.tensorflow.traced import (
    GraphRecorder,
    TFHost,
    handed_on,
    others_callbacks_off,
)
from nondet.records import OP_DTYPE, Kind, Phase

__all__ = ["TFHost", "TFOpRecorder"]


class TFOpRecorder(GraphRecorder):
    """Eager records in execution order, graph records from the slots (module Note)."""

    def __init__(self, backend: TFHost) -> None:
        super().__init__(backend)
        self.cache: dict[int, tuple[weakref.ref[Any], Fp]] = {}  # eager tensors
        self.pending: list[Fp] = []  # eager fingerprints of this step, finalized by resolve
        self.stage_lines = StageLines(self.session.sources)  # lines inside tf.data functions
        self.step_order = StepOrder()  # entries.py: what ran before an entry in its step
        self.host = HostTensors()  # eager tensors made from host data (entries.py)
        self.calls: list[Call] = []  # traced calls running (entries.call_entries)
        op_callbacks.add_op_callback(self._callback)

    # -- window ----------------------------------------------------------------------------
    def set_window(self, on: bool) -> None:
        self.active = on
        self.firsts.active = on
        # Assigned only when it changes: called at every step end, an eager assignment is
        # a dispatch through the op callbacks (~0.5 ms of CPU per step with --ops all)
        if self.instrument and self._vars is not None and self._vars.window != on:
            with self.quiet():  # nondet's own op: not one of the step's (entries.StepOrder)
                self._vars.window_flag.assign(on)
            self._vars.window = on
        if not on:
            self.cache = {}

    # -- the callback ----------------------------------------------------------------------
    def _callback(self, op_type: str, inputs: Any, attrs: Any, outputs: Any,
                  op_name: str | None = None, graph: Any = None) -> Any:
        """TensorFlow's op callback; a list returned while tracing replaces the outputs.

        Every other return leaves them as they are (``handed_on``)."""
        if getattr(self._local, "busy", False) or self.backend.disabled or outputs is None:
            return handed_on(outputs)
        op_type = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
        # busy was False (checked above); the plain flag, not _quiet(): this runs for every op
        self._local.busy = True
        try:
            with others_callbacks_off():  # what nondet traces from here is its own
                if self._vars is None and graph is None:
                    # An eager op has run, so the runtime is up: make nondet's variables now
                    # rather than in the middle of a trace (made there, they missed that
                    # trace's first data write).
                    self.vars  # noqa: B018
                if graph is not None:
                    if op_type in LOOP_OPS:
                        self._note_parallel_draws(op_type, attrs)
                    if self.instrument and not self.full and recordable_graph(graph):
                        self.backend.tracing()
                        replaced = self._trace(op_type, inputs, outputs, op_name or op_type, graph)
                        return handed_on(outputs) if replaced is None else replaced
                    self.stage_lines.note_op(op_type, outputs, graph)
                    self.firsts.untraced_op(op_type, inputs, graph)
                    return handed_on(outputs)
                if self.firsts.known and not op_type.startswith(FUNCTION_CALLS):
                    self.firsts.eager_op(op_type, inputs)  # it may write a variable
                if op_type.startswith(FUNCTION_CALLS):
                    self.backend.after_function()
                elif op_type.endswith("Dataset") or "DatasetV" in op_type:
                    self._note_dataset(op_type, inputs, attrs)
                elif not self.backend.evaluating:
                    if self.step_order.clean and self.backend.started:
                        # (init is always recorded op by op: its records name its entries)
                        self._eager_in_clean_step(op_type, inputs, outputs)
                    if self.active:
                        self._eager(op_type, inputs, outputs)
        except Exception:
            self.backend.hook_failed()  # the script goes on, uncaptured; the report says why
        finally:
            self._local.busy = False
        return handed_on(outputs)


    def _note_parallel_draws(self, op_type: str, attrs: Any) -> None:
        """A loop being traced that runs iterations at once and draws from a legacy random
        op: a capture note with its line, whether or not the race strikes (loops.py)."""
        draws = parallel_random_draws(op_type, attrs)
        if draws is None:
            return
        source = traced_user_line(self.session.sources)
        if source < 0:
            source = self.session.sources.here(4)
        op, iterations = draws
        self.backend.note_once(f"{LOOPS_NOTE_KEY}:{source}", PARALLEL_DRAWS_NOTE.format(
            source=self.session.string(source) or "?", iterations=iterations, op=op))

    def _note_dataset(self, op_type: str, inputs: Any, attrs: Any) -> None:
        """Remember where a tf.data stage that may reorder its elements was built
        (``deterministic=False``), or one that runs a stateful function in parallel
        (``data.stateful_parallel_stage``): batches that differ are reported at that line,
        the one to fix, rather than where they were read."""
        pairs = dict(zip(attrs[::2], attrs[1::2], strict=False)) if attrs else {}
        function = stage_function(pairs)
        # the stateful call inside the stage's function (AutoGraph hides it from here())
        inner = self.stage_lines.take(function) if function else -1
        flag = pairs.get("deterministic")
        if (flag.decode() if isinstance(flag, bytes) else flag) == "false":
            if op_determinism_enabled():
                return  # tf.data runs every stage in order then
            stage = self.session.sources.here(4)
            self.reordering_stage = self.unordered_stage = stage
            self.session.send_facts({STAGE_ORDER_FACT: False})
            # a race that did not strike in these two runs is still there (as below)
            self.backend.note_once(f"tf_data_unordered:{stage}", UNORDERED_STAGE_NOTE.format(
                source=self.session.string(stage) or "?"))
        elif stateful_parallel_stage(op_type, inputs, pairs):
            stage = self.session.sources.here(4)
            if self.unordered_stage < 0:  # else that stage is the likelier cause: its line
                self.reordering_stage = inner if inner >= 0 else stage
            # A race that did not strike in these two runs is still there: say so even
            # when they repeat (shown with every report on this capture).
            self.backend.note_once("tf_data_stateful_parallel", STATEFUL_STAGE_NOTE.format(
                source=self.session.string(stage) or "?",
                inner=f" (its first stateful op at {self.session.string(inner)})"
                if inner >= 0 else ""))

    # -- eager ops -------------------------------------------------------------------------
    def _eager_in_clean_step(self, op_type: str, inputs: Any, outputs: Any) -> None:
        """An eager op of the script's while nothing that could make a difference ran
        earlier in the step (entries.py, Note [Entries named like the op records]). The
        values a re-run records as entries here become data rows, named as it names them
        (``_eager``, same call depth): a tensor made from host data at its first use in
        the step ("external:tensor"), and the outputs of an op it records as an entry (a
        batch, an optional's value); the step stays clean while the op cannot make a
        difference from such values (``entries.INERT_EAGER_OPS``), else later entries are
        not placed."""
        order = self.step_order
        if order.creating:
            return  # a variable's initializer: the value is checked (StepOrder.made_values)
        numeric_in = [t for t in inputs or () if hashable(t)]
        numeric_out = [t for t in outputs or () if hashable(t)]
        if not numeric_in and not numeric_out:
            return  # a re-run records nothing of it (VarHandleOp, MakeIterator)
        source = self.session.sources.here(3)
        for t in numeric_in:
            if order.is_covered(t):
                continue
            holder = self.host.cached_fp(t)
            if holder is None or op_type in SHAPE_ONLY_OPS:
                order.clean = False  # computed elsewhere, or host memory used for its shape
                return
            if not self._clean_row("external:tensor", source, holder, t):
                return
            order.covered([t])
        entry = _entry_name(op_type, inputs, self.backend.phase)
        if entry is not None and op_type != READ:  # (a read: its variable was compared)
            name, batch = entry
            if batch and self.reordering_stage >= 0:
                source = self.reordering_stage
            if numeric_out and not self._clean_row(name, source, [], *numeric_out):
                return
        elif op_type not in INERT_EAGER_OPS:
            order.clean = False
            return
        order.covered(numeric_out)

    def _clean_row(self, name: str, source: int, holder: list[Fp], *tensors: Any) -> bool:
        """A placed data row of ``tensors`` ("name @ line"), after the values of the
        variables made earlier in the step; False (and the step no longer clean) when
        those cannot all be taken yet."""
        order = self.step_order
        backend = self.backend
        with self.quiet():
            if order.made:
                made = order.made_values(self.hash_eager)
                if made is None or order.made:
                    order.clean = False
                    return False
                if made:
                    backend.add_data(MADE_VARIABLES, made, -1)
            where = self.session.string(source) if source >= 0 else ""
            if not where:
                order.clean = False
                return False
            if not holder:
                holder.extend(self.hash_eager(t) for t in tensors)
        backend.add_data(f"{name} @ {where}", list(holder), numel(tensors[0]))
        return True

    def _eager(self, op_type: str, inputs: Any, outputs: Any) -> None:
        backend = self.backend
        phase = int(backend.phase)
        module = backend.current_module()
        source = self.session.sources.here(3)
        ins = []
        for t in inputs or ():
            if hashable(t):
                ins.append(self._eager_input(t, phase, module, source))
        outs_t = [t for t in (outputs or ()) if hashable(t)]
        if not outs_t:
            return
        name = self.session.intern(op_type)
        kind = Kind.OP
        entry = _entry_name(op_type, inputs, backend.phase)
        if entry is not None:
            kind = Kind.ENTRY
            name = self.session.intern(entry[0])
            if entry[1]:  # a batch
                phase = int(Phase.DATA)
                if self.reordering_stage >= 0:
                    source = self.reordering_stage
        if op_type in DERIVED_OPS and kind == Kind.OP:
            fps = [self._derive(name_code(op_type), ins, t) for t in outs_t]
        else:
            fps = [self.hash_eager(t) for t in outs_t]
        for t, fp in zip(outs_t, fps, strict=True):
            self._remember(t, fp)
        self.records.append((kind, phase, 0, name, module, source, fps, ins, numel(outs_t[0])))

    def _eager_input(self, t: Any, phase: int, module: int, source: int) -> Fp:
        hit = self.cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        fp = self._remember(t, self.hash_eager(t))
        self.records.append((Kind.ENTRY, phase, 0, self.session.intern("external:tensor"),
                             module, source, [fp], [], numel(t)))
        return fp

    def _remember(self, t: Any, fp: Fp) -> Fp:
        try:
            self.cache[id(t)] = (weakref.ref(t), fp)
        except TypeError:  # not weak-referenceable
            pass
        return fp

    def hash_eager(self, t: Any) -> Fp:
        """Start fingerprinting an eager tensor: small host tensors through NumPy now, others
        where they live, read back with the step's other fingerprints (``resolve``)."""
        fp = Fp()
        fp.meta = describe(t)
        if on_host_and_small(t):
            fp.content = host(t)
        else:
            with self.quiet():
                fp.content = self.vars.hasher.content(t)
        self.pending.append(fp)
        return fp

    def _derive(self, code: int, parents: list[Fp], t: Any) -> Fp:
        fp = Fp()
        fp.parents = tuple(parents)
        fp.meta = (code, *describe(t))
        self.pending.append(fp)
        return fp

    def resolve(self) -> None:
        """Finalize this step's eager fingerprints: one read-back for all device contents."""
        with self.quiet():
            resolve(self.pending, _read_contents)
        self.pending = []

    def remember_eager(self, t: Any) -> Fp:
        """Fingerprint of an eager tensor, remembered so later ops see it as known."""
        return self._remember(t, self.hash_eager(t))

    def add_record(self, kind: Kind, name: str, fps: list[Fp], value: Any) -> None:
        """A record made by the backend itself (a probe) at the current place in the script."""
        self.records.append((kind, int(self.backend.phase), 0, self.session.intern(name),
                             self.backend.current_module(), self.session.sources.here(3), fps,
                             [], numel(value)))

    def entry(self, kind: str, what: str, tensors: list[Any]) -> list[Fp]:
        """Data entering from outside in eager code (e.g. a tf.data iterator's next)."""
        fps = [self._remember(t, self.hash_eager(t)) for t in tensors if hashable(t)]
        if self.active and fps:
            source = self.session.sources.here(3)
            if kind == "tf_data" and self.reordering_stage >= 0:
                source = self.reordering_stage
            self.records.append((Kind.ENTRY, int(self.backend.phase), 0,
                                 self.session.intern(f"{kind}:{what}"),
                                 self.backend.current_module(), source, fps, [],
                                 numel(tensors[0])))
        return fps

    # -- rows ------------------------------------------------------------------------------
    def take_rows(self, step: int) -> np.ndarray:
        self.resolve()
        # graph records carry final values already (traced.collect), eager ones Fps
        rows = [
            (step, i, kind, phase, flags, name, module, source,
             outs if isinstance(outs, int) else combined(outs),
             ins if isinstance(ins, int) else combined(ins), 0, 0, numel)
            for i, (kind, phase, flags, name, module, source, outs, ins, numel)
            in enumerate(self.records)
        ]
        self.records = []
        return np.array(rows, dtype=OP_DTYPE) if rows else np.zeros(0, dtype=OP_DTYPE)


def _reads_variant(inputs: Any) -> bool:
    return any(getattr(t, "dtype", None) == tf.variant for t in inputs or ())


def _entry_name(op_type: str, inputs: Any, phase: Phase) -> tuple[str, bool] | None:
    """How an eager op whose outputs are entries is named in the records ("kind:what"), and
    whether it is a batch; None for an op."""
    # A batch read eagerly past the Python iterator hook (a distributed iterator's
    # get_next_as_optional, as MirroredStrategy's fit uses), or decoded from the
    # iterator's variant output (a ragged or sparse batch: RaggedTensorFromVariant):
    # data entering, at the stage that let it vary when there is one, as in a graph.
    if op_type in DATA_OPS or (phase == Phase.DATA and _reads_variant(inputs)):
        return f"tf_data:{op_type}", True
    if op_type in ENTRY_KINDS_OF:
        return f"{ENTRY_KINDS_OF[op_type]}:{entry_label(op_type)}", False
    if _reads_variant(inputs):
        # A variant input (an encoded list, optional or dataset element) cannot be
        # hashed, so "its inputs matched" would be vacuous: a differing output is a
        # value entering, never an op creating the difference.
        return f"external:{op_type}", False
    return None


def _read_contents(contents: list[Any]) -> list[int]:
    """Device content sums (int64 scalars) to the host in one copy."""
    with tf.device(HOST):
        stacked = tf.stack(contents)
    return [int(v) for v in to_host(stacked).tolist()]
