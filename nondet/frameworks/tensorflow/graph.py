"""What the TensorFlow op recorder knows about graphs: which op types are derived, skipped,
control flow or data; the record of one graph op (``GraphOp``); nondet's own variables
(``RecorderVariables``: the slot buffer, the window flag and the guard functions); and which
graphs are instrumented. See Note [Graph instrumentation] in traced.py."""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph

from nondet.fingerprint import MASK64, name_code
from nondet.frameworks.tensorflow.hashing import GraphHasher, Plan
from nondet.records import Kind

#: Elementwise ops (and pass-throughs) whose outputs are derived, not hashed.
DERIVED_OPS = frozenset({
    "Identity", "IdentityN", "StopGradient", "Snapshot", "AddV2", "Add", "Sub", "Mul",
    "RealDiv", "Div", "DivNoNan", "Neg", "Abs", "Relu", "Relu6", "Elu", "Selu", "Sigmoid",
    "Tanh", "Softplus", "Maximum", "Minimum", "Cast", "Square", "Sqrt", "Rsqrt", "Exp",
    "Log", "Reciprocal", "Select", "SelectV2", "Greater", "GreaterEqual", "Less",
    "LessEqual", "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "ReluGrad",
    "Relu6Grad", "EluGrad", "SeluGrad", "SigmoidGrad", "TanhGrad", "SoftplusGrad",
    "SqrtGrad", "RsqrtGrad", "BiasAdd", "Reshape", "ExpandDims", "Squeeze", "Transpose",
    "ZerosLike", "OnesLike", "Fill", "Pow", "SquaredDifference", "Floor", "Ceil", "Round",
    # Copies of their input's values into a larger shape, and an elementwise remainder:
    # the seven Tile outputs of a narrow benchmark step were 31% of its hashed words
    # (docs/benchmarks.md, TensorFlow, "Eighth round"). Fingerprint scheme 4.
    "Tile", "BroadcastTo", "FloorMod",
    # Each output element the largest of its window, computed by one thread on every
    # device (no summation: exact, no order to vary); its backward (MaxPoolGrad) scatters
    # with atomics on GPUs (RECIPE.md, TF-MAXPOOL) and stays hashed. Guarded, the two
    # MaxPool outputs of a narrow benchmark step cost ~3 ms of CPU per step, far more
    # than their 164k words (docs/benchmarks.md, TensorFlow, "Ninth round"). Scheme 5.
    "MaxPool", "MaxPoolV2",
})
#: Ops whose outputs carry nothing to compare or that only plumb control flow.
SKIPPED_OPS = frozenset({
    "Const", "NoOp", "VarHandleOp", "VarIsInitializedOp", "AssignVariableOp",
    "AssignAddVariableOp", "AssignSubVariableOp", "Shape", "ShapeN", "Size", "Rank",
    "Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond",
    "ResourceScatterNdUpdate", "ResourceStridedSliceAssign",
})
#: Ops that run a body nondet does not record op by op; their outputs are fingerprinted
#: where something reads them (the op itself must not be touched while TF builds it).
CONTROL_FLOW_OPS = frozenset({
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall",
})
#: Recorded where something first reads their outputs: control-flow ops (see above) and
#: function inputs (a Placeholder's own instrumentation would be pruned from the function).
LATE_OPS = CONTROL_FLOW_OPS | {"Placeholder"}
#: Ops whose outputs are data entering the computation.
#: Eager ops that run a traced function (its slots are read right after): a plain call, and
#: under an eager GradientTape its forward and, during ``tape.gradient``, its backward.
FUNCTION_CALLS = ("__inference_", "__forward_", "__backward_")
DATA_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue"})
ENTRY_KINDS_OF = {"Placeholder": "external", "ReadVariableOp": "variable"}
#: Graphs of tf.cond/tf.while_loop bodies and their gradients (not nested tf.functions).
_CONTROL_FLOW_GRAPHS = frozenset({
    "CondBranchFuncGraph", "_CondGradFuncGraph", "WhileCondFuncGraph", "WhileBodyFuncGraph",
    "_WhileBodyGradFuncGraph",
})
HOST = "/device:CPU:0"
#: The name scope of the ops nondet adds to a traced graph (its guards and data writes):
#: TensorFlow's error names the op that failed, so a failure of nondet's own op is told
#: from the script's (``own_op_failed``).
GUARD_SCOPE = "nondet_guard"
CAPACITY = 1 << 18  # slots in the buffer variable: outputs of all graphs traced in a run
SLOT_MARGIN = 4096  # kept free for the graph inputs and control-flow outputs of one op


