"""Fixes nondet can apply from outside a script, to try them (``--apply``) and verify them.

An intervention is one of three things, as data in ``TABLE``:

- ``env``: environment variables set for both runs (read by libraries as they load);
- ``switch``: a call run in the child before the script (``torch.use_deterministic_algorithms``);
- ``patch``: a known site made deterministic (DataLoaders forced ``in_order=True``, ...).

A recipe lists the interventions that stand in for its fix (``apply = [...]`` in
``recipes/*.toml``); a recipe with none is a code change only the user can make. The
parent turns chosen ids into environment variables (``environment``); the child
(``nondet.boot``) calls ``apply_requested`` once, before the script, and every switch and
patch runs there. A patch verifies the cause; the report still shows the user's own code fix.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: The child's list of switches and patches to run (comma-separated ids).
APPLY_ENV = "NONDET_APPLY"
#: How the child's line starts when it could not apply one (the parent reads the run's log).
NOT_APPLIED = "nondet: could not apply"


@dataclass(frozen=True)
class Intervention:
    id: str
    how: str  # "env", "switch" or "patch"
    does: str  # one line: what it does, as the user would write it
    env: dict[str, str] = field(default_factory=dict)


TABLE: dict[str, Intervention] = {i.id: i for i in (
    Intervention("env.cublas_workspace", "env", "CUBLAS_WORKSPACE_CONFIG=:4096:8",
                 {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    Intervention("env.omp_one_thread", "env", "OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"}),
    Intervention("env.python_hash_seed", "env", "PYTHONHASHSEED=0", {"PYTHONHASHSEED": "0"}),
    Intervention("env.mkl_one_thread", "env", "MKL_NUM_THREADS=1", {"MKL_NUM_THREADS": "1"}),
    Intervention("env.tf_deterministic_ops", "env", "TF_DETERMINISTIC_OPS=1",
                 {"TF_DETERMINISTIC_OPS": "1"}),
    Intervention("env.tf_onednn_off", "env", "TF_ENABLE_ONEDNN_OPTS=0",
                 {"TF_ENABLE_ONEDNN_OPTS": "0"}),
    # NCCL reads these when it creates a communicator: set for every rank of a job
    Intervention("nccl.algo_ring", "env", "NCCL_ALGO=Ring", {"NCCL_ALGO": "Ring"}),
    Intervention("nccl.proto_simple", "env", "NCCL_PROTO=Simple", {"NCCL_PROTO": "Simple"}),
    Intervention("nccl.ring_simple", "env", "NCCL_ALGO=Ring NCCL_PROTO=Simple",
                 {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}),
    Intervention("torch.deterministic", "switch", "torch.use_deterministic_algorithms(True)"),
    Intervention("torch.deterministic_warn_only", "switch",
                 "torch.use_deterministic_algorithms(True, warn_only=True)"),
    Intervention("torch.one_thread", "switch", "torch.set_num_threads(1)"),
    Intervention("torch.one_interop_thread", "patch",
                 "torch.set_num_interop_threads(1), the script's own calls of it left out"),
    Intervention("torch.cudnn_deterministic", "switch",
                 "torch.backends.cudnn.benchmark = False; "
                 "torch.backends.cudnn.deterministic = True"),
    Intervention("tf.op_determinism", "switch",
                 "tf.config.experimental.enable_op_determinism()"),
    Intervention("tf.one_thread", "switch",
                 "tf.config.threading.set_inter_op_parallelism_threads(1); "
                 "tf.config.threading.set_intra_op_parallelism_threads(1)"),
    Intervention("torch.dataloader_in_order", "patch",
                 "every DataLoader made with in_order=True"),
    Intervention("torch.stable_tensor_hash", "patch",
                 "tensors hash by a number given in the order they are first hashed, not by "
                 "address: a set of tensors iterates in the same order in every run"),
    Intervention("tf.data_deterministic", "patch",
                 "every tf.data Options given with_options() made deterministic=True, and "
                 "every map/interleave/batch call given deterministic=False given True"),
    Intervention("tf.image_stateless", "patch",
                 "every tf.image.random_* op made its tf.image.stateless_random_* twin, "
                 "seeded by the element's values and the call's place in the trace"),
    Intervention("tf.sequential_loops", "patch",
                 "every tf.while_loop (tf.map_fn's, tf.scan's, AutoGraph's loops too) built "
                 "with parallel_iterations=1"),
    Intervention("keras.pydataset_one_worker", "patch",
                 "every keras.utils.PyDataset made with workers=1"),
    Intervention("keras2.fit_one_worker", "patch",
                 "Keras 2 (tf_keras) model.fit run with workers=1, use_multiprocessing=False"),
    Intervention("seeding.pin_seeds", "patch",
                 "every seeding call (torch.manual_seed, np.random.seed, random.seed, "
                 "tf.random.set_seed, ...) given a fixed seed instead of its value"),
    Intervention("tf.generator_from_seed", "patch",
                 "tf.random.Generator.from_non_deterministic_state() (and so the global "
                 "generator) made from_seed (the run's seed + its call number)"),
    Intervention("numpy.seed_unseeded_generators", "patch",
                 "np.random.default_rng() and np.random.seed() without a seed get one (the "
                 "run's seed + its call number)"),
    Intervention("python.seed_unseeded_random", "patch",
                 "random.Random() and random.seed() without a seed get one (the run's seed + "
                 "their call number)"),
    Intervention("python.seed_system_random", "patch",
                 "random.SystemRandom() draws from a random.Random seeded with the run's "
                 "seed + its call number, not from the OS"),
)}


def unknown(ids: Iterable[str]) -> list[str]:
    """The ids that name no intervention."""
    return [i for i in ids if i not in TABLE]


def environment(ids: Iterable[str]) -> dict[str, str]:
    """The environment variables that apply ``ids`` in a child: env interventions directly,
    switches and patches as a list the child's ``apply_requested`` runs."""
    env: dict[str, str] = {}
    in_child: list[str] = []
    for i in ids:
        intervention = TABLE[i]
        env.update(intervention.env)
        if intervention.how != "env":
            in_child.append(i)
    if in_child:
        env[APPLY_ENV] = ",".join(in_child)
    return env


