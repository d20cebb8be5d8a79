"""What a torch run's state is made of, and what its environment looks like: named
parameters, buffers and optimizer state in a stable order, host copies of tensors, the
versions and determinism switches in force. Plain functions over torch objects: no hooks."""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from nondet.frameworks.torch.hostwords import raw_bytes
from nondet.frameworks.torch.leaves import local_tensor
from nondet.frameworks.torch.tensors import to_numpy as numpy_of

Named = list[tuple[str, Any]]
_NP_DTYPES: dict[torch.dtype, Any] = {}  # NumPy's dtype for each torch dtype to_numpy copies


def named_state(roots: list[torch.nn.Module],
                optimizers: list[weakref.ref[torch.optim.Optimizer]],
                param_names: dict[int, str],
                owner_names: dict[int, str] | None = None,
                held: dict[int, weakref.ref[torch.Tensor]] | None = None
                ) -> tuple[Named, Named, Named]:
    """Named parameters, buffers and optimizer state, in a stable order. Parameters an
    optimizer updates but no root module owns are named after their owner's variable
    (``owner_names``), by owner and in the owner's order, else after their optimizer slot;
    optimizer state follows the parameters' order, never the slot order (Note [Parameters
    an optimizer is given in another order] in owners.py). ``held``: the owners' other
    trainable tensors (owners.py); entries that died or that a root module now holds are
    dropped from it, so it costs nothing once the model has been called."""
    live = [opt for opt in (ref() for ref in optimizers) if opt is not None]
    params, buffers = _module_tensors(roots, param_names, with_buffers=True)
    _add_loose(params, live, param_names, owner_names or {}, held or {})
    optim: Named = []
    # Parameter by parameter, not optimizer by optimizer: pyro makes one optimizer per
    # parameter as it first steps it, in the order of a set of tensors (their addresses),
    # so the optimizers' order differs between runs whose state is the same (trial 18).
    members = [{id(t) for group in opt.param_groups for t in group["params"]} for opt in live]
    for name, t in params.values():
        for opt, ids in zip(live, members, strict=True):
            if id(t) not in ids:
                continue
            state = opt.state.get(t, {})
            for key in sorted(state, key=str):
                optim.append((f"{name}:{key}", state[key]))
    return list(params.values()), list(buffers.values()), optim


def named_params(roots: list[torch.nn.Module],
                 optimizers: list[weakref.ref[torch.optim.Optimizer]],
                 param_names: dict[int, str],
                 owner_names: dict[int, str] | None = None,
                 held: dict[int, weakref.ref[torch.Tensor]] | None = None) -> Named:
    """``named_state``'s parameters alone (the gradients' snapshot at the optimizer step
    needs no buffers or optimizer state)."""
    live = [opt for opt in (ref() for ref in optimizers) if opt is not None]
    params, _ = _module_tensors(roots, param_names, with_buffers=False)
    _add_loose(params, live, param_names, owner_names or {}, held or {})
    return list(params.values())


def _module_tensors(roots: list[torch.nn.Module], param_names: dict[int, str],
                    with_buffers: bool
                    ) -> tuple[dict[int, tuple[str, torch.Tensor]],
                               dict[int, tuple[str, torch.Tensor]]]:
    """The roots' parameters (and buffers) by id, in ``Module.parameters()`` order."""
    params: dict[int, tuple[str, torch.Tensor]] = {}
    buffers: dict[int, tuple[str, torch.Tensor]] = {}
    for root in roots:
        walked = _walk(root, with_buffers)
        if walked is None:  # a module that walks itself otherwise: torch's own walk
            walked = (list(root.parameters()), list(root.buffers()) if with_buffers else [])
        for p in walked[0]:
            if holds_values(p):
                params.setdefault(id(p), (param_names.get(id(p), "?"), p))
        for b in walked[1]:
            if holds_values(b):
                buffers.setdefault(id(b), (param_names.get(id(b), "?"), b))
    return params, buffers


#: Where an owner's name ends in a parameter's: ``model.0.weight``, ``ws[2]``.
_OWNER = re.compile(r"[.\[]")


def _add_loose(params: dict[int, tuple[str, torch.Tensor]], live: list[torch.optim.Optimizer],
               param_names: dict[int, str], owners: dict[int, str],
               held: dict[int, weakref.ref[torch.Tensor]]) -> None:
    """Parameters the optimizers update that no root module owns, after the roots' own:
    named ones (``param_names``, ``owners``) by their owner's name and in its order, then
    the rest in optimizer slot order."""
    loose: list[tuple[int, int, str, torch.Tensor]] = []  # (0 if named, slot, name, p)
    seen = set(params)
    for oi, opt in enumerate(live):
        for gi, group in enumerate(opt.param_groups):
            for pi, t in enumerate(group["params"]):
                if id(t) in seen or not holds_values(t):
                    continue
                seen.add(id(t))
                name = param_names.get(id(t)) or owners.get(id(t))
                slot = f"optimizer{oi}.group{gi}.param{pi}"
                loose.append((0 if name else 1, len(loose), name or slot, t))
    for pid, ref in list(held.items()):  # the rest of their owners' (owners.py)
        t = ref()
        if t is None or id(t) != pid or pid in params:
            del held[pid]  # gone, or listed with its root module's from now on
            continue
        if pid in seen or pid not in owners or not holds_values(t):
            continue
        seen.add(pid)
        loose.append((0, len(loose), owners[pid], t))
    # named ones by their owner's name, then in that owner's order (owners.py names all of
    # an owner's at once), not in the order of the optimizers that hold them: those may be
    # made in another order in every run (pyro's, one per parameter, in a set's)
    within = {pid: i for i, pid in enumerate(owners)}
    loose.sort(key=lambda x: (x[0], _OWNER.split(x[2], 1)[0] if x[0] == 0 else "",
                              within.get(id(x[3]), x[1]) if x[0] == 0 else x[1]))
    for _, _, name, t in loose:
        params[id(t)] = (name, t)


