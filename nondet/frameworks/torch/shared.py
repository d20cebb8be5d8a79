"""Memory shared with other processes, in a process where they may write it at any moment.

Note [Writes during an op]
In a child process the script started (children.py), memory shared with its siblings
(Hogwild weights, ``model.share_memory()``) can be written by them at any time, unseen by
this process's version counters. So every read of it is an entry point, hashed afresh
(``FingerprintCache.shared_is_volatile``, ``lookup``). That hash is taken before the op
runs; a sibling's write that lands *while* the op runs makes the op compute with values
other than those hashed: its output differs while its inputs matched, and the op would be
blamed for a difference that entered from outside.

So in such a process the op's shared inputs are hashed again right after it (only those
it reads: not the ones it writes, whose value afterwards is its own output). If one
changed, the entry record made for that read takes both values: its fingerprint (the same
object the op record holds among its inputs) becomes a combination of the value before and
the value after. Then the entry differs between the runs (the finding: "parameter
0.weight" entered with a different value, at this op's line) and the op's inputs differ,
so the op is not blamed. Nothing is added to the records: an extra record in one run only
would misalign the two runs' records (a "structure" finding). A value unchanged by the op
stays exactly as it was, and a change made identically in both runs folds identically:
only a write whose timing differs between the runs shows.

Note [A sibling's write during an in-place op]
An op that writes the shared tensor itself (Hogwild's ``p.add_``, ``index_add_`` or a sparse
``add_`` into a shared embedding table) cannot be re-read that way: its value afterwards is
its own output. Its evidence is the op itself: the written tensors are copied just before
their entry is hashed (``snapshot``), and after the op the op is run again, twice, on copies
of those copies (``_own_result``), once its output has been hashed (``check_own_write``).
When both re-runs agree with each other and not with what the shared tensor holds, the op
cannot have made that difference: another process wrote the tensor between the copy and
the output's hash, and the change is folded into the entry of the written tensor as above.
(Checked before the output hash, a write landing between the check and the hash, which the
check itself makes longer, was still blamed on the op: 2 of 3 runs of a Hogwild table.)
When the re-runs disagree with each other the op is
nondeterministic on its own and stays the finding. Only ATen ops that draw no random
numbers are re-run (a re-run of a Python custom op or of ``bernoulli_`` would have effects
of its own), and none whose read arguments share memory with a written one.

On the host both hashes are final at once and compared on the spot. A fingerprint still
on its device is compared when the step's fingerprints are resolved (``fold``); outputs
derived from it then keep the value from before, which changes nothing found: the entry
comes first. Ordinary processes pay nothing (``shared_is_volatile`` is False).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from nondet.fingerprint import combine
from nondet.frameworks.fp import Fp
from nondet.records import Flag

if TYPE_CHECKING:
    from nondet.frameworks.torch.optable import OpInfo

#: Marks a fingerprint folded from a value before and a value after an op.
_CHANGED_TAG = 0x5B1B_3A7E


def in_shared_memory(t: torch.Tensor) -> bool:
    """``t`` lives in memory shared with other processes (never raises)."""
    try:
        return bool(t.is_shared())  # type: ignore[no-untyped-call]
    except Exception:
        return False


class Snapshot(list[tuple[torch.Tensor, torch.Tensor]]):
    """(shared tensor the op writes, its value just before the op) for each one; and the
    entry fingerprints the op's reads of them made (``reread_inputs`` keeps them before
    the op's outputs take their place in the cache)."""

    entries: dict[int, Fp]


