"""The PyTorch backend: step boundaries, step-level fingerprints, entry points, op capture.

Installed right after the user's script imports torch. It seeds torch, then hooks:

- optimizer steps (global pre/post hooks): the step boundary, gradients before the update,
  parameters and optimizer state after it;
- ``torch.autograd.backward``: the loss, and for scripts that update parameters by hand, the
  boundary ("each backward-and-update is a step": it ends when the next forward, batch or
  backward begins);
- module calls (global forward hooks): module paths, and parameter names from root modules;
- DataLoader iteration and ``torch.from_numpy``/``as_tensor``/``tensor``/``frombuffer``: data
  entering from outside, with the loader's settings as facts for the recipe;
- ``CaptureMode`` (torch/ops.py) during steps that get op-level capture.

Step numbering: "init" (step -1) lasts until training starts, i.e. an optimizer is created
(or, without one, the first DataLoader batch or root-module call); steps count from 0.
"""

from __future__ import annotations

import functools
import math
import os
import random
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from nondet.capture import Session, StopRun
from nondet.fingerprint import bytes_fp, combine, scalar_value
from nondet.frameworks.torch import compiled
from nondet.frameworks.torch.hashing import TorchHasher, local_tensor
from nondet.frameworks.torch.ops import CaptureMode, Fp, OpRecorder, tensors_in
from nondet.records import TENSOR_DTYPE, Group, Kind, Phase