# Note [Walking the modules]
# ``Module.parameters()`` and ``buffers()`` walk the tree through nested generators
# (``named_modules``, ``_named_members``, a prefix string built per module): about 130 us
# per step for the narrow benchmark model's 16 modules, hot, twice per step. ``_walk``
# yields the same tensors in the same order (modules in pre-order, each module once, each
# tensor once, a module's ``_parameters`` and ``_buffers`` in their dicts' order) in one
# loop, for trees whose every module class walks as ``nn.Module`` does (none overrides
# those methods, nor ``__eq__``/``__hash__``, which torch's memo sets use); any other tree
# is walked by torch.
_MODULE = torch.nn.Module
_WALKS_AS_MODULE: dict[type, bool] = {}
_WALK_METHODS = ("parameters", "named_parameters", "buffers", "named_buffers",
                 "_named_members", "named_modules", "__eq__", "__hash__")


def _walks_as_module(kind: type) -> bool:
    verdict = _WALKS_AS_MODULE.get(kind)
    if verdict is None:
        verdict = _WALKS_AS_MODULE[kind] = all(
            getattr(kind, name, None) is getattr(_MODULE, name) for name in _WALK_METHODS)
    return verdict


def _walk(root: torch.nn.Module, with_buffers: bool
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """``(list(root.parameters()), list(root.buffers()))`` (buffers only if asked), or None
    where torch's walk must decide (Note [Walking the modules])."""
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    seen_modules: set[int] = set()
    seen: set[int] = set()  # torch's two walks each have their memo
    seen_buffers: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        if not _walks_as_module(type(module)):
            return None
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if with_buffers:
            for b in module._buffers.values():
                if b is not None and id(b) not in seen_buffers:
                    seen_buffers.add(id(b))
                    buffers.append(b)
        children = [m for m in module._modules.values() if m is not None]
        stack.extend(reversed(children))
    return params, buffers


def persistent_buffers(root: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers ``root.state_dict()`` saves, in its order, each once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for module in root.modules():
        skipped = getattr(module, "_non_persistent_buffers_set", ())
        for name, b in module._buffers.items():
            if b is not None and name not in skipped and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
    return out


def holds_values(t: torch.Tensor) -> bool:
    """Not training state: a tensor on the meta device (torch.func's functional_call
    template of an ensemble, a model built empty), or a lazy module's parameter before its
    first forward (``UninitializedParameter``: any read of it raises; torchrl's ``MLP``
    without ``in_features`` is made of ``LazyLinear``s). It joins once materialized."""
    kind = type(t)
    if kind is torch.nn.Parameter or kind is torch.Tensor:  # without Parameter's Python
        return not t.is_meta  # isinstance check (its metaclass's), twice per tensor and step
    return not t.is_meta and not isinstance(t, (UninitializedParameter, UninitializedBuffer))


def module_paths(root: torch.nn.Module, prefix: str) -> Iterator[tuple[str, Any]]:
    """(path, object) of a root's submodules, parameters and buffers, ``prefix`` first."""
    def joined(name: str) -> str:
        return ".".join(x for x in (prefix, name) if x)

    for name, sub in root.named_modules():
        yield joined(name), sub
    for name, p in root.named_parameters():
        yield joined(name), p
    for name, b in root.named_buffers():
        yield joined(name), b


def leaf_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in a batch: a tensor, or dicts, lists and tuples of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from leaf_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from leaf_tensors(item)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy with the same values (fp8/bf16/fp16 widened exactly to float32)."""
    t = local_tensor(t).resolve_conj().resolve_neg().cpu()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype in (torch.bfloat16, torch.float16) or (
        t.is_floating_point() and t.element_size() == 1
    ):
        t = t.float()  # exact: every bf16/fp16/fp8 value is a float32 value
    elif t.dtype == torch.complex32:
        t = t.to(torch.complex64)
    # Copied through the bytes: numpy() marks the storage it views as not resizable for
    # good, so on the script's memory a later resize_ there would raise. (Not a torch clone
    # either: an extra storage per kept output changes which addresses the allocator hands
    # out next, which tests/frameworks/test_torch_capture.py's recycled-address test needs.)
    dtype = _NP_DTYPES.get(t.dtype)
    if dtype is None:
        dtype = _NP_DTYPES[t.dtype] = numpy_of(torch.empty(0, dtype=t.dtype)).dtype
    out = np.empty(tuple(t.shape), dtype=dtype)
    if out.size:
        dense = t if t.is_contiguous() else t.contiguous()  # alive while its bytes are read
        out.reshape(-1).view(np.uint8)[:] = raw_bytes(dense)
    return out


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
        version = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
        env["cudnn_version"] = str(version or "(none)")
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
            nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            env["nccl_version"] = ".".join(map(str, nccl))
        except Exception:
            env["nccl_version"] = "(none)"
    else:
        env.setdefault("device_name", "cpu")
    return env