@dataclass
class GraphOp:
    """What nondet knows about one graph op from trace time (see the module Note)."""

    kind: Kind
    phase: int
    name_id: int
    module: int
    source: int
    slots: list[int]  # one per hashed output (empty for derived ops)
    meta: list[tuple[int, ...]]  # description of each output
    producers: list[tuple[int, int]]  # (op table index, output index) of each input
    derived: bool = False
    code: int = 0
    numel: int = -1
    data: bool = False  # recorded every step, outside the op window
    values: tuple[int, ...] = ()  # output fingerprint values of the last execution
    keys: Any = None  # OpKeys, made at the first collection (traced.collect)
    graph: int = 0  # id of the graph traced (producers and aliases are in the same graph)
    alias: int | None = None  # a repeated variable read: the table index of the earlier one
    #: a derived read after a write: (index, position) of what it is derived from, in place
    #: of ``producers`` (Note [Reads after a write] in reads.py)
    bases: list[tuple[int, int]] | None = None
    #: has a value whenever it runs: hashed, or derived from something that has one (a
    #: derived op whose inputs are all unrecorded, e.g. a ``Fill`` of constants, has none)
    valued: bool = True
    #: a variable's first read in a top-level graph: the tracked variable whose content at
    #: the call's start is its value (Note [First reads] in first_reads.py)
    first: Any = None

    #: a data op: its trace position, and whether nothing that can make a difference was
    #: traced before it in its graph (entries.TraceOrder: Note [Entries named like the op
    #: records] in entries.py)
    order: int = -1
    unpreceded: bool = False

class OpKeys:
    """An op's descriptions, packed as the tails of its ``combine`` words at its first
    collection: per hashed output, its description; per derived output, the op type's
    code and its description (Note [Derived fingerprints]); and its known inputs as
    (producer, output position), read by ``inputs`` without a table look-up per input
    and call. A fingerprint is then one blake2b of the packed leading words and a tail
    (``combine_words((*lead, *tail))``, the same value): packing each description
    again at every call was a third of ``collect`` (docs/benchmarks.md, TensorFlow,
    "Eighth round")."""

    __slots__ = ("bases", "derived", "meta", "record", "sources")

    def __init__(self, op: GraphOp, table: list[GraphOp]) -> None:
        metas = [tuple(x & MASK64 for x in m) for m in op.meta]
        self.meta = [_pack(m) for m in metas]
        self.derived = [_pack(((op.code & MASK64), *m)) for m in metas]
        # producers come before the op in the table, which only grows
        self.sources = _sources(op.producers, table)
        self.bases = None if op.bases is None else _sources(op.bases, table)
        #: the fields of the op's records before its fingerprints (traced.collect)
        self.record = (op.kind, op.phase, 0, op.name_id, op.module, op.source)

    def inputs(self, sources: list[tuple[GraphOp, int]] | None = None) -> list[int]:
        """The fingerprint values of the op's inputs (or of ``sources``) in the call just
        collected: of those whose producer is known and ran."""
        return [values[position] for producer, position in
                (self.sources if sources is None else sources)
                if position < len(values := producer.values)]

    def hashed(self, stored: list[int]) -> tuple[int, ...]:
        """The fingerprints of the op's hashed outputs from their slots (content + 1)."""
        return tuple(_digest(_PACK1((v - 1) & MASK64) + tail)
                     for v, tail in zip(stored, self.meta, strict=True))

    def derive(self, bases: list[int]) -> tuple[int, ...]:
        """The derived fingerprints of the op's outputs from its inputs' (``bases``)."""
        lead = _PACK1(bases[0]) if len(bases) == 1 else _pack(bases)
        return tuple(_digest(lead + tail) for tail in self.derived)


