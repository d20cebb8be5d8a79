"""Tensor content fingerprints: exact, order-sensitive, right for every dtype and layout."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from nondet.fingerprint import CHUNK_WORDS, MASK64, chunk_keys, position_keys, word_size  # noqa: E402
from nondet.frameworks.torch.hashing import (  # noqa: E402
    HOST_COPY_LIMIT,
    HOST_LIMIT,
    TorchHasher,
)
from nondet.frameworks.torch.hostwords import StateViews  # noqa: E402
from nondet.frameworks.torch.testing import recorder  # noqa: E402

HASHER = TorchHasher()
REC = recorder()  # the op recorder's fingerprint cache, on a stand-in backend

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64,
]
for name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, name):
        DTYPES.append(getattr(torch, name))


def content(t: torch.Tensor) -> int:
    """The content sum, checking that the device path and the small-CPU path agree."""
    on_device = HASHER.content(t, on_device=True)
    assert isinstance(on_device, torch.Tensor)
    value = int(on_device.item()) & MASK64
    host = HASHER.content(t)
    assert host is not None
    if t.numel() <= HOST_LIMIT:
        assert isinstance(host, int), "small CPU tensors take the host path"
    assert int(host) & MASK64 == value, "the host and device paths disagree"
    return value


def _sample(dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g) * 50
    if dtype == torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, base.flip(0)).to(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return base.abs().to(torch.int64).to(dtype)
    return base.to(dtype)


def _from_bytes(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return raw.reshape(-1).view(like.dtype).reshape(like.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 5, 8, 13, 1000])
def test_equal_bits_equal_fingerprint_and_swaps_change_it(dtype: torch.dtype, n: int) -> None:
    x = _sample(dtype, n + 2)[1 : n + 1]  # odd storage offset: alignment must not matter
    assert content(x) == content(x.clone())
    # Edit the bytes directly: not every dtype has indexing kernels.
    raw = x.clone().view(torch.uint8).reshape(n, -1)
    flipped = raw.clone()
    flipped[0, 0] ^= 1
    assert content(_from_bytes(flipped, x)) != content(x), "one bit must change it"
    if n >= 2 and not torch.equal(raw[0], raw[1]):
        swapped = raw[torch.tensor([1, 0, *range(2, n)])]
        assert content(_from_bytes(swapped, x)) != content(x), "a swap must change it"


def test_zero_size_tensors_have_a_fingerprint() -> None:
    assert content(torch.empty(0)) == 0
    assert content(torch.empty(0, 3, dtype=torch.int64)) == 0
    assert HASHER.content_of_many([torch.empty(0)]) == {}


def test_layout_does_not_matter_only_values() -> None:
    x = torch.randn(30, 40)
    assert content(x.t()) == content(x.t().contiguous())
    assert content(x[:, ::3]) == content(x[:, ::3].contiguous())
    assert content(torch.ones(1).expand(50)) == content(torch.ones(50))


def test_nan_payloads_and_signed_zeros_are_distinguished() -> None:
    a = torch.tensor([float("nan"), 0.0])
    b = a.clone()
    b.view(torch.int32)[0] += 1
    c = torch.tensor([float("nan"), -0.0])
    assert len({content(a), content(b), content(c)}) == 3


def test_large_tensors_are_hashed_in_chunks_exactly() -> None:
    n = CHUNK_WORDS * 2 + 12345  # float64: one word per element
    x = torch.randn(n, dtype=torch.float64)
    base = content(x)
    y = x.clone()
    y[CHUNK_WORDS + 7] += 1
    assert content(y) != base
    z = x.clone()
    z[[5, CHUNK_WORDS + 5]] = x[[CHUNK_WORDS + 5, 5]]  # same offset, different chunks
    assert content(z) != base
    assert content(x.clone()) == base


def test_conjugate_negative_sparse_and_quantized_views_hash_their_values() -> None:
    z = torch.randn(6, dtype=torch.complex64)
    assert content(z.conj()) == content(z.conj().resolve_conj())
    sparse = torch.randn(4, 4).to_sparse()
    assert content(sparse) == content(sparse.coalesce())
    dense = torch.zeros(4, 4)
    dense[1, 2] = 3.0
    other = torch.zeros(4, 4)
    other[2, 1] = 3.0
    assert content(dense.to_sparse()) != content(other.to_sparse())
    q = torch.quantize_per_tensor(torch.randn(10), 0.1, 0, torch.qint8)
    assert content(q) == content(q.int_repr())


def test_grouped_content_is_the_content_of_the_concatenation() -> None:
    parts = [torch.randn(3, 4), torch.arange(10, dtype=torch.int64), torch.randn(7).double(),
             torch.randn(5).to(torch.bfloat16)]
    whole = torch.cat([TorchHasher.words(p) for p in parts])
    for on_device in (False, True):
        (grouped,) = HASHER.content_of_many(parts, on_device=on_device).values()
        assert int(grouped) & MASK64 == content_of_words(whole)
        swapped = HASHER.content_of_many([parts[1], parts[0], *parts[2:]], on_device=on_device)
        assert int(next(iter(swapped.values()))) & MASK64 != content_of_words(whole)
    # Across the chunk boundary too, on both paths.
    big = [torch.randn(CHUNK_WORDS // 2 + 3, dtype=torch.float64) for _ in range(3)]
    results = {int(next(iter(HASHER.content_of_many(big, on_device=d).values()))) & MASK64
               for d in (False, True)}
    assert len(results) == 1



def test_runs_of_small_parts_and_long_parts_sum_as_their_concatenation() -> None:
    """The host kernel concatenates consecutive small parts (1- and 4-byte words widened
    to int64: zero- and sign-extended) and sums long int64 parts with einsum: the number
    is the definition's, also when the group crosses a chunk boundary."""
    gen = torch.Generator().manual_seed(5)

    def ints(low: int, high: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, (n,), dtype=dtype, generator=gen)

    high_bytes = ints(128, 256, 3, torch.uint8)  # zero-extended: would differ if signed
    negative = ints(-2**31, -1, 5, torch.int32)  # sign-extended 4-byte words
    parts = [high_bytes, negative, torch.randn(7, generator=gen),  # 28 bytes: 4-byte words
             ints(-2**62, 2**62, 9000, torch.int64),  # long: einsum
             torch.randn(3, generator=gen).to(torch.bfloat16), negative,  # 6 bytes: bytes
             ints(-2**62, 2**62, 10, torch.int64)]
    whole = torch.cat([TorchHasher.words(p) for p in parts])  # type: ignore[misc]
    (host,) = HASHER.content_of_many(parts).values()
    assert isinstance(host, int)
    assert host & MASK64 == content_of_words(whole)
    straddling = [*parts[:3], ints(-2**62, 2**62, CHUNK_WORDS - 2, torch.int64), *parts]
    (host,) = HASHER.content_of_many(straddling).values()
    (device,) = HASHER.content_of_many(straddling, on_device=True).values()
    assert host & MASK64 == int(device) & MASK64  # type: ignore[operator]

