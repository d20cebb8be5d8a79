"""Parent side of a recorded run: the child process, its environment, and its capture file.

``CapturedRun`` starts ``python -m nondet.boot`` with the seed and plan in its environment,
stores everything the child streams into the run's HDF5 file, keeps the step rows in memory
(for live comparison and progress) and tells the child to stop when asked. What a run is
(``Target``, ``Plan``, ``RunResult``, the child's config) is ``nondet.runspec``; how two
runs share the machine (lockstep, one after the other) is ``nondet.schedule``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from nondet import channel, child_captures, idle, inherited, outdir, output, own_group
from nondet.errors import NondetError, Terminated
from nondet.runspec import Plan as Plan  # re-exported: tests and callers name runs here
from nondet.runspec import RunResult as RunResult
from nondet.runspec import Target as Target
from nondet.runspec import capture_attrs, child_argv, child_config, child_env
from nondet.store import CaptureWriter
from nondet.store.writer import IDLE_ENDED
from nondet.stream import STORE_SECONDS, RunStream, ensure_space, write_failure
from nondet.worker_seeds import seeds_file

#: seconds a run that closed nondet's pipe (from C: ``fdguard``) may take to open it again
#: (its watcher does within half a second) before nondet gives up on recording it
CHANNEL_GRACE = 10.0
#: seconds a run gets to end on a SIGINT nondet got, outside a terminal's foreground, before
#: it is sent its own (``Run._interrupt_script``)
INTERRUPT_WAIT = 2.0


class CapturedRun(RunStream):
    """One child process, and the threads that store its stream (``RunStream``) and its
    output."""

    def __init__(self, target: Target, plan: Plan, seed: int, out_dir: Path,
                 on_step: Callable[[CapturedRun, np.void], None] | None = None,
                 echo: bool = False,
                 on_end: Callable[[CapturedRun], None] | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        super().__init__(out_dir / f"run-{plan.label}.h5")
        self.extra_env = extra_env or {}  # interventions (nondet.interventions.environment)
        self.target = target
        self.plan = plan
        self.seed = seed
        self.log_path = out_dir / f"run-{plan.label}.log"
        for made in (self.path, self.log_path,  # nondet's own, for pruning later
                     Path(seeds_file(str(out_dir), plan.label))):
            outdir.claim(made)
        self.on_step = on_step
        self.on_end = on_end
        self.echo = echo
        self._echo_closed = False  # nondet's stderr went away: the output goes to the log only
        self._stop_sent = False
        self._interrupted = False
        self._cancelled = False  # nondet itself is ending (Ctrl-C, SIGTERM): see cancel()
        self._freed = False  # let go on its own while cancelled (request_stop)
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._result_cache: RunResult | None = None
        self._ctrl_w = -1  # parent end of the control pipe, once started
        self._ctrl_r = -1  # and the run's end of it, kept (see start)
        self._ctrl_lock = threading.Lock()
        self._log: BinaryIO | None = None
        self._idle: idle.IdleWatch | None = None
        self._idle_ended = 0.0
        self._outlived = 0.0  # > 0: ended by ``end_if_outlived`` after this many seconds
        self._child_fds = (-1, -1)  # the channel's descriptor numbers in the child

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._proc is not None:
            return  # started already (an early narrowing run: nondet.live)
        config = child_config(self.target, self.plan, self.seed)
        config.children_dir = str(self.path.parent)
        try:
            ensure_space(self.path, 0)
            self.writer = self._open_writer()
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in _finish_threads
        except OSError as exc:
            self._close_writer(channel.WRITE_FAILED, None)
            raise NondetError(write_failure(self.path, exc)) from None
        data_r, data_w = os.pipe()
        ctrl_r, ctrl_w = os.pipe()
        config.channel_fd, config.control_fd = data_w, ctrl_r
        # where the run opens the pipes again if the script closes its ends (fdguard.live)
        config.channel_path = f"/proc/{os.getpid()}/fd/{data_r}"
        config.control_path = f"/proc/{os.getpid()}/fd/{ctrl_w}"
        self._child_fds = (data_w, ctrl_r)  # pass_fds keeps the numbers
        env = child_env(config, self.extra_env)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "nondet.boot", *child_argv(config)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            pass_fds=(data_w, ctrl_r, *inherited.descriptors()),  # the launcher's, as python's
        )
        os.close(data_w)
        # ctrl_r stays open here: a word sent while the script has closed the run's end
        # (before the run reopens it) waits in the pipe instead of being lost (EPIPE); and
        # a write never blocks, whatever the run does not read
        self._ctrl_r = ctrl_r
        os.set_blocking(ctrl_w, False)
        self._ctrl_w = ctrl_w
        self._idle = idle.IdleWatch(self._proc.pid, idle.idle_after())
        self._threads = [
            threading.Thread(target=self._pump_frames, args=(data_r,), daemon=True),
            threading.Thread(target=self._pump_output, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _open_writer(self) -> CaptureWriter:
        return CaptureWriter(self.path, capture_attrs(self.target, self.plan, self.seed),
                             store_every=STORE_SECONDS)

    def request_stop(self) -> None:
        """Ask the child to stop at its next step boundary (idempotent). While nondet is
        being cancelled and the child has not ended, it is let go on its own instead (FREE):
        its signal says how it ended, and one waiting for its turn (a script that finishes
        its step on the signal) must not wait for a word that never comes."""
        if self._stop_sent:
            return
        if self._cancelled and self.end is None:
            if not self._freed:
                self._freed = True
                self.send_control(channel.FREE)
            return
        self._stop_sent = True
        self.send_control(channel.STOP)

    def send_control(self, message: bytes) -> None:
        if self._idle is not None:
            self._idle.word()  # what it waited for until now was nondet's word
        with self._ctrl_lock:  # never write to a closed (perhaps reused) descriptor
            if self._ctrl_w < 0:
                return  # never started, or already collected
            try:
                os.write(self._ctrl_w, message)
            except OSError:
                pass  # the child is gone

    def _close_control(self) -> None:
        with self._ctrl_lock:
            for fd in (self._ctrl_w, self._ctrl_r):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._ctrl_w = self._ctrl_r = -1

    def request_kept(self, step: int, index: int, timeout: float = 120.0
                     ) -> list[np.ndarray] | None:
        """Lockstep, while the child waits: fetch the outputs it kept for (step, index).

        Returns None if the child could not answer (it ended, or it kept nothing there:
        an empty list)."""
        self.send_control(channel.dump_request(step, index))
        with self._dumps_done:
            self._dumps_done.wait_for(
                lambda: (step, index) in self.kept or self._pipe_closed, timeout)
        return self.kept.get((step, index))

    def end_if_idle(self) -> bool:
        """End the run, with every process it started, if it has gone idle
        (``nondet.idle``: no frame, no CPU for the limit): the script has stopped training
        without ending, its capture is closed as ``stopped`` holding the steps it recorded;
        or the script ended (its END was sent) but the process does not exit (it waits at
        exit for a process it started that never ends), and the run keeps its END's status.
        Only for a run nobody makes wait (the schedule's part). True if it was ended."""
        watch = self._idle
        if watch is None or not self.running() or not watch.idle():
            return False
        self._end_quiet(watch.after)
        return True

    def end_if_outlived(self, twin: CapturedRun, floor: float) -> bool:
        """End the run, with every process it started, if its twin (the other run of the
        pair) has ended and this one has sent nothing for several times longer than the
        twin ever went quietly (``idle.IdleWatch.outlived``), computing or not: a loop that
        never ends in one run only. Its capture is closed as ``stopped`` holding the steps
        it recorded, as an idle run's is. True if it was ended."""
        watch, other = self._idle, twin._idle
        if (watch is None or other is None or not twin.ended or self.ended
                or not self.running()):
            return False
        quiet = watch.outlived(other, floor)
        if not quiet:
            return False
        self._end_quiet(quiet, outlived=True)
        return True

    def _end_quiet(self, seconds: float, outlived: bool = False) -> None:
        """End a run that went quiet for ``seconds``: idle, or outlived its twin. Only an
        idle one is marked ``idle_ended`` (it would never have gone on: its missing steps
        are a finding, ``analysis._extra_steps_count``); one that outlived its twin was
        computing, perhaps only slower, so its steps are compared with the twin's common
        ones and no more."""
        if outlived:
            self._outlived = seconds
        else:
            self._idle_ended = seconds
        self._interrupted = True
        code = self._terminate()
        self._finish_threads()
        self._result(code)

    def _terminate(self) -> int:
        assert self._proc is not None
        tree = self._descendants()  # before the script ends: its children then leave the tree
        for sig, patience in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self._proc.poll() is None:
                self._proc.send_signal(sig)
            try:
                code = self._proc.wait(timeout=patience)
            except subprocess.TimeoutExpired:
                continue
            _end_processes(tree)
            return code
        _end_processes(tree)
        return -signal.SIGKILL

    def _descendants(self) -> list[int]:
        """The processes the script started that share nondet's process group (its
        workers, a ``multiprocessing`` child), which a signal to the script alone leaves
        running once nondet ends the run (a descendant in a group of its own left the
        script's group on purpose, as under a shell)."""
        assert self._proc is not None
        try:
            return own_group.run_processes(self._proc.pid, os.getpgrp())[1:]
        except OSError:
            return []

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait(self, timeout: float | None = None) -> RunResult:
        """The result once the child has exited; ``TimeoutError`` after ``timeout`` seconds
        (the child is left running)."""
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"run {self.plan.label} still running after {timeout} s") from None
        except (KeyboardInterrupt, Terminated) as exc:
            self.interrupt(forward=isinstance(exc, Terminated))
            raise
        self._finish_threads()
        return self._result(code)

    def cancel(self) -> None:
        """nondet is ending (Ctrl-C, SIGTERM): from now on the run is not told to stop at a
        step boundary, it is interrupted. Its twin, interrupted a moment earlier, ended, and
        turn-taking stopped this one (a step only one run has) before its own signal came:
        a cancelled job's capture said ``stopped``, as if nondet had ended it on purpose."""
        self._cancelled = True

    def interrupt(self, forward: bool = False) -> RunResult:
        """End the child: give it time to end cleanly, then SIGTERM, then SIGKILL.

        On Ctrl-C the child got SIGINT from the terminal already; ``forward`` sends it one
        (nondet itself was told to end: SIGTERM). The capture is closed either way, marked
        with how the run ended."""
        if self._result_cache is not None:
            return self._result_cache
        self._interrupted = True
        code = self._interrupt(forward)
        self._finish_threads()
        return self._result(code)

    def _interrupt(self, forward: bool) -> int:
        assert self._proc is not None
        tree = self._descendants()
        try:
            return self._interrupt_script(forward)
        finally:
            _end_processes(tree)  # the processes it started, had it not ended them itself

    def _interrupt_script(self, forward: bool) -> int:
        assert self._proc is not None
        # Ctrl-C in a terminal reached the child with nondet; a SIGINT sent to nondet alone
        # (``kill -INT``, a CI runner cancelling the job) did not. Without a terminal whose
        # foreground nondet is, nothing tells the two apart: a child still running after a
        # short wait is sent SIGINT too, so it ends as interrupted in seconds, before the
        # SIGTERM that would follow. (In a terminal's foreground, a second SIGINT so soon
        # would be a second Ctrl-C the user never pressed, cutting short a script's own
        # clean-up.)
        steps = (((signal.SIGINT, 10.0),) if forward else ((None, 10.0),)
                 if _terminal_foreground()
                 else ((None, INTERRUPT_WAIT), (signal.SIGINT, 10.0 - INTERRUPT_WAIT)))
        for sig, patience in (*steps, (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if sig is not None and self._proc.poll() is None:
                self._proc.send_signal(sig)
            try:
                return self._wait_letting_go(patience)
            except subprocess.TimeoutExpired:
                continue
            except (KeyboardInterrupt, Terminated):
                continue
        try:
            return self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return -signal.SIGKILL  # not reaped (uninterruptible sleep): give up waiting

    def _wait_letting_go(self, patience: float) -> int:
        """Wait up to ``patience`` seconds for the child to exit. One that has sent its end
        (the script ended, on its own or cleanly on the signal: finish the step, save,
        exit 0) may wait for nondet's word to go (lockstep): it is told to stop, or it
        would wait through every signal and be SIGKILLed (faults round 11)."""
        assert self._proc is not None
        deadline = time.monotonic() + patience
        while True:
            if self.end is not None:
                self.request_stop()
            try:
                return self._proc.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise

    def _finish_threads(self) -> None:
        if self._log is None or self._log.closed:
            return
        for thread in self._threads:
            thread.join(timeout=30)
        self._close_control()
        try:
            self._log.close()
        except OSError:
            pass  # disk full: what could be written was

    def _result(self, code: int) -> RunResult:
        if self._result_cache is not None:
            return self._result_cache
        end = self.end
        if self.write_error:
            status = channel.WRITE_FAILED
        elif end is not None:  # (one that then did not exit, ended as idle, keeps it)
            status = end.status
        elif self._idle_ended or self._outlived:
            status = channel.STOPPED  # ended on purpose, as at a step boundary
        elif code == 0:
            status = channel.COMPLETE
        elif self._interrupted:
            status = channel.INTERRUPTED  # we ended it before it could say how
        else:
            status = channel.CRASHED
        if code in (130, -signal.SIGINT) and status not in (channel.COMPLETE, channel.STOPPED):
            status = channel.INTERRUPTED
        self._close_writer(status, code, {IDLE_ENDED: self._idle_ended} if self._idle_ended
                           else None)
        child_captures.store(self.path)  # the run's recorded child processes, beside it
        self._result_cache = RunResult(
            label=self.plan.label, path=self.path, log_path=self.log_path, status=status,
            exit_code=code, steps=sum(1 for r in self.steps if int(r["step"]) >= 0),
            error=end.error if end else "", hook_error=self.hook_error,
            final=dict(end.final) if end else {}, write_error=self.write_error,
            unsupported=self.unsupported, idle_ended=self._idle_ended,
            outlived=self._outlived,
        )
        return self._result_cache

    # -- threads ---------------------------------------------------------------------------------
    def _pump_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        proc, stream = self._proc, self._proc.stdout
        output.pump(stream, lambda: proc.poll() is not None, self._store_output,
                    self._echo if self.echo else None, self.log_path)

    def _store_output(self, data: bytes) -> None:
        if self._log is not None and not self.write_error:
            try:
                self._log.write(data)
                self._log.flush()
            except OSError as exc:
                self._write_failed(exc, self.log_path)

    def _echo(self, lines: bytes) -> None:
        if self._echo_closed:
            return
        prefix = f"[{self.plan.label}] ".encode()
        try:
            for line in lines.splitlines(keepends=True):
                sys.stderr.buffer.write(prefix + line)
            sys.stderr.flush()
        except (OSError, ValueError):
            # nondet's stderr is gone (``nondet run -v ... 2>&1 | head``): the run's output
            # is still drained into its log, or the run would block writing it
            self._echo_closed = True

    def _pump_frames(self, fd: int) -> None:
        try:
            self._read_frames(fd)
        except Exception as exc:  # nondet's bug: an internal error, never a verdict
            self.hook_error = self.hook_error or (
                f"nondet's reader of the run failed: {type(exc).__name__}: {exc}")
            self.request_stop()
        finally:
            os.close(fd)
            with self._dumps_done:
                self._pipe_closed = True
                self._dumps_done.notify_all()
            if self._idle is not None:
                # its end: a twin's quiet spells include its tail
                self._idle.activity(counts=bool(self.steps))
            self._ended()

    def _dropped_by_script(self, fd: int) -> bool:
        """The pipe lost its writer while the run's process goes on without it: the script
        closed (or replaced) nondet's descriptor. A dying process loses it too, at exit:
        that one is a zombie, or gone, by now (or within moments: ``_read_frames``)."""
        if self._proc is None or self.end is not None or self._proc.poll() is not None:
            return False
        pid, number = self._proc.pid, self._child_fds[0]
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in (b"Z", b"X"):
            return False
        try:
            return os.readlink(f"/proc/{pid}/fd/{number}") != f"pipe:[{os.fstat(fd).st_ino}]"
        except OSError:
            return True  # no such descriptor in a live process

    def _channel_lost(self) -> None:
        data_fd, control_fd = self._child_fds
        self.unsupported = self.unsupported or (
            f"the script closed file descriptor {data_fd}, nondet's pipe from the run "
            f"(os.closerange, os.close or os.dup2 over it, or a library closing every "
            f"inherited descriptor from C), and it could not be opened again, so the run "
            f"could not be recorded; leave descriptors {data_fd} and {control_fd} open")

    def _read_frames(self, fd: int) -> None:
        parser = channel.FrameParser()
        idle_since: float | None = None
        lost_since: float | None = None  # the script closed the run's end of the pipe
        while True:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:  # no writer left
                    if lost_since is None and self._dropped_by_script(fd):
                        lost_since = time.monotonic()
                    if lost_since is None:
                        return  # the run ended (or died)
                    if self._proc is not None and self._proc.poll() is not None:
                        # it ended without opening it again (a run that failed or died is
                        # told as such: its exit says more than the pipe)
                        if time.monotonic() - lost_since > 0.3 and self._proc.returncode == 0:
                            self._channel_lost()
                        return
                    if time.monotonic() - lost_since > CHANNEL_GRACE:
                        self._channel_lost()  # it runs on unrecorded: the schedule ends it
                        return
                    time.sleep(0.1)  # the run opens the pipe again (fdguard.watch)
                    continue
                lost_since = None
                idle_since = None
                if self._idle is not None:
                    self._idle.activity(counts=bool(self.steps))
                self._handle_frames(parser.feed(data))
                if self.steps and self._idle is not None:
                    self._idle.stepped()
                self.store_due()
                continue
            self.store_due()
            lost_since = None  # a writer again: the run opened the pipe again
            # The child may have exited while a forked grandchild (a DataLoader worker)
            # still holds the pipe open: stop once it ended and the pipe is quiet.
            if self._proc is not None and self._proc.poll() is not None:
                if self.end is not None:
                    return
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.0:
                    return


def _terminal_foreground() -> bool:
    """nondet is in the foreground process group of its controlling terminal (where Ctrl-C
    reaches the whole group, the runs with it)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)  # ENXIO: no controlling terminal
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


#: How long the processes a run started get to end after SIGTERM before SIGKILL.
_LEFTOVER_PATIENCE = 3.0


def _end_processes(pids: list[int]) -> None:
    """SIGTERM, then after ``_LEFTOVER_PATIENCE`` SIGKILL, to those of ``pids`` still
    alive (checked with signal 0; seconds after the snapshot, a pid is not reused)."""
    alive = [pid for pid in pids if _signal(pid, signal.SIGTERM)]
    deadline = time.monotonic() + _LEFTOVER_PATIENCE
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _signal(pid, 0) and not _exited(pid)]
    for pid in alive:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _exited(pid: int) -> bool:
    """The process has exited (a zombie its new parent has not waited for yet, or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[:1] == [b"Z"]
    except OSError:
        return True
