"""The TensorFlow backend: steps, variables, data and op capture for TF 2.x and Keras 3.

Installed right after the script imports tensorflow. It seeds TF (and Keras when imported),
then hooks:

- the op callbacks (tensorflow/ops.py): eager ops as they run, graph ops when traced;
- variable creation (a variable creator): every ``tf.Variable`` with the line that made it,
  fingerprinted when training starts and after each step (random generator states too);
- Keras: layer calls (module paths), optimizer creation (training starts) and updates
  (the step boundary: directly in eager code, counted in-graph for ``tf.function``/``fit``);
- ``GradientTape.gradient`` (backward phase, and the loss: hashed in eager code, carried
  out of traced steps by ``TFOpRecorder.carry_loss``);
- tf.data iterators used from Python (data entering).
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
import random
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from nondet import frameworks
from nondet.capture import Session, StopRun
from nondet.fingerprint import bytes_fp, combine, host_content, host_words, name_code
from nondet.frameworks.fp import Fp
from nondet.frameworks.tensorflow.hashing import hashable
from nondet.frameworks.tensorflow.ops import TFOpRecorder
from nondet.records import TENSOR_DTYPE, Group, Phase


@dataclass
class TrackedVariable:
    ref: weakref.ref[Any]
    name: str
    source: str
    group: Group  # PARAM (trainable), BUFFER, OPTIM or DATA (random generator states)


class TFBackend:
    name = "tensorflow"

    def __init__(self, session: Session) -> None:
        self.session = session
        self.disabled = False
        self.phase = Phase.INIT
        self.started = False
        self.explicit = False
        self.layer_stack: list[int] = []
        self.scopes: dict[str, tuple[int, int]] = {}  # graph name scope -> (module, source)
        self.variables: list[TrackedVariable] = []
        self._making_own_variables = False
        self.evaluating = False  # inside Keras evaluate/predict (see _mark_evaluation)
        self.noted: set[str] = set()
        self._reset_step()
        try:
            tf.random.set_seed(session.config.seed)
            self.recorder = TFOpRecorder(self)
            self._install_hooks()
            frameworks.after_import("keras", self._install_keras_hooks)
            session.send_meta({"env": tf_environment()})
            self._sync_window()
        except Exception:
            self.disable()  # hooks installed before the failure stay, but do nothing
            raise

    def _reset_step(self) -> None:
        self.data: list[tuple[str, list[Fp], int]] = []  # (label, fingerprints, numel or -1)
        self.losses: list[Fp] = []
        self.loss_value = math.nan

    # -- hooks ---------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        backend = self

        def creator(next_creator: Any, **kwargs: Any) -> Any:
            variable = next_creator(**kwargs)
            if not backend.disabled and not backend._making_own_variables:
                backend._track(variable)
            return variable

        # Entered for good (and kept referenced, or leaving the generator would exit it):
        # every variable made in this thread from now on passes through.
        self._creator_scope = tf.variable_creator_scope(creator)
        self._creator_scope.__enter__()

        original_gradient = tf.GradientTape.gradient

        @functools.wraps(original_gradient)
        @tf.autograph.experimental.do_not_convert
        def gradient(tape: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
            if backend.disabled:
                return original_gradient(tape, target, *args, **kwargs)
            with backend.guarded():
                backend._note_loss(target)
            previous, backend.phase = backend.phase, Phase.BACKWARD
            try:
                return original_gradient(tape, target, *args, **kwargs)
            finally:
                backend.phase = previous

        tf.GradientTape.gradient = gradient  # type: ignore[method-assign]

        from tensorflow.python.data.ops import iterator_ops

        original_next = iterator_ops.OwnedIterator.__next__

        @functools.wraps(original_next)
        @tf.autograph.experimental.do_not_convert
        def iterator_next(iterator: Any) -> Any:
            if backend.disabled or backend.evaluating or not tf.executing_eagerly():
                return original_next(iterator)
            previous, backend.phase = backend.phase, Phase.DATA
            try:
                element = original_next(iterator)
            finally:
                backend.phase = previous
            tensors = tf.nest.flatten(element)
            with backend.guarded():
                fps = backend.recorder.entry("tf_data", "iterator next", tensors)
                if fps:
                    numel = sum(t.shape.num_elements() or 0 for t in tensors if hashable(t))
                    backend.data.append(("tf_data:iterator next", fps, numel))
            return element

        iterator_ops.OwnedIterator.__next__ = iterator_next  # type: ignore[method-assign]

    def _install_keras_hooks(self) -> None:
        import keras
        from keras.src.layers.layer import Layer
        from keras.src.optimizers.base_optimizer import BaseOptimizer

        backend = self
        keras.utils.set_random_seed(self.session.config.seed)

        original_call = Layer.__call__

        @functools.wraps(original_call)
        @tf.autograph.experimental.do_not_convert
        def layer_call(layer: Any, *args: Any, **kwargs: Any) -> Any:
            if backend.disabled:
                return original_call(layer, *args, **kwargs)
            backend.layer_stack.append(backend._layer_id(layer))
            try:
                return original_call(layer, *args, **kwargs)
            finally:
                backend.layer_stack.pop()

        Layer.__call__ = layer_call  # type: ignore[method-assign]

        original_init = BaseOptimizer.__init__

        @functools.wraps(original_init)
        @tf.autograph.experimental.do_not_convert
        def optimizer_init(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            original_init(optimizer, *args, **kwargs)
            if not backend.disabled and not backend.started:
                with tf.init_scope():
                    backend.start_training()

        BaseOptimizer.__init__ = optimizer_init  # type: ignore[method-assign]

        original_apply = BaseOptimizer.apply

        @functools.wraps(original_apply)
        @tf.autograph.experimental.do_not_convert
        def apply(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if backend.disabled:
                return original_apply(optimizer, *args, **kwargs)
            previous, backend.phase = backend.phase, Phase.OPTIMIZER
            try:
                result = original_apply(optimizer, *args, **kwargs)
            finally:
                backend.phase = previous
            if tf.executing_eagerly():
                if not backend.explicit:
                    backend.boundary()
            else:
                backend.recorder.count_update()  # in a graph: counted when it runs
            return result

        BaseOptimizer.apply = apply  # type: ignore[method-assign]
        self._mark_evaluation()

    def _mark_evaluation(self) -> None:
        """``evaluate``/``predict`` (also ``fit``'s validation) do not train: what their
        functions read and compute is not part of the next training step."""
        try:
            from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
        except ImportError:  # another Keras layout: validation counts into the next step
            return
        backend = self
        for method in ("evaluate", "predict"):
            original = getattr(TensorFlowTrainer, method)

            def not_training(model: Any, *args: Any, _original: Any = original,
                             **kwargs: Any) -> Any:
                outer, backend.evaluating = backend.evaluating, True
                try:
                    return _original(model, *args, **kwargs)
                finally:
                    backend.evaluating = outer

            setattr(TensorFlowTrainer, method, functools.wraps(original)(not_training))

    def _layer_id(self, layer: Any) -> int:
        path = getattr(layer, "path", None) or getattr(layer, "name", "")
        import keras

        parts = str(path).split("/")
        if isinstance(layer, keras.Model) and len(parts) == 1:
            return self.session.intern("")
        return self.session.intern("/".join(parts[1:]) if len(parts) > 1 else parts[0])

    def _track(self, variable: Any) -> None:
        stack = traceback.extract_stack(limit=40)
        files = " ".join(frame.filename for frame in stack)
        if "stateful_random_ops" in files:
            group = Group.DATA  # a random generator's state: reported with the RNG state
        elif "/optimizers/" in files:
            group = Group.OPTIM
        elif getattr(variable, "trainable", False):
            group = Group.PARAM
        else:
            group = Group.BUFFER
        source = self.session.sources.here(3)
        try:
            ref = weakref.ref(variable)
        except TypeError:
            return
        self.variables.append(TrackedVariable(ref, str(getattr(variable, "name", "?")),
                                              self.session.string(source), group))

    def _note_loss(self, target: Any) -> None:
        if not tf.executing_eagerly():
            self.recorder.carry_loss(target)
            return
        if not hasattr(target, "numpy"):
            return
        with self._paused():
            fp = self.recorder._hash_eager(target)
        self.losses.append(fp)
        try:
            if int(np.prod(target.shape)) == 1:
                self.loss_value = float(np.asarray(target.numpy()).reshape(-1)[0])
        except (TypeError, ValueError):
            pass

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
        sources = self.session.sources
        for frame in reversed(frames or ()):
            if sources.user_file(frame.filename):
                return sources.intern_location(frame.filename, frame.lineno)
        return sources.here(5)

    # -- after a traced function ran -----------------------------------------------------------
    def after_function(self) -> None:
        training_records = len(self.recorder.records)
        data, updates = self.recorder.collect()
        if self.evaluating:
            del self.recorder.records[training_records:]
            return
        loss = self.recorder.take_loss()
        if loss is not None:
            fp, self.loss_value = loss
            self.losses.append(fp)
        if data:
            self.data.append(("tf_data:IteratorGetNext", data, -1))  # size not known here
        if updates > 1 and not self.explicit:
            self.note_once("steps_per_execution", (
                "one traced call made several training steps (Keras steps_per_execution > 1): "
                "they share one weights snapshot and the op records of the first; for a "
                "step-exact finding, compile with steps_per_execution=1"))
        for _ in range(updates):
            if not self.explicit:
                self.boundary()

    # -- window, pause ---------------------------------------------------------------------------
    def _sync_window(self) -> None:
        self.recorder.set_window(not self.disabled and self.session.captures_ops())

    def note_once(self, key: str, text: str) -> None:
        """A note on the capture itself, shown with the report (see pipeline.capture_notes)."""
        if key not in self.noted:
            self.noted.add(key)
            self.session.send_facts({f"capture_note.{key}": text})

    def hook_failed(self) -> None:
        """A hook raised: report it once (a nondet bug: exit 3, with a log) and stop
        capturing, so that the script itself runs on."""
        if not self.disabled:
            self.session.send_meta({"hook_error": traceback.format_exc()})
        self.disable()

    @contextmanager
    def guarded(self) -> Any:
        """Runs nondet's part of a hook; an error in it must not reach the script."""
        try:
            yield
        except Exception:
            self.hook_failed()

    @contextmanager
    def own_variables(self) -> Any:
        """Variables made in here are nondet's: not tracked as the script's state."""
        self._making_own_variables = True
        try:
            yield
        finally:
            self._making_own_variables = False

    @contextmanager
    def _paused(self) -> Any:
        was, self.recorder.active = self.recorder.active, False
        try:
            yield
        finally:
            self.recorder.active = was

    # -- step-level state ------------------------------------------------------------------------
    def _live_variables(self) -> list[tuple[TrackedVariable, Any]]:
        alive = []
        for tracked in self.variables:
            variable = tracked.ref()
            if variable is not None:
                alive.append((tracked, variable))
        self.variables = [t for t, _ in alive]
        return alive

    def _snapshot_row(self, row: np.ndarray, step: int) -> np.ndarray:
        detailed = self.session.captures_ops(step)
        groups: dict[Group, list[tuple[str, np.ndarray]]] = {g: [] for g in Group}
        for tracked, variable in self._live_variables():
            try:
                value = np.asarray(variable.numpy())
            except Exception:  # not readable (uninitialized, remote): nothing to compare
                continue
            groups[tracked.group].append((tracked.name, value))
        with self._paused():
            row["params_fp"] = _group_fp(groups[Group.PARAM])
            row["buffers_fp"] = _group_fp(groups[Group.BUFFER])
            row["optim_fp"] = _group_fp(groups[Group.OPTIM])
            params = [v for _, v in groups[Group.PARAM] if v.dtype.kind == "f"]
            row["params_sum"] = float(sum(np.sum(v, dtype=np.float64) for v in params)) \
                if params else math.nan
        data_fps = [combine(fp.value or 0 for fp in fps) for _, fps, _ in self.data]
        row["data_fp"] = combine(data_fps) if data_fps else 0
        row["loss_fp"] = combine(fp.value or 0 for fp in self.losses) if self.losses else 0
        row["loss"] = self.loss_value
        generators = [bytes_fp(v.tobytes()) for _, v in groups[Group.DATA]]
        legacy = np.random.get_state()[1]  # type: ignore[index]
        row["rng_fp"] = combine([*generators, bytes_fp(legacy.tobytes()),
                                 bytes_fp(np.asarray(random.getstate()[1],
                                                     dtype=np.uint64).tobytes())])
        rows: list[tuple[Any, ...]] = []
        if detailed:
            for group in (Group.PARAM, Group.BUFFER, Group.OPTIM, Group.DATA):
                for name, value in groups[group]:
                    content = host_content([host_words(value)])
                    total = float(np.sum(value, dtype=np.float64)) if value.dtype.kind == "f" \
                        else math.nan
                    rows.append((step, int(group), self.session.intern(f"variable {name}"),
                                 combine((content, name_code(str(value.dtype)))), total,
                                 math.nan, value.size))
        for (label, _, numel), data_fp in zip(self.data, data_fps, strict=True):
            rows.append((step, int(Group.DATA), self.session.intern(label), data_fp, math.nan,
                         math.nan, numel))
        return np.array(rows, dtype=TENSOR_DTYPE) if rows else np.zeros(0, dtype=TENSOR_DTYPE)

    # -- boundaries ------------------------------------------------------------------------------
    def start_training(self) -> None:
        if self.started:
            return
        self.started = True
        self._end_step()
        self.session.send_meta({"env": tf_environment()})
        self.session.send_facts(tf_facts())

    def boundary(self) -> None:
        if not self.started:
            self.start_training()
        self._end_step()

    def _end_step(self) -> None:
        session = self.session
        step = session.step
        row = session.new_step_row()
        tensors = self._snapshot_row(row, step)
        ops = self.recorder.take_rows(step)
        row["n_records"] = len(ops)
        self._reset_step()
        self.phase = Phase.FORWARD
        try:
            session.end_step(row, tensors, ops)
        finally:
            self._sync_window()

    def explicit_step(self) -> None:
        if self.disabled:
            return
        self.explicit = True
        if not self.started:
            self.started = True
            self.session.step = 0
        self.boundary()

    def probe(self, value: Any, name: str) -> bool:
        if self.disabled or not isinstance(value, (tf.Tensor, tf.Variable)):
            return False
        if not tf.executing_eagerly():  # a symbolic tensor: there is no value to take here
            self.note_once("probe_in_graph", "nondet.probe() inside a tf.function is ignored: "
                           "call it on the function's result, outside")
            return True
        with self.guarded():
            self.recorder.entry("probe", name, [tf.convert_to_tensor(value)])
        return True

    def finish(self, status: str) -> str:
        if self.disabled:
            return status
        if status == "complete" and not self.session.trained_elsewhere(self):
            try:
                if not self.started:
                    self.start_training()
            except StopRun:
                pass
            params = [np.asarray(v.numpy()) for t, v in self._live_variables()
                      if t.group == Group.PARAM]
            if params:
                self.session.final = {"final_params_fp": _group_fp(
                    [("", p) for p in params])}
        elif self.recorder.records:
            self.session.flush_ops(self.recorder.take_rows(self.session.step))
        self.session.send_meta({"env": tf_environment()})
        return status

    def kept(self, step: int, index: int) -> list[np.ndarray]:
        return []  # graph outputs are hashed in the graph, not saved: sizes are not measured

    def disable(self) -> None:
        self.disabled = True
        if hasattr(self, "recorder"):
            self.recorder.active = False


def _group_fp(items: list[tuple[str, np.ndarray]]) -> int:
    if not items:
        return 0
    content = host_content([host_words(v) for _, v in items])
    return combine((content, *(name_code(str(v.dtype)) for _, v in items),
                    *(d for _, v in items for d in (v.ndim, *v.shape))))


def tf_facts() -> dict[str, Any]:
    from tensorflow.python.framework import config

    return {
        "tf.op_determinism": bool(config.is_op_determinism_enabled()),
        "tf.intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "tf.inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "tf.onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") not in ("0", "false"),
    }


def tf_environment() -> dict[str, str]:
    build = tf.sysconfig.get_build_info()
    env = {
        "tensorflow_version": tf.__version__,
        "tf.cuda_version": str(build.get("cuda_version", "(none)")),
        "tf.cudnn_version": str(build.get("cudnn_version", "(none)")),
        "tf.intra_op_threads": str(tf.config.threading.get_intra_op_parallelism_threads()),
        "tf.inter_op_threads": str(tf.config.threading.get_inter_op_parallelism_threads()),
    }
    from tensorflow.python.framework import config

    env["tf.op_determinism"] = str(config.is_op_determinism_enabled())
    gpus = tf.config.list_physical_devices("GPU")
    env["tf.devices"] = ", ".join(d.name for d in tf.config.list_physical_devices()) or "cpu"
    env["tf.gpu_count"] = str(len(gpus))
    try:  # from the package metadata: keras may be half-imported (it imports tensorflow)
        env["keras_version"] = importlib.metadata.version("keras")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - ships with TF 2.16+
        pass
    return env