class TorchBackend:
    name = "torch"

    def __init__(self, session: Session) -> None:
        self.session = session
        self.hasher = TorchHasher()
        self.recorder = OpRecorder(self)
        self.mode: CaptureMode | None = None
        self.disabled = False  # in forked children
        self.paused = False  # while nondet itself runs torch ops
        self.phase = Phase.INIT
        self.started = False
        self.optimizer_made = False  # boundaries then come from optimizer steps
        self.explicit = False  # nondet.step() is in charge of boundaries
        self.update_pending = False  # hand-written update: step ends at the next forward
        self.verified_step: int | None = None  # last step whose parameters were re-checked
        self._kept: dict[tuple[int, int], list[np.ndarray]] = {}  # see keep()
        self.kept_bytes = 0
        self.module_stack: list[int] = []  # string ids of module paths
        self.module_ids: dict[int, int] = {}  # id(module) -> string id of its path
        self.roots: list[torch.nn.Module] = []
        self.param_names: dict[int, str] = {}  # id(tensor) -> "encoder.weight"
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.loaders: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.loader_of_iter: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._reset_step()
        torch.manual_seed(session.config.seed)
        self._install_hooks()
        session.send_meta({"env": torch_environment(initialized=False)})
        self._sync_mode()

    # -- state of the current step -----------------------------------------------------------
    def _reset_step(self) -> None:
        # What entered from outside in this step: (label, fingerprints, elements).
        self.data: list[tuple[str, list[Fp], int]] = []
        self.losses: list[Fp] = []
        self.loss_value = math.nan
        self.grads: list[tuple[str, Fp, torch.Tensor | None]] | None = None
        self.probes: list[tuple[str, Fp]] = []

    # -- hooks ---------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module
        from torch.utils.data import dataloader

        nn_module.register_module_forward_pre_hook(self._module_pre)
        nn_module.register_module_forward_hook(self._module_post, always_call=True)
        optim_module.register_optimizer_step_pre_hook(self._optimizer_pre)
        optim_module.register_optimizer_step_post_hook(self._optimizer_post)

        original_opt_init = torch.optim.Optimizer.__init__

        @functools.wraps(original_opt_init)
        def optimizer_init(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original_opt_init(opt, *args, **kwargs)
            if not self.disabled:
                self.optimizers.append(weakref.ref(opt))
                self.optimizer_made = True
                if not self.started:
                    self.start_training()

        torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign,assignment]

        original_backward = torch.autograd.backward

        @functools.wraps(original_backward)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self.disabled or self.paused:
                return original_backward(tensors, *args, **kwargs)
            self._before_backward(tensors)
            try:
                return original_backward(tensors, *args, **kwargs)
            finally:
                self._after_backward()

        torch.autograd.backward = backward

        original_grad = torch.autograd.grad

        @functools.wraps(original_grad)
        def grad(*args: Any, **kwargs: Any) -> Any:
            if self.disabled or self.paused:
                return original_grad(*args, **kwargs)
            previous, self.phase = self.phase, Phase.BACKWARD
            try:
                return original_grad(*args, **kwargs)
            finally:
                self.phase = previous

        torch.autograd.grad = grad

        original_iter = dataloader.DataLoader.__iter__

        @functools.wraps(original_iter)
        def loader_iter(loader: Any) -> Any:
            iterator = original_iter(loader)
            if not self.disabled:
                try:
                    self.loader_of_iter[iterator] = self._loader_index(loader)
                except TypeError:  # not weak-referenceable (custom iterator)
                    pass
            return iterator

        dataloader.DataLoader.__iter__ = loader_iter  # type: ignore[method-assign]

        original_next = dataloader._BaseDataLoaderIter.__next__

        @functools.wraps(original_next)
        def loader_next(iterator: Any) -> Any:
            if self.disabled or self.paused:
                return original_next(iterator)
            self._before_batch()
            previous, self.phase = self.phase, Phase.DATA
            # With worker processes the main process only rebuilds tensors from shared
            # memory: not computation worth recording; the batch itself is the entry.
            recording = self.recorder.active
            if getattr(iterator, "_num_workers", 0) > 0:
                self.recorder.active = False
            try:
                batch = original_next(iterator)
            finally:
                self.phase = previous
                self.recorder.active = recording
            self._record_batch(iterator, batch)
            return batch

        dataloader._BaseDataLoaderIter.__next__ = loader_next  # type: ignore[method-assign,assignment]

        for name, kind in (("from_numpy", "numpy"), ("as_tensor", None), ("tensor", None),
                           ("frombuffer", "numpy")):
            setattr(torch, name, self._creation_wrapper(getattr(torch, name), name, kind))
        compiled.install(self)

    def _creation_wrapper(self, original: Any, name: str, kind: str | None) -> Any:
        """Wrap a function that makes tensors from Python or NumPy data (an entry point)."""

        @functools.wraps(original)
        def make(data: Any, *args: Any, **kwargs: Any) -> Any:
            if self.disabled or self.paused or isinstance(data, torch.Tensor):
                return original(data, *args, **kwargs)
            entry_kind = kind or ("numpy" if isinstance(data, (np.ndarray, np.generic))
                                  else "python_value")
            recorder = self.recorder
            outer, recorder.creating = recorder.creating, (entry_kind, f"torch.{name}")
            try:
                result = original(data, *args, **kwargs)
            finally:
                recorder.creating = outer
            if isinstance(result, torch.Tensor) and outer is None:
                self._note_entry(result, entry_kind, f"torch.{name}")
            return result

        return make

    def _note_entry(self, t: torch.Tensor, kind: str, what: str) -> None:
        """A tensor made from outside data: an entry point, and data of this step if made by
        the training loop itself (inside a module, a backward or a custom op's own code it
        is part of the computation, not data)."""
        recorder = self.recorder
        if recorder.depth > 0:
            return
        source = self.session.sources.here(2)
        with self._paused():
            fp = recorder.known(t)
            if fp is None:
                fp = recorder.remember(t, recorder.fingerprint(t))
                if recorder.window:
                    recorder.add(Kind.ENTRY, int(self.phase), 0,
                                 self.session.intern(f"{kind}:{what}"), self.current_module(),
                                 source, [fp], [], [], (), t.numel(), [t])
        if not self.module_stack and self.phase in (Phase.INIT, Phase.DATA, Phase.FORWARD):
            self.data.append((self._data_label(f"{kind}:{what}", source), [fp], t.numel()))

    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.disabled or self.paused:
            return
        if not self.module_stack:
            self._root_call(module)
        mid = self.module_ids.get(id(module))
        if mid is None:
            mid = self.module_ids[id(module)] = self.session.intern(type(module).__name__)
        self.module_stack.append(mid)

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.module_stack and not self.disabled and not self.paused:
            self.module_stack.pop()

    def _root_call(self, module: torch.nn.Module) -> None:
        if self.update_pending:
            self.boundary()
        if id(module) not in self.module_ids:
            self._register_root(module)
        if not self.started and not self.optimizer_made:
            self.start_training()
        if self.recorder.window and self.verified_step != self.session.step:
            # Once per captured step: parameters and buffers become entry points again, so
            # a value changed outside the recorded ops is caught where it is first used.
            self.verified_step = self.session.step
            for root in self.roots:
                for t in (*root.parameters(), *root.buffers()):
                    self.recorder.forget(t)

    def _register_root(self, root: torch.nn.Module) -> None:
        # The first root's paths are relative ("encoder.mixer"); later roots (a loss module,
        # a second network) are prefixed with their class name so names stay unique.
        prefix = "" if not self.roots else type(root).__name__
        self.roots.append(root)
        for name, sub in root.named_modules():
            path = ".".join(p for p in (prefix, name) if p)
            self.module_ids.setdefault(id(sub), self.session.intern(path))
        for name, p in root.named_parameters():
            self.param_names.setdefault(id(p), ".".join(x for x in (prefix, name) if x))
        for name, b in root.named_buffers():
            self.param_names.setdefault(id(b), ".".join(x for x in (prefix, name) if x))

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.disabled or self.paused:
            return
        self.phase = Phase.OPTIMIZER
        if not self.explicit:
            self.grads = self._grad_snapshot()

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.disabled or self.paused or self.explicit:
            return
        self.boundary()

    def _before_backward(self, tensors: Any) -> None:
        if self.update_pending:
            self.boundary()
        if not self.started:
            self.start_training()
        if self.recorder.stamp is not None:
            self.recorder.apply_stamp()
        loss = next(tensors_in(tensors), None)
        if loss is not None:
            with self._paused():
                fp = self.recorder.known(loss)
                if fp is None:
                    fp = self.recorder.fingerprint(loss)
                self.losses.append(fp)
                if loss.numel() == 1 and (loss.is_floating_point() or loss.is_complex()):
                    self.loss_value = float(loss.detach().real.item())
        self.phase = Phase.BACKWARD

    def _after_backward(self) -> None:
        self.phase = Phase.OPTIMIZER
        if not self.optimizer_made and not self.explicit:
            self.grads = self._grad_snapshot()
            self.update_pending = True

    def _before_batch(self) -> None:
        if self.update_pending:
            self.boundary()
        if not self.started and not self.optimizer_made:
            self.start_training()

    def _loader_index(self, loader: Any) -> int:
        index = self.loaders.get(loader)
        if index is None:
            index = self.loaders[loader] = len(self.loaders)
            self.session.send_facts({f"dataloader#{index}": {
                "loader.num_workers": int(getattr(loader, "num_workers", 0)),
                "loader.in_order": bool(getattr(loader, "in_order", True)),
                "loader.has_generator": getattr(loader, "generator", None) is not None,
                "loader.has_worker_init_fn": getattr(loader, "worker_init_fn", None) is not None,
                "loader.persistent_workers": bool(getattr(loader, "persistent_workers", False)),
                "loader.sampler": type(getattr(loader, "sampler", None)).__name__,
            }})
        return index

    def _record_batch(self, iterator: Any, batch: Any) -> None:
        index = self.loader_of_iter.get(iterator, 0)
        tensors = list(_leaf_tensors(batch))
        recorder = self.recorder
        name = f"dataloader:batch from DataLoader#{index}"
        source = self.session.sources.here(2)
        numel = tensors[0].numel() if tensors else 0
        with self._paused():
            fps = []
            for t in tensors:
                fp = recorder.known(t) or recorder.remember(t, recorder.fingerprint(t))
                fps.append(fp)
            if recorder.window:
                recorder.add(Kind.ENTRY, int(Phase.DATA), 0, self.session.intern(name), -1,
                             source, fps, [], [], (), numel, tensors)
        self.data.append((self._data_label(name, source), fps, numel))

    def _data_label(self, name: str, source: int) -> str:
        """How a data entry is named in the step-level rows: "kind:what @ file:line"."""
        where = self.session.string(source)
        return f"{name} @ {where}" if where else name

    # -- context for op records ------------------------------------------------------------------
    def current_module(self) -> int:
        return self.module_stack[-1] if self.module_stack else -1

    def node_origin(self, node: Any) -> tuple[int, int]:
        """(module, source) of the forward op that created an autograd node."""
        origin = node.metadata.get("nondet")
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
    def _sync_mode(self) -> None:
        want = not self.disabled and self.session.captures_ops()
        if want:
            if self.mode is None:
                self.mode = CaptureMode(self.recorder)
                self.mode.__enter__()
            if not self.recorder.window:
                self.recorder.open_window()
            return
        self.recorder.close_window()
        if self.mode is not None and _get_current_dispatch_mode() is self.mode:
            self.mode.__exit__(None, None, None)
            self.mode = None
        # Otherwise another mode was pushed above ours: leave ours in place, inactive.

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """Run nondet's own torch work without recording it or touching autograd."""
        was_paused, was_active = self.paused, self.recorder.active
        self.paused, self.recorder.active = True, False
        try:
            with _disable_current_modes(), torch.no_grad():
                yield
        finally:
            self.paused, self.recorder.active = was_paused, was_active

    # -- step-level state ------------------------------------------------------------------------
    def _state(self) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]],
                              list[tuple[str, Any]]]:
        """Named parameters, buffers and optimizer state, in a stable order."""
        params: dict[int, tuple[str, torch.Tensor]] = {}
        buffers: dict[int, tuple[str, torch.Tensor]] = {}
        for root in self.roots:
            for p in root.parameters():
                params.setdefault(id(p), (self.param_names.get(id(p), "?"), p))
            for b in root.buffers():
                buffers.setdefault(id(b), (self.param_names.get(id(b), "?"), b))
        optim: list[tuple[str, Any]] = []
        for oi, ref in enumerate(self.optimizers):
            opt = ref()
            if opt is None:
                continue
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    name = self.param_names.get(id(p)) or f"optimizer{oi}.group{gi}.param{pi}"
                    params.setdefault(id(p), (name, p))
                    state = opt.state.get(p, {})
                    for key in sorted(state, key=str):
                        optim.append((f"{name}:{key}", state[key]))
        return list(params.values()), list(buffers.values()), optim

    def _grad_snapshot(self) -> list[tuple[str, Fp, torch.Tensor | None]]:
        params, _, _ = self._state()
        with self._paused():
            return self._fps([(n, p.grad) for n, p in params if p.grad is not None],
                             detailed=self.session.captures_ops())

    def _fps(self, named: list[tuple[str, Any]], detailed: bool
             ) -> list[tuple[str, Fp, torch.Tensor | None]]:
        """Fingerprints of named tensors (and numbers): one per tensor in steps with op
        capture (the report can then name them), else one for the whole group, hashed as a
        single concatenation (a few large ops instead of several small ones per tensor)."""
        numbers: list[tuple[str, Fp, torch.Tensor | None]] = [
            (n, Fp(value=scalar_value(v)), None) for n, v in named
            if not isinstance(v, torch.Tensor)]
        tensors = [(n, v) for n, v in named if isinstance(v, torch.Tensor)]
        out: list[tuple[str, Fp, torch.Tensor | None]]
        if detailed:
            out = [(n, self._fp_of(t), t) for n, t in tensors]
        else:
            out = [("(group)", fp, None) for fp in self.recorder.fingerprint_many(
                [t for _, t in tensors])]
        return out + numbers

    def _fp_of(self, t: torch.Tensor) -> Fp:
        return self.recorder.known(t) or self.recorder.remember(t, self.recorder.fingerprint(t))

    def _rng_fp(self) -> int:
        with self._paused():
            parts = [self._fp_of(torch.get_rng_state())]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                parts.extend(self._fp_of(s) for s in torch.cuda.get_rng_state_all())
            self.recorder.resolve()
        legacy = np.random.get_state()[1]  # type: ignore[index]
        py_state = np.asarray(random.getstate()[1], dtype=np.uint64)
        return combine([*(p.value or 0 for p in parts), bytes_fp(legacy.tobytes()),
                        bytes_fp(py_state.tobytes())])

    def _snapshot_row(self, row: np.ndarray, step: int) -> np.ndarray:
        """Fill a step row (and per-tensor rows if this step has op capture)."""
        detailed = self.session.captures_ops(step)
        params, buffers, optim = self._state()
        grads = self.grads if self.grads is not None else self._grad_snapshot()
        with self._paused():
            groups: list[tuple[Group, list[tuple[str, Fp, torch.Tensor | None]]]] = [
                (Group.PARAM, self._fps(params, detailed)),
                (Group.BUFFER, self._fps(buffers, detailed)),
                (Group.GRAD, grads),
                (Group.OPTIM, self._fps(optim, detailed)),
                (Group.PROBE, [(n, fp, None) for n, fp in self.probes]),
            ]
            sums = [p.detach().sum(dtype=torch.float64) for _, p in params
                    if p.is_floating_point()]
            params_sum = torch.stack(sums).sum() if sums else None
            stats = {}
            if detailed:
                for group, items in groups:
                    for name, _, t in items:
                        if t is not None:
                            stats[(group, name)] = self.hasher.stats(t)
            self.recorder.resolve()
            fps = {group: [fp.value or 0 for _, fp, _ in items] for group, items in groups}
            row["params_sum"] = float(params_sum.item()) if params_sum is not None else math.nan
            tensor_rows = self._tensor_rows(step, groups if detailed else [], stats)
        row["params_fp"] = combine(fps[Group.PARAM]) if fps[Group.PARAM] else 0
        row["buffers_fp"] = combine(fps[Group.BUFFER]) if fps[Group.BUFFER] else 0
        row["grads_fp"] = combine(fps[Group.GRAD]) if fps[Group.GRAD] else 0
        row["optim_fp"] = combine(fps[Group.OPTIM]) if fps[Group.OPTIM] else 0
        row["probes_fp"] = combine(fps[Group.PROBE]) if fps[Group.PROBE] else 0
        data_fps = [combine(fp.value or 0 for fp in fps) for _, fps, _ in self.data]
        row["data_fp"] = combine(data_fps) if data_fps else 0
        row["loss_fp"] = combine(fp.value or 0 for fp in self.losses) if self.losses else 0
        row["loss"] = self.loss_value
        row["rng_fp"] = self._rng_fp()
        # Data entries are listed every step (a few rows): a difference in them can be
        # named even in steps without op capture.
        data_rows = np.array(
            [(step, int(Group.DATA), self.session.intern(label), value, math.nan, math.nan,
              numel) for (label, _, numel), value in zip(self.data, data_fps, strict=True)],
            dtype=TENSOR_DTYPE)
        return np.concatenate([tensor_rows, data_rows]) if len(data_rows) else tensor_rows

    def _tensor_rows(self, step: int, groups: list[Any], stats: dict[Any, Any]) -> np.ndarray:
        rows = []
        for group, items in groups:
            for name, fp, t in items:
                pair = stats.get((group, name))
                total, maxabs = (float(pair[0]), float(pair[1])) if pair else (math.nan, math.nan)
                rows.append((step, int(group), self.session.intern(name), fp.value or 0, total,
                             maxabs, t.numel() if t is not None else 0))
        return np.array(rows, dtype=TENSOR_DTYPE) if rows else np.zeros(0, dtype=TENSOR_DTYPE)

    # -- boundaries ------------------------------------------------------------------------------
    def start_training(self) -> None:
        """Close the init phase: send the init row (state when training starts)."""
        if self.started:
            return
        self.started = True
        self._end_step()
        self.session.send_meta({"env": torch_environment(initialized=True)})
        self.session.send_facts(torch_facts())

    def boundary(self) -> None:
        """End the current training step and start the next one."""
        if not self.started:
            self.start_training()
        self.update_pending = False
        self._end_step()

    def _end_step(self) -> None:
        session = self.session
        step = session.step
        row = session.new_step_row()
        tensors = self._snapshot_row(row, step)
        with self._paused():
            self.recorder.resolve()
            ops = self.recorder.take_rows(step)
            self.recorder.prune()
        row["n_records"] = len(ops)
        self._reset_step()
        self.phase = Phase.FORWARD
        try:
            session.end_step(row, tensors, ops)
        finally:
            self._sync_mode()

    def explicit_step(self) -> None:
        if self.disabled:
            return
        self.explicit = True
        if not self.started:
            # Nothing marked the start of training (no optimizer, loader or module call):
            # what ran before the first nondet.step() is step 0 itself, not init.
            self.started = True
            self.session.step = 0
        self.boundary()

    def probe(self, value: Any, name: str) -> bool:
        if not isinstance(value, torch.Tensor) or self.disabled:
            return False
        with self._paused():
            fp = self.recorder.fingerprint(value)
        self.probes.append((name, fp))
        if self.recorder.window:
            self.recorder.add(Kind.PROBE, int(self.phase), 0,
                              self.session.intern(f"probe:{name}"), self.current_module(),
                              self.session.sources.here(2), [fp], [], [], (), value.numel(),
                              [value])
        return True

    def finish(self, status: str) -> str:
        if self.disabled:
            return status
        session = self.session
        if status == "complete" and not session.trained_elsewhere(self):
            try:
                if not self.started:
                    self.start_training()  # no training step at all: the init row is all
                elif self.update_pending:
                    self.boundary()
            except StopRun:
                pass
            params, _, _ = self._state()
            with self._paused():
                fps = [self._fp_of(p) for _, p in params]
                self.recorder.resolve()
            session.final = {"final_params_fp": combine(f.value or 0 for f in fps) if fps else 0}
        elif self.recorder.records:
            with self._paused():
                self.recorder.resolve()
                session.flush_ops(self.recorder.take_rows(session.step))
        session.send_meta({"env": torch_environment(initialized=self.started)})
        return status

    def keep(self, step: int, index: int, tensors: list[torch.Tensor]) -> None:
        """Keep a host copy of a record's outputs while the budget lasts (lockstep runs), so
        the parent can measure a difference without re-running the script."""
        budget = self.session.config.keep_bytes
        size = sum(t.numel() * t.element_size() for t in tensors)
        if not tensors or self.kept_bytes + size > budget:
            return
        with self._paused():
            self._kept[(step, index)] = [_to_numpy(t) for t in tensors]
        self.kept_bytes += size

    def kept(self, step: int, index: int) -> list[np.ndarray]:
        return self._kept.get((step, index), [])

    def dump_and_exit(self, tensors: list[torch.Tensor]) -> None:
        """Save one op's outputs (the dump pass) and end the run right here."""
        with self._paused():
            for i, t in enumerate(tensors):
                session_step, index = self.session.config.dump  # type: ignore[misc]
                self.session.send_dump(f"out{i}", _to_numpy(t),
                                       {"step": session_step, "index": index,
                                        "torch_dtype": str(t.dtype)})
        self.session.finish("stopped", 0)
        os._exit(0)

    def disable(self) -> None:
        self.disabled = True
        self.recorder.window = self.recorder.active = False


