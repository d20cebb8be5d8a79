"""Input-pipeline settings that let a seeded pipeline's batches vary, with the user's line.

Two settings make the batches of a TensorFlow/Keras input pipeline differ between runs
without any op saying so:

- ``tf.data.Options().deterministic = False`` (or its deprecated alias
  ``experimental_deterministic``) applied with ``Dataset.with_options``: every parallel
  stage may hand out elements in completion order. The op callback only sees a stage's
  own ``deterministic`` attribute, which stays ``"default"`` here.
- a Keras 3 ``keras.utils.PyDataset`` read by several workers: ``__getitem__`` runs in
  several threads (or processes) at once, so whatever the calls share (an RNG, a counter)
  is consumed in an order that depends on scheduling. Its batches reach the graph through
  ``Dataset.from_generator``, which says nothing about workers.

The hooks below remember the line to fix (the line that set the option; the
``__getitem__`` definition) as the recorder's ``reordering_stage``, so that batches that
differ are reported there, and send a fact the recipes match on (``tf.data.deterministic``,
``keras.pydataset_workers``). A hook never raises into the script (``guarded``).
"""

from __future__ import annotations

import functools
import weakref
from contextlib import AbstractContextManager
from typing import Any, Protocol

from nondet import frameworks
from nondet.frameworks.base import Session
from nondet.frameworks.tensorflow.shared_draws import NOTE, NOTE_KEY, SharedDraws
from nondet.frameworks.tensorflow.stage_lines import draws_state

#: tf.data stages that run their function on several elements at once.
_PARALLEL_STAGES = ("ParallelMapDataset", "ParallelInterleaveDataset", "MapAndBatchDataset",
                    "ParallelFilterDataset")

#: The names ``tf.data.Options`` accepts for the ordering setting (TF 2.21: both).
_ORDER_OPTIONS = ("deterministic", "experimental_deterministic")

#: Fact: the user's lines calling ``Dataset.list_files`` with its shuffle on and no seed.
LIST_FILES_FACT = "tf.data.list_files_shuffled"

#: How deep into functions a stage's function runs (nested stages, branches) is looked.
_MAX_NESTING = 8

#: Sites kept per run for a fact that lists lines.
_MAX_SITES = 16


class DataHost(Protocol):
    """What the hooks need from the backend (``TFBackend``)."""

    session: Session
    recorder: Any  # TFOpRecorder: its ``reordering_stage`` (a source id, -1 for none)

    @property
    def disabled(self) -> bool: ...

    def guarded(self) -> AbstractContextManager[None]: ...

    def note_once(self, key: str, text: str) -> None: ...


STATEFUL_STAGE_NOTE = (
    "the tf.data stage built at {source} runs a stateful function{inner} (random ops, a Keras "
    "random layer) on several elements at once: which element gets which random state depends on "
    "thread timing, so its batches can differ between runs even when two runs agree; "
    "tf.config.experimental.enable_op_determinism() runs it in order")


UNORDERED_STAGE_NOTE = (
    "the tf.data stage built at {source} was given deterministic=False: it hands out "
    "elements in the order its parallel calls finish, so its batches can differ between "
    "runs even when two runs agree; leave the argument out (or deterministic=True) there")

#: Fact: a tf.data stage was built with ``deterministic=False`` (recipe TF-DATA-STAGE-ORDER).
STAGE_ORDER_FACT = "tf.data.stage_deterministic"


def op_determinism_enabled() -> bool:
    """``tf.config.experimental.enable_op_determinism()`` is in force: tf.data then runs
    every stage in order and a stateful function on one element at a time."""
    from tensorflow.python.framework import config

    return bool(config.is_op_determinism_enabled())  # not exported: tf.config has only set


def stateful_parallel_stage(op_type: str, inputs: Any, attrs: dict[str, Any]) -> bool:
    """A stage built to run a stateful function on several elements at once (``map(f,
    num_parallel_calls=...)`` with a Keras random layer, whose seed is a variable read and
    bumped per call, or an unseeded random op): the elements still come out in order, but
    which element gets which state depends on thread timing, so this stage's line is where
    batches that differ were made (keras-io's augmentation in ``train_ds.map(...)``)."""
    if not op_type.startswith(_PARALLEL_STAGES):
        return False
    if op_determinism_enabled():
        return False  # tf.data then runs a stateful function on one element at a time
    # num_parallel_calls is the stage's last input; 1 runs the calls one after the other
    calls = inputs[-1] if inputs else None
    try:
        if calls is not None and int(calls.numpy()) == 1:
            return False
    except (AttributeError, TypeError, ValueError):
        pass
    name = stage_function(attrs)
    if name is None:
        return False
    try:
        return function_draws_state(name)
    except Exception:  # a function TF no longer holds: this is only about the line shown
        return False