_PACK1 = struct.Struct("<Q").pack
_blake2b = hashlib.blake2b


def _digest(data: bytes) -> int:
    """``combine_packed``: the fingerprint of packed words."""
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little") or 1


def _pack(words: Sequence[int]) -> bytes:
    packer = _WORD_PACKERS.get(len(words))
    if packer is None:
        packer = _WORD_PACKERS[len(words)] = struct.Struct(f"<{len(words)}Q")
    return packer.pack(*words)


def _sources(places: list[tuple[int, int]], table: list[GraphOp]) -> list[tuple[GraphOp, int]]:
    return [(table[index], position) for index, position in places if 0 <= index < len(table)]


_WORD_PACKERS: dict[int, struct.Struct] = {}


def combine_words(words: Sequence[int]) -> int:
    """``fingerprint.combine`` of words already within 64 bits (the same value: its masking
    leaves them as they are), without the masking pass."""
    return _digest(_pack(words))


def joined(values: Sequence[int]) -> int:
    """``fp.combined`` of final fingerprints, from their values: 0 for none, a lone one
    stands for itself (never 0), several are combined."""
    if not values:
        return 0
    if len(values) == 1:
        return values[0]
    return combine_words(values)


class RecorderVariables:
    """nondet's own variables. Made on first use, not at import: making a variable starts
    TensorFlow's runtime, after which the script's own set-up calls
    (``tf.config.threading.set_intra_op_parallelism_threads``, ``set_memory_growth``,
    ``set_visible_devices``) would raise."""

    def __init__(self, window: bool) -> None:
        self.hasher = GraphHasher()
        with tf.init_scope():
            self.buffer = tf.Variable(tf.zeros([CAPACITY], tf.int64), trainable=False,
                                      name="nondet_slots")
            # On the host, whatever device the script's scope names: an ``If``'s predicate
            # is read on the host, so a flag on a GPU would be copied and waited for by every
            # guarded op of every step.
            with tf.device(HOST):
                self.window_flag = tf.Variable(window, trainable=False, name="nondet_window")
            self.window = window  # the flag's value: only nondet assigns it (``set_window``)
            self.updates = tf.Variable(tf.zeros([], tf.int64), trainable=False,
                                       name="nondet_updates")
            # the loss of a traced step (see carry_loss): its content hash + 1, and its value
            self.loss_hash = tf.Variable(tf.zeros([], tf.int64), trainable=False,
                                         name="nondet_loss_hash")
            self.loss_value = tf.Variable(tf.constant(math.nan, tf.float64), trainable=False,
                                          name="nondet_loss")
        self._guards: dict[Any, tuple[Any, Any]] = {}
        self._drains: dict[int, Any] = {}  # per slot count: drain's traced function

    def drain(self, slots: int) -> tuple[int, int, float, np.ndarray]:
        """After a traced function ran: the update count, the carried loss (hash + 1, value)
        and the first ``slots`` slots, in one read-back; the slots and the loss hash are
        then zeroed (the next call writes them afresh). One call of a function traced once
        per slot count: done as eager ops (three reshapes, a read, a bitcast, a slice, a
        concat, two assignments) it cost about 1.2 ms of CPU after every call of the
        script's step, as much as the step-level state hash (docs/benchmarks.md)."""
        function = self._drains.get(slots)
        if function is None:
            if len(self._drains) >= 8:  # a function retraced again and again: keep a few
                self._drains.clear()
            with tf.init_scope():
                function = tf.function(functools.partial(self._drained, slots),
                                       autograph=False).get_concrete_function()
            self._drains[slots] = function
        values = to_host(function())
        loss_value = float(values[2:3].view(np.float64)[0])
        return int(values[0]), int(values[1]), loss_value, values[3:]

    def _drained(self, slots: int) -> tf.Tensor:
        """``drain``'s computation: the values, read before the zeroing (control
        dependencies; a function runs its assignments even when nothing uses them)."""
        parts = [tf.reshape(self.updates.read_value(), [1]),
                 tf.reshape(self.loss_hash.read_value(), [1]),
                 tf.reshape(tf.bitcast(self.loss_value.read_value(), tf.int64), [1])]
        if slots:
            parts.append(self.buffer.read_value()[:slots])
        values = tf.concat(parts, 0)
        with tf.control_dependencies([values]):
            if slots:
                self.buffer[:slots].assign(tf.zeros([slots], tf.int64))
            self.loss_hash.assign(tf.zeros([], tf.int64))
        return values

    def guard(self, dtype: Any, plan: Plan | None) -> tuple[Any, Any]:
        """The two branches of the guard for tensors of ``dtype`` whose static shape gave
        ``plan`` (word size, chunked: ``hashing.static_plan``; None: decided when the graph
        runs), traced once per key (a ``tf.cond`` per op would trace two small graphs per
        op, which made tracing a Keras model many times slower; without the plan each
        branch held a ``tf.cond`` per word size and one on the size, a dozen functions
        for TensorFlow to optimize and instantiate): ``then`` hashes its tensor into the
        given slot, ``otherwise`` does nothing; both take the tensor, the slot and
        ``then``'s captured variables, as an ``If`` op requires."""
        key = (dtype, plan)
        if key not in self._guards:
            hasher, buffer = self.hasher, self.buffer

            def write(t: tf.Tensor, slot: tf.Tensor) -> tf.Tensor:
                content = hasher.content(t) if plan is None \
                    else hasher.content_planned(t, plan)
                # a scalar update at a scalar index: no index or update packing in the graph
                tf.raw_ops.ResourceScatterUpdate(resource=buffer.handle, indices=slot,
                                                 updates=content + 1)
                return tf.constant(True)

            def skip(t: tf.Tensor, slot: tf.Tensor, *captured: tf.Tensor) -> tf.Tensor:
                return tf.constant(False)

            specs = (tf.TensorSpec(None, dtype), tf.TensorSpec([], tf.int32))
            with tf.init_scope():
                then = tf.function(write, autograph=False).get_concrete_function(*specs)
                captured = [tf.TensorSpec(c.shape, c.dtype) for c in then.captured_inputs]
                otherwise = tf.function(skip, autograph=False).get_concrete_function(
                    *specs, *captured)
            self._guards[key] = (then, otherwise)
        return self._guards[key]


