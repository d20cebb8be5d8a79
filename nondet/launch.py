"""Parent side of a captured run: the child process, its environment, and its capture file.

``CapturedRun`` starts ``python -m nondet.boot`` with the seed and plan in its environment,
stores everything the child streams into the run's HDF5 file, keeps the step rows in memory
(for live comparison and progress) and tells the child to stop when asked.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from nondet import channel, environment
from nondet.capture import CONFIG_ENV, ChildConfig
from nondet.errors import NondetError
from nondet.records import OP_DTYPE, STEP_DTYPE, TENSOR_DTYPE
from nondet.store import CaptureWriter

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name, plus the script's own arguments."""

    script: str | None
    module: str | None
    args: tuple[str, ...] = ()

    def check(self) -> None:
        if self.script is not None:
            path = Path(self.script)
            if not path.exists():
                raise NondetError(f"script not found: {self.script}")
            if not path.is_file():
                raise NondetError(f"not a script file: {self.script}")

    @property
    def command(self) -> list[str]:
        head = ["-m", str(self.module)] if self.module else [str(self.script)]
        return [*head, *self.args]

    def describe(self) -> str:
        return shlex.join(self.command)


@dataclass(frozen=True)
class Plan:
    """What one run captures and when it stops."""

    label: str  # "a", "b", "a-ops", ...
    op_steps: list[int] | None  # steps with op-level capture (None: every step)
    stop_after: int | None = None  # last step to run
    dump: tuple[int, int] | None = None  # (step, record index) whose outputs to save
    lockstep: bool = False  # take turns with another run (see Lockstep)
    keep_bytes: int = 0  # keep op outputs of op-captured steps, for dump requests


