"""Host-side fingerprint helpers: stable across machines, order-sensitive."""

from __future__ import annotations

import numpy as np

from nondet import fingerprint as fp


def test_keys_are_odd_and_reproducible() -> None:
    keys = fp.position_keys(1000)
    assert (keys & 1).all()
    # splitmix64 is fully specified: the first output for state 0 is a published constant.
    assert int(fp.splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert np.array_equal(keys, fp.position_keys(1000))
    assert np.array_equal(fp.position_keys(10, offset=5), keys[5:15])


def test_combine_is_order_sensitive_and_never_zero() -> None:
    assert fp.combine([1, 2, 3]) != fp.combine([3, 2, 1])
    assert fp.combine([]) != 0
    assert fp.combine([0]) != fp.combine([0, 0])


def test_scalar_fingerprints_are_bit_exact() -> None:
    assert fp.scalar_value(0.0) != fp.scalar_value(-0.0)
    assert fp.scalar_value(1) != fp.scalar_value(1.0)
    assert fp.scalar_value(True) != fp.scalar_value(1)
    assert fp.scalar_value(0.1 + 0.2) != fp.scalar_value(0.3)


def test_name_codes_do_not_depend_on_the_hash_seed() -> None:
    # Python's str hash is salted per process; name codes must not be.
    assert fp.name_code("torch.float32") == fp.name_code("torch.float32")
    import subprocess
    import sys

    code = "from nondet.fingerprint import name_code; print(name_code('torch.float32'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}, check=True).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1 and outs.pop().strip() == str(fp.name_code("torch.float32"))
