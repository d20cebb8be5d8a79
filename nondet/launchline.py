"""The torchrun launch line after nondet's options: recognised, and split with torchrun's own
argument parser into torchrun's options (kept as written: ``Target.launcher``), the script
and the script's arguments. Running the job is ``nondet.distributed``."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

from nondet.errors import NondetError
from nondet.runspec import Target

#: The words that start a torchrun launch line (after nondet's options).
_TORCHRUN = ("torchrun",)
RUN_MODULE = "torch.distributed.run"


# -- the launch line --------------------------------------------------------------------------
def is_launch_line(words: tuple[str, ...], module: str | None) -> bool:
    """Does SCRIPT [ARGS] (or ``-m MODULE``) start a torchrun launch line?"""
    if module == RUN_MODULE:
        return True
    if not words:
        return False
    head = os.path.basename(words[0])
    if head in _TORCHRUN and (not os.path.isfile(words[0]) or _torchrun_entry(words[0])):
        return True
    return (head.startswith("python") and len(words) >= 3 and words[1] == "-m"
            and words[2] == RUN_MODULE)


def _torchrun_entry(path: str) -> bool:
    """Is the file ``path`` (named torchrun) torch's console script, as in ``nondet run
    $(which torchrun) ...`` or ``.venv/bin/torchrun``, and not a script of the user's that
    happens to be called so? Before, it was run as the script: torchrun's workers were not
    recorded and the run ended in "no training step was observed"."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and RUN_MODULE.encode() in head


def parse_launch_line(words: tuple[str, ...], module: str | None) -> Target:
    """The target of ``torchrun [TORCHRUN_ARGS] SCRIPT [ARGS]`` (or ``python -m
    torch.distributed.run ...``, or nondet's ``-m torch.distributed.run ...``): torchrun's
    own options are kept as written, parsed by torchrun's parser to find the script."""
    if module == RUN_MODULE:
        rest = list(words)
    elif os.path.basename(words[0]) in _TORCHRUN:
        rest = list(words[1:])
    else:
        rest = list(words[3:])
    parsed = _torchrun_parse(rest)
    script = str(parsed.training_script)
    script_args = tuple(str(a) for a in parsed.training_script_args)
    options = rest[: len(rest) - len(script_args) - 1]
    if parsed.no_python:
        raise NondetError("nondet records Python scripts: drop torchrun's --no-python")
    as_module = bool(parsed.module)
    options = [o for o in options if o not in ("-m", "--module")]
    if parsed.run_path:
        options = [o for o in options if o != "--run-path" and o != "--run_path"]
    return Target(script=None if as_module else script, module=script if as_module else None,
                  args=script_args, launcher=tuple(options))


def multi_node(launcher: tuple[str, ...]) -> bool:
    """Does torchrun's ``--nnodes`` allow more than one node (``2``, ``1:4``)?"""
    for i, word in enumerate(launcher):
        if word.startswith(("--nnodes", "--nnodes_")):
            value = word.split("=", 1)[1] if "=" in word else (
                launcher[i + 1] if i + 1 < len(launcher) else "1")
            return value.split(":")[-1] != "1"
    return False


def shorthand(nproc_per_node: int, target: Target) -> Target:
    """``--nproc-per-node N SCRIPT``: a single-node torchrun job."""
    return Target(script=target.script, module=target.module, args=target.args,
                  launcher=("--nproc-per-node", str(nproc_per_node)))


def _torchrun_parse(words: list[str]) -> Any:
    try:
        from torch.distributed.run import get_args_parser
    except ImportError:
        raise NondetError("a torchrun launch line needs torch: pip install torch") from None
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(errors):
            return get_args_parser().parse_args(words)
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if line.strip()]
        why = lines[-1].split("error: ", 1)[-1] if lines else "cannot be parsed"
        raise NondetError(f"the torchrun launch line: {why} (write it as "
                          "`nondet run torchrun [TORCHRUN_ARGS] SCRIPT [ARGS]`)") from None