def function_draws_state(name: str, depth: int = 0) -> bool:
    """Whether the tf.data function ``name`` (or one it runs: a nested stage's function, a
    branch, a call) has an op that ``stage_lines.draws_state``. Its signature's
    ``is_stateful`` alone is not enough: an interleave's function that only builds a
    dataset per element (``from_tensor_slices(...)``, ``TFRecordDataset``) is marked
    stateful and races on nothing."""
    from tensorflow.python.eager import context
    from tensorflow.python.framework import op_def_registry

    try:
        function = context.context().get_function_def(name)
    except Exception:
        if depth:
            return True  # a nested function not found: as stateful as its caller says
        raise
    if not function.signature.is_stateful:
        return False  # nothing stateful inside, nested functions included
    if depth >= _MAX_NESTING:
        return True
    for node in function.node_def:
        nested = [a.func.name for a in node.attr.values() if a.HasField("func")]
        nested += [f.name for a in node.attr.values() if a.HasField("list") for f in a.list.func]
        op_def = op_def_registry.get(node.op)
        if op_def is None:  # a function called by its name
            nested.append(node.op)
        if nested:  # a call, a branch, a nested stage: what it runs decides
            if any(function_draws_state(n, depth + 1) for n in nested):
                return True
        elif op_def is not None and draws_state(node.op, op_def.is_stateful):
            return True
    return False


def stage_function(attrs: dict[str, Any]) -> str | None:
    """Name of the function a tf.data stage op runs on its elements (its ``f`` or
    ``predicate`` attribute), or None."""
    function = attrs.get("f") or attrs.get("predicate")
    name = getattr(function, "name", function)
    name = name.decode() if isinstance(name, bytes) else name
    return name if isinstance(name, str) else None


def install(backend: DataHost) -> None:
    """Hook ``tf.data.Options``/``Dataset.with_options`` now and Keras' PyDataset adapter
    once ``keras`` has finished importing."""
    watch = PipelineSettings(backend)
    watch.hook_options()
    frameworks.after_import("keras", watch.hook_pydataset)
    frameworks.after_import("tf_keras", watch.hook_tf_keras_fit)


