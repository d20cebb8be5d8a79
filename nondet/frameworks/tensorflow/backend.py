"""The TensorFlow backend: steps, variables, data and op capture for TF 2.x and Keras 3.

Installed right after the script imports tensorflow. It seeds TF (and Keras when imported),
then hooks (tensorflow/hooks.py, unless said otherwise):

- the op callbacks (tensorflow/ops.py): eager ops as they run, graph ops when traced;
- variable creation (a variable creator): every ``tf.Variable`` with the line that made it,
  fingerprinted when training starts and after each step (random generator states too);
- Keras on TensorFlow (not Keras on torch or JAX: that framework's backend owns the
  steps): layer calls (module paths), optimizer creation (training starts) and updates
  (the step boundary: directly in eager code, counted in-graph for ``tf.function``/``fit``);
- ``GradientTape.gradient`` (backward phase, and the loss: hashed in eager code, carried
  out of traced steps by ``TFOpRecorder.carry_loss``); without a Keras optimizer, a
  gradient of trainable variables is the script's own update (Note [Updates by hand]);
- tf.data iterators used from Python (data entering).
"""

from __future__ import annotations

import functools
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.util import tf_stack

from nondet import channel, frameworks
from nondet.frameworks.base import Session, StepLifecycle, StepState
from nondet.frameworks.fp import Fp, group_fp
from nondet.frameworks.tensorflow import data, file_reads, graph_mode, hooks, image_random
from nondet.frameworks.tensorflow import seeding as tf_seeding
from nondet.frameworks.tensorflow.entries import Call, CallEntry, call_entries
from nondet.frameworks.tensorflow.graph import (
    GraphOp,
    first_replica,
    in_dataset_function,
    in_loop_body,
    strategy_facts,
    under_strategy,
)
from nondet.frameworks.tensorflow.hashing import hashable
from nondet.frameworks.tensorflow.ops import TFOpRecorder
from nondet.frameworks.tensorflow.stage_lines import user_line
from nondet.frameworks.tensorflow.state import (
    TrackedVariable,
    tf_environment,
    tf_facts,
    values_fp,
    variable_group,
)
from nondet.frameworks.tensorflow.statehash import StateHasher
from nondet.records import INIT_STEP, Group, Kind, Phase

STEPS_PER_EXECUTION_NOTE = (
    "one traced call made several training steps (Keras steps_per_execution > 1): they share "
    "one weights snapshot and the op records of the first; for a step-exact finding, compile "
    "with steps_per_execution=1")
LOOP_UPDATES_NOTE = (
    "one traced call made several optimizer updates in a loop (a training loop inside one "
    "tf.function, such as `for _ in tf.range(steps)`): each update counts as a step, and they "
    "share the weights snapshot taken after the call, so a difference made inside the call is "
    "named at the call's first update; for a step-exact finding, make one update per call")
UPDATES_PER_CALL_NOTE = (
    "one traced call made several optimizer updates (a training step that applies more than "
    "one, such as a GAN's two optimizers): each counts as a step, and they share the weights "
    "snapshot taken after the call, so a difference made inside the call is named at the "
    "call's first update")


