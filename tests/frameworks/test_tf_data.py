"""Input-pipeline settings the TensorFlow backend notices (frameworks/tensorflow/data.py):
tf.data options that relax the order, Keras PyDatasets read by several workers. Each test
runs one small captured script (no CLI) and reads what the capture says."""

from __future__ import annotations

import re
from pathlib import Path
from textwrap import dedent

import pytest

pytest.importorskip("tensorflow")

from nondet import recipe
from nondet.records import Group, Kind
from nondet.store import Capture
from tests.frameworks.test_tf_capture import line_of, records, run_script

# An eager loop over the dataset with an optimizer: every batch is a tf_data entry record.
EAGER_LOOP = """
w = tf.Variable(tf.ones((4, 1)))
opt = tf.keras.optimizers.SGD(0.1)
for x in ds:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((x @ w) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
"""


def _data_lines(capture: Capture, step: int) -> set[str]:
    return {str(r["line"]) for r in records(capture, step)
            if r["kind"] == Kind.ENTRY and str(r["name"]).startswith("tf_data")}


@pytest.mark.parametrize("name", ["deterministic", "experimental_deterministic"])
def test_options_that_relax_the_order_point_at_the_line_that_set_them(
        tmp_path: Path, name: str) -> None:
    body = f"""
    ds = tf.data.Dataset.range(16).map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)),
                                       num_parallel_calls=2)
    options = tf.data.Options()
    options.{name} = False  # SET
    ds = ds.with_options(options)
    """
    c, _ = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[1])
    assert c.facts.get("tf.data.deterministic") is False
    assert _data_lines(c, 1) == {line_of(tmp_path, "# SET")}


def test_options_set_back_to_true_or_never_applied_say_nothing(tmp_path: Path) -> None:
    body = """
    ds = tf.data.Dataset.range(16).map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)))
    options = tf.data.Options()
    options.deterministic = False
    options.deterministic = True
    ds = ds.with_options(options)
    unused = tf.data.Options()
    unused.deterministic = False  # made, never applied to a dataset
    """
    c, _ = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[1])
    assert "tf.data.deterministic" not in c.facts
    assert _data_lines(c, 1) == {line_of(tmp_path, "for x in ds:")}


def test_a_users_invalid_option_value_raises_as_without_nondet(tmp_path: Path) -> None:
    body = """
    options = tf.data.Options()
    try:
        options.deterministic = "no"
    except TypeError as e:
        print("user error:", e)
    ds = tf.data.Dataset.range(4).map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)))
    """
    c, result = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[1])
    assert "user error:" in result.log_tail()
    assert "tf.data.deterministic" not in c.facts


PYDATASET = """
import keras
import numpy as np

class Rows(keras.utils.PyDataset):
    def __init__(self, workers):
        super().__init__(workers=workers, use_multiprocessing=False)

    def __len__(self):
        return 4

    def __getitem__(self, index):  # GETITEM
        x = np.full((8, 4), index, np.float32)
        return x, x[:, :1]

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(Rows(WORKERS), epochs=1, verbose=0)  # FIT
"""


def test_a_pydataset_with_workers_points_at_its_getitem(tmp_path: Path) -> None:
    c, _ = run_script(tmp_path, PYDATASET.replace("WORKERS", "3"), op_steps=[1])
    assert c.facts.get("keras.pydataset_workers") == 3
    assert c.facts.get("keras.pydataset_processes") is False
    assert _data_lines(c, 1) == {line_of(tmp_path, "# GETITEM")}


def test_a_pydataset_with_one_worker_says_nothing(tmp_path: Path) -> None:
    c, _ = run_script(tmp_path, PYDATASET.replace("WORKERS", "1"), op_steps=[1])
    assert "keras.pydataset_workers" not in c.facts
    assert line_of(tmp_path, "# GETITEM") not in _data_lines(c, 1)


# -- the recipes these facts select (no run needed) ----------------------------------------
def _suggestions(**facts: object) -> list[recipe.Suggestion]:
    base = {"framework": "tensorflow", "kind": "entry", "entry_kind": "tf_data",
            "phase": "data", "op": "IteratorGetNext", "tensorflow_version": "2.21.0",
            "keras_version": "3.15.1"}
    return recipe.suggest({**base, **facts})


def test_relaxed_options_are_fixed_by_setting_them_back() -> None:
    first = _suggestions(**{"tf.data.deterministic": False})[0]
    assert (first.recipe.id, first.fix, first.applies_here) == (
        "TF-DATA-OPTIONS", "options.deterministic = True", True)


