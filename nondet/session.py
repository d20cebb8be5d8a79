"""Child side, framework-independent: step numbering, the op window, strings, transport.

A ``Session`` lives in the recorded run (started by ``nondet.boot``). Framework backends
detect step boundaries and fingerprint tensors; the session numbers the steps, decides
which steps get op-level recording, interns strings, streams everything to the parent and
stops the run when asked. It never imports a framework.
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np

from nondet import channel, fdguard, own_os
from nondet.frameworks.base import Backend, StopRun
from nondet.records import (
    COMM_DTYPE,
    INIT_STEP,
    OP_DTYPE,
    SOURCE_TEXT_MARK,
    STEP_DTYPE,
    TENSOR_DTYPE,
)

CONFIG_ENV = "NONDET_CHILD_CONFIG"
#: Longest a finished lockstep run waits for the parent's word before exiting anyway.
FINISH_WAIT_SECONDS = 600.0

#: Lockstep, inside a grant of several steps: step frames are held back at most this long
#: (``FrameWriter.flush_later``: written then even if the script sleeps after its last
#: step; a run killed by a signal loses at most these last rows).
GRANT_FLUSH_SECONDS = 0.2

_CURRENT: Session | None = None


def current() -> Session | None:
    """The session of this process, or None when not running under nondet."""
    return _CURRENT


@dataclass
class ChildConfig:
    """What the parent tells a recorded run (passed as JSON in an environment variable)."""

    label: str
    seed: int
    channel_fd: int
    control_fd: int
    script: str | None = None  # path of the script, or
    module: str | None = None  # name of the module run with -m
    args: list[str] = field(default_factory=list)
    op_steps: list[int] | None = None  # steps with op-level recording; None = every step
    stop_after: int | None = None  # end the run after this step
    dump: tuple[int, int] | None = None  # (step, record index) whose outputs to save
    lockstep: bool = False  # wait for the parent's go after every step (see schedule.Lockstep)
    keep_bytes: int = 0  # lockstep: keep op outputs of op-captured steps up to this many bytes
    children_dir: str | None = None  # where recorded child processes write their frames
    socket: str | None = None  # distributed job: each rank connects here (channel.connect)
    # where the pipes can be opened again if the script closes ours (fdguard.reachable)
    channel_path: str | None = None
    control_path: str | None = None
    # op_steps is only the first pair's default: a backend whose op-level capture would cost
    # the rest of the run may record no ops (``decline_op_steps``); the pipeline then finds
    # the op by re-running the differing step, as it does for later steps
    ops_optional: bool = False
    # the user's values of the variables set to start the run, put back before the script
    # (nondet.importpath)
    startup_env: dict[str, str | None] = field(default_factory=dict)
    # the script's arguments are this process's own (``sys.argv[1:]``), not ``args``
    # (runspec.child_env)
    args_in_argv: bool = False

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> ChildConfig:
        data = json.loads(os.environ[CONFIG_ENV])
        if data.get("dump") is not None:
            data["dump"] = tuple(data["dump"])
        return cls(**data)

    def captures_ops(self, step: int) -> bool:
        return self.op_steps is None or step in self.op_steps


class Session:
    """One recorded run's bookkeeping and transport (see module docstring)."""

    def __init__(self, config: ChildConfig) -> None:
        self.config = config
        self.step = INIT_STEP
        self.started = time.perf_counter()
        self.writer = channel.FrameWriter(config.channel_fd)
        fdguard.claim(config.control_fd)  # the script may close or replace it (fdguard.ours)
        fdguard.reachable(config.channel_fd, config.channel_path, os.O_WRONLY)
        fdguard.reachable(config.control_fd, config.control_path, os.O_RDONLY)
        self._strings: dict[str, int] = {}
        self._string_list: list[str] = []
        self._new_strings: list[str] = []
        self.backends: list[Backend] = []  # installed framework backends (see frameworks/)
        self.sources = SourceLocator(self)
        self.final: dict[str, Any] = {}  # final loss and weights digest, sent with END
        self.pid = own_os.getpid()
        self._free = False  # lockstep released: no more waiting at boundaries
        # STOP was read (by any thread): a script that still ends "complete" (the StopRun
        # ended a training thread, not the main one) must not wait for a second word
        self._told_to_stop = False
        # Steps ended by two threads (until frameworks/step_thread.py stops the run) must
        # not both wait on the control pipe: one could take the other's STOP and leave it
        # waiting for good.
        self._turn_lock = threading.Lock()
        # lockstep: steps left of the last GO's grant, run without waiting (turns.Turns grants
        # several steps per turn when steps are short)
        self._granted = 0
        # seconds spent held at step boundaries by the parent (lockstep): left out of the
        # step rows' ``wall`` so that step times (a fix's cost) measure the script, not how
        # long the parent took to compare the step or fetch kept outputs
        self.held = 0.0
        #: called with each finished step's number after its row is sent (never raise)
        self.step_listeners: list[Callable[[int], None]] = []

    # -- strings -------------------------------------------------------------------------
    def intern(self, text: str) -> int:
        sid = self._strings.get(text)
        if sid is None:
            # HDF5 strings end at a NUL: a name holding one (a probe's, a module's) made the
            # parent's write fail, "VLEN strings do not support embedded NULLs" (exit 3)
            stored = text.replace("\x00", "\\x00")
            sid = self._strings.get(stored)
            if sid is None:
                sid = len(self._string_list)
                self._strings[stored] = sid
                self._string_list.append(stored)
                self._new_strings.append(stored)
            self._strings[text] = sid
        return sid

    def string(self, sid: int) -> str:
        return self._string_list[sid] if 0 <= sid < len(self._string_list) else ""

    def _send_strings(self) -> None:
        if self._new_strings:
            self.writer.send_json(channel.STRINGS, self._new_strings)
            self._new_strings = []

    # -- metadata --------------------------------------------------------------------------
    def send_meta(self, meta: dict[str, Any]) -> None:
        self.writer.send_json(channel.META, meta)
        self.writer.flush()

    def send_facts(self, facts: dict[str, Any]) -> None:
        self.writer.send_json(channel.FACTS, facts)

    def send_comm(self, rows: np.ndarray) -> None:
        """Rows of the step's collectives (records.COMM_DTYPE), after the strings they name."""
        if len(rows):
            self._send_strings()
            self.writer.send(channel.COMM, rows.astype(COMM_DTYPE, copy=False).tobytes())

    # -- steps -----------------------------------------------------------------------------
    def captures_ops(self, step: int | None = None) -> bool:
        return self.config.captures_ops(self.step if step is None else step)

    def decline_op_steps(self, kept: list[int]) -> None:
        """Op-level capture only at the ``kept`` steps of the planned ones (allowed by
        ``ChildConfig.ops_optional``); the capture says so in its ``op_steps`` attribute."""
        self.config.op_steps = list(kept)
        self.send_meta({channel.META_OP_STEPS: list(kept)})

    def new_step_row(self) -> np.ndarray:
        row = np.zeros(1, dtype=STEP_DTYPE)
        row["step"] = self.step
        row["loss"] = np.nan
        row["wall"] = time.perf_counter() - self.started - self.held
        return row

    def flush_ops(self, ops: np.ndarray) -> None:
        """Send op records without ending the step (partial step at a crash or a dump)."""
        self._send_strings()
        if len(ops):
            self.writer.send(channel.OPS, ops.astype(OP_DTYPE, copy=False).tobytes())
        self.writer.flush()

    def end_step(self, row: np.ndarray, tensors: np.ndarray, ops: np.ndarray) -> None:
        """Send one finished step, advance the counter, and stop the run if it is time."""
        self._send_strings()
        if len(ops):
            self.writer.send(channel.OPS, ops.astype(OP_DTYPE, copy=False).tobytes())
        if len(tensors):
            self.writer.send(channel.TENSORS, tensors.astype(TENSOR_DTYPE, copy=False).tobytes())
        self.writer.send(channel.STEP, row.tobytes())
        for listener in self.step_listeners:
            listener(self.step)
        if self._granted > 0 and self.config.lockstep and not self._free:
            # Inside a grant the rows go out together at its end (the other run waits for
            # all of them anyway): one write per turn, and the parent stores them at once.
            self.writer.flush_later(GRANT_FLUSH_SECONDS)
        else:
            self.writer.flush()
        finished = self.step
        self.step += 1
        if finished >= 0 and self.config.stop_after is not None \
                and finished >= self.config.stop_after:
            raise StopRun()
        if self._told_to_stop:
            raise StopRun()  # another thread read the STOP
        if self.config.lockstep and not self._free:
            with self._turn_lock:  # one reader of the control pipe at a time
                if self._told_to_stop:
                    raise StopRun()
                if self._granted > 0:
                    # a step of the last turn's grant ("go N"): no word to wait for yet, and
                    # the pipe is not read (a STOP or a dump request waits for the grant's end)
                    self._granted -= 1
                    return
                held_from = time.perf_counter()
                answer, steps = channel.wait_for_grant(self.config.control_fd, self._send_kept)
                self.held += time.perf_counter() - held_from
                self._granted = max(0, steps - 1)
            if answer == channel.FREE:
                self._free = True
            elif answer in (channel.STOP, channel.GONE):
                self._told_to_stop = True
                raise StopRun()
        elif channel.stop_requested(self.config.control_fd) or self.writer.parent_gone:
            # the parent gone (nondet killed): nobody records the run, so it ends here
            # rather than train on as an orphan (for good, if the script never ends)
            self._told_to_stop = True
            raise StopRun()

    def _send_kept(self, step: int, index: int) -> None:
        """Answer a dump request with the outputs a backend kept for (step, index)."""
        sent = 0
        for backend in self.backends:
            for i, array in enumerate(backend.kept(step, index)):
                self.send_dump(channel.kept_name(step, index, i), array,
                               {"step": step, "index": index})
                sent += 1
        self.writer.send_json(channel.META, {channel.META_DUMP_DONE: [step, index, sent]})
        self.writer.flush()

    def send_dump(self, name: str, array: np.ndarray, attrs: dict[str, Any]) -> None:
        self.writer.send(channel.DUMP, channel.Dump(name, array, attrs).encode())

    def finish(self, status: str, exit_code: int, error: str = "") -> None:
        self._send_strings()
        self.writer.send_json(channel.END,
                              channel.End(status, exit_code, error, self.final).encode())
        self.writer.flush()
        if self.config.lockstep and self.config.keep_bytes and status == channel.COMPLETE \
                and not self._told_to_stop:
            # The script ended on its own: stay until the parent has asked for the outputs
            # it needs (schedule.Lockstep holds both runs here) and lets us go. The parent
            # always lets us go (or closes the pipe); the bound is only a backstop.
            channel.wait_for_turn(self.config.control_fd, self._send_kept,
                                  timeout=FINISH_WAIT_SECONDS)

    def trained_elsewhere(self, backend: Backend) -> bool:
        """True if another framework's backend saw training while ``backend`` did not: in a
        script that imports both frameworks, the idle one must not add steps or weights."""
        return not backend.started and any(
            other.started for other in self.backends if other is not backend
        )

    # -- API for user scripts ----------------------------------------------------------------
    def explicit_step(self) -> None:
        for backend in self.backends:
            backend.explicit_step()

    def probe(self, value: Any, name: str) -> None:
        for backend in self.backends:
            if backend.probe(value, name):
                return


