"""The script's TensorFlow and Keras calls hooked for the backend (``TFBackend``).

- variable creation (a variable creator): every ``tf.Variable`` with the line that made it;
- ``GradientTape.gradient``: the backward phase, and the loss (``note_loss``); without an
  optimizer the script updates its variables by hand, and a gradient of them is an update
  (``gradients_taken``; a tape opening starts training and closes such an update);
- tf.data iterators used from Python: data entering;
- Keras (once ``keras`` has finished importing): layer calls (module paths), optimizer
  creation (training starts) and updates (the step boundary in eager code, counted in-graph
  for ``tf.function``/``fit``); ``evaluate``/``predict`` marked as not training.

Each hook calls the original first when capture is disabled, and never raises into the
script (``guarded``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, cast

import tensorflow as tf

from nondet.frameworks.base import RecorderHost
from nondet.frameworks.fp import Fp
from nondet.frameworks.step_thread import STEP_THREAD
from nondet.frameworks.tensorflow.entries import Call
from nondet.frameworks.tensorflow.graph import (
    first_replica,
    install_data_function_watch,
    install_pfor_watch,
    own_op_failed,
    strategy_facts,
    under_strategy,
)
from nondet.frameworks.tensorflow.hashing import hashable
from nondet.frameworks.tensorflow.ops import TFOpRecorder
from nondet.records import Phase

_F = TypeVar("_F", bound=Callable[..., Any])


def not_converted(function: _F) -> _F:
    """AutoGraph leaves ``function`` alone (a typed ``do_not_convert``: TF's is untyped)."""
    return cast(_F, tf.autograph.experimental.do_not_convert(function))


class HookHost(RecorderHost, Protocol):
    """What the hooks need from the backend (``TFBackend``)."""

    recorder: TFOpRecorder
    started: bool
    optimizer_made: bool  # a Keras (or tf_keras) optimizer exists: its updates are the steps
    explicit: bool  # nondet.step() is in charge of boundaries
    evaluating: bool  # inside Keras evaluate/predict
    fit_steps_per_execution: int  # of the Keras model whose fit/train_on_batch is running
    layer_stack: list[int]
    making_own_variables: bool  # nondet's own variables are not the script's state

    def guarded(self) -> AbstractContextManager[None]: ...

    def start_training(self) -> None: ...

    def optimizer_created(self) -> None: ...

    def boundary(self) -> None: ...

    def add_data(self, label: str, fps: list[Fp], numel: int) -> None: ...

    def track(self, variable: Any) -> None: ...

    def note_loss(self, target: Any) -> None: ...

    def note_gradients(self, grads: Any) -> None: ...

    def call_starting(self, function: Any, args: list[Any]) -> Call: ...

    def count_update(self, grads: Any) -> None: ...

    def tape_opened(self) -> None: ...

    def gradients_taken(self, sources: Any, grads: Any) -> None: ...

    def before_batch(self) -> None: ...


def install(backend: HookHost) -> Any:
    """Hook variable creation, ``GradientTape.gradient`` and tf.data iterators; returns the
    variable creator scope, which the caller keeps referenced (see below)."""

    def creator(next_creator: Any, **kwargs: Any) -> Any:
        if backend.disabled or backend.making_own_variables:
            return next_creator(**kwargs)
        order = backend.recorder.step_order
        order.creating += 1  # its initializer's eager ops are not the step's (entries.py)
        try:
            variable = next_creator(**kwargs)
        finally:
            order.creating -= 1
        with backend.guarded():
            backend.track(variable)
            order.made_variable(variable)
        return variable

    # Entered for good (and kept referenced, or leaving the generator would exit it):
    # every variable made in this thread from now on passes through.
    creator_scope = tf.variable_creator_scope(creator)
    creator_scope.__enter__()

    original_gradient = tf.GradientTape.gradient

    @functools.wraps(original_gradient)
    @not_converted
    def gradient(tape: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        if backend.disabled:
            return original_gradient(tape, target, *args, **kwargs)
        with backend.guarded():
            backend.note_loss(target)
        previous, backend.phase = backend.phase, Phase.BACKWARD
        try:
            grads = original_gradient(tape, target, *args, **kwargs)
        finally:
            backend.phase = previous
        with backend.guarded():
            backend.gradients_taken(args[0] if args else kwargs.get("sources"), grads)
        return grads

    tf.GradientTape.gradient = gradient

    original_enter = tf.GradientTape.__enter__

    @functools.wraps(original_enter)
    @not_converted
    def enter(tape: Any) -> Any:
        if not backend.disabled:
            with backend.guarded():
                backend.tape_opened()
        return original_enter(tape)

    tf.GradientTape.__enter__ = enter

    from tensorflow.python.data.ops import iterator_ops

    original_next = iterator_ops.OwnedIterator.__next__

    @functools.wraps(original_next)
    @not_converted
    def iterator_next(iterator: Any) -> Any:
        if backend.disabled or backend.evaluating or not tf.executing_eagerly() \
                or (backend.recorder.foreign() and not STEP_THREAD.owned()):
            # (a loader thread feeding a queue: its batches are drawn at points of the
            # step set by thread timing; Note [Calls from other threads])
            return original_next(iterator)
        with backend.guarded():
            backend.before_batch()
        previous, backend.phase = backend.phase, Phase.DATA
        try:
            element = original_next(iterator)
        finally:
            backend.phase = previous
        # expand_composites: a ragged or sparse batch is hashed by its dense components
        tensors = tf.nest.flatten(element, expand_composites=True)
        with backend.guarded():
            fps = backend.recorder.entry("tf_data", "iterator next", tensors)
            if fps:
                numel = sum(t.shape.num_elements() or 0 for t in tensors if hashable(t))
                backend.add_data("tf_data:iterator next", fps, numel)
        return element

    iterator_ops.OwnedIterator.__next__ = iterator_next
    install_pfor_watch()  # no guards in a loop pfor vectorizes
    install_data_function_watch()  # nor in tf.data's own functions
    _hook_calls(backend)
    _save_unguarded(backend)
    return creator_scope


# Note [Calls from other threads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# TensorFlow's op callbacks are per thread: nondet sees the ops of the thread that made its
# recorder (``GraphRecorder.thread``), and a traced call's end (``TFBackend.after_function``,
# which takes the call's entries and may end the step) only there. A ``tf.function`` is
# also called from other threads: a helper inside a ``tf.py_function`` of a tf.data
# ``map`` (run by tf.data's threads) or of the training graph (TensorFlow's inter-op
# threads), a monitoring or checkpointing thread. Such a call must leave the step's state
# alone: pushed on ``recorder.calls``, it was taken by the main thread's next call end
# (whose own entries were lost) or trimmed it away, and its ``call_entries`` used the
# step's ``StepOrder`` (taking the values of the variables made in the step) and added
# fingerprints to the step's; all at points set by thread timing, so a deterministic
# script's data rows differed between runs (a false alarm, "data: runs diverge"). Calls,
# first reads (first_reads.py) and the step order are kept for the recorder's thread only.
# Likewise a batch drawn in Python by another thread (a loader thread feeding a queue) is
# no data of the step it happens to fall in, unless that thread trains (owns the steps).


def _hook_calls(backend: HookHost) -> None:
    """Every eager call of a traced function goes through ``ConcreteFunction._call_flat``
    with its flat inputs and its graph: the graph inputs made from host data are data of
    the step (entries.py), taken before the call (its end may end the step). Calls from
    another thread pass through (Note [Calls from other threads])."""
    from tensorflow.python.eager.polymorphic_function import concrete_function

    original = concrete_function.ConcreteFunction._call_flat

    def recorded_call(function: Any, tensor_inputs: Any, captured_inputs: Any) -> Any:
        recorder = backend.recorder
        if backend.disabled or backend.evaluating or recorder.busy or recorder.foreign() \
                or not tf.executing_eagerly():  # (busy: nondet's own, the state hash)
            return original(function, tensor_inputs, captured_inputs)
        calls = recorder.calls
        depth = len(calls)
        with backend.guarded():
            calls.append(backend.call_starting(function, [*tensor_inputs, *captured_inputs]))
        try:
            return original(function, tensor_inputs, captured_inputs)
        finally:
            del calls[depth:]  # taken by after_function, unless the call failed

    @functools.wraps(original)
    def call_flat(function: Any, tensor_inputs: Any, captured_inputs: Any) -> Any:
        try:
            return recorded_call(function, tensor_inputs, captured_inputs)
        except Exception as error:
            if own_op_failed(error):
                _report_own_op_failure(backend, error)
            raise  # the call failed all the same: the script cannot go on without its result

    concrete_function.ConcreteFunction._call_flat = call_flat


def _report_own_op_failure(backend: HookHost, error: Exception) -> None:
    """A traced call failed in an op nondet placed there: nondet's failure (exit 3, with
    TensorFlow's error in its log), never reported as the script's."""
    try:
        raise RuntimeError("a graph op nondet added to the script's function failed "
                           "(TensorFlow's error above)") from error
    except RuntimeError:
        backend.hook_failed()


def _save_unguarded(backend: HookHost) -> None:
    """Functions traced while a SavedModel is written (``tf.saved_model.save``, which Keras'
    ``model.export`` and the TF Lite converter's ``from_keras_model`` call) get no op guards:
    a guard captures nondet's own variables, which the saved object does not track, and
    TensorFlow refuses to export it ("references an 'untracked' resource"), so with the op
    window open (``--ops all``) the script failed for nondet's graph. Exporting is not
    training: nothing of it is recorded. Patched where every alias of the API
    (``tf.saved_model.save``, ``tf.compat.v2...``) ends up: the module's own global."""
    from tensorflow.python.saved_model import save as save_module

    original = save_module.save_and_return_nodes

    @functools.wraps(original)
    def save_and_return_nodes(*args: Any, **kwargs: Any) -> Any:
        with backend.recorder.quiet():
            return original(*args, **kwargs)

    save_module.save_and_return_nodes = save_and_return_nodes


def _export_unguarded(backend: HookHost) -> None:
    """Keras' export archive (``model.export``, the TF Lite converter) may trace its
    endpoints before ``tf.saved_model.save``: those traces get no guards either."""
    try:
        from keras.src.export.saved_model_export_archive import SavedModelExportArchive
    except ImportError:  # another Keras layout: tf.saved_model.save is still covered
        return
    for method in ("add_endpoint", "track_and_add_endpoint", "write_out"):
        original = getattr(SavedModelExportArchive, method, None)
        if original is None:
            continue

        def unguarded(archive: Any, *args: Any, _original: Any = original,
                      **kwargs: Any) -> Any:
            with backend.recorder.quiet():
                return _original(archive, *args, **kwargs)

        setattr(SavedModelExportArchive, method, functools.wraps(original)(unguarded))


def keras_backend_name() -> str:
    """The framework Keras runs its layers on: ``KERAS_BACKEND`` as Keras read it."""
    import keras

    try:
        return str(keras.backend.backend())
    except Exception:  # an older or unusual Keras: it ran on TensorFlow
        return "tensorflow"


def install_keras(backend: HookHost) -> None:
    """Seed Keras and hook layer calls, optimizer creation and updates, evaluation."""
    import keras
    from keras.src.layers.layer import Layer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    if keras_backend_name() != "tensorflow":
        # Keras 3 on torch (or JAX) imports TensorFlow only as a utility (its array
        # adapter builds a tf.data pipeline, often mid-fit). Its layers and optimizer run
        # on that other framework, whose backend owns the steps: hooking them here too
        # would end every step twice, and reseeding now would change the running program.
        return
    keras.utils.set_random_seed(backend.session.config.seed)

    original_call = Layer.__call__

    @functools.wraps(original_call)
    @not_converted
    def layer_call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        if backend.disabled:
            return original_call(layer, *args, **kwargs)
        layer_id = -1
        with backend.guarded():
            layer_id = _layer_id(backend, layer)
        backend.layer_stack.append(layer_id)
        try:
            return original_call(layer, *args, **kwargs)
        finally:
            backend.layer_stack.pop()

    Layer.__call__ = layer_call

    BaseOptimizer.__init__ = _starting_training(backend, BaseOptimizer.__init__)

    BaseOptimizer.apply = _update_hook(
        backend, BaseOptimizer.apply, lambda args, kwargs: (
            args, kwargs, args[0] if args else kwargs.get("grads", ())))
    _mark_evaluation(backend)
    _note_steps_per_execution(backend)
    _export_unguarded(backend)


_Split = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any], Any]]


