"""A Keras PyDataset whose __getitem__ draws from a generator every call shares, read by
several workers (frameworks/tensorflow/shared_draws.py): the capture notes it even when the
two runs happen to agree (with forked workers they mostly do)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from nondet.frameworks.tensorflow.shared_draws import NOTE_KEY
from tests.frameworks.test_tf_capture import line_of, run_script

SCRIPT = """
import keras
import numpy as np

class Rows(keras.utils.PyDataset):
    def __init__(self):
        super().__init__(workers=2, use_multiprocessing=PROCESSES)
        self.rng = np.random.default_rng(1)
        self.order = np.arange(6)

    def __len__(self):
        return 6

    def __getitem__(self, index):  # GETITEM
        DRAW
        return x, x[:, :1]

    def on_epoch_end(self):
        self.rng.shuffle(self.order)  # the main thread draws here, not __getitem__

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(Rows(), epochs=2, verbose=0)
"""

SHARED = "x = self.rng.normal(size=(8, 4)).astype(np.float32)"
PER_INDEX = "x = np.random.default_rng(index).normal(size=(8, 4)).astype(np.float32)"
GLOBAL = "x = np.random.normal(size=(8, 4)).astype(np.float32)"


def _note(tmp_path: Path, processes: bool, draw: str) -> str | None:
    body = SCRIPT.replace("PROCESSES", str(processes)).replace("DRAW", draw)
    c, _ = run_script(tmp_path, body)
    note = c.facts.get(f"capture_note.{NOTE_KEY}")
    return None if note is None else str(note)


@pytest.mark.parametrize(("processes", "draw", "what"), [
    (True, SHARED, "self.rng"),
    (True, GLOBAL, "NumPy's global generator"),
    (False, SHARED, "self.rng"),
])
def test_getitem_drawing_from_a_shared_generator_is_noted(
        tmp_path: Path, processes: bool, draw: str, what: str) -> None:
    note = _note(tmp_path, processes, draw)
    assert note is not None
    assert f"train.py:{line_of(tmp_path, '# GETITEM')} drew from {what}" in note
    assert ("2 worker processes" if processes else "2 worker threads") in note


@pytest.mark.parametrize("processes", [True, False])
def test_a_generator_per_index_is_not_noted(tmp_path: Path, processes: bool) -> None:
    # the dataset's own on_epoch_end still draws from self.rng (main thread): not a call's
    assert _note(tmp_path, processes, PER_INDEX) is None


def test_a_run_that_ends_inside_its_first_epoch_is_noted(tmp_path: Path) -> None:
    """nondet stops both runs a few steps after they part: no epoch end is ever reached."""
    body = SCRIPT.replace("PROCESSES", "True").replace("DRAW", SHARED).replace(
        "model.fit(Rows(), epochs=2, verbose=0)", """
class Stop(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            raise SystemExit(0)

model.fit(Rows(), epochs=2, verbose=0, callbacks=[Stop()])""")
    c, _ = run_script(tmp_path, body)
    assert "self.rng" in str(c.facts.get(f"capture_note.{NOTE_KEY}"))


class _Dataset:
    def __init__(self) -> None:
        import numpy as np

        self.rng = np.random.default_rng(1)


def _draw(uid: int, i: int) -> int:  # Keras' get_index: the pool runs it for each batch
    return int(_SEQUENCES[uid].rng.integers(100))


_SEQUENCES = {0: _Dataset()}


def test_a_pool_forked_while_the_epoch_begins_still_marks_the_draws() -> None:
    """Keras' enqueuer thread forks the pool while the main thread is still inside the
    dataset's on_epoch_begin; the workers must not inherit that as 'inside an epoch hook'
    (the CI run where nothing was noted)."""
    import os

    from nondet.frameworks.tensorflow.shared_draws import SharedDraws

    watch = SharedDraws()
    watch.arm()
    checked = watch.wrap(_draw, lambda: _SEQUENCES)
    watch.epoch_hooks = 1  # the parent is inside on_epoch_begin when the pool forks
    pid = os.fork()
    if pid == 0:  # the pool's worker: one batch, then gone
        try:
            checked(0, 0)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert watch.seen() == "self.rng"