def describe(ids: Iterable[str]) -> str:
    """``torch.use_deterministic_algorithms(True); OMP_NUM_THREADS=1`` for a report line."""
    return "; ".join(TABLE[i].does for i in ids if i in TABLE)


# -- child side --------------------------------------------------------------------------------
def apply_requested(seed: int = 0) -> list[str]:
    """Run the switches and patches the parent asked for (``APPLY_ENV``), before the script.

    A switch that raises is the intervention failing, not the script: it is written to
    stderr as one line (the parent reads the run's log) and the script runs without it.
    Returns the ids applied.
    """
    applied = []
    for name in filter(None, os.environ.get(APPLY_ENV, "").split(",")):
        function = _CHILD.get(name)
        if function is None:
            print(f"nondet: no intervention named {name}", file=sys.stderr)
            continue
        try:
            function(seed)
        except Exception as exc:  # reported; the script runs on without it
            print(f"{NOT_APPLIED} {name}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            continue
        applied.append(name)
    return applied


def _torch_deterministic(_seed: int) -> None:
    import torch

    torch.use_deterministic_algorithms(True)


def _torch_deterministic_warn_only(_seed: int) -> None:
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)


def _torch_one_thread(_seed: int) -> None:
    import torch

    torch.set_num_threads(1)


def _torch_one_interop_thread(_seed: int) -> None:
    import torch

    torch.set_num_interop_threads(1)  # before any inter-op work: the child's first call

    def kept_at_one(_count: int) -> None:
        """The script's own call (it may only come once, and before parallel work: after
        nondet's it would fail) leaves the count at one."""

    setattr(torch, "set_num_interop_threads", kept_at_one)  # noqa: B010 - typed stubs refuse it


def _torch_cudnn_deterministic(_seed: int) -> None:
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def _tf_op_determinism(_seed: int) -> None:
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()


def _tf_one_thread(_seed: int) -> None:
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)