#: How many times nondet copied its own values from TensorFlow to the host (``to_host``): on
#: a GPU each copy waits for the device, so a step should make few (tests count them).
read_backs = 0


def to_host(t: Any) -> np.ndarray:
    """A host copy of one of nondet's own tensors: the only way they leave the device."""
    global read_backs
    read_backs += 1
    return np.asarray(t.numpy())


def own_op_failed(error: BaseException) -> bool:
    """Did a traced call fail in an op nondet added (``GUARD_SCOPE``)? TensorFlow names the
    failing node in its error (``uncompress_nondet_guard_readvariableop_resource``)."""
    return isinstance(error, tf.errors.OpError) and GUARD_SCOPE in str(error)


def backward_graph(graph: Any) -> bool:
    """The gradient function TensorFlow builds for a function called under an eager tape:
    it is traced along with the forward call, while nondet's phase is still "forward"."""
    return str(getattr(graph, "name", "")).startswith("__backward_")


#: The functions of tf.data's MultiDeviceIterator (a tf.distribute strategy's input on
#: several devices, ``multi_device_iterator_ops``): tf.data machinery run on another
#: device, where a guard could not read nondet's variables (TensorFlow refuses a resource
#: read across devices); the batches they hand over are recorded where they are read.
_MULTI_DEVICE_ITERATOR = frozenset({
    "_init_func", "_remote_init_func", "_next_func", "_remote_next_func",
    "_finalize_func", "_remote_finalize_func"})


