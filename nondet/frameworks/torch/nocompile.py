"""nondet's own Python is never compiled by Dynamo (``torch.compile``).

Note [nondet's frames and Dynamo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
While a ``torch.compile``d function runs, Dynamo's frame callback is set on the thread, and
every Python frame started under it that is not in Dynamo's skip lists is offered to Dynamo
to compile, not only the user's: a graph break (``loss.backward()``, ``opt.step()``: both
break in torch itself) runs the rest eagerly under the callback, so a hook of nondet's that
fires there (an optimizer step hook, the ``torch.autograd.backward`` wrapper, a compiled
region's backward hook) had its own functions traced and compiled by Dynamo. They use NumPy
structured arrays, ``sys._getframe``, HDF5 writes: Dynamo raised into the hook ("data type
'void' not understood", "Expected np.nditer base"), the run ended as nondet's internal error
(the PyTorch tutorial's compiled ``opt.step()``, a whole training step under
``torch.compile``). And where tracing happened to succeed, nondet's side effects would have
been replayed by Dynamo's bytecode, not run.

So nondet's hook code is marked with Dynamo's per-code execution strategy, which the C frame
evaluator reads before it calls Dynamo (no ``torch._dynamo`` import, no cost per call):

- ``internal``: this frame and every frame it starts run as plain Python (SKIP, SKIP). For
  code that never calls back into the user's: the hooks' bodies, region hooks.
- ``passing``: this frame runs as plain Python, the frames it starts as without nondet
  (SKIP, DEFAULT). For wrappers that call the original (``torch.autograd.backward``: the
  engine runs the user's autograd functions and hooks, which Dynamo compiles in a plain run
  too); their own nondet work goes through ``internal`` functions.
- ``opaque``: ``internal``, and a function Dynamo must not inline when it traces a call to it
  (the ``torch.compiler.disable`` marks): Dynamo breaks the graph there and calls it eagerly.
  For hooks that must run at run time, not at trace time: the optimizer step hooks (``step``
  breaks the graph in torch itself anyway, ``_use_grad``) and a root module's first call.

Module forward hooks themselves stay traceable: Dynamo inlines them into the user's graph
(only their bookkeeping of the module stack), so a compiled model has the same graphs as
without nondet (tests/frameworks/test_torch_compile.py).

Note [A root module called in compiled code]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.compile(model)`` calls the root eagerly (the ``OptimizedModule``), but a compiled
training step calls it inside the traced function, and the root's hook registers the model,
ends a hand-written step, pauses the loop watch: none of it traceable, and an ``opaque`` root
hook would break the graph before the model, which then ran eagerly (other kernels, other
numbers: not the user's program). So a hook traced by Dynamo (``torch.compiler.is_compiling()``,
a constant while tracing) does only what Dynamo can replay at run time without a guard that
changes: it pushes and pops a placeholder on the module stack, and stores the root as an
attribute of ``TracedRoots``; the next eager hook (a backward, an optimizer step) registers
it. A module inside the root pushes nothing, and a root in the body of a higher-order op
that Dynamo compiles on its own (``torch.cond`` called eagerly) registers nothing: Dynamo
refuses every side effect in such a body (checkpoint under fullgraph, cond's branches), and
``torch.cond`` reaches the capture mode whole, recorded as one op. The draw watch's module
hook does nothing while traced and is removed as soon as its mode
leaves the stack (a removal later, eagerly, would change a hook dict Dynamo guards: a
recompile). Checked: the same graphs, calls and numbers as a plain run.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def _strategies() -> tuple[Any, Any] | None:
    """(skip recursively, skip this frame only), or None where torch has no such API."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:
        return None
    try:
        action = eval_frame._FrameAction
        return (eval_frame._FrameExecStrategy(action.SKIP, action.SKIP),
                eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT))
    except (AttributeError, TypeError):  # another torch: its frames stay as they were
        return None


def _code(fn: Any) -> Any:
    fn = getattr(fn, "__func__", fn)  # a bound method's function
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__code__", None)


def _mark(fn: Any, which: int) -> None:
    strategies = _strategies()
    code = _code(fn)
    if strategies is None or code is None:
        return
    try:
        from torch._C._dynamo import eval_frame

        eval_frame.set_code_exec_strategy(code, strategies[which])
    except (AttributeError, TypeError, RuntimeError):
        pass


def internal(fn: F) -> F:
    """``fn``'s frames, and all frames they start, are never compiled (see the Note)."""
    _mark(fn, 0)
    return fn


def passing(fn: F) -> F:
    """``fn``'s own frames are never compiled; the frames it starts are left to Dynamo."""
    _mark(fn, 1)
    return fn


def opaque(fn: F) -> F:
    """``internal``, and never inlined into a traced graph: a call to it breaks the graph
    and runs eagerly (the marks ``torch.compiler.disable`` sets, read by Dynamo)."""
    internal(fn)
    target: Any = getattr(fn, "__func__", fn)
    try:
        target._torchdynamo_disable = True
        target._torchdynamo_disable_recursive = True
        target._torchdynamo_disable_msg = "nondet's hook (runs eagerly)"
    except (AttributeError, TypeError):
        pass
    return fn


def inside_compiled_call() -> bool:
    """Is a ``torch.compile``d function running on this thread (its eager parts included)?

    Its wrapper (``compile_wrapper`` in torch/_dynamo/eval_frame.py) saves the thread's
    dispatch key sets on entry and forces them back on return (``_ForceDispatchKeyGuard``):
    a dispatch mode pushed or popped inside is on the mode stack afterwards but not in the
    key set, or the reverse, and the next factory op outside fails in torch ("Hit Python
    dispatch key but no arguments had PyInterpreter"). The frames are walked, not Dynamo's
    callback read: a ``torch.compiler.disable``d function inside clears the callback but
    not the guard. Called once per step end, never per op."""
    if "torch._dynamo.eval_frame" not in sys.modules:
        return False  # nothing was ever compiled
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith(_EVAL_FRAME):
            return True
        frame = frame.f_back
    return False


_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


class TracedRoots:
    """Root modules whose call Dynamo traced, as attributes ``m<id>`` (Note [A root module
    called in compiled code]): written in traced code, where Dynamo replays an attribute
    store at run time without a guard on the object's contents (a dict or list it would
    guard by its keys or length, and recompile the user's function once they changed)."""