class TFBackend(StepLifecycle):
    name = "tensorflow"

    def __init__(self, session: Session) -> None:
        self.layer_stack: list[int] = []
        self.scopes: dict[str, tuple[int, int]] = {}  # graph name scope -> (module, source)
        self.variables: list[TrackedVariable] = []  # in creation order
        self._ordered: list[TrackedVariable] | None = None  # in the state hash's order
        self.making_own_variables = False
        self._state_hasher: StateHasher | None = None  # made with the recorder's variables
        self._refresher: StateHasher | None = None  # first reads' contents (first_reads.py)
        self.evaluating = False  # inside Keras evaluate/predict (see hooks._mark_evaluation)
        self.fit_steps_per_execution = 0  # 0: no Keras fit running (hooks: the model's value)
        self.updates_in_loop = False  # an update was counted inside a tf.while_loop body
        self.optimizer_made = False  # a Keras/tf_keras optimizer: its updates are the steps
        self.update_pending = False  # an eager update by hand: the step ends at the next tape
        # before training starts without an optimizer: data entries and op records made
        # before the latest batch was drawn (see start_training)
        self._batch_mark: tuple[int, int] | None = None
        super().__init__(session)
        try:
            tf.random.set_seed(session.config.seed)
            planned = session.config.op_steps
            # The first pair's default window (init and step 0) would instrument the
            # training step, traced at step 0, and a graph keeps its guards: seconds of
            # tracing and a dearer step for the whole run. So the first graph traced while
            # the window is still ahead declines the steps after init (``tracing``); a
            # difference from step 0 on is then found by re-running the differing step with
            # op-level capture (pipeline._narrow). A script that trains eagerly traces
            # nothing: its step 0 stays captured (cheap: no guards) and needs no re-run.
            self._decline_on_trace = bool(session.config.ops_optional and planned
                                          and max(planned) > INIT_STEP)
            self.recorder = TFOpRecorder(self)
            self.recorder.host.install()  # tensors made from host data (entries.py)
            self._creator_scope = hooks.install(self)  # kept referenced: see hooks.install
            data.install(self)  # tf.data options, Keras PyDataset workers
            file_reads.install()  # caches and checkpoints read in C, for readback
            image_random.install(self)  # where stateful tf.image.random_* ops are called
            graph_mode.install(self)  # TensorFlow 1 graph mode: said, not recorded
            tf_seeding.install(session)  # after nondet's own seeding above
            frameworks.after_import("keras", functools.partial(hooks.install_keras, self))
            frameworks.after_import("keras", file_reads.install_keras)
            frameworks.after_import("tf_keras", functools.partial(hooks.install_tf_keras, self))
            session.send_meta({"env": tf_environment()})
            self._sync_capture()
        except Exception:
            self.disable()  # hooks installed before the failure stay, but do nothing
            raise

    def start_training(self) -> None:
        if not self.started:
            # Sent before the init row: the first step traces the step function (seconds of
            # single-threaded Python), so lockstep runs it in both runs at once (measured in
            # docs/benchmarks.md; turns.Turns).
            self.session.send_meta({channel.META_OVERLAP_FIRST_STEP: True})
        mark, self._batch_mark = self._batch_mark, None
        if mark is None or self.optimizer_made or self.started:
            super().start_training()
            return
        # Training started by hand (a tape opened, no optimizer) after the script drew the
        # batch it trains on: that batch is step 0's, not init's.
        data, self.data = self.data[mark[0]:], self.data[:mark[0]]
        records = self.recorder.records
        held, self.recorder.records = records[mark[1]:], records[:mark[1]]
        super().start_training()
        self.data.extend(data)
        if self.session.captures_ops(self.session.step):
            init, forward = int(Phase.INIT), int(Phase.FORWARD)  # made before training began
            self.recorder.records.extend(
                (r[0], forward, *r[2:]) if r[1] == init else r for r in held)

    # Note [Updates by hand]
    # ~~~~~~~~~~~~~~~~~~~~~~
    # Steps are optimizer updates, but a script may update its variables without a Keras
    # optimizer: ``w.assign_sub(lr * dw)`` (TensorFlow's "basic training loops" guide), a
    # Sonnet 2 optimizer (``snt.optimizers.Adam().apply(grads, params)``, a tf.Module),
    # or any other library's. Before, such a script had no step at all ("no training step
    # was observed", exit 2). With no Keras optimizer made, a ``GradientTape.gradient``
    # whose sources include a trainable variable is taken as one update: in a traced
    # function counted in-graph like an optimizer's (after the gradients), so the call's
    # state snapshot holds the assignments that follow; in eager code the step stays open
    # (``update_pending``) until the next tape opens or batch is drawn, as torch's
    # backward-and-update does, so the assignments made after the gradient belong to it.
    # Training starts when the first tape opens: that tape records step 0's forward. A
    # gradient of anything else (an input image, a penalty's interpolates) is no update.

    def before_batch(self) -> None:
        """A tf.data batch is about to be drawn in Python."""
        if self.update_pending and not self.explicit:
            self.boundary()
        elif not self.started and not self.optimizer_made:
            self._batch_mark = (len(self.data), len(self.recorder.records))

    def tape_opened(self) -> None:
        """A ``GradientTape`` opens (Note [Updates by hand])."""
        if self.optimizer_made or self.explicit or not first_replica():
            return  # (the other replicas of a strategy: one update whatever their number)
        if not tf.executing_eagerly() and (under_strategy() or in_dataset_function()):
            # a tf.data stage's trace is no training step; a replica's thread
            # (MirroredStrategy) would own the steps, which the main thread counts: the
            # first count starts training then
            return
        with tf.init_scope():  # traced: the rows are taken outside the graph
            if self.update_pending:
                self.boundary()
            elif not self.started:
                self.start_training()

    def optimizer_created(self) -> None:
        """A Keras (or tf_keras) optimizer was made: its updates are the steps from now on,
        and an update by hand still open ends here (not with the optimizer's first)."""
        if self.update_pending and not self.explicit:
            self.boundary()
        self.optimizer_made = True
        if not self.started:
            self.start_training()

    def gradients_taken(self, sources: Any, grads: Any) -> None:
        """``tape.gradient(target, sources)`` returned ``grads`` (Note [Updates by hand])."""
        if self.optimizer_made or self.explicit or self.evaluating or not first_replica():
            return  # (the other replicas of a strategy: one update whatever their number)
        if not any(_trainable_variable(s) for s in tf.nest.flatten(sources)):
            return
        if not tf.executing_eagerly() and in_dataset_function():
            return  # run by tf.data's threads, as far ahead as prefetching goes
        if tf.executing_eagerly():
            if not self.started:
                self.start_training()
            self.note_gradients(grads)
            self.update_pending = True
            return
        if under_strategy():
            self.note_once("tf_distribute", hooks.DISTRIBUTE_NOTE)
            self.session.send_facts(strategy_facts())
        elif not self.started:
            with tf.init_scope():
                self.start_training()
        self.count_update(grads)

    def count_update(self, grads: Any) -> None:
        """In a graph being traced: an update counted when the graph runs."""
        self.updates_in_loop = self.updates_in_loop or in_loop_body()
        self.recorder.count_update(grads)

    def boundary(self) -> None:
        self.update_pending = False
        super().boundary()

    def _end_pending_step(self) -> None:
        if self.update_pending:  # an update by hand that no later tape or batch closed
            self.boundary()

    def _reset_step(self) -> None:
        super()._reset_step()
        self.grads: list[Fp] = []  # eager updates only: traced gradients stay in the graph
        if hasattr(self, "recorder"):
            self.recorder.step_order.reset()  # nothing ran yet in the new step (entries.py)

    def track(self, variable: Any) -> None:
        files = " ".join(frame.filename for frame in traceback.extract_stack(limit=40))
        if "__autograph_generated_file" in files:
            # TensorFlow's stack, mapped back through AutoGraph: a library's optimizer that
            # makes its slots while a tf.function traces (Sonnet's Adam) runs as generated
            # code, whose file names say nothing of "/optimizers/" (its state was grouped as
            # buffers). Only then: it costs twice the Python stack (~90 us at depth 100)
            frames = list(tf_stack.extract_stack())[-40:]
            files = " ".join(frame.filename for frame in frames)
        group = variable_group(variable, files)
        source = self.session.sources.here(3)
        try:
            ref = weakref.ref(variable)
        except TypeError:
            return
        self.variables.append(TrackedVariable(
            ref, str(getattr(variable, "name", "?")), self.session.string(source), group,
            order=(str(getattr(variable, "dtype", "")), str(getattr(variable, "shape", "")))))
        self._ordered = None

    def note_loss(self, target: Any) -> None:
        if not tf.executing_eagerly():
            self.recorder.carry_loss(target)
            return
        if not hasattr(target, "numpy"):
            return
        with self._paused():
            fp = self.recorder.hash_eager(target)
        self.losses.append(fp)
        try:
            if int(np.prod(target.shape)) == 1:
                self.loss_value = float(np.asarray(target.numpy()).reshape(-1)[0])
        except (TypeError, ValueError):
            pass

    def note_gradients(self, grads: Any) -> None:
        """The gradients an eager update applies (traced updates keep theirs in the graph:
        their effect shows in the parameters after the update)."""
        with self._paused():
            self.grads.extend(self.recorder.hash_eager(g) for g in tf.nest.flatten(grads)
                              if hashable(g))

    # -- context for records -------------------------------------------------------------------
    def current_module(self) -> int:
        return self.layer_stack[-1] if self.layer_stack else -1

    def graph_origin(self, op_name: str, output: Any) -> tuple[int, int]:
        """(module, source) of a graph op being traced. Gradient ops are attributed to the
        forward op whose name their scope repeats (``gradient_tape/<forward op>/...``)."""
        if self.phase == Phase.BACKWARD or op_name.startswith("gradient_tape/"):
            scope = op_name.removeprefix("gradient_tape/")
            while scope:
                hit = self.scopes.get(scope)
                if hit is not None:
                    return hit
                scope = scope.rpartition("/")[0]
        origin = (self.current_module(), self._graph_source(output))
        # the op and its enclosing scopes: a gradient op may be named after either
        # (``.../proj_1/MatMul/MatMul`` repeats the op, ``.../proj_1/TanhGrad`` the scope)
        scope = getattr(getattr(output, "op", None), "name", op_name)
        while scope and not scope.startswith("gradient_tape/"):
            self.scopes.setdefault(scope, origin)
            scope = scope.rpartition("/")[0]
        return origin

    def _graph_source(self, output: Any) -> int:
        """The innermost user line in the op's creation traceback, which TensorFlow maps back
        through AutoGraph's generated code to the user's source."""
        try:
            frames = output.op.traceback
        except Exception:
            frames = None
        line = user_line(self.session.sources, frames)
        return line if line >= 0 else self.session.sources.here(5)

    def tracing(self) -> None:
        """A graph op is being traced (called before it is instrumented): in a first pair
        whose optional window is still ahead, op-level capture is declined for the steps
        after init, before the graph gets any guard (see ``__init__``)."""
        if not self._decline_on_trace:
            return
        self._decline_on_trace = False
        session = self.session
        planned = session.config.op_steps or []
        if max(planned, default=INIT_STEP) < session.step:
            return  # the window is over: this graph gets no guards anyway
        session.decline_op_steps([s for s in planned if s <= INIT_STEP])
        if session.step > INIT_STEP:
            self.recorder.records.clear()  # this step is no longer captured op by op
        with tf.init_scope():  # the window flag is assigned now, not in the graph
            self._sync_capture()

    # -- traced calls -----------------------------------------------------------------------------
    def call_starting(self, function: Any, args: list[Any]) -> Call:
        """A traced function is called eagerly (``ConcreteFunction._call_flat``) with flat
        arguments ``args``: its graph inputs made from host data, fingerprinted now (before
        the call ends the step), named by entries.py."""
        recorder = self.recorder
        graph = getattr(function, "_func_graph", None)
        with recorder.quiet():
            return call_entries(graph, recorder.trace_order.of(graph), args,
                                recorder.step_order, recorder.host, self.session.string,
                                recorder.hash_eager)

    def after_function(self) -> None:
        recorder = self.recorder
        call = recorder.calls.pop() if recorder.calls else None  # this call's, if hooked
        training_records = len(recorder.records)
        data, updates = recorder.collect()
        if self.evaluating:
            del recorder.records[training_records:]
            return
        loss = recorder.take_loss()
        if loss is not None:
            fp, self.loss_value = loss
            self.losses.append(fp)
        self._add_call_data(call, data)
        if updates > 1 and not self.explicit:
            self._note_several_updates()
        for _ in range(updates):
            if not self.explicit:
                self.boundary()

    def _add_call_data(self, call: Call | None, data: list[tuple[GraphOp, list[Fp]]]) -> None:
        """The data rows of a traced call: its graph inputs made from host data and the
        batches its data ops read, in trace order, each placed (named with its line) when
        nothing before it in the step could have made a difference (Note [Entries named like
        the op records] in entries.py); then, if its graph may have made one, later entries
        of the step are not placed."""
        order = self.recorder.step_order
        clean = call.clean and not call.waiting if call is not None else order.clean
        string = self.session.string
        entries = list(call.entries) if call is not None else []
        for op, fps in data:
            name = string(op.name_id)
            where = string(op.source) if clean and op.unpreceded and op.source >= 0 else ""
            entries.append(CallEntry(op.order, f"{name} @ {where}" if where else name, fps,
                                     op.numel))
        entries.sort(key=lambda entry: entry.position)
        for entry in entries:
            self.add_data(entry.label, entry.fps, entry.numel)
        if call is None or call.busy:
            order.clean = False

    def _note_several_updates(self) -> None:
        """One traced call ran several optimizer updates: each is a step, but they share the
        weights snapshot taken after the call. Worded by its cause: Keras
        ``steps_per_execution`` (which the user can set to 1), a training loop inside the
        function (an update counted in a ``tf.while_loop`` body), or a step function
        applying several updates itself (a GAN's two optimizers)."""
        if self.fit_steps_per_execution > 1:
            self.note_once("steps_per_execution", STEPS_PER_EXECUTION_NOTE)
        elif self.updates_in_loop:
            self.note_once("updates_in_loop", LOOP_UPDATES_NOTE)
        else:
            self.note_once("updates_per_call", UPDATES_PER_CALL_NOTE)

    # -- window, pause ---------------------------------------------------------------------------
    def in_op_window(self) -> bool:
        return self.recorder.active

    def _sync_capture(self) -> None:
        self.recorder.set_window(not self.disabled and self.session.captures_ops())

    @contextmanager
    def own_variables(self) -> Iterator[None]:
        """Variables made in here are nondet's: not tracked as the script's state, and made
        by TensorFlow's own creator. nondet makes its first ones at the first op it sees,
        which may run inside a library's variable creator scope: the SavedModel loader's
        (``tf.saved_model.load`` as a script's first TensorFlow call) builds every variable
        made there from a saved spec, and failed on nondet's (exit 3, TensorFlow round 11).
        So the creator stack is set aside meanwhile (a private TensorFlow API: left alone
        where it is missing)."""
        self.making_own_variables = True
        graph = tf.compat.v1.get_default_graph()
        try:
            creators = graph._variable_creator_stack
            graph._variable_creator_stack = []
        except Exception:
            creators = None
        try:
            yield
        finally:
            self.making_own_variables = False
            if creators is not None:
                graph._variable_creator_stack = creators

    @contextmanager
    def _paused(self) -> Iterator[None]:
        was, self.recorder.active = self.recorder.active, False
        try:
            yield
        finally:
            self.recorder.active = was and not self.disabled

    # -- step-level state ------------------------------------------------------------------------
    # Note [Variables in the order of their names]
    # The state hash folds the tracked variables in one order. Creation order is not the same
    # in every run: a SavedModel loaded mid-training (``tf.saved_model.load`` of a Keras
    # ``model.export()``, a ``TFSMLayer``) makes its variables in an order that varies from
    # process to process, with the same values, and the state "differed" at that step (a
    # false alarm, TensorFlow round 11). Variables are therefore hashed in the order of their
    # names, dtypes and shapes, creation order breaking ties only. Scheme 7.
    def _live_variables(self) -> list[tuple[TrackedVariable, Any]]:
        if self._ordered is None or len(self._ordered) != len(self.variables):
            self._ordered = sorted(self.variables, key=lambda t: (t.name, *t.order))
        alive = []
        for tracked in self._ordered:
            variable = tracked.ref()
            if variable is not None:
                alive.append((tracked, variable))
        if len(alive) != len(self._ordered):
            dead = {id(t) for t in self._ordered} - {id(t) for t, _ in alive}
            self.variables = [t for t in self.variables if id(t) not in dead]
            self._ordered = [t for t, _ in alive]
        return alive

    def _step_state(self, step: int, detailed: bool) -> StepState:
        recorder = self.recorder
        recorder.resolve()  # this step's eager fingerprints: data, losses, gradients, probes
        state = self._hash_state(detailed)
        if detailed:  # what the next call's first reads take (Note [First reads])
            recorder.firsts.refresh(self._state_hasher.contents)  # type: ignore[union-attr]
        state.grads = group_fp([fp.value or 0 for fp in self.grads])
        return state

    def _hash_state(self, detailed: bool) -> StepState:
        if self._state_hasher is None:
            self._state_hasher = StateHasher(self.recorder.vars.hasher)
        # own_variables: the state hash keeps its folded keys in a variable (statefold.py)
        with self._paused(), self.recorder.quiet(), self.own_variables():
            return self._state_hasher.state(self._live_variables(), detailed)

    def tracked_variables(self) -> list[TrackedVariable]:
        return self.variables

    def variable_contents(self, needed: list[TrackedVariable]
                          ) -> list[tuple[TrackedVariable, int]]:
        """The content of each of ``needed`` now (Note [First reads] in first_reads.py): a
        detailed state hash of just those, by a hasher of its own (the sets it sees vary;
        the step's hasher keeps its few traced functions)."""
        if self._refresher is None:
            self._refresher = StateHasher(self.recorder.vars.hasher)
        live = [(t, v) for t in needed if (v := t.ref()) is not None]
        with self._paused(), self.recorder.quiet(), self.own_variables():
            self._refresher.state(live, True)
        return self._refresher.contents

    def _take_records(self, step: int) -> np.ndarray:
        return self.recorder.take_rows(step)

    def _final_params_fp(self) -> int | None:
        params = [np.asarray(v.numpy()) for t, v in self._live_variables()
                  if t.group == Group.PARAM]
        return values_fp(params) if params else None

    def probe(self, value: Any, name: str) -> bool:
        if not self.disabled and isinstance(value, (tf.Tensor, tf.Variable)) \
                and not tf.executing_eagerly():  # a symbolic tensor: no value to take here
            self.note_once("probe_in_graph", "nondet.probe() inside a tf.function is ignored: "
                           "call it on the function's result, outside")
            return True
        return super().probe(value, name)

    def _probe_fp(self, value: Any) -> Fp | None:
        if not isinstance(value, (tf.Tensor, tf.Variable)):
            return None
        return self.recorder.remember_eager(tf.convert_to_tensor(value))

    def _record_probe(self, name: str, fp: Fp, value: Any) -> None:
        self.recorder.add_record(Kind.PROBE, f"probe:{name}", [fp], value)

    def environment(self) -> dict[str, str]:
        return tf_environment()

    def facts(self) -> dict[str, Any]:
        return tf_facts()

    def disable(self) -> None:
        super().disable()
        if hasattr(self, "recorder"):
            self.recorder.active = False


def _trainable_variable(value: Any) -> bool:
    """A trainable variable (TensorFlow's or Keras'), which a script updating by hand
    assigns to after taking its gradient."""
    return getattr(value, "trainable", False) is True and hasattr(value, "assign_sub")
