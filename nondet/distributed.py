"""Distributed jobs: one job of N ranks recorded per run (the launch line: ``launchline``).

``nondet run torchrun --nproc-per-node 2 train.py`` runs the user's own launch line twice,
as two whole jobs one after the other (each with its own rendezvous: torchrun picks a free
port for a single-node job unless the line names one). torchrun starts
``python -m nondet.boot`` in place of the script (``--module nondet.boot``); the script,
its arguments and the seed travel in the child config, as for one process.

Why a socket: torchrun's agent does not pass inherited descriptors on to its workers, so
the pipes of a single run cannot reach them. Each job gets a Unix socket in a private
directory (``/tmp/nondet-XXXX/s``, short enough for ``sun_path``); each rank connects,
says who it is (``channel.HELLO``: rank, world size, pid), and then speaks the same framed
protocol as a single run, control words included, over that one connection. Its frames
go to ``run-<label>/rank<R>.h5``. The single-process path is untouched.

Never hanging, never leaving processes behind: torchrun runs in a session of its own and
starts each worker in another one (``start_new_session``), so every worker's process group
is ended by pid once the job is over (SIGTERM, then SIGKILL), after checking it still is
one of this job's workers. A job in which no rank has sent anything for ``stall_after``
seconds is ended (a rank hangs, or waits in a collective for one that does), and so is a
job whose agent has exited while ranks stay silent.

``OMP_NUM_THREADS`` is passed through as the user set it. When it is unset torchrun sets 1
in every worker of a job with more than one process per node (its own behaviour, the same
under nondet as without it); the value each rank saw is recorded in its capture.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from nondet import channel, inherited, outdir, paused
from nondet.errors import NondetError
from nondet.launchline import RUN_MODULE, multi_node
from nondet.runspec import (
    Plan,
    RunResult,
    Target,
    capture_attrs,
    child_argv,
    child_config,
    child_env,
)
from nondet.store import CaptureWriter
from nondet.stream import STORE_SECONDS, RunStream

#: Ranks are ended this long after their agent has exited (they should have ended with it).
AGENT_EXIT_GRACE = 10.0
#: A worker asked to end by signal has this long before SIGKILL.
KILL_GRACE = 5.0
#: A job whose ranks have all been silent this long (and 5 x their slowest step) is ended.
STALL_AFTER = 120.0


# -- one rank ---------------------------------------------------------------------------------
class RankStream(RunStream):
    """One rank's connection: its frames into ``rank<R>.h5``, control words back."""

    def __init__(self, path: Path, conn: socket.socket, hello: dict[str, int]) -> None:
        super().__init__(path)
        self.conn = conn
        self.rank = int(hello["rank"])
        self.world_size = int(hello["world_size"])
        self.pid = int(hello["pid"])
        self.last_frame = time.monotonic()
        self.slowest = 0.0  # longest silence between two reads so far (a slow step)
        self.ended_at: float | None = None
        self._send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._pump, daemon=True)

    def request_stop(self) -> None:
        self.send_control(channel.STOP)

    def send_control(self, message: bytes) -> None:
        with self._send_lock:
            try:
                self.conn.sendall(message)
            except OSError:
                pass  # the rank is gone

    def _pump(self) -> None:
        parser = channel.FrameParser()
        try:
            while True:
                try:
                    # a quiet rank's waiting rows are stored meanwhile (store_due)
                    ready, _, _ = select.select([self.conn], [], [], 0.2)
                    data = self.conn.recv(1 << 16) if ready else None
                except (OSError, ValueError):  # ValueError: the socket was closed
                    break
                if data is None:
                    self.store_due()
                    continue
                if not data:
                    break
                now = time.monotonic()
                self.slowest = max(self.slowest, now - self.last_frame)
                self.last_frame = now
                for kind, payload in parser.feed(data):
                    self._handle(kind, payload)
                self.store_due()
        except Exception as exc:  # nondet's bug: an internal error, never a verdict
            self.hook_error = self.hook_error or (
                f"nondet's reader of rank {self.rank} failed: {type(exc).__name__}: {exc}")
            self.request_stop()
        finally:
            self.ended_at = time.monotonic()
            self._ended()

    def result(self, label: str, log_path: Path, hung: bool) -> RunResult:
        """How this rank ended; its capture is closed with that status."""
        end = self.end
        if self.write_error:
            status = channel.WRITE_FAILED
        elif end is not None:
            status = end.status
        else:
            status = channel.INTERRUPTED if hung else channel.CRASHED
        code = end.exit_code if end is not None else -1
        self._close_writer(status, code)
        return RunResult(label=f"{label}/rank{self.rank}", path=self.path, log_path=log_path,
                         status=status, exit_code=code,
                         steps=sum(1 for r in self.steps if int(r["step"]) >= 0),
                         error=end.error if end else "", hook_error=self.hook_error,
                         final=dict(end.final) if end else {}, write_error=self.write_error)


