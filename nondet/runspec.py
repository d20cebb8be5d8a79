"""What a recorded run is: the target, its plan and its result, and what its child is told.

Plain values shared by everything that starts, schedules or judges runs (``launch`` for one
process, ``distributed`` for a torchrun job, the schedules, narrowing and verification),
so that none of them needs the process machinery to name a run: ``child_config`` (the
``ChildConfig`` a child reads), ``child_env`` (its environment) and ``capture_attrs`` (the
root attributes of its capture).
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nondet import environment, importpath, interventions, readback
from nondet.errors import NondetError
from nondet.printable import LINE_MAX, clip
from nondet.session import CONFIG_ENV, ChildConfig

#: When this nondet invocation began (real time): a file newer than this that a run reads
#: was written by one of its runs (``readback``).
_INVOCATION_STARTED = time.time()


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name, plus the script's own arguments."""

    script: str | None
    module: str | None
    args: tuple[str, ...] = ()
    #: torchrun's own options (``--nproc-per-node 2 ...``) for a distributed job, else None:
    #: the job is launched by ``nondet.distributed``, one capture per rank
    launcher: tuple[str, ...] | None = None

    def check(self) -> None:
        if self.script is not None:
            path = Path(self.script)
            if not path.exists():
                raise NondetError(f"script not found: {self.script}")
            if path.is_dir() and (path / "__main__.py").is_file():
                return  # python runs a directory by its __main__.py, and so do we
            if not path.is_file():
                raise NondetError(f"not a script file: {self.script}")

    @property
    def command(self) -> list[str]:
        head = ["-m", str(self.module)] if self.module else [str(self.script)]
        return [*head, *self.args]

    def describe(self) -> str:
        """The command as a line to show (cut: 4,000 file names as arguments were printed
        whole in every progress line, the verdict and the JUnit name)."""
        if self.launcher is not None:
            return clip(shlex.join(["torchrun", *self.launcher, *self.command]), LINE_MAX)
        return clip(shlex.join(self.command), LINE_MAX)


@dataclass(frozen=True)
class Plan:
    """What one run captures and when it stops."""

    label: str  # "a", "b", "a-ops", ...
    op_steps: list[int] | None  # steps with op-level recording (None: every step)
    stop_after: int | None = None  # last step to run
    dump: tuple[int, int] | None = None  # (step, record index) whose outputs to save
    lockstep: bool = False  # take turns with another run (schedule.Lockstep)
    keep_bytes: int = 0  # keep op outputs of op-captured steps, for dump requests
    # op_steps is the first pair's default window: a framework whose op-level capture costs
    # the whole run (TensorFlow) may record none and say so (session.ChildConfig)
    ops_optional: bool = False


@dataclass
class RunResult:
    label: str
    path: Path
    log_path: Path
    status: str  # one of channel.STATUSES
    exit_code: int
    steps: int
    error: str = ""
    hook_error: str = ""
    final: dict[str, Any] = field(default_factory=dict)
    unsupported: str = ""  # channel.META_UNSUPPORTED: what nondet cannot record, one line
    write_error: str = ""  # the parent could not write the capture: one line saying why
    idle_ended: float = 0.0  # > 0: nondet ended the run after this many idle seconds
    outlived: float = 0.0  # > 0: ... this many quiet seconds after its twin had ended

    @property
    def idle_note(self) -> str:
        if self.outlived:
            return (f"run {self.label} sent nothing for {self.outlived:.0f} s after the "
                    f"other run had ended ({self.steps} steps), several times longer than "
                    "that run ever went quietly: nondet ended it and compared the steps both "
                    "runs have (a loop that never ends in one run only, or a run far slower "
                    "than the other)")
        if not self.idle_ended:
            return ""
        return (f"run {self.label} sent nothing and used no CPU for {self.idle_ended:.3g} s "
                f"after its last step ({self.steps} steps): nondet ended it and compared the "
                "steps it recorded (NONDET_IDLE_AFTER sets the limit)")

    @property
    def complete(self) -> bool:
        return self.status in ("complete", "stopped")

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


#: How much of a run's log is read for the lines shown under an error (its end only), and
#: how long a line shown may be. The whole log was read, and its last lines printed whole:
#: a script that drew a progress bar with carriage returns (one "line" of hundreds of MB)
#: and then failed had nondet hold the log in memory and print 12 MB to the terminal.
TAIL_BYTES = 64 * 1024


def invocation_started() -> float:
    """When this nondet invocation began (real time): what its runs wrote is newer."""
    return _INVOCATION_STARTED


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log, read from its last ``TAIL_BYTES``, each cut to
    ``printable.LINE_MAX`` characters (start and end kept)."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(size - TAIL_BYTES, 0))
            data = log.read(TAIL_BYTES)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace").rstrip()
    return "\n".join(clip(line, LINE_MAX) for line in text.splitlines()[-lines:])


def child_config(target: Target, plan: Plan, seed: int) -> ChildConfig:
    """What a recorded run is told (its descriptors are filled in when it starts)."""
    return ChildConfig(
        label=plan.label, seed=seed, channel_fd=-1, control_fd=-1,
        script=os.path.abspath(target.script) if target.script else None,
        module=target.module, args=list(target.args),
        op_steps=plan.op_steps, stop_after=plan.stop_after, dump=plan.dump,
        lockstep=plan.lockstep, keep_bytes=plan.keep_bytes, ops_optional=plan.ops_optional,
    )


def child_env(config: ChildConfig, extra_env: dict[str, str]) -> dict[str, str]:
    """A recorded run's environment: ours, the interventions, its config, a fixed
    PYTHONHASHSEED (unless the user set one) and nondet importable (``importpath``)."""
    # nondet's own list of fixes for a run is set here only: one in the caller's environment
    # (a leftover export, a recorded run's child invoking nondet) was applied silently, and
    # a racing script was called deterministic (faults round 11)
    env = {**{k: v for k, v in os.environ.items() if k != interventions.APPLY_ENV},
           **extra_env}
    config.startup_env = importpath.startup_env(env)
    # The script's arguments travel as the run's own argv (``child_argv``), as they would
    # to ``python train.py``: in this one variable 4,000 file names (200 KB) exceeded the
    # kernel's limit on one string of the environment (128 KiB), "Argument list too long",
    # and nondet ended "internal error", exit 3, where python ran the script.
    env[CONFIG_ENV] = replace(config, args=[], args_in_argv=True).to_env()
    env.setdefault(readback.STARTED_ENV, str(_INVOCATION_STARTED))
    env.setdefault("PYTHONHASHSEED", str(config.seed % 2**32))
    return env


def child_argv(config: ChildConfig) -> list[str]:
    """The arguments after ``-m nondet.boot``: the script's (``child_env``)."""
    return list(config.args)


def capture_attrs(target: Target, plan: Plan, seed: int, rank: int = 0,
                  world_size: int = 1) -> dict[str, Any]:
    """The root attributes of a run's capture (a rank's, in a distributed job)."""
    return {
        "label": plan.label,
        "command": target.command,
        "script": target.script or "",
        "module": target.module or "",
        "script_sha256": environment.script_digest(target.script) if target.script else "",
        "seed": seed,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "cwd": os.getcwd(),
        "rank": rank,
        "world_size": world_size,
        "op_steps": "all" if plan.op_steps is None else plan.op_steps,
    }