def test_a_stage_given_deterministic_false_is_fixed_at_that_call() -> None:
    first = _suggestions(**{"tf.data.stage_deterministic": False})[0]
    assert first.recipe.id == "TF-DATA-STAGE-ORDER" and first.applies_here
    # the call at that line, whichever stage it is (an interleave line was told "ds.map")
    assert "deterministic=False taken out of the call at that line" in first.fix
    assert "interleave" in first.fix and "batch" in first.fix
    assert first.recipe.apply[0] == "tf.data_deterministic"


def test_a_pydataset_with_workers_is_fixed_in_getitem() -> None:
    first = _suggestions(**{"keras.pydataset_workers": 4})[0]
    assert first.recipe.id == "KERAS-PYDATASET-WORKERS"
    assert "default_rng(seed + index)" in first.fix and "workers=1" in first.recipe.note


@pytest.mark.parametrize("facts", [{}, {"keras.pydataset_workers": 4},
                                   {"tf.data.deterministic": False}])
def test_no_fix_for_keras_3_passes_workers_to_fit(facts: dict[str, object]) -> None:
    # Keras 3's fit() has no workers/use_multiprocessing: they are PyDataset arguments.
    for suggestion in recipe.suggest({**{"framework": "tensorflow", "kind": "entry",
                                         "entry_kind": "tf_data", "keras_version": "3.15.1",
                                         "tensorflow_version": "2.21.0"}, **facts}, limit=99):
        assert not re.search(r"\bfit\(.*workers", suggestion.fix), suggestion.recipe.id


@pytest.mark.parametrize(("fact", "recipe_id"), [
    ({}, None),
    ({"tf.data.list_files_shuffled": ["train.py:3"]}, "TF-LISTFILES"),
    ({"keras.fit_workers": 2}, "TF-KERAS-FIT"),
    ({"tf.distribute.strategy": True}, "TF-DISTRIB"),
])
def test_a_batch_finding_lists_only_the_fixes_that_can_explain_it(
        fact: dict[str, object], recipe_id: str | None) -> None:
    """list_files, Keras 2 fit workers and tf.distribute are offered only when the capture
    saw them (before: for every batch that differed)."""
    gated = {"TF-LISTFILES", "TF-KERAS-FIT", "TF-DISTRIB"}
    facts = {k: bool(v) if isinstance(v, list) else v for k, v in fact.items()}
    suggestions = recipe.suggest({**{"framework": "tensorflow", "kind": "entry",
                                     "entry_kind": "tf_data", "phase": "data",
                                     "op": "IteratorGetNext", "keras_version": "3.15.1",
                                     "tensorflow_version": "2.21.0"}, **facts},
                                 limit=99, sites=fact)
    ids = [s.recipe.id for s in suggestions]
    assert gated & set(ids) == ({recipe_id} if recipe_id else set()), ids
    if recipe_id == "TF-KERAS-FIT":  # the specific cause comes first
        assert ids[0] == recipe_id and suggestions[0].recipe.apply == ("keras2.fit_one_worker",)
    elif recipe_id == "TF-LISTFILES":
        listed = next(s for s in suggestions if s.recipe.id == recipe_id)
        assert listed.details == ["list_files with its shuffle on and no seed at train.py:3"]
    if not fact:
        assert ids[0] == "TF-DATA"


def test_list_files_with_its_shuffle_on_is_recorded(tmp_path: Path) -> None:
    body = """
    import pathlib
    here = pathlib.Path(__file__).parent
    for i in range(4):
        (here / f"{i}.txt").write_text(" ".join(str(i + j) for j in range(4)))
    pattern = str(here / "*.txt")
    files = tf.data.Dataset.list_files(pattern)  # LIST
    unshuffled = tf.data.Dataset.list_files(pattern, shuffle=False)
    seeded = tf.data.Dataset.list_files(pattern, seed=4)
    ds = files.map(lambda f: tf.reshape(tf.strings.to_number(
        tf.strings.split(tf.io.read_file(f))), (1, 4)))
    """
    c, _ = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[])
    where = f"{tmp_path / 'train.py'}:{line_of(tmp_path, '# LIST')}"
    assert c.facts.get("tf.data.list_files_shuffled") == [where]


# An interleave whose function builds a dataset per element: TensorFlow marks dataset
# sources stateful, but they draw no state (the keras-io TFRecord pattern).
_SLICES = "tf.data.Dataset.from_tensor_slices(tf.fill((3, 2, 4), tf.cast(i, tf.float32)))"