def snapshot(rec: Any, func: Any, info: OpInfo, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Snapshot | None:
    """Before an in-place op in a process whose shared memory is volatile: copies of the
    shared tensors it writes (Note [A sibling's write during an in-place op]), or None when
    the op is not one to re-run. Never raises (trouble is nondet's bug: reported)."""
    try:
        if not (info.mutated_args or info.mutated_kwargs) or info.flags & Flag.RNG \
                or info.from_storage or getattr(func, "namespace", None) != "aten":
            return None
        written = list(_tensors(_written(info, args, kwargs)))
        if not any(in_shared_memory(t) for t in written) or not all(
                t.layout == torch.strided for t in written):
            return None
        memory = {_memory(t) for t in written}
        if any(_memory(t) in memory for t in _tensors(_read(info, args, kwargs))):
            return None  # reads what it writes (``w.add_(w)``): a re-run reads its output
        snap = Snapshot((t, t.clone()) for t in written)
        snap.entries = {}
        return snap
    except Exception:
        rec.backend.hook_failed()
        return None


def reread_inputs(rec: Any,  # a FingerprintCache (cache.py imports this module)
                  info: OpInfo, args: tuple[Any, ...],
                  kwargs: dict[str, Any], snap: Snapshot | None = None) -> None:
    """After an op in a process whose shared memory is volatile: hash the shared tensors
    it read again, and fold a change into the entry it read (Note [Writes during an op]);
    keep the entries of the tensors in ``snap`` for ``check_own_write``.
    Never raises: the op has run and its result goes back to the script whatever happens
    here (trouble is nondet's bug: reported, capture stops)."""
    try:
        for t, _ in snap or ():
            entry = rec.entry(t)  # the one ``lookup`` made for the op's read of it
            if entry is not None:
                snap.entries[id(t)] = entry[4]  # type: ignore[union-attr]
        _reread(rec, info, args, kwargs)
    except Exception:
        rec.backend.hook_failed()


def check_own_write(rec: Any, func: Any, info: OpInfo, args: tuple[Any, ...],
                    kwargs: dict[str, Any], snap: Snapshot) -> None:
    """After an in-place op's outputs were hashed: for each shared tensor it wrote, fold a
    change the op did not make into the entry it read (Note [A sibling's write during an
    in-place op]). Never raises (as ``reread_inputs``)."""
    try:
        _check_own_write(rec, func, info, args, kwargs, snap)
    except Exception:
        rec.backend.hook_failed()


def _check_own_write(rec: Any, func: Any, info: OpInfo, args: tuple[Any, ...],
                     kwargs: dict[str, Any], snap: Snapshot) -> None:
    # What the shared memory holds now, after the op's output hash: a write that landed
    # any time from the copy to that hash shows here (a later one folds too: it is a
    # sibling's all the same).
    now = [t.clone() for t, _ in snap]
    first, second = _own_result(func, info, args, kwargs, snap), \
        _own_result(func, info, args, kwargs, snap)
    for (t, _), held, mine, again in zip(snap, now, first, second, strict=True):
        if not in_shared_memory(t) or _same_bits(held, mine) or not _same_bits(mine, again):
            continue  # the op's own result; or an op that does not repeat itself: its own
        before = snap.entries.get(id(t))
        if before is None or before.uninit or before.lazy:
            continue
        _fold_or_defer(rec, before, rec.fingerprint(held))


def _own_result(func: Any, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any],
                snap: Snapshot) -> list[torch.Tensor]:
    """The op run again with each written tensor replaced by a copy of its value before:
    the copies, in ``snap``'s order, hold what the op alone makes of them."""
    copies = {id(t): before.clone() for t, before in snap}

    def swap(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return copies[id(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) if isinstance(v, torch.Tensor) else v for v in value)
        return value

    again = [swap(v) if i in info.mutated_args else v for i, v in enumerate(args)]
    kw = {k: swap(v) if k in info.mutated_kwargs else v for k, v in kwargs.items()}
    func(*again, **kw)
    return [copies[id(t)] for t, _ in snap]


def _fold_or_defer(rec: Any, before: Fp, after: Fp) -> None:
    """Fold ``after`` into entry ``before`` now if both are final on the host, else when the
    step's device fingerprints are resolved (``rec.rereads``)."""
    if before.value is not None and after.value is not None:
        _fold(before, after)
    else:
        rec.rereads.append((before, after))


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equal (NaNs included: ``torch.equal`` says a NaN differs from itself)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return bool(torch.equal(x.reshape(-1).view(torch.uint8),
                                y.reshape(-1).view(torch.uint8)))
    return bool(torch.equal(x, y))


def _reread(rec: Any, info: OpInfo, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> None:
    seen: set[int] = set()
    # memory the op writes itself changes by its own doing (a read alias of a written
    # tensor, ``w.add_(w)``): left alone, so an op's own nondeterminism stays the op's
    written = {_memory(t) for t in _tensors(_written(info, args, kwargs))}
    for t in _tensors(_read(info, args, kwargs)):
        if id(t) in seen or not in_shared_memory(t):
            continue
        seen.add(id(t))
        if written and _memory(t) in written:
            continue
        entry = rec.entry(t)  # the one ``lookup`` made for this read
        if entry is None:
            continue
        before = entry[4]
        if before.uninit or before.lazy:
            continue
        _fold_or_defer(rec, before, rec.fingerprint(t))


def fold(pairs: list[tuple[Fp, Fp]]) -> None:
    """Fold the changes of fingerprints compared once final (``resolve``)."""
    for before, after in pairs:
        _fold(before, after)


def _fold(before: Fp, after: Fp) -> None:
    if after.value != before.value:
        before.value = combine((before.value or 0, after.value or 0, _CHANGED_TAG)) or 1


def _read(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    return [v for i, v in enumerate(args) if i not in info.mutated_args] + [
        v for k, v in kwargs.items() if k not in info.mutated_kwargs]


def _written(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    return [args[i] for i in info.mutated_args if i < len(args)] + [
        kwargs[k] for k in info.mutated_kwargs if k in kwargs]


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's return value or argument: a tensor, or a list/tuple of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    """Tensors among op arguments."""
    for value in values:
        yield from tensors_in(value)


def _memory(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts (None: no storage to read)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return None