def _torch_dataloader_in_order(_seed: int) -> None:
    from torch.utils.data import DataLoader

    original = DataLoader.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["in_order"] = True  # the parameter exists from torch 2.6 (the recipe's range)
        original(self, *args, **kwargs)

    DataLoader.__init__ = __init__  # type: ignore[method-assign]


def _torch_stable_tensor_hash(_seed: int) -> None:
    import itertools

    import torch
    from torch.overrides import has_torch_function_unary

    original: Any = torch.Tensor.__hash__
    numbers = itertools.count(1)

    def __hash__(self: torch.Tensor) -> int:
        if has_torch_function_unary(self):
            return int(original(self))
        # unique per live tensor like id(), so a set never compares two tensors with ==
        number: int | None = self.__dict__.get("_nondet_hash")
        if number is None:
            number = self.__dict__["_nondet_hash"] = next(numbers)
        return number

    torch.Tensor.__hash__ = __hash__  # type: ignore[method-assign]


def _tf_data_deterministic(_seed: int) -> None:
    import tensorflow as tf

    original = tf.data.Dataset.with_options

    def with_options(self: Any, options: Any, name: Any = None) -> Any:
        options.deterministic = True  # also covers the experimental_deterministic alias
        return original(self, options, name=name)

    tf.data.Dataset.with_options = with_options
    for name in _ORDERED_STAGES:
        original_stage = getattr(tf.data.Dataset, name, None)
        if original_stage is not None:
            setattr(tf.data.Dataset, name, _in_order(original_stage))


#: Dataset methods that take a ``deterministic`` argument (TF 2.21).
_ORDERED_STAGES = ("map", "interleave", "batch")


def _in_order(method: Any) -> Any:
    """``method`` with ``deterministic=False`` made True (given by name or position)."""
    import functools
    import inspect

    signature = inspect.signature(method)

    @functools.wraps(method)
    def stage(*args: Any, **kwargs: Any) -> Any:
        try:
            given = signature.bind(*args, **kwargs)
        except TypeError:  # the call is wrong as written: TensorFlow says so
            return method(*args, **kwargs)
        if given.arguments.get("deterministic") is False:
            given.arguments["deterministic"] = True
        return method(*given.args, **given.kwargs)

    return stage


def _numpy_seed_unseeded_generators(seed: int) -> None:
    import numpy as np

    original = np.random.default_rng
    calls = [0]

    def default_rng(seed_arg: Any = None) -> Any:
        if seed_arg is None:
            calls[0] += 1  # a seed per call: two generators must not draw the same stream
            seed_arg = [seed, calls[0]]
        return original(seed_arg)

    setattr(np.random, "default_rng", default_rng)  # noqa: B010 - typed stubs refuse it
    original_seed = np.random.seed

    def reseed(seed_arg: Any = None) -> None:
        if seed_arg is None:  # the global RandomState from fresh entropy
            calls[0] += 1
            seed_arg = [seed, calls[0]]
        original_seed(seed_arg)

    setattr(np.random, "seed", reseed)  # noqa: B010 - typed stubs refuse it


def _python_seed_system_random(seed: int) -> None:
    import random

    calls = [0]

    def own(self: Any) -> random.Random:
        made: random.Random | None = self.__dict__.get("_nondet_seeded")
        if made is None:
            calls[0] += 1  # a stream per instance, as for random.Random()
            made = self.__dict__["_nondet_seeded"] = random.Random(seed * 1_000_003 + calls[0])
        return made

    def draw(self: Any) -> float:
        return own(self).random()

    def bits(self: Any, k: int) -> int:
        return own(self).getrandbits(k)

    def some_bytes(self: Any, n: int) -> bytes:
        return own(self).randbytes(n)

    # every other method (randint, choice, shuffle, uniform, ...) draws through these
    setattr(random.SystemRandom, "random", draw)  # noqa: B010 - typed stubs refuse it
    setattr(random.SystemRandom, "getrandbits", bits)  # noqa: B010
    setattr(random.SystemRandom, "randbytes", some_bytes)  # noqa: B010