def test_long_narrow_words_sum_as_the_definition() -> None:
    """Long 4-byte and 1-byte word arrays (an odd-sized float32 tensor, a byte tensor)
    are summed by einsum, which widens them in buffers: sign- and zero-extended as the
    definition says, the same number as the device kernel's."""
    gen = torch.Generator().manual_seed(6)
    negative = torch.randint(-2**31, -1, (9001,), dtype=torch.int32, generator=gen)
    high = torch.randint(128, 256, (9003,), dtype=torch.uint8, generator=gen)
    for t in (negative, high, negative.view(torch.float32)):
        words = TorchHasher.words(t)
        assert words is not None and word_size(t.nbytes) < 8  # the narrow-word path
        (host,) = HASHER.content_of_many([t]).values()
        assert isinstance(host, int)
        assert host & MASK64 == content_of_words(words)


def content_of_words(words: torch.Tensor) -> int:
    """The definition, written out: sum of words times keys, chunked, mod 2**64."""
    keys = [int(k) for k in position_keys(min(words.numel(), CHUNK_WORDS))]
    values = [int(w) for w in words.tolist()]
    partial = [sum(v * keys[i % CHUNK_WORDS] for i, v in enumerate(values[c : c + CHUNK_WORDS],
                                                                    start=c)) & MASK64
               for c in range(0, len(values), CHUNK_WORDS)]
    if len(partial) == 1:
        return partial[0]
    weights = chunk_keys(len(partial))
    return sum(p * (int(w) & MASK64) for p, w in zip(partial, weights, strict=True)) & MASK64


def test_content_matches_the_written_out_definition() -> None:
    for t in (torch.randn(37), torch.arange(9, dtype=torch.int16), torch.randn(4, 4).t()):
        assert content(t) & MASK64 == content_of_words(TorchHasher.words(t))


def test_meta_tensors_have_no_fingerprint() -> None:
    assert HASHER.content(torch.empty(3, device="meta")) is None


