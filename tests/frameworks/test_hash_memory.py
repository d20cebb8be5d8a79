"""The extra memory of hashing is bounded by a few chunks, whatever the tensor's size, byte
count, layout or alignment (Note [Fingerprint definition]). Peak RSS is measured in a fresh
child process: tracemalloc does not see torch's allocations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from nondet.fingerprint import CHUNK_WORDS
from tests.conftest import REPO

CHUNK_BYTES = CHUNK_WORDS * 8
BIG = 96 << 20  # a 96 MiB tensor: widening it whole to int64 would take 768 MiB

CHILD = """
import json, re, sys
import torch
from nondet.frameworks.torch.hashing import TorchHasher

def kib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

torch.set_num_threads(1)
hasher = TorchHasher()
big = int(sys.argv[1])
cases = {
    "odd uint8": lambda: torch.ones(big + 1, dtype=torch.uint8),
    "odd int8 group": lambda: torch.ones(big + 1, dtype=torch.int8),
    "transposed float32": lambda: torch.ones(big // 4 // 3001, 3001).t(),
    "misaligned float32": lambda: torch.ones(big // 4 + 1)[1:],
    "odd float16 rows": lambda: torch.ones(2002, big // 2 // 2002 | 1)[:, 1:].t(),
}
# Warm up: keys, scratch and staging buffers reach their full (fixed) size first. On the
# device path (torch ops): contiguous tensors take the host path, which has none of them
# (it read as warmed up only because NumPy's int64 copy of 4-byte words left the heap large).
hasher.content(torch.ones(3 * (1 << 20) + 1), on_device=True)
hasher.content_of_many([torch.ones(3 * (1 << 20) + 1, dtype=torch.uint8)], on_device=True)
hasher.content(torch.ones(3 * (1 << 20) + 1)[1:], on_device=True)  # staging, misaligned
out = {}
for name, make in cases.items():
    x = make()
    x.add_(0)  # touch every page: RSS includes the tensor itself
    open("/proc/self/clear_refs", "w").write("5")  # peak := current
    before = kib("VmRSS")
    if "group" in name:
        hasher.content_of_many([x])
    else:
        hasher.content(x)
    out[name] = (kib("VmHWM") - before) * 1024
    del x
print(json.dumps(out))
"""


def test_hashing_needs_at_most_a_few_chunks_of_extra_memory() -> None:
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure peak RSS")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(BIG)], env=env,
                            capture_output=True, text=True, timeout=600, check=True)
    extra = json.loads(result.stdout.strip().splitlines()[-1])
    # A chunk of scratch products, a chunk of widened words, a copied block and a carry.
    bound = 4 * CHUNK_BYTES
    print({k: v >> 20 for k, v in extra.items()})
    assert all(v < bound for v in extra.values()), {k: v >> 20 for k, v in extra.items()}


TF_CHILD = """
import json, re, sys
import numpy as np
import tensorflow as tf
from nondet.frameworks.tensorflow.hashing import GraphHasher, host

def kib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

tf.config.threading.set_intra_op_parallelism_threads(1)
hasher = GraphHasher()
big = int(sys.argv[1])
known = tf.function(hasher.content)
unknown = tf.function(hasher.content, input_signature=[tf.TensorSpec([None], tf.uint8)])
# Warm up with the measured shape: a first call of `known` on a new shape traces (graph
# building and Grappler take memory unrelated to the tensor's size).
warm = tf.ones([big + 1], tf.uint8)
known(warm), unknown(warm), host(warm)
del warm
out = {}
for name, fn in (("graph", known), ("graph, unknown shape", unknown), ("host", host)):
    x = tf.ones([big + 1], tf.uint8) + 0
    np.asarray(x.numpy()).sum()  # touch every page
    # The least of three peaks: TF's thread pools allocate now and then on their own (up to
    # ~50 MiB seen under load), while memory that grows with the tensor shows every time.
    peaks = []
    for _ in range(3):
        open("/proc/self/clear_refs", "w").write("5")
        before = kib("VmRSS")
        fn(x)
        peaks.append((kib("VmHWM") - before) * 1024)
    out[name] = min(peaks)
    del x
print(json.dumps(out))
"""


def test_tensorflow_hashing_needs_at_most_a_few_chunks_of_extra_memory() -> None:
    pytest.importorskip("tensorflow")
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure peak RSS")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(TF_CHILD), str(BIG)],
                            env=env, capture_output=True, text=True, timeout=600, check=True)
    extra = json.loads(result.stdout.strip().splitlines()[-1])
    print({k: v >> 20 for k, v in extra.items()})
    assert all(v < 4 * CHUNK_BYTES for v in extra.values()), {k: v >> 20 for k, v in extra.items()}