# -- one job ----------------------------------------------------------------------------------
@dataclass
class JobResult:
    """A run of a distributed job: each rank's result (by rank) and how the job ended."""

    label: str
    ranks: list[RunResult]
    agent_exit_code: int
    log_path: Path
    hung: list[int] = field(default_factory=list)  # ranks silent when the job was ended
    stalled: bool = False  # ended because nothing was heard for too long
    silence: float = 0.0  # how long, then (seconds)
    ended_first: list[int] = field(default_factory=list)  # ranks in the order they ended
    world_size: int = 0
    multi_node: bool = False  # this node's ranks only: the others report to their own nondet


class Job:
    """One run (``plan.label``) of the job: torchrun and its ranks, until all have ended."""

    def __init__(self, target: Target, plan: Plan, seed: int, out_dir: Path,
                 extra_env: dict[str, str] | None = None, echo: bool = False,
                 stall_after: float = STALL_AFTER, poll: float = 0.2) -> None:
        assert target.launcher is not None
        self.target, self.plan, self.seed = target, plan, seed
        self.dir = out_dir / f"run-{plan.label}"
        self.log_path = out_dir / f"run-{plan.label}.log"
        outdir.claim(self.log_path)  # nondet's own, for pruning later (the ranks' directory
        # is not listed: a directory there keeps the invocation)
        self.extra_env = extra_env or {}
        self.echo = echo
        self.stall_after = stall_after
        self.poll = poll
        self.ranks: dict[int, RankStream] = {}
        self._agent: subprocess.Popen[bytes] | None = None
        self._output: threading.Thread | None = None
        self._sock_dir = ""

    def run(self) -> JobResult:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sock_dir = _socket_dir()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        hung: list[int] = []
        code, silence = -1, 0.0
        try:
            path = os.path.join(self._sock_dir, "s")
            listener.bind(path)
            listener.listen(64)
            listener.settimeout(self.poll)
            self._start_agent(path)
            code, hung, silence = self._serve(listener)
        except BaseException:
            hung = sorted(self.ranks)  # Ctrl-C, SIGTERM: every capture closed, interrupted
            raise
        finally:
            listener.close()
            self._end_everything()
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            streams = [self.ranks[r] for r in sorted(self.ranks)]
            results = [s.result(self.plan.label, self.log_path, s.rank in hung)
                       for s in streams]
        order = sorted(streams, key=lambda s: s.ended_at or float("inf"))
        return JobResult(
            label=self.plan.label, ranks=results, agent_exit_code=code,
            log_path=self.log_path, hung=hung, stalled=silence > 0, silence=silence,
            ended_first=[s.rank for s in order],
            world_size=max((s.world_size for s in streams), default=0),
            multi_node=multi_node(self.target.launcher or ()))

    def _start_agent(self, sock_path: str) -> None:
        config = child_config(self.target, self.plan, self.seed)
        config.socket = sock_path
        env = child_env(config, self.extra_env)
        command = [sys.executable, "-m", RUN_MODULE, *(self.target.launcher or ()),
                   "--module", "nondet.boot", *child_argv(config)]
        self._agent = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True,
                                       pass_fds=inherited.descriptors())  # as torchrun's
        self._output = threading.Thread(target=self._pump_output, daemon=True)
        self._output.start()

    def _pump_output(self) -> None:
        """The job's output (torchrun forwards its workers') to the log, and with
        ``echo`` (--verbose) to our stderr too."""
        assert self._agent is not None and self._agent.stdout is not None
        prefix = f"[{self.plan.label}] ".encode()
        with open(self.log_path, "wb") as log:
            for line in iter(self._agent.stdout.readline, b""):
                with contextlib.suppress(OSError):
                    log.write(line)
                    log.flush()
                if self.echo:
                    sys.stderr.buffer.write(prefix + line)
                    sys.stderr.flush()

    def _serve(self, listener: socket.socket) -> tuple[int, list[int], float]:
        """Accept ranks and watch the job until the agent and every rank have ended, or it
        must be ended: (agent exit code, the ranks that were silent when it was, and how
        long nothing was heard if that is why: 0.0 otherwise).

        Silence is judged like lockstep's stall (``schedule.Lockstep``): longer than
        ``stall_after`` and than 5 x the slowest gap between two frames of a rank so far,
        so that a job with long steps is not ended for computing."""
        assert self._agent is not None
        last_activity = time.monotonic()
        agent_done_at: float | None = None
        while True:
            with contextlib.suppress(TimeoutError, socket.timeout):
                conn, _ = listener.accept()
                self._welcome(conn)
                last_activity = time.monotonic()
            now = time.monotonic()
            live = [s for s in self.ranks.values() if s.ended_at is None]
            last_activity = max([last_activity, *(s.last_frame for s in self.ranks.values())])
            code = self._agent.poll()
            if code is not None:
                if not live:
                    return code, [], 0.0
                agent_done_at = agent_done_at or now
                if now - agent_done_at > AGENT_EXIT_GRACE:
                    return code, sorted(s.rank for s in live), 0.0
                continue
            limit = max([self.stall_after, *(5 * s.slowest for s in self.ranks.values())])
            quiet = now - paused.since(last_activity)  # nondet's own pause is no silence
            if quiet > limit:
                return -1, self._behind(live), quiet

    def _welcome(self, conn: socket.socket) -> None:
        conn.settimeout(30.0)  # a rank says who it is at once, or is dropped
        try:
            hello = _read_hello(conn)
        except (OSError, ValueError, KeyError):
            conn.close()
            return
        conn.settimeout(None)
        rank = int(hello["rank"])
        stream = RankStream(self.dir / f"rank{rank}.h5", conn, hello)
        stream.writer = CaptureWriter(stream.path, capture_attrs(
            self.target, self.plan, self.seed, rank=rank, world_size=stream.world_size),
            store_every=STORE_SECONDS)
        self.ranks[rank] = stream
        stream.thread.start()

    @staticmethod
    def _behind(live: list[RankStream]) -> list[int]:
        """The silent ranks that got least far (a hung rank and those waiting for it
        may all stop at the same step: then all are named)."""
        if not live:
            return []
        least = min(len(s.steps) for s in live)
        return sorted(s.rank for s in live if len(s.steps) == least)

    def _end_everything(self) -> None:
        """End the agent's session and every worker's process group still alive."""
        groups = [p for p in (self._agent.pid if self._agent else None,) if p]
        groups += [s.pid for s in self.ranks.values() if self._is_our_worker(s.pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [g for g in groups if _signal_group(g, sig)]
            deadline = time.monotonic() + KILL_GRACE
            while alive and time.monotonic() < deadline:
                if self._agent is not None:
                    self._agent.poll()  # reap it, else its group looks alive
                alive = [g for g in alive if _group_alive(g)]
                time.sleep(0.1)
            if not alive:
                break
        if self._agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._agent.wait(timeout=KILL_GRACE)
        if self._output is not None:
            self._output.join(timeout=KILL_GRACE)
        for stream in self.ranks.values():
            stream.thread.join(timeout=KILL_GRACE)
            with contextlib.suppress(OSError):
                stream.conn.close()

    def _is_our_worker(self, pid: int) -> bool:
        """Only a process whose environment names this job's socket is signalled (a pid
        may have been reused by an unrelated process)."""
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False
        return self._sock_dir.encode() in environ


#: The longest path a Unix socket can be bound at (``sun_path``, with its terminating NUL).
_SUN_PATH = 107


def _socket_dir() -> str:
    """A private directory (mode 0700) for the job's socket, in the temporary directory
    unless the socket's path would be too long there (a long TMPDIR: a batch system's
    per-job directory, a build sandbox), then in /tmp or /dev/shm. A long TMPDIR made
    ``bind`` fail with "AF_UNIX path too long": "internal error", exit 3."""
    tried = []
    for base in (None, "/tmp", "/dev/shm"):
        try:
            folder = tempfile.mkdtemp(prefix="nondet-", dir=base)
        except OSError as exc:
            tried.append(f"{base or tempfile.gettempdir()}: {exc.strerror or exc}")
            continue
        if len(os.fsencode(os.path.join(folder, "s"))) <= _SUN_PATH:
            return folder
        os.rmdir(folder)
        tried.append(f"{base or tempfile.gettempdir()}: path too long for a socket")
    raise NondetError("cannot make the directory for the job's socket (" + "; ".join(tried)
                      + "): set TMPDIR to a short, writable directory")


def _read_hello(conn: socket.socket) -> dict[str, int]:
    """The HELLO frame, read to its last byte and no further (frames follow at once)."""
    header = _recv_exactly(conn, 5)
    if header[:1] != channel.HELLO:
        raise ValueError("not a hello")
    length = int.from_bytes(header[1:], "little")
    if length > 4096:
        raise ValueError("hello too long")
    hello = json.loads(_recv_exactly(conn, length))
    return {k: int(hello[k]) for k in ("rank", "world_size", "local_rank", "pid")}


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("closed before saying hello")
        data += chunk
    return data


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