def test_stats_are_float64_sum_and_max_abs() -> None:
    x = torch.tensor([1.0, -3.0, 2.0])
    total, maxabs = HASHER.stats(x)
    assert float(total) == 0.0 and float(maxabs) == 3.0
    assert HASHER.stats(torch.tensor([1, 2])) is None


def test_wrapper_subclasses_hash_their_inner_tensors() -> None:
    """A wrapper subclass (float8 training tensors, NF4, DTensor: ``__tensor_flatten__``) is
    fingerprinted by the words of its inner tensors, in flatten order; it used to hash to
    None (compared by shape only)."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(6, 4), torch.randn(6, 4)
    wrapped = TwoTensor(a, b)
    expected = content(torch.cat([a.reshape(-1), b.reshape(-1)]))
    assert HASHER.content(wrapped) is not None
    assert int(HASHER.content(wrapped)) & MASK64 == expected  # type: ignore[arg-type]
    device = HASHER.content(wrapped, on_device=True)
    assert isinstance(device, torch.Tensor) and int(device.item()) & MASK64 == expected
    changed = b.clone()
    changed[5, 3] += 1
    assert HASHER.content(TwoTensor(a, changed)) != HASHER.content(wrapped)
    group = HASHER.content_of_many([wrapped])
    assert [int(v) & MASK64 for v in group.values()] == [expected]


def _reference(t: torch.Tensor) -> int:
    """The content sum from the whole widened word array (the definition, unchunked input)."""
    from nondet.fingerprint import host_content

    words = TorchHasher.words(t)
    assert words is not None
    return host_content([words.numpy()])


@pytest.mark.parametrize("make", [
    # odd byte count: byte words; larger than a chunk
    lambda: torch.arange(3 * CHUNK_WORDS + 5, dtype=torch.int64).to(torch.uint8),
    # transposed, blocks of rows whose byte counts split 4-byte words (a carried word)
    lambda: torch.randn(3001, 2002).to(torch.float16).t(),
    # contiguous but starting off an 8-byte boundary
    lambda: torch.randn(2 * CHUNK_WORDS + 1)[1:],
    # expanded (stride 0) and a row longer than a block
    lambda: torch.randn(1, 5 * CHUNK_WORDS + 3).expand(2, -1),
], ids=["odd-uint8", "transposed-f16", "misaligned-f32", "expanded-long-rows"])
def test_large_odd_strided_and_misaligned_tensors_hash_chunk_by_chunk(make: object) -> None:
    t = make()  # type: ignore[operator]
    expected = _reference(t)
    assert int(HASHER.content(t)) & MASK64 == expected  # type: ignore[arg-type]
    assert int(HASHER.content(t.contiguous())) & MASK64 == expected  # type: ignore[arg-type]
    group = HASHER.content_of_many([t])
    assert [int(v) & MASK64 for v in group.values()] == [expected]


def _golden_tensors() -> list[tuple[str, torch.Tensor]]:
    """Exactly computed values (integer arithmetic, /8) in several dtypes and sizes, from
    one element to above HOST_LIMIT, contiguous, misaligned ([1:]) and strided."""
    out = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64,
                  torch.uint8, torch.bool):
        for n in (1, 3, 32, 1001, 70_001, 300_000):
            base = torch.arange(n, dtype=torch.int64) * 2654435761 % 65521 - 32760
            t = ((base > 0) if dtype == torch.bool else
                 base.to(dtype) / 8 if dtype.is_floating_point else base.to(dtype))
            out.append((f"{dtype} {n}", t))
            if n > 3:
                out.append((f"{dtype} {n} [1:]", t[1:]))
            if n == 300_000:
                out.append((f"{dtype} {n} strided", t.reshape(-1, 10)[:, ::3]))
    return out


def test_fingerprint_values_are_those_of_earlier_versions() -> None:
    """Captures and baselines are compared across nondet versions: a faster kernel must give
    the same numbers. The digests below were computed by the version before the zero-copy
    host path (commit 6b1dd9b, torch's multiply-then-sum for CPU tensors above HOST_LIMIT)."""
    import hashlib

    values = {name: int(HASHER.content(t)) & MASK64  # type: ignore[arg-type]
              for name, t in _golden_tensors()}
    digest = hashlib.sha256(repr(sorted(values.items())).encode()).hexdigest()
    assert digest == "33fa79415b7c8120615410bd9d7bd8ad9d2cf21e43d762915a6553683bfe800f"
    group = HASHER.content_of_many([t for _, t in _golden_tensors()[:40]])
    assert [int(v) & MASK64 for v in group.values()] == [17753861392501052773]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_contiguous_cpu_tensors_of_any_size_take_the_host_path_and_agree(
        dtype: torch.dtype) -> None:
    """The zero-copy host path (np.dot over the tensor's own memory) serves contiguous CPU
    tensors of every size, also above HOST_LIMIT and off an 8-byte boundary, with the
    device path's value."""
    for n in (1, 7, HOST_LIMIT + 3, 3 * HOST_LIMIT):
        whole = _sample(dtype, n + 1)
        for t in (whole[:n], whole[1:]):
            host = HASHER.content(t)
            assert isinstance(host, int), f"{dtype} {n}: not the host path"
            device = HASHER.content(t, on_device=True)
            assert isinstance(device, torch.Tensor)
            assert host & MASK64 == int(device.item()) & MASK64
    # Not contiguous: copied to the host up to HOST_COPY_LIMIT elements (the same value),
    # the torch path above it (a host copy would be unbounded).
    strided = _sample(dtype, 4 * HOST_LIMIT)[::2]
    host = HASHER.content(strided)
    assert isinstance(host, int), f"{dtype}: a strided tensor not copied to the host"
    assert host & MASK64 == int(HASHER.content(strided, on_device=True).item()) & MASK64
    above = _sample(dtype, 1).expand(HOST_COPY_LIMIT + 1)  # not contiguous (stride 0)
    assert isinstance(HASHER.content(above), torch.Tensor)


def test_state_views_are_reused_only_while_they_are_the_tensors_bytes() -> None:
    """Step-level groups reuse word views across steps (hostwords.StateViews); every way
    a kept tensor can change what it shows must give the fingerprint of a fresh read."""
    views = StateViews()
    p = torch.nn.Parameter(torch.randn(300, 7))
    b = torch.randn(5)
    step = torch.tensor(3.0)
    group = [p, b, step]

    def check() -> int:
        kept = HASHER.content_of_many(group, views=views)
        fresh = HASHER.content_of_many(group)
        device = HASHER.content_of_many(group, on_device=True)
        assert kept == fresh
        assert [int(v) & MASK64 for v in kept.values()] == [
            int(v) & MASK64 for v in device.values()]
        # the whole fingerprint too: with views, the tensors' descriptions are kept too
        (kept_fp,), (fresh_fp,) = (REC.fingerprint_many(group, views),
                                   REC.fingerprint_many(group))
        REC.resolve()
        assert kept_fp.value == fresh_fp.value
        return int(next(iter(kept.values())))

    first = check()
    reused = views.words(group)[0]
    assert reused is views.words(group)[0], "an unchanged tensor reuses its view"
    group.reverse()  # every view reused, the descriptions kept packed in another order
    check()
    group.reverse()
    with torch.no_grad():
        p.add_(1)  # in place: the same memory, new values
    changed = check()
    assert changed != first
    p.data = torch.randn(300, 7)  # new memory, same shape
    assert check() != changed
    p.data = torch.randn(7, 300)  # new shape
    check()
    p.data = p.data.view(300, 7)  # the same memory and bytes, another shape
    check()
    b.resize_(6)  # may move the memory
    b.fill_(2.0)
    check()
    b.data = torch.randn(3, 2, dtype=torch.float64)  # another dtype and shape
    check()
    step.set_(torch.tensor([4.0, 5.0]).untyped_storage(), 1, ())  # another storage
    assert float(step) == 5.0
    check()
    p.data = p.data.t()  # not contiguous: the general path
    check()
    assert views.words([b])[0] is not None and len(views._views) == 1, "dropped when gone"


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5), lambda: torch.randn(3 * HOST_LIMIT), lambda: torch.randn(40)[1:],
    lambda: torch.randn(6, 4).t(), lambda: torch.randn(4, dtype=torch.complex128),
    lambda: torch.zeros(0),
], ids=["small", "large", "misaligned", "transposed", "complex128", "empty"])
def test_hashing_never_stops_a_tensor_from_being_resized(make: object) -> None:
    """``Tensor.numpy()`` marks a storage as not resizable for good: had the hasher read a
    tensor that way, a later ``resize_`` in the user's script would raise."""
    for read in (lambda t: HASHER.content(t), lambda t: HASHER.content_of_many([t]),
                 lambda t: HASHER.content_of_many([t], views=StateViews())):
        t = make()  # type: ignore[operator]
        read(t)
        t.resize_(50)  # raises "Trying to resize storage that is not resizable"