@pytest.mark.parametrize(("stage", "stateful"), [
    ("map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)) + tf.random.uniform(()), "
     "num_parallel_calls=2", True),
    ("map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)), num_parallel_calls=2", False),
    ("map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)) + tf.random.uniform(()), "
     "num_parallel_calls=1", False),
    (f"interleave(lambda i: {_SLICES}.shuffle(3), cycle_length=2, num_parallel_calls=2",
     False),
    # a lookup table's reads (Keras' TextVectorization, StringLookup) are stateful ops
    # that every element reads alike
    ("map(lambda i: tf.fill((2, 4), tf.cast(TABLE.lookup(i % 3), tf.float32)), "
     "num_parallel_calls=2", False),
])
def test_a_parallel_stage_with_a_stateful_function_is_where_batches_are_made(
        tmp_path: Path, stage: str, stateful: bool) -> None:
    """keras-io's augmentation: random ops inside map(..., num_parallel_calls=N) take their
    random state in thread-completion order although the elements come out in order."""
    body = f"""
    TABLE = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant([0, 1, 2], tf.int64), tf.constant([5, 6, 7], tf.int64)), default_value=0)
    ds = tf.data.Dataset.range(16)
    ds = ds.{stage})  # MAP
    """
    c, _ = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[1])
    notes = [v for k, v in c.facts.items() if k == "capture_note.tf_data_stateful_parallel"]
    map_line = line_of(tmp_path, "# MAP")
    if stateful:
        assert _data_lines(c, 1) == {map_line}
        assert len(notes) == 1 and map_line in str(notes[0]), notes
    else:
        assert map_line not in _data_lines(c, 1)
        assert notes == []


def test_a_stage_given_deterministic_false_is_the_line_and_noted_when_runs_agree(
        tmp_path: Path) -> None:
    """``map(..., deterministic=False)`` hands out elements in completion order: its line
    is where batches that differ are named, even with a stateful parallel stage built after
    it, a fact selects its recipe, and a note says so when the two runs happen to agree."""
    body = """
    ds = tf.data.Dataset.range(16)
    ds = ds.map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)), 2, False)  # UNORDERED
    ds = ds.map(lambda x: x + tf.random.uniform(()), num_parallel_calls=2)  # STATEFUL
    """
    c, _ = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[1])
    unordered = line_of(tmp_path, "# UNORDERED")
    assert _data_lines(c, 1) == {unordered}
    assert c.facts.get("tf.data.stage_deterministic") is False
    notes = [str(v) for k, v in c.facts.items() if k.startswith("capture_note.tf_data_unordered")]
    assert len(notes) == 1 and f"train.py:{unordered} was given deterministic=False" in notes[0]
    stateful = [str(v) for k, v in c.facts.items()
                if k == "capture_note.tf_data_stateful_parallel"]
    assert len(stateful) == 1 and line_of(tmp_path, "# STATEFUL") in stateful[0]


def test_a_stage_given_deterministic_true_or_under_op_determinism_says_nothing(
        tmp_path: Path) -> None:
    body = """
    ds = tf.data.Dataset.range(16).map(lambda i: tf.fill((2, 4), tf.cast(i, tf.float32)),
                                       num_parallel_calls=2, deterministic=True)
    tf.config.experimental.enable_op_determinism()
    ds = ds.map(lambda x: x * 2, num_parallel_calls=2, deterministic=False)  # IN ORDER NOW
    """
    c, _ = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[1])
    assert "tf.data.stage_deterministic" not in c.facts
    assert not [k for k in c.facts if k.startswith("capture_note.tf_data_unordered")]


def test_a_stateful_call_inside_a_converted_map_function_is_named_not_the_map(
        tmp_path: Path) -> None:
    """AutoGraph converts the map function (its frames are generated files): the line named
    is the random call inside it, mapped back through AutoGraph's source map; the note
    still names the stage that runs it in parallel."""
    body = """
    def noisy(i):
        x = tf.fill((2, 4), tf.cast(i, tf.float32))
        if i > 3:  # AutoGraph: a tf.cond, the random op in its branch graph
            x = x + tf.random.uniform(())  # DRAW
        return x

    ds = tf.data.Dataset.range(16).map(lambda i: i * 2)
    ds = ds.map(noisy, num_parallel_calls=2)  # MAP
    """
    c, _ = run_script(tmp_path, dedent(body) + EAGER_LOOP, op_steps=[1])
    assert _data_lines(c, 1) == {line_of(tmp_path, "# DRAW")}
    notes = [str(v) for k, v in c.facts.items() if k == "capture_note.tf_data_stateful_parallel"]
    assert len(notes) == 1 and line_of(tmp_path, "# MAP") in notes[0], notes
    assert line_of(tmp_path, "# DRAW") in notes[0], notes


