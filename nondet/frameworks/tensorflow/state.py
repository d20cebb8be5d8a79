"""What a TensorFlow run's state is made of: every variable the script makes, grouped as
parameters, buffers, optimizer state and random-generator state (hashed each step by
``statehash.py``); and what its environment looks like. Plain functions and records: no
hooks."""

from __future__ import annotations

import importlib.metadata
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from nondet.fingerprint import combine, host_content, name_code
from nondet.frameworks.fp import narrow_host_words
from nondet.records import Group


@dataclass
class TrackedVariable:
    ref: weakref.ref[Any]
    name: str
    source: str
    group: Group  # PARAM (trainable), BUFFER, OPTIM or DATA (random generator states)
    initialized: bool = False  # known to be (asked on the host until it is: statehash.py)
    order: tuple[str, str] = ("", "")  # (dtype, shape): with the name, its place in the
    # state hash (Note [Variables in the order of their names] in backend.py)


#: Keras 3's SeedGenerator (every random layer's seed state) is made in this file.
_KERAS_SEED_GENERATOR = os.path.join("keras", "src", "random", "seed_generator.py")


def variable_group(variable: Any, creating_files: str) -> Group:
    """The group of a variable, from who made it (the files on the stack at creation)."""
    if "stateful_random_ops" in creating_files or _KERAS_SEED_GENERATOR in creating_files:
        # a random generator's state (tf.random.Generator, Keras' SeedGenerator): reported
        # with the RNG state. One a tf.data function draws from advances as far as the
        # pipeline has run ahead, which thread timing decides: never training state.
        return Group.DATA
    if "/optimizers/" in creating_files:
        return Group.OPTIM
    if getattr(variable, "trainable", False):
        return Group.PARAM
    return Group.BUFFER


def values_fp(values: list[np.ndarray]) -> int:
    """One fingerprint for a group of host arrays: their words concatenated, plus dtypes
    and shapes (0 when the group is empty)."""
    if not values:
        return 0
    content = host_content([narrow_host_words(v) for v in values])
    return combine((content, *(name_code(str(v.dtype)) for v in values),
                    *(d for v in values for d in (v.ndim, *v.shape))))


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
