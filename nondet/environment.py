"""What a run's result can depend on besides its code: versions, hardware, threads, variables.

Every key is a flat string so captures from different machines compare key by key.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from nondet import __version__
from nondet.printable import LINE_MAX, clip

#: Environment variables that change numerical results or their repeatability.
DETERMINISM_VARIABLES = (
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_CUDNN_V8_API_DISABLED",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TF_DETERMINISTIC_OPS",
    "TF_CUDNN_DETERMINISTIC",
    "TF_CUDNN_USE_AUTOTUNE",
    "TF_USE_CUDNN_AUTOTUNE",
    "TF_CUDNN_USE_FRONTEND",
    "TF_ENABLE_ONEDNN_OPTS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
    "XLA_FLAGS",
    "OMP_NUM_THREADS",
    "OMP_DYNAMIC",
    "MKL_NUM_THREADS",
    "MKL_DYNAMIC",
    "MKL_CBWR",
    "OPENBLAS_NUM_THREADS",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
)

#: Keys that describe a run but cannot change its numbers (left out of drift checks).
INFORMATIONAL = ("hostname", "nondet_version")


def base() -> dict[str, str]:
    """Framework-independent part, taken when the run starts."""
    env: dict[str, str] = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": str(os.cpu_count()),
        "hostname": platform.node(),
        "nondet_version": __version__,
        "fingerprint_scheme": fingerprint_scheme(),
    }
    try:
        import numpy

        env["numpy_version"] = numpy.__version__
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    for name in DETERMINISM_VARIABLES:
        env[f"env.{name}"] = os.environ.get(name, "(unset)")
    return env


def fingerprint_scheme() -> str:
    from nondet.fingerprint import SCHEME  # imports NumPy: only when a run starts

    return SCHEME


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, str]]:
    """Keys whose values differ, in a stable order (missing values shown as "(absent)").
    Values are cut to a line's length: a capture's 5 MB value (crafted, or a variable that
    holds a file) was printed whole, in the report's row and in ``check``'s drift error."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key in INFORMATIONAL:
            continue
        va, vb = a.get(key, "(absent)"), b.get(key, "(absent)")
        if str(va) != str(vb):
            out.append({"key": clip(key), "a": clip(str(va), LINE_MAX),
                        "b": clip(str(vb), LINE_MAX)})
    return out


def script_digest(path: str) -> str:
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return ""