class PipelineSettings:
    def __init__(self, backend: DataHost) -> None:
        self.backend = backend
        # Options object (by id, checked by weak reference) -> line that set it to False.
        # Options compare by value and are unhashable: no WeakKeyDictionary.
        self._set_at: dict[int, tuple[weakref.ref[Any], int]] = {}
        self.draws = SharedDraws()
        self._draws_note: dict[str, Any] = {}  # the armed dataset's line, workers, kind
        self._draws_noted = False

    # -- tf.data.Options -------------------------------------------------------------------
    def hook_options(self) -> None:
        from tensorflow.python.data.ops import dataset_ops, options

        watch = self
        original_setattr = options.Options.__setattr__

        @functools.wraps(original_setattr)
        def setattr_(opts: Any, name: str, value: Any) -> None:
            original_setattr(opts, name, value)  # the user's errors pass through untouched
            if name in _ORDER_OPTIONS and not watch.backend.disabled:
                with watch.backend.guarded():
                    watch._note_setting(opts, value)

        options.Options.__setattr__ = setattr_

        original_with_options = dataset_ops.DatasetV2.with_options

        @functools.wraps(original_with_options)
        def with_options(dataset: Any, opts: Any, *args: Any, **kwargs: Any) -> Any:
            result = original_with_options(dataset, opts, *args, **kwargs)
            if not watch.backend.disabled:
                with watch.backend.guarded():
                    watch._note_applied(opts)
            return result

        dataset_ops.DatasetV2.with_options = with_options
        self._hook_list_files(dataset_ops.DatasetV2)

    def _hook_list_files(self, dataset_v2: Any) -> None:
        """``Dataset.list_files`` shuffles the file names unless told not to (``shuffle=False``)
        or seeded: its lines are the fact ``LIST_FILES_FACT`` (TF-LISTFILES matches it)."""
        watch = self
        original = dataset_v2.list_files
        sites: list[str] = []

        @functools.wraps(original)
        def list_files(file_pattern: Any, shuffle: Any = None, seed: Any = None,
                       *args: Any, **kwargs: Any) -> Any:
            result = original(file_pattern, shuffle, seed, *args, **kwargs)
            if shuffle is not False and seed is None and not watch.backend.disabled:
                with watch.backend.guarded():
                    where = watch.backend.session.sources.here(2)  # the caller of this
                    text = watch.backend.session.string(where) if where >= 0 else ""
                    if text and text not in sites and len(sites) < _MAX_SITES:
                        sites.append(text)
                        watch.backend.session.send_facts({LIST_FILES_FACT: list(sites)})
            return result

        dataset_v2.list_files = staticmethod(list_files)

    def _note_setting(self, opts: Any, value: Any) -> None:
        # The innermost user frame above the wrapper: the assignment in the user's file.
        key = id(opts)
        if value is False:
            ref = weakref.ref(opts, lambda _: self._set_at.pop(key, None))
            self._set_at[key] = (ref, self.backend.session.sources.here(3))
        else:
            self._set_at.pop(key, None)

    def _note_applied(self, opts: Any) -> None:
        if getattr(opts, "deterministic", None) is not False:
            return
        sources = self.backend.session.sources
        hit = self._set_at.get(id(opts))
        if hit is not None and hit[0]() is opts:
            source = hit[1]
        elif sources.direct_caller(3) is not None:  # options made elsewhere: this call
            source = sources.here(3)
        else:  # a library re-applying merged options: the user's own call was seen before
            return
        self.backend.recorder.reordering_stage = source
        self.backend.session.send_facts({"tf.data.deterministic": False})

    # -- Keras PyDataset -------------------------------------------------------------------
    def hook_pydataset(self) -> None:
        try:
            from keras.src.trainers.data_adapters import py_dataset_adapter
            from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
        except ImportError:  # another Keras layout: no PyDataset to watch
            return
        watch = self
        original_init = PyDatasetAdapter.__init__
        if hasattr(py_dataset_adapter, "get_index"):
            py_dataset_adapter.get_index = self.draws.wrap(
                py_dataset_adapter.get_index, lambda: py_dataset_adapter._SHARED_SEQUENCES)
        for name in ("on_epoch_begin", "on_epoch_end"):
            if hasattr(PyDatasetAdapter, name):
                setattr(PyDatasetAdapter, name, self._epoch_hook(getattr(PyDatasetAdapter, name)))

        @functools.wraps(original_init)
        def adapter_init(adapter: Any, x: Any, *args: Any, **kwargs: Any) -> None:
            original_init(adapter, x, *args, **kwargs)
            if not watch.backend.disabled:
                with watch.backend.guarded():
                    watch._note_pydataset(x)

        PyDatasetAdapter.__init__ = adapter_init

    # -- Keras 2 (tf_keras) fit(workers=...) ----------------------------------------------------
    def hook_tf_keras_fit(self) -> None:
        """Keras 2 takes the workers in ``fit`` (Keras 3 in the PyDataset): a Sequence read
        by several is the fact ``keras.fit_workers`` and its ``__getitem__`` the line."""
        try:
            from tf_keras.src.engine.training import Model
        except ImportError:  # another tf_keras layout
            return
        import inspect

        watch = self
        original_fit = Model.fit
        signature = inspect.signature(original_fit)

        @functools.wraps(original_fit)
        def fit(model: Any, *args: Any, **kwargs: Any) -> Any:
            if not watch.backend.disabled:
                with watch.backend.guarded():
                    given = signature.bind(model, *args, **kwargs).arguments
                    workers = given.get("workers", 1)
                    processes = given.get("use_multiprocessing", False) is True
                    if watch._workers_line(given.get("x"), workers, processes) >= 0:
                        watch.backend.session.send_facts({"keras.fit_workers": workers})
            return original_fit(model, *args, **kwargs)

        Model.fit = fit

    def _workers_line(self, dataset: Any, workers: Any, processes: bool) -> int:
        """For a dataset whose batches several workers make at once (Keras' rule: a pool only
        then), its user-defined ``__getitem__``'s line, now the line batches that differ are
        named at; else -1."""
        if not isinstance(workers, int):  # a subclass's own attribute: not Keras' setting
            return -1
        if not (workers > 1 or (workers > 0 and processes)):
            return -1
        code = getattr(getattr(type(dataset), "__getitem__", None), "__code__", None)
        sources = self.backend.session.sources
        if code is None or not sources.user_file(code.co_filename):
            return -1  # a library's dataset: its line is not the user's to change
        stage = sources.intern_location(code.co_filename, code.co_firstlineno)
        self.backend.recorder.reordering_stage = stage
        return stage

    def _note_pydataset(self, dataset: Any) -> None:
        workers = getattr(dataset, "workers", 1)
        processes = getattr(dataset, "use_multiprocessing", False) is True
        stage = self._workers_line(dataset, workers, processes)
        if stage < 0:
            return
        self._draws_note = {"source": self.backend.session.string(stage),
                            "workers": workers, "kind": "processes" if processes else "threads"}
        if not self.draws.armed:
            # a run stopped a few steps after the pair parted never reaches an epoch's end:
            # the page is read at every step end too (one byte)
            listeners = getattr(self.backend.session, "step_listeners", None)
            if isinstance(listeners, list):
                listeners.append(self._step_ended)
        self.draws.arm()
        self.backend.session.send_facts({"keras.pydataset_workers": workers,
                                         "keras.pydataset_processes": processes})

    def _epoch_hook(self, original: Any) -> Any:
        """The adapter's ``on_epoch_begin``/``on_epoch_end``: the dataset's own epoch hooks run
        inside (``SharedDraws.epoch_hooks``), and an epoch's end says what the calls drew."""
        watch = self

        @functools.wraps(original)
        def hook(adapter: Any) -> Any:
            watch.draws.epoch_hooks += 1
            try:
                return original(adapter)
            finally:
                watch.draws.epoch_hooks += 1
                if not watch.backend.disabled:
                    with watch.backend.guarded():
                        watch._note_draws()

        return hook

    def _step_ended(self, _step: int) -> None:
        if not self.backend.disabled:
            with self.backend.guarded():
                self._note_draws()

    def _note_draws(self) -> None:
        if self._draws_noted:
            return
        what = self.draws.seen()
        if what is not None and self._draws_note:
            self._draws_noted = True
            self.backend.note_once(NOTE_KEY, NOTE.format(what=what, **self._draws_note))
