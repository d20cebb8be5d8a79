"""The PyTorch backend: step boundaries, step-level fingerprints, op capture.

Installed right after the user's script imports torch. It seeds torch, then hooks:

- optimizer steps (global pre/post hooks; only the outermost when one optimizer's step
  calls another's): the step boundary, gradients before the update, parameters and
  optimizer state after it;
- ``torch.autograd.backward``: the loss, and for scripts that update parameters by hand, the
  boundary ("each backward-and-update is a step": it ends when the next forward, batch or
  backward begins);
- module calls (global forward hooks): module paths, and parameter names from root modules;
- data entering from outside (``entries.py``): DataLoader batches, tensors made from NumPy;
- ``CaptureMode`` (``ops.py``) during steps that get op-level capture.

Step numbering: "init" (step -1) lasts until training starts, i.e. an optimizer is created
(or, without one, the first DataLoader batch or root-module call); steps count from 0. The
lifecycle itself (rows, probes, finish, hook-error containment) is ``base.StepLifecycle``.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import (
    _disable_current_modes,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)

from nondet import channel, loop_end
from nondet.frameworks.base import Session, StepLifecycle, StepState
from nondet.frameworks.fp import Fp, group_fp
from nondet.frameworks.step_thread import STEP_THREAD
from nondet.frameworks.torch import (
    children,
    comm,
    compiled,
    cuda,
    draws,
    exporting,
    kernels,
    nocompile,
    owners,
)
from nondet.frameworks.torch import seeding as torch_seeding
from nondet.frameworks.torch.entries import DataEntries
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.kept import KeptOutputs
from nondet.frameworks.torch.ops import CaptureMode, OpRecorder, tensors_in
from nondet.frameworks.torch.state import Named as Tensors
from nondet.frameworks.torch.state import (
    holds_values,
    module_paths,
    named_params,
    named_state,
    persistent_buffers,
    torch_environment,
    torch_facts,
)
from nondet.frameworks.torch.stepstate import GroupFps, StateFingerprints
from nondet.frameworks.torch.tensors import faking
from nondet.frameworks.torch.updates import FreshGrads
from nondet.records import Kind, Phase

_autograd_node = torch._C._current_autograd_node

_dispatch_depth = torch._C._len_torch_dispatch_stack
_pre_dispatch_depth: Callable[[], int] = torch._ops._len_torch_dispatch_stack_pre_dispatch


def _hooked_step_code() -> CodeType | None:
    """The code of torch's wrapper around every hooked ``Optimizer.step``
    (``Optimizer.profile_hook_step``): the frame the global step hooks are called from."""
    try:
        return torch.optim.Optimizer.profile_hook_step(lambda: None).__code__
    except Exception:  # another torch: no nesting known, every step's hooks count
        return None


_HOOKED_STEP = _hooked_step_code()


def _inside_another_step() -> bool:
    """Does this step hook's optimizer step run inside another optimizer's step (on this
    thread)? A wrapper's ``step`` calling its inner optimizer's: ZeRO's local optimizer
    over this rank's shard, whose update ZeRO then broadcasts; a Lookahead-style wrapper's
    base optimizer, whose update it then averages. Read from the stack, not counted by the
    hooks: a step that raised never calls its post-hooks (a count would stay off)."""
    if _HOOKED_STEP is None:
        return False
    frame = sys._getframe(1)
    steps = 0
    while frame is not None:
        if frame.f_code is _HOOKED_STEP:
            steps += 1
            if steps > 1:
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class TorchBackend(StepLifecycle):
    name = "torch"

    def __init__(self, session: Session) -> None:
        self.hasher = TorchHasher()
        self.mode: CaptureMode | None = None
        self.paused = False  # while nondet itself runs torch ops
        self.optimizer_made = False  # boundaries then come from optimizer steps
        self.update_pending = False  # hand-written update: step ends at the next forward
        # an optimizer step left gradients for others: the step goes on (updates.py)
        self.optimizer_pending = False
        self.fresh = FreshGrads()
        self.backward_calls = 0  # the script's backward calls now running (nested too)
        # an optimizer stepped inside the running backward: the step ends when it returns
        # (Note [Optimizer steps inside a backward])
        self.stepped_in_backward = False
        self.verified_step: int | None = None  # last step whose parameters were re-checked
        self.module_stack: list[int] = []  # string ids of module paths
        # The module stack's depth where forward code began inside a backward (a reentrant
        # checkpoint's recomputation, a module called by an autograd Function's backward),
        # None outside: its ops are attributed like forward ops (ops.py).
        self.forward_in_backward_at: int | None = None
        self.backward_call_source = -1  # then: the script's innermost line (the backward call)
        self.module_ids: dict[int, int] = {}  # id(module) -> string id of its path
        self.roots: list[torch.nn.Module] = []
        self.param_names: dict[int, str] = {}  # id(tensor) -> "encoder.weight"
        # parameters an optimizer got before their model was called: "model.0.weight"
        self.owner_names: dict[int, str] = {}
        self.owner_held: dict[int, weakref.ref[torch.Tensor]] = {}  # owners.owner_names
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        # made on another thread while the step owner ran: out of the step state until the
        # owner changes (Note [State made on another thread] in frameworks/step_thread.py)
        self.held_roots: list[torch.nn.Module] = []
        # SWA/EMA copies the script made (torch.optim.swa_utils.AveragedModel): end state
        self.averaged: list[weakref.ref[torch.nn.Module]] = []
        self.held_optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.owner_changes = 0
        # roots whose call Dynamo traced: id -> module (Note [A root module called in
        # compiled code] in nocompile.py)
        self.traced_roots = nocompile.TracedRoots()
        super().__init__(session)
        self.recorder = OpRecorder(self)
        self.state_fps = StateFingerprints(self.recorder, self.hasher)
        self.recorder.collectives = comm.Collectives(
            self.recorder.fingerprint, self.paused_capture, lambda: comm.is_ddp(self.roots))
        self.outputs = KeptOutputs(session, self.paused_capture)
        self.entries = DataEntries(self)
        torch.manual_seed(session.config.seed)
        self._install_hooks()
        # after nondet's own seeding above; the recording wrappers go outermost (they name
        # the frame that called them)
        draws.install(session, session.config.seed, self.paused_capture)
        torch_seeding.install(session)
        session.send_meta({"env": torch_environment(initialized=False)})
        self._sync_capture()

    def _reset_step(self) -> None:
        super()._reset_step()
        self.grads: GroupFps | None = None
        self.loss_scalar: torch.Tensor | None = None  # read once, at the step end

    # -- hooks -------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        from torch.optim import optimizer as optim_module

        # Note [nondet's frames and Dynamo] in nocompile.py
        for hook in (self._module_pre, self._module_post, self._before_backward,
                     self._after_backward,
                     StepLifecycle.guarded.__wrapped__):  # type: ignore[attr-defined]
            nocompile.internal(hook)
        for hook in (self._optimizer_pre, self._optimizer_post, self._root_call,
                     self._root_done):
            nocompile.opaque(hook)
        self._register_module_hooks()
        exporting.install(self.module_hooks_set_aside)
        optim_module.register_optimizer_step_pre_hook(self._optimizer_pre)
        optim_module.register_optimizer_step_post_hook(self._optimizer_post)
        self.entries.install()
        compiled.install(self)
        children.install(self)
        kernels.install(self)
        comm.install(self._work_waited)
        cuda.install_replay_hook(self.recorder.graph_outputs,
                                 lambda: not self.disabled and self.recorder.window, self.guarded)

        original_opt_init = torch.optim.Optimizer.__init__

        @functools.wraps(original_opt_init)
        def optimizer_init(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original_opt_init(opt, *args, **kwargs)
            if not self.disabled and not faking():
                with self.guarded():
                    held = STEP_THREAD.foreign()
                    (self.held_optimizers if held else self.optimizers).append(weakref.ref(opt))
                    self.owner_names.update(owners.owner_names(
                        (p for group in opt.param_groups for p in group["params"]),
                        self.param_names, sys._getframe(1), self.owner_held))
                    order = {pid: i for i, pid in enumerate(
                        dict.fromkeys([*self.param_names, *self.owner_names]))}
                    if owners.given_a_set(args, kwargs) or owners.set_ordered(
                            (group["params"] for group in opt.param_groups), order):
                        where = self.session.sources.here(2)
                        # its order (memory addresses) is the order foreach ops and
                        # clip_grad_norm_ sum the parameters in
                        self.session.send_facts({
                            channel.OPTIMIZER_PARAMS_SET: True,
                            f"{channel.OPTIMIZER_PARAMS_SET}.line":
                                self.session.string(where) if where >= 0 else ""})
                    self.optimizer_made = True
                    if not self.started:
                        self.start_training()

        torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign,assignment]
        self._install_averaged_hook()

        original_backward = torch.autograd.backward

        @functools.wraps(original_backward)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self.disabled or self.paused or cuda.capturing() or faking():
                return original_backward(tensors, *args, **kwargs)
            with self.guarded():
                self._before_backward(tensors)
            self.backward_calls += 1
            try:
                return original_backward(tensors, *args, **kwargs)
            finally:
                self.backward_calls -= 1
                with self.guarded():
                    self._after_backward()

        nocompile.passing(backward)
        torch.autograd.backward = backward

        original_grad = torch.autograd.grad

        @functools.wraps(original_grad)
        def grad(*args: Any, **kwargs: Any) -> Any:
            if self.disabled or self.paused:
                return original_grad(*args, **kwargs)
            with self.guarded():
                self._before_grad(args[0] if args else kwargs.get("outputs"))
            previous, self.phase = self.phase, Phase.BACKWARD
            try:
                return original_grad(*args, **kwargs)
            finally:
                self.phase = previous

        nocompile.passing(grad)
        torch.autograd.grad = grad

    def _register_module_hooks(self) -> None:
        from torch.nn.modules import module as nn_module

        self._module_hooks = (
            nn_module.register_module_forward_pre_hook(self._module_pre),
            nn_module.register_module_forward_hook(self._module_post, always_call=True))

    @contextmanager
    def module_hooks_set_aside(self) -> Iterator[None]:
        """nondet's global module hooks removed, then registered again, and nothing
        recorded meanwhile: a strict ``torch.export`` refuses any global module hook, and
        the ops it traces with are not the script's computation (exporting.py)."""
        was_paused, was_active = self.paused, self.recorder.active
        self.paused, self.recorder.active = True, False
        for handle in self._module_hooks:
            handle.remove()
        try:
            yield
        finally:
            self._register_module_hooks()
            self.paused, self.recorder.active = was_paused, was_active and not self.disabled

    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.disabled or self.paused:
            return
        with self.guarded():
            if torch.compiler.is_compiling():
                # Dynamo is tracing this hook into the user's graph: only what it can
                # replay at run time, and nothing that breaks the graph (Note [A root module
                # called in compiled code] in nocompile.py). A module inside the root
                # changes nothing: in the body of a higher-order op (torch.cond's branches,
                # checkpoint under fullgraph) Dynamo refuses every side effect.
                if not self.module_stack and not _in_hop_compile():
                    setattr(self.traced_roots, f"m{id(module)}", module)
                    self.module_stack.append(-1)  # replayed, with its pop, after the graph
                return
            if faking():
                return  # a dry run under the script's fake tensors (Note [The script's ...])
            if not self.module_stack and not cuda.capturing():
                self._root_call(module)
            mid = self.module_ids.get(id(module))
            if mid is None:
                mid = self.module_ids[id(module)] = self.session.intern(type(module).__name__)
            if self.forward_in_backward_at is None and _autograd_node() is not None:
                self.forward_in_backward_at = len(self.module_stack)
                self.backward_call_source = self.session.sources.here(2)
            self.module_stack.append(mid)

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() and not self._traced_root(module):
            return  # its pre-hook pushed nothing (above)
        if self.module_stack and not self.disabled and not self.paused and not faking():
            self.module_stack.pop()
            if self.forward_in_backward_at == len(self.module_stack):
                self.forward_in_backward_at = None
            if not self.module_stack and not torch.compiler.is_compiling():
                self._root_done()

    def _traced_root(self, module: torch.nn.Module) -> bool:
        """While Dynamo traces: ``module`` is the root whose pre-hook pushed the
        placeholder (read only: Note [A root module called in compiled code])."""
        return self.module_stack == [-1] and not _in_hop_compile() and \
            getattr(self.traced_roots, f"m{id(module)}", None) is module

    def _adopt_traced_roots(self) -> None:
        """Roots called inside compiled code, registered from an eager hook (Note [A root
        module called in compiled code] in nocompile.py)."""
        seen = vars(self.traced_roots)
        for module in list(seen.values()):
            if id(module) not in self.module_ids:
                self._register_root(module)
        seen.clear()

    def _root_done(self) -> None:
        loop_end.resume()

    def _root_call(self, module: torch.nn.Module) -> None:
        loop_end.pause()  # the model's own Python is not the step loop's (loop_end.py)
        if self.update_pending:
            self.boundary()
        if id(module) not in self.module_ids:
            self._register_root(module)
        if not self.started and not self.optimizer_made:
            self.start_training()
        if self.phase == Phase.OPTIMIZER:
            # a model called after a backward within one step is a forward again: the next
            # micro-batch of gradient accumulation, or an LBFGS closure inside step()
            self.phase = Phase.FORWARD
        if self.recorder.window and self.verified_step != self.session.step:
            # Once per captured step: parameters and buffers become entry points again, so
            # a value changed outside the recorded ops is caught where it is first used.
            self.verified_step = self.session.step
            for root in self.roots:
                for t in (*root.parameters(), *root.buffers()):
                    if holds_values(t):  # a lazy module's parameter: nothing to forget yet
                        self.recorder.forget(t)

    def _install_averaged_hook(self) -> None:
        """An SWA/EMA copy (``torch.optim.swa_utils.AveragedModel``) is training state the
        script keeps and saves, updated by ``update_parameters`` and seldom called: its
        parameters and buffers join the end state (a trial's EMA, updated in a thread racing
        ``opt.step``, differed unseen). Not the step rows: a step end may come while such a
        thread is still writing, and what it read then would depend on timing."""
        averaged = getattr(getattr(torch.optim, "swa_utils", None), "AveragedModel", None)
        if averaged is None:
            return
        original_init = averaged.__init__

        @functools.wraps(original_init)
        def averaged_init(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            original_init(model, *args, **kwargs)
            if not self.disabled:
                with self.guarded():
                    self.averaged.append(weakref.ref(model))

        averaged.__init__ = averaged_init

    def _end_roots(self) -> list[torch.nn.Module]:
        """The modules whose state the end state covers: the roots and the averaged copies."""
        kept = [m for m in (ref() for ref in self.averaged) if m is not None]
        known = {id(m) for m in self.roots + self.held_roots}
        return self.roots + self.held_roots + [m for m in kept if id(m) not in known]

    def _register_root(self, root: torch.nn.Module) -> None:
        # The first root's paths are relative ("encoder.mixer"); later roots (a loss module,
        # a second network) are prefixed with their class name so names stay unique.
        prefix = "" if not self.roots and not self.held_roots else type(root).__name__
        (self.held_roots if STEP_THREAD.foreign() else self.roots).append(root)
        for path, obj in module_paths(root, prefix):
            if isinstance(obj, torch.nn.Module):
                self.module_ids.setdefault(id(obj), self.session.intern(path))
            else:
                self.param_names.setdefault(id(obj), path)

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        loop_end.pause()
        if self.disabled or self.paused or cuda.capturing() or faking():  # Note [CUDA graphs]
            return
        if self._in_backward():
            self.stepped_in_backward = True
            return
        self.phase = Phase.OPTIMIZER
        # the step's gradients are those the outermost optimizer got, not what a wrapper
        # made of them for its inner one (LARS rescales them), or the first of a group
        # (pyro's ClippedAdam clips each gradient in place as it steps its parameter)
        if not self.explicit and not _inside_another_step() and not self.optimizer_pending:
            with self.guarded():
                if vars(self.traced_roots):
                    self._adopt_traced_roots()
                self.grads = self._grad_snapshot()

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.disabled or self.paused or self.explicit or cuda.capturing() or faking():
            return
        if _inside_another_step() or self._in_backward():
            return  # the step ends when the outermost optimizer's step (or backward) returns
        with self.guarded():
            live = [opt for opt in (ref() for ref in self.optimizers) if opt is not None]
            if self.fresh.others_left(optimizer, live, len(self.optimizers)):
                # Note [Optimizer groups] in updates.py: the update goes on
                self.update_pending = self.optimizer_pending = True
                return
            self.boundary()

    def _in_backward(self) -> bool:
        """Note [Optimizer steps inside a backward]
        PyTorch's recipe for saving memory steps one optimizer per parameter from a hook
        the backward runs as each gradient is ready (``register_post_accumulate_grad_hook``,
        torch.distributed's ``_apply_optimizer_in_backward``). Every such step ended a
        training step: "40 steps" for 10 iterations of a 4-parameter model, each one
        hashing the whole state, and step numbers the user could not map to iterations.
        An optimizer step run by the autograd engine inside the script's backward call ends
        nothing: the step ends when that backward returns (``_after_backward``)."""
        return self.backward_calls > 0 and _autograd_node() is not None

    def _before_backward(self, tensors: Any) -> None:
        loop_end.pause()
        if _autograd_node() is None:  # a backward of the script's own, not a nested one:
            self.forward_in_backward_at = None  # no recomputation can still be running
            self.fresh.backward_began(self._update_params(), len(self.optimizers))
        if vars(self.traced_roots):
            self._adopt_traced_roots()
        if self.update_pending:
            self.boundary()
        if not self.started:
            self.start_training()
        if self.recorder.stamp is not None:
            self.recorder.apply_stamp()
        self._record_loss(tensors)
        self.phase = Phase.BACKWARD

    def _before_grad(self, outputs: Any) -> None:
        """Note [Losses of torch.autograd.grad]
        A functional training loop (``torch.func.functional_call`` with torchopt's update,
        or a hand-written one, of parameters kept in a dict and replaced at every step)
        calls ``torch.autograd.grad``, never ``backward``, and keeps its parameters where no
        module or optimizer shows them. Its steps (marked with ``nondet.step()``) held no
        state at all, so noise that changed every step's batch was "a difference that never
        reached training" and the verdict "deterministic" (trial round 20, torchopt). The
        outputs it differentiates are recorded as a backward's loss is, once training has
        begun: a gradient taken before (a gradient check) starts nothing, and one taken
        inside a backward (double backward, a hook) is part of that backward. Nor inside a
        torch.func transform: ``torch.func.grad`` calls it itself, on wrapped tensors whose
        values cannot be read there (under ``vmap``)."""
        if (not self.started or torch.compiler.is_compiling() or cuda.capturing() or faking()
                or _autograd_node() is not None
                or torch._C._functorch.maybe_current_level() is not None):
            return
        self._record_loss(outputs)

    def _record_loss(self, tensors: Any) -> None:
        """The step's loss: the first tensor a backward (or autograd.grad) starts from."""
        loss = next(tensors_in(tensors), None)
        if loss is not None and not STEP_THREAD.foreign():  # not the owner's loss
            with self.paused_capture():
                fp = self.recorder.known(loss)
                if fp is None:
                    fp = self.recorder.fingerprint(loss)
                self.losses.append(fp)
                if loss.numel() == 1 and (loss.is_floating_point() or loss.is_complex()):
                    # kept on its device: read at the step end, not synced per backward
                    self.loss_scalar = loss.detach().real.reshape(()).to(torch.float64)

    def _after_backward(self) -> None:
        loop_end.resume()
        self.recorder.merge_threads()  # Note [Autograd worker threads] in threads.py
        if self.recorder.window:
            self.recorder.collectives.backward_done()  # DDP waited for its buckets
        self.phase = Phase.OPTIMIZER
        if not self.optimizer_made and not self.explicit:
            self.grads = self._grad_snapshot()
            self.update_pending = True
        if self.stepped_in_backward and not self.backward_calls and not self.explicit:
            self.stepped_in_backward = False
            self.boundary()

    def before_batch(self) -> None:
        """A DataLoader batch is about to be drawn (entries.py)."""
        if self.update_pending:
            self.boundary()
        if not self.started and not self.optimizer_made:
            self.start_training()

    # -- context for op records ------------------------------------------------------------------
    def current_module(self) -> int:
        return self.module_stack[-1] if self.module_stack else -1

    def node_origin(self, node: Any) -> tuple[int, int]:
        """(module, source) of the forward op that created an autograd node."""
        origin: tuple[int, int] | None = node.metadata.get("nondet")
        if origin is not None:
            return origin
        variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter
        if variable is not None:
            name = self.param_names.get(id(variable))
            if name is not None:
                return self.session.intern(name.rpartition(".")[0]), -1
        return -1, -1

    def tensor_name(self, t: torch.Tensor) -> str | None:
        name = self.param_names.get(id(t))
        return f"parameter {name}" if name else None

    # -- op capture on/off ---------------------------------------------------------------------
    def in_op_window(self) -> bool:
        return self.recorder.window

    def _sync_capture(self) -> None:
        want = not self.disabled and self.session.captures_ops()
        # A step that ends inside a torch.compile'd function (a compiled training step, a
        # compiled opt.step()) must not push or pop the mode there: torch puts the dispatch
        # keys back as they were when that function returns (nocompile.inside_compiled_call).
        # Then the mode waits for a step end outside; until it comes, compiled regions are
        # still recorded, eager ops in the function's graph breaks are not, and a mode left
        # on the stack stays inactive.
        if want:
            if self.mode is None and not nocompile.inside_compiled_call():
                self.mode = CaptureMode(self.recorder)
                self.mode.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
            if not self.recorder.window:
                self.recorder.open_window()
            return
        self.recorder.close_window()
        if (self.mode is not None and _get_current_dispatch_mode() is self.mode
                and not nocompile.inside_compiled_call()
                and not torch.is_inference_mode_enabled()):
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.mode = None
        # Otherwise another mode was pushed above ours: leave ours in place, inactive. Inside
        # the script's inference_mode too (an opt.step() there): leaving it puts back the
        # dispatch keys it entered with, the Python key among them, and with no mode left
        # the next op failed ("Hit Python dispatch key but no arguments had PyInterpreter").

    @contextmanager
    def paused_capture(self) -> Iterator[None]:
        """Run nondet's own torch work without recording it or touching autograd."""
        was_paused, was_active = self.paused, self.recorder.active
        self.paused, self.recorder.active = True, False
        try:
            # Inside torch.func transforms every op would wrap its output for the
            # transform's level, nondet's own included (a ``detach`` of a parameter's
            # values): they run below it (Note [torch.func wrappers] in leaves.py)
            with torch._C._DisableFuncTorch():
                depth = _dispatch_depth()
                if _pre_dispatch_depth() or depth > 1:
                    with _disable_current_modes(), torch.no_grad():
                        yield
                elif depth:  # one mode (ours, in steps with op capture): what it would do
                    with _pop_mode_temporarily(), torch.no_grad():
                        yield
                else:  # no mode to take off (steps without op capture)
                    with torch.no_grad():
                        yield
        finally:
            self.paused, self.recorder.active = was_paused, was_active and not self.disabled

    # -- step-level state ------------------------------------------------------------------------
    def _named_state(self) -> tuple[Tensors, Tensors, Tensors]:
        """The step state's named tensors (Note [State made on another thread])."""
        self._join_held()
        return named_state(self.roots, self.optimizers, self.param_names, self.owner_names,
                           self.owner_held)

    def _join_held(self) -> None:
        """Held state joins once the step count has changed owner since it was held, or is
        about to at this step's end (the gradients are read before it)."""
        handing_over = STEP_THREAD.handing_over()
        if handing_over or STEP_THREAD.changes != self.owner_changes:
            # the change about to be counted is this one, not a later owner's
            self.owner_changes = STEP_THREAD.changes + handing_over
            self.roots += self.held_roots
            self.optimizers += self.held_optimizers
            self.held_roots, self.held_optimizers = [], []

    def _grad_snapshot(self) -> GroupFps:
        self._join_held()
        params = named_params(self.roots, self.optimizers, self.param_names, self.owner_names,
                              self.owner_held)
        with self.paused_capture():
            return self.state_fps.named([(n, p.grad) for n, p in params if p.grad is not None],
                                        detailed=self.session.captures_ops())

    def _step_state(self, step: int, detailed: bool) -> StepState:
        params, buffers, optim = self._named_state()
        grads = self.grads if self.grads is not None else self._grad_snapshot()
        with self.paused_capture():
            state, loss = self.state_fps.step_state(params, buffers, optim, grads,
                                                    self.loss_scalar, detailed)
        if loss is not None:
            self.loss_value = loss
        return state

    def _work_waited(self, work: Any) -> None:
        """A ``Work.wait()`` returned (comm.py): read that collective's outputs now."""
        if not self.disabled and not self.paused and self.recorder.window \
                and self.recorder.threads.on_owner():
            with self.guarded():
                self.recorder.collectives.waited(work)

    def _take_records(self, step: int) -> np.ndarray:
        with self.paused_capture():
            self.recorder.resolve()
            self.recorder.merge_threads()
            self.session.send_comm(self.recorder.collectives.take_rows(
                step, self.recorder.records, self.session.intern))
            ops = self.recorder.take_rows(step)
            self.recorder.prune()
        return ops

    def _final_params_fp(self) -> int | None:
        params, _, _ = named_state(self._end_roots(),
                                   self.optimizers + self.held_optimizers, self.param_names,
                                   self.owner_names, self.owner_held)
        with self.paused_capture():
            # Read afresh, never from the fingerprint cache: another process (Hogwild workers
            # on shared memory) or thread may have changed them without bumping the version
            # counter this process sees.
            fps = [self.recorder.fingerprint(p) for _, p in params]
            self.recorder.resolve()
        return group_fp([f.value or 0 for f in fps])

    def _final_buffers_fp(self) -> int | None:
        """The roots' buffers a ``state_dict`` saves (non-persistent ones are scratch):
        ``update_bn`` or a calibration pass after the last step changes only these."""
        unique = {id(b): b for root in self._end_roots() for b in persistent_buffers(root)}
        buffers = [b for b in unique.values() if holds_values(b)]
        if not buffers:
            return None
        with self.paused_capture():
            fps = [self.recorder.fingerprint(b) for b in buffers]  # afresh, as parameters
            self.recorder.resolve()
        return group_fp([f.value or 0 for f in fps])

    # -- boundaries ------------------------------------------------------------------------------
    def boundary(self) -> None:
        self.update_pending = self.optimizer_pending = False
        super().boundary()

    def _update_params(self) -> list[torch.Tensor]:
        """The parameters an update may step: the roots' and the optimizers'."""
        params = {id(p): p for root in self.roots for p in root.parameters()}
        for opt in (ref() for ref in self.optimizers):
            if opt is not None:
                params.update((id(p), p) for group in opt.param_groups for p in group["params"])
        return list(params.values())

    def _end_pending_step(self) -> None:
        if self.update_pending:  # a hand-written update that no later forward closed
            self.boundary()

    def _probe_fp(self, value: Any) -> Fp | None:
        if not isinstance(value, torch.Tensor):
            return None
        with self.paused_capture():
            return self.recorder.fingerprint(value)

    def _record_probe(self, name: str, fp: Fp, value: Any) -> None:
        self.recorder.add(Kind.PROBE, int(self.phase), 0, self.session.intern(f"probe:{name}"),
                          self.current_module(), self.session.sources.here(2), [fp], [], [],
                          (), value.numel(), [value])

    def environment(self) -> dict[str, str]:
        return torch_environment(initialized=self.started)

    def facts(self) -> dict[str, Any]:
        return torch_facts()

    # -- kept outputs and dumps (kept.py) -------------------------------------------------------
    def keep(self, step: int, index: int, tensors: list[torch.Tensor]) -> None:
        self.outputs.keep(step, index, tensors)

    def kept(self, step: int, index: int) -> list[np.ndarray]:
        return self.outputs.kept(step, index)

    def dump_and_exit(self, tensors: list[torch.Tensor]) -> None:
        self.outputs.dump_and_exit(tensors)

    def disable(self) -> None:
        super().disable()
        self.recorder.window = self.recorder.active = False


def _in_hop_compile() -> bool:
    """Dynamo traces a higher-order op's body on its own (``torch.cond`` called eagerly):
    the roots it calls are registered by the eager hooks around it, not from inside."""
    try:
        from torch._higher_order_ops.utils import _in_hop_compile as in_hop
    except ImportError:  # another torch: as before
        return False
    return bool(in_hop())
