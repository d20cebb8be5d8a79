"""``torch.compile`` under nondet: compiled code is compiled, and each compiled region is one op.

Dynamo refuses to compile a frame while a dispatch mode is on the stack, unless the mode
declares ``ignore_compile_internals`` (``CaptureMode`` does): Dynamo then traces and compiles
with the mode switched off, and runs the compiled artifact with it switched back on. So a
script compiles exactly the same graphs under nondet as without it, and its Inductor kernels
(and their nondeterminism: ``atomic_add`` in a scatter/index backward, split reductions) are
what runs.

Ops inside a compiled region are not seen one by one: the generated kernels do not go
through the dispatcher, and the few aten calls that do (extern ``mm``, the runtime wrapper's
views) are passed through unrecorded. Instead each call of a compiled graph is recorded as
ONE op, named ``compiled:<qualified name of the compiled function>`` (``compiled:Model.forward``;
a graph after a graph break is named after Dynamo's resume function), with the fingerprints
of all its tensor inputs (the graph's inputs include the parameters it reads) and outputs
(including inputs it mutated, e.g. BatchNorm running stats), the module and the user's
source line of the call. Its backward (the compiled autograd function's backward node) is
likewise one op, ``compiled:<name> (backward)``, attributed to the same module and line.
A difference made inside a region is therefore reported at that region. To see its ops one
by one, run with ``TORCH_COMPILE_DISABLE=1`` (the region then runs eagerly, under the
mode), at the price of running a different program: eager kernels may not have the race.

How: ``OutputGraph.call_user_compiler`` (where Dynamo hands a graph to the backend) is
wrapped once ``torch._dynamo.output_graph`` is imported (never imported by nondet itself),
so every compiled graph's callable goes through ``Regions.forward``, which does nothing but
call it unless op-level capture is recording.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nondet.frameworks.torch import nocompile
from nondet.frameworks.torch.regions import CompileHost, Regions

_current: Regions | None = None  # the installed backend's regions (one backend per process)
_patched = False


# -- installation ----------------------------------------------------------------------------
def in_region() -> bool:
    """For ``CaptureMode``: ops of a compiled region are not recorded one by one."""
    regions = _current
    return regions is not None and regions.inside()


def wrap(compiled_fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """The callable Dynamo runs for one compiled graph, recorded as ``name`` when capturing."""

    def region(*args: Any, **kwargs: Any) -> Any:
        regions = _current
        if regions is None or not regions.recording():
            return compiled_fn(*args, **kwargs)
        return regions.forward(compiled_fn, name, args, kwargs)

    nocompile.internal(region)  # Note [nondet's frames and Dynamo]
    region._boxed_call = getattr(compiled_fn, "_boxed_call", False)  # type: ignore[attr-defined]
    region.__wrapped__ = compiled_fn  # type: ignore[attr-defined]
    return region


def region_name(code: Any) -> str:
    return "compiled:" + str(getattr(code, "co_qualname", None) or getattr(code, "co_name", "?"))


def _patch_dynamo() -> None:
    global _patched
    if _patched:
        return
    from torch._dynamo import output_graph

    original = output_graph.OutputGraph.call_user_compiler

    @functools.wraps(original)
    def call_user_compiler(graph: Any, gm: Any, example_inputs: Any) -> Any:
        with _compiling():
            compiled_fn = original(graph, gm, example_inputs)
        if getattr(graph, "export", False):
            return compiled_fn  # torch.export: nothing runs here
        _force_lazy(compiled_fn)
        return wrap(compiled_fn, region_name(graph.root_tx.f_code))

    output_graph.OutputGraph.call_user_compiler = call_user_compiler  # type: ignore[method-assign,assignment]
    _patched = True


@contextmanager
def _compiling() -> Iterator[None]:
    """The backend compiler (AOTAutograd, Inductor) runs Python that makes tensors (fake
    ones, mostly): nondet's hooks must not take that for the script's work."""
    regions = _current
    if regions is None:
        yield
        return
    backend = regions.backend
    was = backend.paused, backend.recorder.active
    backend.paused, backend.recorder.active = True, False
    try:
        yield
    finally:
        backend.paused, backend.recorder.active = was


def _force_lazy(compiled_fn: Any) -> None:
    """Dynamo compiles a lazy GraphModule returned by the backend (eager, aot_eager) on
    the spot, which it no longer recognizes behind our wrapper: do it here."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    lazy = compiled_fn if isinstance(compiled_fn, _LazyGraphModule) else getattr(
        compiled_fn, "__self__", None)
    if isinstance(lazy, _LazyGraphModule):
        _LazyGraphModule.force_recompile(lazy)


def install(backend: CompileHost) -> None:
    """Record compiled regions for ``backend`` from now on (see the module docstring)."""
    global _current
    _current = Regions(backend)
    from nondet.frameworks import after_import

    def patch() -> None:
        try:
            _patch_dynamo()
        except Exception:  # another torch version: regions then run op by op under the mode
            backend.session.send_meta({"note": "torch.compile regions could not be hooked: "
                                               + traceback.format_exc(limit=1)})

    after_import("torch._dynamo.output_graph", patch)