@dataclass
class RunResult:
    label: str
    path: Path
    log_path: Path
    status: str  # complete | stopped | failed | interrupted | crashed
    exit_code: int
    steps: int
    error: str = ""
    hook_error: str = ""
    final: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.status in ("complete", "stopped")

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").rstrip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class CapturedRun:
    """One child process and the thread that stores its stream."""

    def __init__(self, target: Target, plan: Plan, seed: int, out_dir: Path,
                 on_step: Callable[[CapturedRun, np.void], None] | None = None,
                 echo: bool = False,
                 on_end: Callable[[CapturedRun], None] | None = None) -> None:
        self.target = target
        self.plan = plan
        self.seed = seed
        self.path = out_dir / f"run-{plan.label}.h5"
        self.log_path = out_dir / f"run-{plan.label}.log"
        self.on_step = on_step
        self.on_end = on_end
        self.echo = echo
        self.steps: list[np.void] = []
        self.ops: dict[int, list[np.ndarray]] = {}  # op records per step, as they arrive
        self.strings: list[str] = []
        self.kept: dict[tuple[int, int], list[np.ndarray]] = {}  # answers to dump requests
        self._incoming: dict[tuple[int, int], list[np.ndarray]] = {}
        self._dumps_done = threading.Condition()
        self.end: dict[str, Any] | None = None
        self.hook_error = ""
        self._stop_sent = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._result_cache: RunResult | None = None
        self._end_reported = False

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        data_r, data_w = os.pipe()
        ctrl_r, ctrl_w = os.pipe()
        config = ChildConfig(
            label=self.plan.label, seed=self.seed, channel_fd=data_w, control_fd=ctrl_r,
            script=os.path.abspath(self.target.script) if self.target.script else None,
            module=self.target.module, args=list(self.target.args),
            op_steps=self.plan.op_steps, stop_after=self.plan.stop_after, dump=self.plan.dump,
            lockstep=self.plan.lockstep, keep_bytes=self.plan.keep_bytes,
        )
        env = dict(os.environ)
        env[CONFIG_ENV] = config.to_env()
        env.setdefault("PYTHONHASHSEED", str(self.seed % 2**32))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
        self.writer = CaptureWriter(self.path, {
            "label": self.plan.label,
            "command": self.target.command,
            "script": self.target.script or "",
            "module": self.target.module or "",
            "script_sha256": environment.script_digest(self.target.script)
            if self.target.script else "",
            "seed": self.seed,
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "cwd": os.getcwd(),
            "rank": 0,
            "world_size": 1,
            "op_steps": "all" if self.plan.op_steps is None else self.plan.op_steps,
        })
        self._log: BinaryIO = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "nondet.boot"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            pass_fds=(data_w, ctrl_r),
        )
        os.close(data_w)
        os.close(ctrl_r)
        self._ctrl_w = ctrl_w
        self._threads = [
            threading.Thread(target=self._pump_frames, args=(data_r,), daemon=True),
            threading.Thread(target=self._pump_output, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def request_stop(self) -> None:
        """Ask the child to stop at its next step boundary (idempotent)."""
        if self._stop_sent:
            return
        self._stop_sent = True
        self.send_control(channel.STOP)

    def send_control(self, message: bytes) -> None:
        try:
            os.write(self._ctrl_w, message)
        except OSError:
            pass  # the child is gone

    def request_kept(self, step: int, index: int, timeout: float = 120.0
                     ) -> list[np.ndarray] | None:
        """Lockstep, while the child waits: fetch the outputs it kept for (step, index).

        Returns None if the child could not answer (it ended, or it kept nothing there:
        an empty list)."""
        self.send_control(channel.dump_request(step, index))
        with self._dumps_done:
            self._dumps_done.wait_for(
                lambda: (step, index) in self.kept or self._end_reported, timeout)
        return self.kept.get((step, index))

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait(self) -> RunResult:
        assert self._proc is not None
        try:
            code = self._proc.wait()
        except KeyboardInterrupt:
            self.interrupt()
            raise
        self._finish_threads()
        return self._result(code)

    def interrupt(self) -> RunResult | None:
        """Ctrl-C: the child got SIGINT too; give it time to end cleanly, then kill it.

        The capture is closed either way, marked with how the run ended.
        """
        if self._result_cache is not None:
            return self._result_cache
        code = self._interrupt()
        self._finish_threads()
        return self._result(code)

    def _interrupt(self) -> int:
        assert self._proc is not None
        for sig, patience in ((None, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if sig is not None and self._proc.poll() is None:
                self._proc.send_signal(sig)
            try:
                return self._proc.wait(timeout=patience)
            except subprocess.TimeoutExpired:
                continue
            except KeyboardInterrupt:
                continue
        return self._proc.wait()

    def _finish_threads(self) -> None:
        if self._log.closed:
            return
        for thread in self._threads:
            thread.join(timeout=30)
        try:
            os.close(self._ctrl_w)
        except OSError:
            pass
        self._log.close()

    def _result(self, code: int) -> RunResult:
        if self._result_cache is not None:
            return self._result_cache
        end = self.end or {}
        if end:
            status = str(end.get("status", "complete"))
        elif code < 0:
            status = "crashed"
        elif code == 0:
            status = "complete"
        else:
            status = "crashed"
        if status == "interrupted" or code in (130, -signal.SIGINT):
            status = "interrupted"
        self.writer.close(status, code)
        self._result_cache = RunResult(
            label=self.plan.label, path=self.path, log_path=self.log_path, status=status,
            exit_code=code, steps=sum(1 for r in self.steps if int(r["step"]) >= 0),
            error=str(end.get("error", "")), hook_error=self.hook_error,
            final={k: v for k, v in end.items() if k.startswith("final_")},
        )
        return self._result_cache

    # -- threads ---------------------------------------------------------------------------------
    def _pump_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        prefix = f"[{self.plan.label}] ".encode()
        for line in iter(self._proc.stdout.readline, b""):
            self._log.write(line)
            self._log.flush()
            if self.echo:
                sys.stderr.buffer.write(prefix + line)
                sys.stderr.flush()

    def _pump_frames(self, fd: int) -> None:
        try:
            self._read_frames(fd)
        finally:
            os.close(fd)
            self._ended()

    def _read_frames(self, fd: int) -> None:
        parser = channel.FrameParser()
        idle_since: float | None = None
        while True:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    return
                idle_since = None
                for kind, payload in parser.feed(data):
                    self._handle(kind, payload)
                continue
            # The child may have exited while a forked grandchild (a DataLoader worker)
            # still holds the pipe open: stop once it ended and the pipe is quiet.
            if self._proc is not None and self._proc.poll() is not None:
                if self.end is not None:
                    return
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.0:
                    return

    def _ended(self) -> None:
        """Tell the owner once that this run will send no more steps."""
        if self._end_reported:
            return
        self._end_reported = True
        with self._dumps_done:
            self._dumps_done.notify_all()
        if self.on_end is not None:
            self.on_end(self)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        writer = self.writer
        if kind == channel.STEP:
            row = np.frombuffer(payload, dtype=STEP_DTYPE)
            writer.add_step(row)
            self.steps.append(row[0])
            if self.on_step is not None:
                self.on_step(self, row[0])
        elif kind == channel.OPS:
            rows = np.frombuffer(payload, dtype=OP_DTYPE)
            writer.add_ops(rows)
            if len(rows):
                self.ops.setdefault(int(rows["step"][0]), []).append(rows)
        elif kind == channel.TENSORS:
            writer.add_tensors(np.frombuffer(payload, dtype=TENSOR_DTYPE))
        elif kind == channel.STRINGS:
            strings = json.loads(payload)
            writer.add_strings(strings)
            self.strings.extend(strings)
        elif kind == channel.META:
            meta = json.loads(payload)
            if "env" in meta:
                writer.add_env(meta["env"])
            if "hook_error" in meta:
                self.hook_error = meta["hook_error"]
            if "dump_done" in meta:
                step, index, _ = meta["dump_done"]
                with self._dumps_done:
                    self.kept[(step, index)] = self._incoming.pop((step, index), [])
                    self._dumps_done.notify_all()
        elif kind == channel.FACTS:
            writer.add_facts(json.loads(payload))
        elif kind == channel.DUMP:
            header_end = payload.index(b"\n")
            header = json.loads(payload[:header_end])
            array = np.frombuffer(payload[header_end + 1 :], dtype=np.dtype(header["dtype"]))
            name = header.pop("name")
            array = array.reshape(header.pop("shape"))
            writer.add_dump(name, array, {k: v for k, v in header.items() if k != "dtype"})
            if name.startswith("kept-"):
                self._incoming.setdefault((header["step"], header["index"]), []).append(array)
        elif kind == channel.END:
            self.end = json.loads(payload)
            self._ended()



class Lockstep:
    """Two runs that take turns: A runs a step while B waits, then B runs it while A waits.

    Only one run computes at a time, so neither slows the other down (two processes with
    their own thread pools on the same cores can each run several times slower), yet they
    start together (imports and set-up overlap) and both stop as soon as the answer is
    known. A run in lockstep waits after each step until told to go on
    (``capture.Session.end_step``); when one run ends, the other is set free.

    ``judge(step, row_a, row_b)`` sees each step once both rows are in (a missing row is
    None) and returns False to stop both runs.
    """

    def __init__(self, a: CapturedRun, b: CapturedRun,
                 judge: Callable[[int, np.void | None, np.void | None], bool],
                 hold: bool = False) -> None:
        self.runs = (a, b)
        self.judge = judge
        self.hold = hold  # when the judge says stop, keep both waiting until release()
        self.held = threading.Event()  # set when holding, or when both runs have ended
        self._lock = threading.Lock()
        self._rows: dict[CapturedRun, dict[int, np.void]] = {a: {}, b: {}}
        self._waiting: dict[CapturedRun, int | None] = {a: None, b: None}
        self._ended: set[CapturedRun] = set()
        self._judged: set[int] = set()
        self._stopping = False
        self._holding = False
        for run in self.runs:
            run.on_step = self._on_row
            run.on_end = self._on_end

    def start(self) -> None:
        for run in self.runs:
            run.start()

    def wait_held(self) -> bool:
        """Block until the runs are held (True) or have both ended (False)."""
        while not self.held.wait(0.5):
            if not any(run.running() for run in self.runs) and len(self._ended) == 2:
                break
        with self._lock:
            return self._holding

    def release(self) -> None:
        """End a hold: both runs stop (or, if they already ended, exit)."""
        with self._lock:
            self._holding = False
            for run in self.runs:
                run.send_control(channel.STOP)

    def wait(self) -> tuple[RunResult, RunResult]:
        try:
            results = [run.wait() for run in self.runs]
        except KeyboardInterrupt:
            for run in self.runs:
                run.interrupt()
            raise
        return results[0], results[1]

    def _on_row(self, run: CapturedRun, row: np.void) -> None:
        with self._lock:
            step = int(row["step"])
            self._rows[run][step] = row
            if run not in self._ended:
                self._waiting[run] = step
            self._advance()

    def _on_end(self, run: CapturedRun) -> None:
        with self._lock:
            self._ended.add(run)
            self._waiting[run] = None
            self._advance()
            if len(self._ended) == 2:
                # Runs that ended on their own wait for us (Session.finish) if they keep
                # outputs: hold them there too, unless they were already told to stop.
                self._holding = self.hold and not self._stopping
                self.held.set()

    def _advance(self) -> None:
        a, b = self.runs
        self._judge_complete_steps()
        if self._stopping:
            return  # both were told to stop
        if self._ended:
            for run in self.runs:  # the other run has nobody to take turns with
                if self._waiting[run] is not None:
                    self._waiting[run] = None
                    run.send_control(channel.FREE)
            return
        ka, kb = self._waiting[a], self._waiting[b]
        if ka is None or kb is None:
            return  # one of them is still computing its step
        if ka == kb:
            self._release(a)  # both finished step k: A goes first with k + 1
        elif ka > kb:
            self._release(b)  # A is a step ahead: B catches up

    def _release(self, run: CapturedRun) -> None:
        self._waiting[run] = None
        run.send_control(channel.GO)

    def _judge_complete_steps(self) -> None:
        a, b = self.runs
        rows_a, rows_b = self._rows[a], self._rows[b]
        both_done = a in self._ended and b in self._ended
        for step in sorted(set(rows_a) | set(rows_b)):
            if step in self._judged:
                continue
            have_both = step in rows_a and step in rows_b
            one_ended = (step in rows_a and b in self._ended) or (step in rows_b
                                                                 and a in self._ended)
            if not (have_both or one_ended or both_done):
                continue
            self._judged.add(step)
            if not self.judge(step, rows_a.get(step), rows_b.get(step)) and not self._stopping:
                self._stopping = True
                if self.hold and not self._ended:
                    self._holding = True  # both are waiting at this step: keep them there
                    self.held.set()
                    return
                for run in self.runs:
                    if run not in self._ended:
                        run.request_stop()
