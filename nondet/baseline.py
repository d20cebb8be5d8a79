"""Baselines: a small step-level capture, committed to the repository, that later runs of the
same script are compared with (one run instead of two).

A baseline holds the step rows (fingerprints of data, loss, gradients, parameters, buffers,
optimizer state and RNG states per step) and the environment: kilobytes for a short check,
no tensor values, nothing secret beyond the script's path and the machine's description.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from nondet.environment import INFORMATIONAL, differences
from nondet.errors import NondetError
from nondet.printable import LINE_MAX, clip
from nondet.store import Capture, open_capture

#: Environment keys that describe a run without changing its numbers (the fingerprint
#: scheme changes every number, and is checked before the run: ``scheme_mismatch``).
NOT_DRIFT = (*INFORMATIONAL, "platform", "cpu_count", "fingerprint_scheme")


def load(path: Path) -> Capture:
    if not path.exists():
        raise NondetError(f"baseline not found: {path}; write it with "
                          f"`nondet check --update-baseline --baseline {path} SCRIPT`")
    return open_capture(path)


def save(capture_path: Path, destination: Path) -> int:
    """Store a finished run's capture as the baseline; returns its size in bytes.

    Written next to the destination and renamed over it, so a failed write never leaves a
    half baseline (or destroys the old one); trouble writing is the user's (exit 2).
    """
    if destination.exists() and _same_file(capture_path, destination):
        return destination.stat().st_size
    # a symbolic link (baselines kept in one place, linked from each project) is followed:
    # its target is the baseline renewed, the link stays
    destination = Path(os.path.realpath(destination)) if destination.is_symlink() else destination
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(capture_path, temporary)
        os.replace(temporary, destination)
        return destination.stat().st_size
    except OSError as exc:
        if temporary.exists():
            temporary.unlink(missing_ok=True)
        raise NondetError(f"cannot write the baseline {_text(destination)}: "
                          f"{exc.strerror or exc}") from exc


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def script_mismatch(baseline: Capture, script: str | None, module: str | None,
                    digest: str) -> str:
    """Why the baseline is of another script than the one to check ("" if it is the same).

    The content (sha256) decides for scripts; a moved checkout (another absolute path) with
    the same content is the same script.
    """
    attrs: dict[str, Any] = baseline.attrs
    base_module = str(attrs.get("module") or "")
    base_script = str(attrs.get("script") or "")
    base_digest = str(attrs.get("script_sha256") or "")
    if module or base_module:
        if module != base_module:
            was = f"-m {base_module}" if base_module else base_script or "?"
            return f"it was made from {was}, this check runs {f'-m {module}' if module else script}"
        return ""
    if base_digest and digest and base_digest != digest:
        if Path(base_script).name != Path(script or "").name:
            return f"it was made from {base_script} (sha256 {base_digest[:12]}), this check " \
                   f"runs {script} (sha256 {digest[:12]})"
        return f"{script} has changed since it was made (sha256 {base_digest[:12]} then, " \
               f"{digest[:12]} now)"
    return ""


def args_mismatch(baseline: Capture, module: str | None, args: list[str]) -> str:
    """Why the baseline ran the script with other arguments than this check ("" if the
    same, or if the baseline does not say): ``--gamma 0.98`` against a baseline made
    without it trains another model, which a step comparison reports as nondeterminism."""
    command = baseline.attrs.get("command")
    try:  # stored as JSON text (a capture is untrusted input: anything else says nothing)
        command = json.loads(command) if isinstance(command, str) else command
    except ValueError:
        return ""
    if not isinstance(command, list) or not all(isinstance(x, str) for x in command):
        return ""
    base_args = command[2:] if module else command[1:]  # after "-m module" or the script
    if base_args == list(args):
        return ""
    return (f"it was made with the arguments {_shown(base_args)}, this check runs "
            f"{_shown(list(args))}")


def _shown(args: list[str]) -> str:
    return clip(shlex.join(args), LINE_MAX) if args else "(none)"


def _text(path: Path) -> str:
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def scheme_mismatch(baseline: Capture, scheme: str) -> str:
    """How the baseline's fingerprints were computed, if not as this nondet computes them
    (``fingerprint.SCHEME``): every step would differ, whatever the environment, so no
    option compares them; the baseline must be written again. "" if alike."""
    made = str(baseline.env.get("fingerprint_scheme", ""))
    if not made or made == scheme:
        return ""  # none recorded (a capture from before schemes were): checked after the run
    return (f"fingerprint scheme {clip(made) if made else '(none recorded)'} (nondet "
            f"{clip(str(baseline.env.get('nondet_version', '?')))}), this nondet computes "
            f"scheme {scheme}")


def drift(baseline: Capture, current: Capture) -> list[dict[str, str]]:
    """Environment differences that void a bitwise comparison (versions, devices, thread
    counts, determinism switches and variables)."""
    return [d for d in differences(baseline.env, current.env) if d["key"] not in NOT_DRIFT]


def describe_drift(items: list[dict[str, str]]) -> str:
    return ", ".join(f"{d['key']} (baseline {d['a']}, now {d['b']})" for d in items)
