"""The first read of a variable in a traced call, fingerprinted from what nondet knows of
the variable's value when the call starts, instead of a guarded hash in the graph.

Note [First reads]
In a graph traced at the top level (called from eager code, not from inside another
graph), a ``ReadVariableOp`` that is the graph's first op to use a captured variable's
handle reads the value the variable had when the call started: automatic control
dependencies order every later op on that handle after it, and nothing earlier in the
graph used the handle (``reads.RepeatReads.first``). That value is often known already:
the step-level state hash of an op-captured step fingerprints each variable after the
call that ended the step (statehash.py, per-variable rows), with the same content sum the
read's guard would compute. So the read gets no guard: when the call starts
(``before_call``, a wrapper around TensorFlow's eager function call), nondet takes the
content of every variable it knows, hashing afresh those something may have written since
(a state hash of just those, paused and quiet, with its own traced functions: one more
copy to the host at the first step of an op window); after the call the read's record is that
content with the read's description, the number its guarded hash gives (the same record,
field for field: no fingerprint scheme change). On the narrow benchmark model 57 of a
step's 112 guarded hashes are such reads (docs/benchmarks.md, TensorFlow, "Ninth round").

What may have written a variable is judged conservatively, and a possible write makes
nondet forget what it knew (the next call in an op window then hashes afresh):
- every eager function call forgets everything once its records are collected (the step's
  state hash, right after the call that ends a step, gives it all back), or once it raised
  (no records are collected then, but it may have written before it stopped);
- an eager op that takes a variable's handle and is not a read forgets that variable; one
  that takes any other resource (a copy of a handle could be any variable) forgets
  everything, unless it is an iterator op;
- a ``tf.data`` function that writes through a resource (a Keras random layer's seed, a
  ``tf.random.Generator``) runs on tf.data's threads at times no hook sees: from then on no
  read is derived this way (``off``; reads traced already get no value, in both runs alike).
Writes from another Python thread are not seen (op callbacks are per thread; nondet refuses
scripts that train in two threads at once). A graph with such reads that is then called
from inside another graph (where the outer graph may have written the variable first), or
through a function TensorFlow rewrote for an eager tape, gives those reads no value in
that call: the record is left out, as for an op that did not run.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

from nondet.frameworks.tensorflow.graph import backward_graph, data_function_graph
from nondet.frameworks.tensorflow.state import TrackedVariable

#: Eager ops that take a variable's handle and never write it.
_READ_ONLY = frozenset({"ReadVariableOp", "VarIsInitializedOp", "VariableShape",
                        "ResourceGather", "ResourceGatherNd"})
#: Eager ops on a resource that is not a variable (a tf.data iterator): they write none
#: (a tf.data function that does is caught where it is traced: ``untraced_op``).
_ITERATOR_PREFIXES = ("Iterator", "AnonymousIterator", "MakeIterator", "DeleteIterator",
                      "MultiDeviceIterator", "DatasetToGraph", "SerializeIterator",
                      "DeserializeIterator")
#: Contents of these tracked variables (those alive), hashed now.
Contents = Callable[[list[TrackedVariable]], list[tuple[TrackedVariable, int]]]


class FirstReads:
    """What nondet knows of each tracked variable's current value, and the graphs whose
    first reads take it (module Note)."""

    def __init__(self, variables: Callable[[], list[TrackedVariable]],
                 contents: Contents, failed: Callable[[], None]) -> None:
        self._variables = variables
        self._contents = contents
        self._failed = failed
        self.hooked = False  # the call wrapper is installed (``install``)
        self.off = False  # a tf.data function writes a resource: derive nothing
        self.active = False  # op-level capture is on (the recorder's window)
        self.busy: Callable[[], bool] = lambda: False  # nondet's own ops are running
        #: id(tracked) -> content of the variable's value, while nothing may have written it
        self.known: dict[int, int] = {}
        #: per graph id with derived first reads: the weak graph and the variables they read
        self._graphs: dict[int, tuple[weakref.ref[Any], list[TrackedVariable]]] = {}
        self._nested: set[int] = set()  # graphs also called from inside another graph
        self._handles: dict[int, TrackedVariable] = {}  # id(variable handle) -> tracked
        self._handles_of = -1  # how many tracked variables _handles was built from
        self._entry: tuple[int, dict[int, int]] | None = None  # the call in flight
        self._thread = threading.get_ident()  # the thread whose op callbacks nondet sees

    # -- trace time ------------------------------------------------------------------------
    def read(self, handle: Any, graph: Any) -> TrackedVariable | None:
        """The tracked variable whose value this first read (``handle``: its captured
        handle, ``reads.RepeatReads.first``) takes when the call starts, if it can be
        derived (module Note), else None."""
        if not self.hooked or self.off or handle is None or backward_graph(graph):
            return None
        if isinstance(getattr(graph, "outer_graph", None), FuncGraph):
            return None  # traced inside another graph: the outer one may write first
        external = _external(graph, handle)
        tracked = self._tracked(external) if external is not None else None
        if tracked is None:
            return None
        gid = id(graph)
        got = self._graphs.get(gid)
        if got is None or got[0]() is not graph:
            self._graphs = {k: v for k, v in self._graphs.items() if v[0]() is not None}
            got = self._graphs[gid] = (weakref.ref(graph), [])
        got[1].append(tracked)
        return tracked

    def _tracked(self, handle: Any) -> TrackedVariable | None:
        """The tracked resource variable whose handle is ``handle`` (an optimizer slot made
        in a function's first trace is an ``UnliftedInitializerVariable``: one too)."""
        tracked = self._handles.get(id(handle))
        if tracked is None:
            variables = self._variables()
            if len(variables) == self._handles_of:
                return None
            self._handles = {}
            for t in variables:
                v = t.ref()
                if isinstance(v, BaseResourceVariable):
                    self._handles[id(v.handle)] = t
            self._handles_of = len(variables)
            tracked = self._handles.get(id(handle))
        v = tracked.ref() if tracked is not None else None
        return tracked if v is not None and v.handle is handle else None

    # -- around a call ---------------------------------------------------------------------
    def before_call(self, function: Any) -> None:
        """An eager call of ``function`` (a TensorFlow AtomicFunction) is about to run:
        take the contents its graph's first reads need, hashing those not known."""
        graph = getattr(function, "_cached_graph", None)
        gid = id(graph)
        got = self._graphs.get(gid)
        if got is None or got[0]() is not graph or gid in self._nested:
            return
        needed = [t for t in got[1] if id(t) not in self.known]
        if needed:
            self.refresh(self._contents(needed))
        self._entry = (gid, dict(self.known))

    def nested_call(self, function: Any) -> None:
        """``function`` is called from inside a graph being traced: its first reads may
        follow writes of the outer graph, so they get no value from now on."""
        graph = getattr(function, "_cached_graph", None)
        if id(graph) in self._graphs:
            self._nested.add(id(graph))

    def entry_graph(self) -> int | None:
        """The id of the graph whose eager call is being collected, if its first reads
        took contents (``before_call``)."""
        return self._entry[0] if self._entry is not None else None

    def value(self, graph: int, tracked: TrackedVariable) -> int | None:
        """The content a first read of ``tracked`` in graph ``graph`` read in the call just
        collected (None: unknown, e.g. the graph ran inside another one)."""
        entry = self._entry
        if entry is None or entry[0] != graph:
            return None
        return entry[1].get(id(tracked))

    def called(self) -> None:
        """A traced call has run and been collected: it may have written any variable."""
        self._entry = None
        self.known.clear()

    def refresh(self, contents: list[tuple[TrackedVariable, int]]) -> None:
        """Contents of variables as they are now (the step's state hash, or ``_contents``)."""
        for tracked, content in contents:
            self.known[id(tracked)] = content

    # -- possible writes ---------------------------------------------------------------------
    def eager_op(self, op_type: str, inputs: Any) -> None:
        """An eager op ran: forget the variables it may have written (module Note)."""
        if op_type in _READ_ONLY:
            return
        for t in inputs or ():
            if getattr(t, "dtype", None) != tf.resource:
                continue
            tracked = self._handles.get(id(t))
            v = tracked.ref() if tracked is not None else None
            if v is not None and v.handle is t:
                self.known.pop(id(tracked), None)
            elif not op_type.startswith(_ITERATOR_PREFIXES):
                self.known.clear()
                return

    def untraced_op(self, op_type: str, inputs: Any, graph: Any) -> None:
        """An op traced into a graph nondet does not instrument: one of a tf.data function
        that may write through a resource turns this off for good (module Note)."""
        if self.off or op_type in _READ_ONLY:
            return
        if not any(getattr(t, "dtype", None) == tf.resource for t in inputs or ()):
            return
        if data_function_graph(graph):
            self.off = True
            self.known.clear()

    # -- the hook ------------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap TensorFlow's function call (``AtomicFunction.call_flat``, which every
        ``tf.function`` and concrete function call goes through) with ``before_call`` and
        ``nested_call``; if it cannot be found, first reads stay hashed (``hooked``)."""
        try:
            from tensorflow.python.eager.polymorphic_function import atomic_function
        except ImportError:
            return
        cls = getattr(atomic_function, "AtomicFunction", None)
        original = getattr(cls, "call_flat", None)
        if cls is None or original is None:
            return
        # a backend made again in this process (tests) replaces the earlier wrapper
        original = getattr(original, "_nondet_original", original)
        first = self

        def call_flat(function: Any, *args: Any) -> Any:
            first._seen(function)
            try:
                return original(function, *args)
            except BaseException:
                first._failed_call()
                raise

        call_flat._nondet_original = original  # type: ignore[attr-defined]
        cls.call_flat = call_flat
        self.hooked = True

    def _failed_call(self) -> None:
        """A call raised (a failed ``check_numerics``, an ``OutOfRangeError`` of an iterator
        read inside it): no op callback collects it, but it may have written variables
        before it stopped, so forget as ``called`` does, also the call in flight. A call
        of another thread (whose writes are not seen anyway) leaves this thread's call
        alone."""
        if threading.get_ident() == self._thread and not self.busy():
            self.called()

    def _seen(self, function: Any) -> None:
        """The wrapper's work; never raises into the script."""
        if not self._graphs or self.off:
            return
        try:
            if threading.get_ident() != self._thread or self.busy():
                return
            if not tf.executing_eagerly():
                self.nested_call(function)
            elif self.active:
                self.before_call(function)
        except Exception:
            self.off = True
            self._failed()


def _external(graph: Any, internal: Any) -> Any:
    """The outside tensor ``graph`` captured as ``internal`` (None if not a capture)."""
    try:
        for external, placeholder in graph.captures:
            if placeholder is internal:
                return external
    except Exception:  # not a FuncGraph, or the API moved
        return None
    return None