def under_strategy() -> bool:
    """Traced under a tf.distribute strategy of the script's (MirroredStrategy traces the
    step once per device, each replica in a thread of its own): op-level guards are not
    placed there (they read nondet's variables from the replica's device, which
    TensorFlow refuses or waits on forever); the batches and the step-level state are
    still recorded. ``OneDeviceStrategy`` has one replica in the script's thread and no
    cross-device read: its ops are recorded as without a strategy."""
    if not tf.distribute.has_strategy():
        return False
    return not isinstance(tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy)


def strategy_facts() -> dict[str, bool]:
    """The facts of a step traced under a strategy (``under_strategy``): that it was, and
    whether its updates are a parameter server's (asynchronous: recipe TF-SESSION-PS)."""
    kind = type(tf.distribute.get_strategy()).__name__
    return {"tf.distribute.strategy": True,
            "tf.distribute.parameter_server": "ParameterServer" in kind}


XLA_NOTE = (
    "ops inside XLA-compiled functions (jit_compile=True) are not recorded one by one "
    "(XLA cannot compile nondet's hashing): a difference made inside one is reported at the "
    "step level (batch, loss, state); for an op-level finding, compile with "
    "jit_compile=False")


def xla_compiled(graph: Any) -> bool:
    """Traced for XLA (``tf.function(jit_compile=True)``, Keras ``compile(jit_compile=True)``):
    op-level guards are not placed there, tf2xla refuses their hashing (a loop over a
    dynamic size in int64, reads of nondet's host variable); the batches and the
    step-level state are still recorded outside it."""
    from tensorflow.python.ops import control_flow_util

    try:
        return bool(control_flow_util.GraphOrParentsInXlaContext(graph))
    except Exception:  # an internal API: if it moves, guard as before
        return False


PFOR_NOTE = (
    "ops inside tf.vectorized_map and GradientTape.jacobian/batch_jacobian (TensorFlow's "
    "pfor) are not recorded one by one (pfor vectorizes every op of its loop, nondet's "
    "hashing included, and refuses it): a difference made inside one is reported at the "
    "step level or at the first recorded op that reads it")


class _Pfor(threading.local):
    depth = 0  # > 0 while pfor traces and converts a loop on this thread


_PFOR = _Pfor()


def pfor_converting() -> bool:
    """Is TensorFlow's pfor (``tf.vectorized_map``, ``GradientTape.jacobian``) tracing a
    loop body it will vectorize, on this thread? Guards there broke it: pfor asserts its
    loop variable is the ``PlaceholderWithDefault`` nondet's identity replaced, then fails
    to vectorize nondet's own variable writes ("the script failed")."""
    return _PFOR.depth > 0


def install_pfor_watch() -> None:
    """Wrap pfor's implementation (called by ``pfor`` inside its own tf.function, looked up
    in its module: the wrapper is what runs) to mark the time it traces and converts."""
    from tensorflow.python.ops.parallel_for import control_flow_ops

    original = getattr(control_flow_ops, "_pfor_impl", None)
    if original is None or getattr(original, "__wrapped__", None) is not None:
        return  # an internal API: if it moves, guard as before

    @functools.wraps(original)
    def pfor_impl(*args: Any, **kwargs: Any) -> Any:
        _PFOR.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _PFOR.depth -= 1

    control_flow_ops._pfor_impl = pfor_impl


class _DataFunction(threading.local):
    depth = 0  # > 0 while tf.data traces a function of its own on this thread


_DATA_FUNCTION = _DataFunction()


