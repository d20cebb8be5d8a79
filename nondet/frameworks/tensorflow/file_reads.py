"""Files TensorFlow and Keras read in C, reported to ``nondet.readback``.

The runs share the working directory, and ``readback`` sees only reads made through
``open``/``os.open``. A script that resumes from what it finds there reads it through these
entry points instead: a ``tf.data`` cache (``Dataset.cache(filename)``), a TensorFlow
checkpoint (``tf.train.Checkpoint.restore``, so ``CheckpointManager.latest_checkpoint``), a
Keras weights file or saved model (``Model.load_weights``, ``keras.models.load_model``).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from nondet import readback


def _path(value: Any) -> str | None:
    """A file name the script passed (a tensor or an empty name: None)."""
    if isinstance(value, str | os.PathLike):
        text = os.fsdecode(value)
        return text or None
    return None


def _after(original: Callable[..., Any], keyword: str,
           report: Callable[[str], None]) -> Callable[..., Any]:
    """``original`` that reports the path it was given (its first argument after ``self``,
    or ``keyword``) once it has run (the script's own errors pass through untouched; the
    report never raises)."""

    @functools.wraps(original)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            name = _path(args[1] if len(args) > 1 else kwargs.get(keyword))
            if name is not None:
                report(name)
        except Exception:
            pass  # a hook never raises into the script (readback's watches do not either)
        return result

    return hooked


def install() -> None:
    from tensorflow.python.checkpoint import checkpoint
    from tensorflow.python.data.ops import dataset_ops

    dataset = dataset_ops.DatasetV2
    dataset.cache = _after(dataset.cache, "filename", readback.cache_file)
    saver = checkpoint.TrackableSaver  # what Checkpoint.restore (v1 and v2) ends in
    saver.restore = _after(saver.restore, "save_path", lambda p: readback.file_read(p + ".index"))


def install_keras() -> None:
    from keras.src.models.model import Model
    from keras.src.saving import saving_api

    Model.load_weights = _after(Model.load_weights, "filepath", readback.file_read)
    original_load = saving_api.load_model

    @functools.wraps(original_load)
    def load_model(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_load(filepath, *args, **kwargs)
        name = _path(filepath)
        if name is not None:
            readback.file_read(name)  # never raises
        return result

    # ``keras.models`` and ``keras.saving`` bound it by name when Keras was imported
    for name, module in list(sys.modules.items()):
        if name.split(".", 1)[0] == "keras" and getattr(module, "load_model", None) \
                is original_load:
            setattr(module, "load_model", load_model)  # noqa: B010
