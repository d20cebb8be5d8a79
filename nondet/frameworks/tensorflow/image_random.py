"""Stateful ``tf.image.random_*`` ops: where a script calls them, and stateless stand-ins.

``tf.image.random_flip_left_right``, ``random_brightness``, ``random_crop``, ... are stateful
ops: each keeps its own random stream and hands out the next draw to whichever call reaches
it first. Inside ``Dataset.map(f, num_parallel_calls=...)`` several elements run ``f`` at
once, so which image gets which flip depends on thread timing and the batches differ between
runs (a SimCLR-style pipeline). The usual fix is each op's stateless twin
(``tf.image.stateless_random_*``) with a seed per element made by a serial stage;
``enable_op_determinism()`` also works, but by running the whole map one element at a time.

- ``install`` (in a recorded run) wraps the ``tf.image.random_*`` functions to remember the
  user's lines that call them, as the fact ``FACT`` (a list the recipe shows as sites; the
  recipe ``TF-IMAGE-STATEFUL`` matches on it). The wrapper only looks at the stack: the op
  the script gets is the original's.
- ``make_stateless`` (the intervention ``tf.image_stateless``, applied before the script
  when nondet verifies the fix) replaces each with its stateless twin, seeded from the
  element's own values and the call's place in the trace: the same element gets the same
  draws whatever thread runs it, and two calls on one element (two views) still differ.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import AbstractContextManager
from typing import Any, Protocol

from nondet.frameworks.base import Session
from nondet.frameworks.tensorflow.stage_lines import traced_user_line

#: Stateful ``tf.image`` function -> its stateless twin (same parameters, ``seed`` required).
STATELESS = {
    name: f"stateless_{name}" for name in (
        "random_brightness", "random_contrast", "random_crop", "random_flip_left_right",
        "random_flip_up_down", "random_hue", "random_jpeg_quality", "random_saturation")
}

#: Fact: the user's lines calling a stateful ``tf.image.random_*`` op ("file:line (name)").
FACT = "tf.image.stateful_random"

#: Sites kept per run (a script calls a handful; a generated one could call thousands).
MAX_SITES = 16


class ImageHost(Protocol):
    """What the hook needs from the backend (``TFBackend``)."""

    session: Session

    @property
    def disabled(self) -> bool: ...

    def guarded(self) -> AbstractContextManager[None]: ...


def install(backend: ImageHost) -> None:
    """Wrap ``tf.image``'s stateful random functions to record where the script calls them."""
    import tensorflow as tf

    sites: list[str] = []
    for name in STATELESS:
        original = getattr(tf.image, name, None)
        if original is None or getattr(original, "_nondet_image", False):
            continue
        setattr(tf.image, name, _recording(backend, name, original, sites))


def _recording(backend: ImageHost, name: str, original: Any, sites: list[str]) -> Any:
    import tensorflow as tf

    def note() -> None:
        # the innermost user frame: the line calling the op; in a function AutoGraph
        # converted (generated files) TensorFlow's stack maps it back, else the line that
        # built the stage
        where = traced_user_line(backend.session.sources)
        if where < 0:
            where = backend.session.sources.here(3)
        if where < 0:
            return  # called by a library: not a line the user can change
        text = f"{backend.session.string(where)} (tf.image.{name})"
        if text not in sites and len(sites) < MAX_SITES:
            sites.append(text)
            backend.session.send_facts({FACT: list(sites)})

    # nondet's wrapper must reach TensorFlow as it is: autograph would convert it (it is
    # not in a package autograph leaves alone) when a traced function calls it
    @tf.autograph.experimental.do_not_convert  # type: ignore[untyped-decorator]
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not backend.disabled:
            with backend.guarded():
                note()
        return original(*args, **kwargs)

    wrapper._nondet_image = True
    return wrapper


def make_stateless(seed: int) -> None:
    """Replace every stateful ``tf.image.random_*`` with its stateless twin, seeded per
    element (the intervention ``tf.image_stateless``)."""
    import tensorflow as tf

    calls = [0]  # a different seed for each call made while tracing (two views of one image)
    for name, twin_name in STATELESS.items():
        stateful, twin = getattr(tf.image, name, None), getattr(tf.image, twin_name, None)
        if stateful is None or twin is None:
            continue
        setattr(tf.image, name, _stateless(stateful, twin, seed, calls))


def _stateless(stateful: Any, twin: Any, seed: int, calls: list[int]) -> Any:
    import tensorflow as tf

    signature = inspect.signature(stateful)

    @tf.autograph.experimental.do_not_convert  # type: ignore[untyped-decorator]
    @functools.wraps(stateful)
    def stateless(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments.pop("seed", None)
        values = next(iter(bound.arguments.values()))  # image / value: the first parameter
        calls[0] += 1
        # the element's own values decide its draws, not the thread that gets it first
        content = tf.strings.to_hash_bucket_fast(
            tf.io.serialize_tensor(tf.convert_to_tensor(values)), 2**62)
        op_seed = tf.stack([content, tf.constant(seed * 1_000_003 + calls[0], tf.int64)])
        return twin(**bound.arguments, seed=op_seed)

    return stateless