def _leaf_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaf_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaf_tensors(item)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = local_tensor(t).resolve_conj().resolve_neg().cpu()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype in (torch.bfloat16, torch.float16) or (
        t.is_floating_point() and t.element_size() == 1
    ):
        t = t.float()  # exact: every bf16/fp16/fp8 value is a float32 value
    elif t.dtype == torch.complex32:
        t = t.to(torch.complex64)
    return t.numpy().copy()


def torch_facts() -> dict[str, Any]:
    return {
        "torch.deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch.num_threads": torch.get_num_threads(),
        "cudnn.benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn.deterministic": bool(torch.backends.cudnn.deterministic),
    }


def torch_environment(initialized: bool) -> dict[str, str]:
    """Versions, devices, threads and determinism switches as seen by this run."""
    env = {
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda or "(none)"),
        "torch.num_threads": str(torch.get_num_threads()),
        "torch.num_interop_threads": str(torch.get_num_interop_threads()),
        "torch.deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "torch.deterministic_warn_only": str(
            torch.is_deterministic_algorithms_warn_only_enabled()),
        "torch.float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn.benchmark": str(torch.backends.cudnn.benchmark),
        "cudnn.deterministic": str(torch.backends.cudnn.deterministic),
        "cudnn.allow_tf32": str(torch.backends.cudnn.allow_tf32),
        "cuda.matmul.allow_tf32": str(torch.backends.cuda.matmul.allow_tf32),
    }
    try:
        env["cudnn_version"] = str(torch.backends.cudnn.version() or "(none)")
    except Exception:  # pragma: no cover - depends on the build
        env["cudnn_version"] = "(none)"
    # Device names need CUDA initialized; do not be the one to initialize it at import.
    if initialized and torch.cuda.is_available():  # pragma: no cover - no GPU here
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["device_name"] = ", ".join(names)
        env["cuda_device_count"] = str(len(names))
        env["cuda_capability"] = ", ".join(
            ".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(len(names)))
        try:
            env["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            env["nccl_version"] = "(none)"
    else:
        env.setdefault("device_name", "cpu")
    return env