#: Functions that handle ops on the way to them (a script's own ``TorchDispatchMode``, an
#: op counter, a tensor subclass): their ``return func(*args)`` line is the handler's, not
#: where the script ran the op; the line that did is further up.
_HANDLERS = frozenset({"__torch_dispatch__", "__torch_function__"})


class SourceLocator:
    """Finds the first frame in the user's own files: "train.py:27" as a string id.

    User files are everything outside the standard library, site-packages and nondet itself.
    The verdict is cached per code object, so a lookup is a short walk up the stack.
    """

    def __init__(self, session: Session) -> None:
        self._session = session
        self._is_user: dict[CodeType, bool] = {}
        # by file name: resolving a path costs a dozen system calls, and TensorFlow asks
        # for every frame of every graph op it traces (tens of thousands per trace)
        self._user_files: dict[str, bool] = {}
        self._ids: dict[tuple[str, int], int] = {}
        paths = sysconfig.get_paths()
        prefixes = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
        prefixes.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
        prefixes.add(str(Path(__file__).resolve().parent))
        self._excluded = tuple(os.path.realpath(p) + os.sep for p in prefixes if p)
        self._cwd = os.getcwd()

    def user_file(self, filename: str) -> bool:
        known = self._user_files.get(filename)
        if known is None:
            known = self._user_files[filename] = not (
                filename.startswith("<") or "__autograph_generated_file" in filename
                or os.path.realpath(filename).startswith(self._excluded))
        return known

    def intern_location(self, filename: str, line: int) -> int:
        key = (filename, line)
        sid = self._ids.get(key)
        if sid is None:
            shown = self.display(filename, line)
            sid = self._ids[key] = self._session.intern(shown)
            # The line's text goes into the capture with it: a report shows what ran, and
            # never reads a file a (possibly crafted) capture names (see Capture.source_text).
            text = self.source_line(filename, line)
            if text:
                self._session.intern(f"{SOURCE_TEXT_MARK}{shown}\n{text}")
        return sid

    def here(self, depth: int = 2) -> int:
        """String id of the innermost user frame above the caller, or -1."""
        frame: FrameType | None = sys._getframe(depth)
        is_user = self._is_user
        while frame is not None:
            code = frame.f_code
            user = is_user.get(code)
            if user is None:
                user = is_user[code] = (self.user_file(code.co_filename)
                                        and code.co_name not in _HANDLERS)
            if user:
                return self.intern_location(code.co_filename, frame.f_lineno)
            frame = frame.f_back
        return -1

    def direct_caller(self, depth: int = 2) -> str | None:
        """"file:line" of the frame ``depth`` levels up if it is user code, else None."""
        frame = sys._getframe(depth)
        code = frame.f_code
        if not self.user_file(code.co_filename):
            return None
        return self.display(code.co_filename, frame.f_lineno)

    #: Longest source text kept per location (one line, for the report).
    SOURCE_TEXT_CHARS = 200

    @classmethod
    def source_line(cls, filename: str, line: int) -> str:
        """One stripped line of a user's file, at most SOURCE_TEXT_CHARS long ("" if none)."""
        import linecache

        try:
            text = linecache.getline(filename, line).strip()
        except (OSError, ValueError, MemoryError):
            return ""
        limit = cls.SOURCE_TEXT_CHARS
        return text if len(text) <= limit else text[: limit - 1] + "…"

    def display(self, filename: str, line: int) -> str:
        try:
            rel = os.path.relpath(filename, self._cwd)
        except ValueError:
            rel = filename
        shown = filename if rel.startswith("..") else rel
        return f"{shown}:{line}"