def _python_seed_unseeded_random(seed: int) -> None:
    import random

    calls = [0]
    original_init = random.Random.__init__
    original_seed = random.Random.seed  # the global functions are a Random's bound methods

    def numbered() -> int:
        calls[0] += 1  # a seed per call: two generators must not draw the same stream
        return seed * 1_000_003 + calls[0]

    def init(self: random.Random, x: Any = None) -> None:
        original_init(self, numbered() if x is None and not isinstance(
            self, random.SystemRandom) else x)

    def reseed(self: random.Random, a: Any = None, version: int = 2) -> None:
        original_seed(self, numbered() if a is None and not isinstance(
            self, random.SystemRandom) else a, version)

    random.Random.__init__ = init  # type: ignore[method-assign]
    random.Random.seed = reseed  # type: ignore[method-assign]
    module_seed = random.seed

    def global_seed(a: Any = None, version: int = 2) -> None:
        module_seed(numbered() if a is None else a, version)

    random.seed = global_seed


def _tf_generator_from_seed(seed: int) -> None:
    import tensorflow as tf

    calls = [0]

    def from_non_deterministic_state(cls: Any, alg: Any = None) -> Any:
        calls[0] += 1  # a seed per call: two generators must not draw the same stream
        return cls.from_seed(seed * 1_000_003 + calls[0], alg=alg)

    # get_global_generator() makes the global generator through this classmethod too
    tf.random.Generator.from_non_deterministic_state = classmethod(from_non_deterministic_state)


def _tf_image_stateless(seed: int) -> None:
    from nondet.frameworks.tensorflow import image_random

    image_random.make_stateless(seed)


def _keras_pydataset_one_worker(_seed: int) -> None:
    import keras

    cls = keras.utils.PyDataset
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # PyDataset(workers=1, use_multiprocessing=False, max_queue_size=10) in Keras 3
        if args:
            args = (1, *args[1:])
        else:
            kwargs["workers"] = 1
        original(self, *args, **kwargs)

    cls.__init__ = __init__


def _keras2_fit_one_worker(_seed: int) -> None:
    from nondet import frameworks

    def patch() -> None:
        from tf_keras.src.engine.training import Model

        original = Model.fit

        def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
            # workers/use_multiprocessing come last in fit's signature: passed by keyword
            kwargs.update(workers=1, use_multiprocessing=False)
            return original(self, *args, **kwargs)

        Model.fit = fit

    frameworks.after_import("tf_keras", patch)  # a script that never imports it is left alone


def _tf_sequential_loops(_seed: int) -> None:
    from nondet.frameworks.tensorflow.loops import sequential_loops

    sequential_loops()


def _seeding_pin_seeds(seed: int) -> None:
    from nondet import seeding

    seeding.PINNED = seed  # read by every recorded seeding call (seeding.SeedLog.wrap)


_CHILD: dict[str, Callable[[int], None]] = {
    "seeding.pin_seeds": _seeding_pin_seeds,
    "keras.pydataset_one_worker": _keras_pydataset_one_worker,
    "keras2.fit_one_worker": _keras2_fit_one_worker,
    "torch.deterministic": _torch_deterministic,
    "torch.deterministic_warn_only": _torch_deterministic_warn_only,
    "torch.one_thread": _torch_one_thread,
    "torch.one_interop_thread": _torch_one_interop_thread,
    "torch.cudnn_deterministic": _torch_cudnn_deterministic,
    "tf.op_determinism": _tf_op_determinism,
    "tf.one_thread": _tf_one_thread,
    "torch.dataloader_in_order": _torch_dataloader_in_order,
    "torch.stable_tensor_hash": _torch_stable_tensor_hash,
    "tf.data_deterministic": _tf_data_deterministic,
    "numpy.seed_unseeded_generators": _numpy_seed_unseeded_generators,
    "python.seed_unseeded_random": _python_seed_unseeded_random,
    "python.seed_system_random": _python_seed_system_random,
    "tf.generator_from_seed": _tf_generator_from_seed,
    "tf.image_stateless": _tf_image_stateless,
    "tf.sequential_loops": _tf_sequential_loops,
}
