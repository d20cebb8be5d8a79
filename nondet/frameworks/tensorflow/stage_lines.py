"""The user's line inside a tf.data function: where its stateful op was called.

A stage such as ``ds.map(augment, num_parallel_calls=4)`` whose function draws random
numbers hands each element whatever state the thread that runs it finds, so its batches can
differ between runs. The line to change is the random call inside ``augment``, not the
``.map(`` line that built the stage. TensorFlow converts such functions with AutoGraph,
whose frames are generated files: a Python stack walk (``SourceLocator.here``) passes over
them and stops at the ``.map(`` line. TensorFlow's own stacks (an op's ``traceback``,
``tf_stack.extract_stack()`` while a converted function runs) map the generated lines back
to the user's source through AutoGraph's source map, so they name the line inside.

``StageLines`` watches the ops traced into tf.data's function graphs (names
``Dataset_<transformation>_<function>``) and keeps the line of the first stateful one of
each; the stage op that runs the function is made right after its trace, which ``take``
looks it up for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nondet.frameworks.base import Sources

#: Stateful ops that change no value a batch is made of: never the line to name. A lookup
#: table's reads (Keras' TextVectorization and StringLookup) find what every element would
#: find: TensorFlow marks them stateful because the table is a resource.
_NOT_A_CAUSE = frozenset({"Assert", "Print", "PrintV2", "NoOp", "LookupTableFind",
                          "LookupTableFindV2", "LookupTableSize", "LookupTableSizeV2",
                          "LookupTableExport", "LookupTableExportV2"})

#: Op types with these in their name build a dataset or its shuffle seeds: TensorFlow marks
#: dataset sources stateful (``TensorSliceDataset``, ``TFRecordDatasetV2``), but an
#: interleave's function building one per element hands no element another's state.
_BUILDS_A_DATASET = ("Dataset", "SeedGenerator")

#: How far up nested graphs (a tf.cond branch inside a map function) a dataset graph is
#: looked for.
_MAX_NESTING = 8


def draws_state(op_type: str, is_stateful: bool) -> bool:
    """Whether an op inside a tf.data function can give elements run in parallel different
    state depending on thread timing: a stateful op (a random op, a variable read) that
    neither builds a dataset nor only prints or asserts."""
    return (is_stateful and op_type not in _NOT_A_CAUSE
            and not any(part in op_type for part in _BUILDS_A_DATASET))


def user_line(sources: Sources, frames: Iterable[Any] | None) -> int:
    """String id of the innermost user frame of a TensorFlow stack (``op.traceback``,
    ``tf_stack.extract_stack()``: outermost first), or -1."""
    for frame in reversed(list(frames or ())):
        filename = getattr(frame, "filename", None)
        if isinstance(filename, str) and sources.user_file(filename):
            return sources.intern_location(filename, int(frame.lineno))
    return -1


def traced_user_line(sources: Sources) -> int:
    """The innermost user line of the current call as TensorFlow sees it (AutoGraph's
    generated lines mapped back to the user's) while a function is traced; -1 when
    executing eagerly (the Python stack is right then) or unknown."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return -1
    try:
        from tensorflow.python.util import tf_stack

        return user_line(sources, tf_stack.extract_stack())
    except Exception:  # an internal API: without it the caller's own walk stands
        return -1


class StageLines:
    """First stateful op's user line per tf.data function graph traced since the last
    stage op (module doc)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._first: dict[str, int] = {}  # dataset graph name -> source id

    def note_op(self, op_type: str, outputs: Any, graph: Any) -> None:
        """An op traced into ``graph`` (called for graphs nondet does not instrument)."""
        name = _dataset_graph(graph)
        if name is None or name in self._first or not outputs:
            return
        op = getattr(outputs[0], "op", None)
        if op is None or not draws_state(op_type, op.op_def.is_stateful):
            return
        line = user_line(self.sources, op.traceback)
        if line >= 0:
            self._first[name] = line

    def take(self, function_name: str) -> int:
        """The line for the stage op about to run ``function_name`` (its function def's
        name, ``__inference_Dataset_map_augment_42``), or -1; forgets every graph seen, so a
        later stage never gets an earlier function's line."""
        # the longest graph name it contains: "Dataset_map_f" is in "..._Dataset_map_f2_7" too
        names = sorted((n for n in self._first if n in function_name), key=len)
        found = self._first[names[-1]] if names else -1
        self._first = {}
        return found


def _dataset_graph(graph: Any) -> str | None:
    """Name of the tf.data function graph ``graph`` is (or is nested in), else None."""
    for _ in range(_MAX_NESTING):
        if graph is None:
            return None
        name = getattr(graph, "name", None)
        if isinstance(name, str) and name.startswith("Dataset_"):
            return name
        graph = getattr(graph, "outer_graph", None)
    return None