def install_data_function_watch() -> None:
    """Wrap the maker of tf.data's functions (``StructuredFunctionWrapper``, which traces
    every ``map``/``filter``/``interleave``/``reduce``/``from_generator`` function and those
    tf.data adds itself) to mark the time it traces one. Their graph names are made of the
    transformation's (``Dataset_map_f``, but ``reduce_f``,
    ``tf_data_experimental_map_and_batch_f``, ``DataServiceDataset_uncompress_lambda``), so
    a name does not tell them all. Some are instantiated by their dataset op without
    captured inputs (the tf.data service's uncompression, added by ``distribute()`` with
    its default compression): a guard there, whose ``If`` captures nondet's variables,
    failed the script's input pipeline ("Argument 1 is out of range")."""
    from tensorflow.python.data.ops import structured_function

    cls = getattr(structured_function, "StructuredFunctionWrapper", None)
    original = getattr(cls, "__init__", None)
    if original is None or getattr(original, "_nondet_watch", False):
        return  # an internal API: if it moves, the names below still tell most

    @functools.wraps(original)
    def init(wrapper: Any, *args: Any, **kwargs: Any) -> None:
        _DATA_FUNCTION.depth += 1
        try:
            original(wrapper, *args, **kwargs)
        finally:
            _DATA_FUNCTION.depth -= 1

    init._nondet_watch = True  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[misc]


def data_function_graph(graph: Any) -> bool:
    """Is ``graph`` (traced on this thread) one of tf.data's functions or nested in one?
    They run on tf.data's threads, as far ahead as prefetching goes, and tf.data may
    instantiate them where a capture of nondet's variables cannot be resolved."""
    if _DATA_FUNCTION.depth > 0:
        return True
    while graph is not None:
        name = str(getattr(graph, "name", ""))
        if name.startswith("Dataset_") or name in _MULTI_DEVICE_ITERATOR:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def first_replica() -> bool:
    """Not inside a replica other than the first: each replica of a strategy calls the
    optimizer's ``apply`` once for one update of the shared (mirrored) variables."""
    context = tf.distribute.get_replica_context()
    if context is None:  # cross-replica context
        return True
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return replica is None or int(replica) == 0


def recordable_graph(graph: Any) -> bool:
    """Ops of traced functions (nested ones too) are recorded; not those of tf.cond/while_loop
    bodies, seen as the control-flow op that runs them (their gradient machinery does not
    accept state captured from outside), nor tf.data's own functions, which run on its
    threads for many elements at once (the batches they make are recorded)."""
    if not isinstance(graph, FuncGraph):
        return False  # a TF1-style graph (``with tf.Graph().as_default()``): not ours to change
    if data_function_graph(graph):
        return False
    while graph is not None:
        if str(getattr(graph, "name", "")).startswith("scratch_graph"):
            return False  # Keras' shape inference (never run)
        if type(graph).__name__ in _CONTROL_FLOW_GRAPHS:
            return False
        graph = getattr(graph, "outer_graph", None)
    return True


def in_dataset_function() -> bool:
    """Traced inside a tf.data function (a ``map``/``filter`` stage's), which runs on
    tf.data's threads, as far ahead as prefetching goes: never a training step."""
    return data_function_graph(tf.compat.v1.get_default_graph())


def in_loop_body() -> bool:
    """Traced inside a ``tf.while_loop`` body (a ``for _ in tf.range(n)`` loop that AutoGraph
    converted), in the function being traced or a graph it is nested in."""
    graph: Any = tf.compat.v1.get_default_graph()
    while graph is not None:
        if type(graph).__name__ == "WhileBodyFuncGraph":
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def describe(t: Any) -> tuple[int, ...]:
    dims = [-1 if d is None else int(d) for d in (t.shape.as_list() if t.shape.rank is not None
                                                   else [])]
    device = "gpu" if "GPU" in (getattr(t, "device", "") or "") else "cpu"
    return (name_code(t.dtype.name), name_code(device), len(dims), *dims)


def numel(t: Any) -> int:
    try:
        return int(np.prod(t.shape.as_list())) if t.shape.is_fully_defined() else -1
    except (TypeError, ValueError):
        return -1


def entry_label(op_type: str) -> str:
    return {"Placeholder": "graph input", "ReadVariableOp": "variable read"}.get(op_type, op_type)