def _update_hook(backend: HookHost, original: Any, split: _Split,
                 inside: threading.local | None = None) -> Any:
    """An optimizer's update method hooked: the optimizer phase while it runs, then the step
    boundary (eager) or an update counted in-graph (``tf.function``/``fit``). ``split`` gives
    the arguments to pass on (a one-shot iterator made a list) and the gradients in them.
    ``inside`` (per thread: replicas update at once) marks an update running, so that an
    optimizer wrapping another (a loss-scale optimizer) makes one update, not two."""

    @functools.wraps(original)
    @not_converted
    def update(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if backend.disabled or getattr(inside, "update", False):
            return original(optimizer, *args, **kwargs)
        args, kwargs, grads = split(args, kwargs)
        previous, backend.phase = backend.phase, Phase.OPTIMIZER
        if inside is not None:
            inside.update = True
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            backend.phase = previous
            if inside is not None:
                inside.update = False
        with backend.guarded():
            if tf.executing_eagerly():
                # one update, whatever the replicas: a MirroredStrategy run eagerly applies
                # in each replica's thread (they made two steps of each batch)
                if first_replica():
                    backend.note_gradients(grads)
                    if not backend.explicit:
                        backend.boundary()
            else:
                if under_strategy():
                    backend.note_once("tf_distribute", DISTRIBUTE_NOTE)
                    backend.session.send_facts(strategy_facts())
                if first_replica():  # one update, whatever the replicas (tf.distribute)
                    # in a graph: counted when it runs, once the gradients are
                    backend.count_update(grads)
        return result

    return update


def install_tf_keras(backend: HookHost) -> None:
    """Keras 2 (the ``tf_keras`` package, or ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``):
    optimizer creation starts training, ``apply_gradients`` is the update (its optimizers
    and the legacy ones); ``evaluate``/``predict`` do not train."""
    try:
        from tf_keras.src.engine.training import Model
        from tf_keras.src.optimizers.legacy.optimizer_v2 import OptimizerV2
        from tf_keras.src.optimizers.optimizer import _BaseOptimizer
    except ImportError:  # another tf_keras layout: its steps are not seen
        return
    inside = threading.local()
    for cls in (_BaseOptimizer, OptimizerV2):
        cls.__init__ = _starting_training(backend, cls.__init__)
        cls.apply_gradients = _update_hook(backend, cls.apply_gradients, _pairs_split, inside)
    _not_training(backend, Model, ("evaluate", "predict"))


def _pairs_split(args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``apply_gradients(grads_and_vars, ...)``: the pairs may be a ``zip`` (read once)."""
    if args:
        pairs = list(args[0])
        args = (pairs, *args[1:])
    else:
        pairs = list(kwargs.get("grads_and_vars", ()))
        kwargs = {**kwargs, "grads_and_vars": pairs}
    return args, kwargs, [pair[0] for pair in pairs]


def _starting_training(backend: HookHost, original_init: Any) -> Any:
    """An optimizer's ``__init__``: the first one made starts training."""

    @functools.wraps(original_init)
    @not_converted
    def optimizer_init(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        original_init(optimizer, *args, **kwargs)
        if not backend.disabled and not backend.optimizer_made:
            with backend.guarded(), tf.init_scope():
                backend.optimizer_created()

    return optimizer_init


DISTRIBUTE_NOTE = (
    "the training step runs under a tf.distribute strategy: its ops are not recorded one by "
    "one inside the replicas, so a difference there is named by step (batch, loss, "
    "weights), not by op")


def _mark_evaluation(backend: HookHost) -> None:
    """``evaluate``/``predict`` (also ``fit``'s validation) do not train: what their
    functions read and compute is not part of the next training step."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # another Keras layout: validation counts into the next step
        return
    _not_training(backend, TensorFlowTrainer, ("evaluate", "predict"))


def _not_training(backend: HookHost, cls: Any, methods: tuple[str, ...]) -> None:
    """While these methods of ``cls`` run, the backend is evaluating, not training."""
    for method in methods:
        original = getattr(cls, method)

        def not_training(model: Any, *args: Any, _original: Any = original,
                         **kwargs: Any) -> Any:
            outer, backend.evaluating = backend.evaluating, True
            try:
                return _original(model, *args, **kwargs)
            finally:
                backend.evaluating = outer

        setattr(cls, method, functools.wraps(original)(not_training))


def _note_steps_per_execution(backend: HookHost) -> None:
    """While Keras ``fit``/``train_on_batch`` runs, the model's ``steps_per_execution``: a
    traced call that makes several updates is then worded by its cause (``TFBackend.
    after_function``): a GAN's ``train_step`` applying two optimizers makes several updates
    per call with ``steps_per_execution=1``, where "compile with steps_per_execution=1" is
    no advice."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # another Keras layout: the note names both causes
        return
    for method in ("fit", "train_on_batch"):
        original = getattr(TensorFlowTrainer, method)

        def training(model: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            outer = backend.fit_steps_per_execution
            with backend.guarded():
                backend.fit_steps_per_execution = int(getattr(model, "steps_per_execution", 1)
                                                      or 1)
            try:
                return _original(model, *args, **kwargs)
            finally:
                backend.fit_steps_per_execution = outer

        setattr(TensorFlowTrainer, method, functools.wraps(original)(training))


def _layer_id(backend: HookHost, layer: Any) -> int:
    path = getattr(layer, "path", None) or getattr(layer, "name", "")
    import keras

    parts = str(path).split("/")
    if isinstance(layer, keras.Model) and len(parts) == 1:
        return backend.session.intern("")
    return backend.session.intern("/".join(parts[1:]) if len(parts) > 1 else parts[0])
