"""What a tensor's data is, for hashing and host copies: the plain tensors holding the
bytes of a wrapper subclass (DTensor, float8, NF4), and a tensor's values as plain values
(sparse coalesced, quantized as integers, conjugate and negative views resolved). Attribute
reads only, except ``prepare``'s conversions of those layouts."""

from __future__ import annotations

import torch

# Note [torch.func wrappers]
# Inside ``torch.func.grad``, ``vjp``, ``jacrev`` or ``vmap`` a module's parameters (swapped
# in by ``functional_call``) and every value the transformed function makes are functorch
# wrappers: plain ``torch.Tensor`` objects with no storage of their own, whose values live
# in the tensor they wrap, one wrapper per transform level (a ``vmap`` level's inner tensor
# also holds the other examples of the batch). Reading their memory raises ("Cannot access
# data pointer of Tensor that doesn't have storage"); nondet read them at a step boundary
# that a model call inside ``grad`` opened, and its hook error ended ``nondet run`` with an
# internal error. Whatever reads a tensor's memory reads the innermost tensor instead, and
# nondet's own ops run with the transforms off (backend.paused_capture): an op on the
# innermost tensor inside a transform would wrap its output again.
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrapped = torch._C._functorch.get_unwrapped


def functorch_inner(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s values under torch.func transforms (Note [torch.func
    wrappers]); ``t`` itself when it is not such a wrapper."""
    while _is_wrapped(t):
        t = _unwrapped(t)
    return t


def is_plain(t: torch.Tensor) -> bool:
    kind = type(t)
    return (kind in (torch.Tensor, torch.nn.Parameter)
            or kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors a wrapper subclass holds its data in: its ``__tensor_flatten__``
    attributes (a DTensor's local shard, what ``to_local()`` returns a view of; float8 data
    and scale; NF4 blocks), or None (FakeTensor, FunctionalTensor and other compile
    internals hold no data of the run). Attribute reads only: no op runs."""
    kind = type(t)
    if kind.__module__.startswith("torch._subclasses"):
        return None
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    names, _ = flatten()
    # DTensor also lists its device mesh: only tensors hold data.
    inner = [x for x in (getattr(t, name, None) for name in names) if isinstance(x, torch.Tensor)]
    return inner or None


def data_leaves(tensor: torch.Tensor, depth: int = 0) -> list[torch.Tensor] | None:
    """Plain tensors whose bytes are ``tensor``'s content: itself, prepared, or the inner
    tensors of a wrapper subclass (in ``__tensor_flatten__`` order), or None."""
    t = functorch_inner(tensor.detach())
    if is_plain(t):
        p = prepared(t)
        return None if p is None else [p]
    inner = inner_tensors(t) if depth < 4 else None
    if not inner:
        return None
    out: list[torch.Tensor] = []
    for x in inner:
        leaves = data_leaves(x, depth + 1)
        if leaves is None:
            return None
        out.extend(leaves)
    return out


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor to copy to the host for ``tensor``: a DTensor's local shard, or the
    inner tensor of another wrapper that has the wrapper's shape (float8 data); the tensor
    itself otherwise."""
    t = tensor.detach()
    if is_plain(t):
        return t
    inner = inner_tensors(t) or []
    if type(t).__name__ == "DTensor" and inner:
        return local_tensor(inner[0])
    same_shape = [x for x in inner if x.shape == t.shape]
    return local_tensor(same_shape[0]) if same_shape else t


def storage_owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s data: ``t``, or a wrapper subclass's first
    inner tensor. A wrapper's own storage is an empty placeholder made per object, so
    tracking it would tell apart wrappers of the same data (and reuse addresses)."""
    for _ in range(4):
        if is_plain(t):
            return t
        inner = inner_tensors(t)
        if not inner:
            return t
        t = inner[0]
    return t


def prepared(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor as plain values (sparse coalesced, quantized as integers, conj/neg
    resolved), or None if it has no local data we can trust."""
    t = tensor.detach()
    # Subclasses that override dispatch are unwrapped by _leaves first: their own bytes
    # are not the data.
    if not is_plain(t):
        return None
    if t.device.type == "meta":
        return None
    if t.layout == torch.sparse_coo:
        return t.coalesce()
    if t.layout != torch.strided:
        return None
    if t.is_quantized:
        t = t.int_repr()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t