def test_a_random_layers_seed_state_is_rng_state_not_a_buffer(tmp_path: Path) -> None:
    """A Keras random layer used in a tf.data map bumps its SeedGenerator's state as far as
    the pipeline has run ahead (thread timing): never training state a verdict follows."""
    body = """
    flip = keras.layers.RandomFlip("horizontal")
    ds = tf.data.Dataset.range(16).map(lambda i: tf.fill((2, 4, 4, 1), tf.cast(i, tf.float32)))
    ds = ds.map(lambda x: tf.reshape(flip(x), (2, 16))[:, :4]).prefetch(2)
    """
    c, _ = run_script(tmp_path, "import keras\n" + dedent(body) + EAGER_LOOP, op_steps=[1])
    groups = {c.string(int(r["name"])): Group(int(r["group"])) for r in c.tensor_rows(1)}
    seed_states = [g for name, g in groups.items() if "seed_generator_state" in name]
    assert seed_states == [Group.DATA], groups


def test_an_eager_optional_read_is_a_batch_at_the_stage_that_reorders(tmp_path: Path) -> None:
    """A distributed iterator (MirroredStrategy's, as ``model.fit`` uses it) hands batches
    over through ``get_next_as_optional`` run eagerly: ``OptionalGetValue`` is the batch
    entering, reported at the stage that let it vary, not an op that "created" it."""
    body = """
    ds = tf.data.Dataset.range(4).interleave(  # STAGE
        lambda i: tf.data.Dataset.range(8).map(lambda v: tf.cast(v + i, tf.float32)),
        cycle_length=4, num_parallel_calls=4, deterministic=False)
    ds = ds.batch(4).map(lambda v: tf.reshape(v, (1, 4)))
    w = tf.Variable(tf.ones((4, 1)))
    opt = tf.keras.optimizers.SGD(0.1)
    it = iter(ds)
    for _ in range(3):
        x = it.get_next_as_optional().get_value()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ w) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
    """
    c, _ = run_script(tmp_path, dedent(body), op_steps=[1])
    optional = [r for r in records(c, 1) if "OptionalGetValue" in str(r["name"])]
    assert optional, records(c, 1)
    assert all(r["kind"] == Kind.ENTRY and r["phase"] == "data" for r in optional), optional
    assert _data_lines(c, 1) == {line_of(tmp_path, "# STAGE")}


RAGGED_LOOP = """
rows = tf.ragged.constant([[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]] * 4)
ds = tf.data.Dataset.from_tensor_slices(rows).map(lambda r: r + SHIFT).ragged_batch(4)
emb = tf.keras.layers.Embedding(16, 4)
opt = tf.keras.optimizers.SGD(0.1)
for x in ds:  # READ
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.reduce_mean(tf.ragged.map_flat_values(emb, x), axis=1))
    opt.apply_gradients(zip(tape.gradient(loss, emb.trainable_variables),
                            emb.trainable_variables))
"""


def test_a_ragged_batch_that_differs_enters_as_data(tmp_path: Path) -> None:
    """A ragged batch read eagerly is decoded from the iterator's variant output
    (``RaggedTensorFromVariant``): nondet cannot hash a variant, so that op's "inputs
    matched" vacuously, and a batch that differed was blamed on it as creating the
    difference (cause TF-CPU-THREADS, h-realtf2 trial ragged2.py); and the step's data
    fingerprint left the ragged values out."""
    from nondet import compare, finding
    from nondet.launch import CapturedRun, Plan, Target
    from nondet.store import open_capture
    from tests.frameworks.test_tf_capture import HEADER

    script = tmp_path / "train.py"
    captures = []
    for label, shift in (("a", "0"), ("b", "1")):  # the same file, values shifted in run b
        script.write_text(HEADER + dedent(RAGGED_LOOP.replace("SHIFT", shift)))
        run = CapturedRun(Target(str(script), None, ()), Plan(label, [0]), 0, tmp_path / "out")
        run.start()
        result = run.wait()
        assert result.status == "complete" and not result.hook_error, result.log_tail()
        captures.append(open_capture(result.path))
    a, b = captures
    found = finding.localize(a, b, [0])
    assert found is not None
    assert (found.kind, found.phase) == ("entry", "data"), found
    assert found.source is not None and found.source.endswith(
        f":{line_of(tmp_path, '# READ')}"), found
    step = compare.first_step_divergence(a.steps, b.steps)
    assert step is not None and step.step == 0 and "data_fp" in step.fields, step
