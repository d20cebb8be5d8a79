"""The backend contract, and the step lifecycle every framework shares.

A *backend* connects one framework to the captured run's ``Session``. ``Backend`` is the
whole contract the session, ``boot`` and the pipeline rely on; ``StepLifecycle`` implements
the part that is the same for every framework, so that a new framework only supplies what is
its own (how tensors are fingerprinted, where steps end, what state it has):

- step numbering and boundaries: ``start_training`` (the init row), ``boundary``,
  ``explicit_step`` (``nondet.step()``), ``finish`` (the script ended);
- the step row: every ``STEP_DTYPE`` field is filled in ``_end_step`` from the
  framework's ``StepState`` plus what the lifecycle collected itself (data entries, losses,
  probes, NumPy's and Python's RNG states);
- probes (``nondet.probe``), inside and outside the op window alike;
- hook-error containment (``guarded``): an exception inside nondet's own code never reaches
  the user's script. It disables capture, is sent to the parent as ``hook_error`` (the run
  then ends as a nondet bug, exit 3, with a log) and the script runs on, unobserved.

Differences between frameworks are stated where they are made, as overrides with a comment,
not as copies that drift.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from nondet import channel
from nondet.fingerprint import combine
from nondet.frameworks.fp import Fp, group_fp, host_rng_fps
from nondet.frameworks.step_thread import STEP_THREAD
from nondet.records import TENSOR_DTYPE, Group, Phase


class StopRun(BaseException):
    """Raised at a step boundary to end the run early (BaseException: user code won't catch it)."""


class Sources(Protocol):
    """Where in the user's files something happens (``session.SourceLocator``)."""

    def here(self, depth: int = 2) -> int: ...

    def intern_location(self, filename: str, line: int) -> int: ...

    def user_file(self, filename: str) -> bool: ...

    def direct_caller(self, depth: int = 2) -> str | None: ...


class Session(Protocol):
    """What a backend may ask of the captured run's session (``session.Session``): the
    narrow interface that keeps frameworks from importing the session module."""

    config: Any  # session.ChildConfig: seed, op_steps, dump, keep_bytes
    step: int
    final: dict[str, Any]  # sent with the run's end: final weights digest
    backends: list[Backend]

    @property
    def sources(self) -> Sources: ...

    def intern(self, text: str) -> int: ...

    def string(self, sid: int) -> str: ...

    def send_meta(self, meta: dict[str, Any]) -> None: ...

    def send_facts(self, facts: dict[str, Any]) -> None: ...

    def send_dump(self, name: str, array: np.ndarray, attrs: dict[str, Any]) -> None: ...

    def send_comm(self, rows: np.ndarray) -> None: ...

    def captures_ops(self, step: int | None = None) -> bool: ...

    def decline_op_steps(self, kept: list[int]) -> None: ...

    def new_step_row(self) -> np.ndarray: ...

    def end_step(self, row: np.ndarray, tensors: np.ndarray, ops: np.ndarray) -> None: ...

    def flush_ops(self, ops: np.ndarray) -> None: ...

    def finish(self, status: str, exit_code: int, error: str = "") -> None: ...

    def trained_elsewhere(self, backend: Backend) -> bool: ...


class Backend(Protocol):
    """Everything the session, ``boot`` and the pipeline call on a framework backend."""

    name: str  # "torch", "tensorflow": recorded in the capture as the run's framework
    started: bool  # saw the start of training; see Session.trained_elsewhere

    def explicit_step(self) -> None:
        """``nondet.step()`` was called: end the current step now."""

    def probe(self, value: Any, name: str) -> bool:
        """Fingerprint ``value`` if it is this framework's tensor; True if handled."""

    def finish(self, status: str) -> str:
        """The script ended with ``status``: flush what is pending; return the final status."""

    def kept(self, step: int, index: int) -> list[np.ndarray]:
        """Host copies kept of a record's outputs (lockstep dump requests); [] if none."""

    def disable(self) -> None:
        """Stop capturing for good (forked child processes, after a hook error)."""


class RecorderHost(Protocol):
    """What an op recorder may ask of its backend (recorders never import backends)."""

    session: Session
    phase: Phase
    disabled: bool

    def current_module(self) -> int: ...

    def note_once(self, key: str, text: str) -> None: ...

    def hook_failed(self) -> None: ...


def raised_by_script(exc: BaseException, sources: Sources) -> bool:
    """Is ``exc`` of a class the script defined (in its own files)? Raised inside nondet's
    hook, it can only come from the script's signal handler firing there: it is the
    script's to handle, as under plain Python (it was reported as nondet's error, exit 3,
    and swallowed: the script's watchdog never saw its timeout)."""
    kind = type(exc)
    if kind.__module__ == "__main__":
        return True
    module = sys.modules.get(kind.__module__)
    filename = getattr(module, "__file__", None)
    return isinstance(filename, str) and sources.user_file(filename)


@dataclass
class TensorRow:
    """One named tensor of the step-level state, for steps with op-level capture."""

    group: Group
    name: str
    fp: int
    total: float = math.nan  # sum of the values (floating point only)
    maxabs: float = math.nan
    numel: int = 0


@dataclass
class StepState:
    """What a framework reports about its state at a step end (fingerprints are final)."""

    params: int = 0
    buffers: int = 0
    grads: int = 0
    optim: int = 0
    params_sum: float = math.nan  # shows how a difference grows
    rng: list[int] = field(default_factory=list)  # the framework's own RNG states
    tensors: list[TensorRow] = field(default_factory=list)  # per tensor, detailed steps only


@dataclass
class DataEntry:
    """Data that entered in this step (a batch, a NumPy-made tensor): named in the step rows
    so a difference in it can be reported even in steps without op-level capture."""

    label: str  # "dataloader:batch from DataLoader#0 @ train.py:12"
    fps: list[Fp]
    numel: int  # -1 when unknown
    #: proven never read (dropped in the expression that made it, only its metadata used,
    #: torch/unread.py): no evidence, left out of the step's data row
    unread: bool = False
    watcher: Any = None  # what proves it (kept alive with the entry)


class StepLifecycle:
    """Step numbering, boundaries, the step row, probes and hook-error containment.

    Subclasses implement the ``_``-prefixed hooks marked "framework" below.
    """

    name = "?"

    def __init__(self, session: Session) -> None:
        self.session = session
        self.disabled = False
        self.phase = Phase.INIT
        self.started = False
        self.explicit = False  # nondet.step() is in charge of boundaries
        self._noted: set[str] = set()
        self._reset_step()

    # -- framework hooks -------------------------------------------------------------------
    def _step_state(self, step: int, detailed: bool) -> StepState:
        """framework: parameters, buffers, gradients, optimizer and RNG state at a step end.
        Must also finalize every Fp collected this step (data, losses, probes)."""
        raise NotImplementedError

    def _take_records(self, step: int) -> np.ndarray:
        """framework: the op records of the current step, as OP_DTYPE rows."""
        raise NotImplementedError

    def _sync_capture(self) -> None:
        """framework: switch op-level capture on or off for the step now starting."""

    def _final_params_fp(self) -> int | None:
        """framework: fingerprint of the final parameters (None: no parameters)."""
        return None

    def _final_buffers_fp(self) -> int | None:
        """framework: fingerprint of the final saved buffers (None: none, or not told apart
        from the parameters)."""
        return None

    def _end_pending_step(self) -> None:
        """framework: the script ended; close a step that is still open, if any."""

    def _probe_fp(self, value: Any) -> Fp | None:
        """framework: fingerprint of ``value`` if it is this framework's tensor, else None."""
        return None

    def _record_probe(self, name: str, fp: Fp, value: Any) -> None:
        """framework: add a probe record to the op records (called in the op window)."""

    def environment(self) -> dict[str, str]:
        """framework: versions, devices and switches, as environment entries."""
        return {}

    def facts(self) -> dict[str, Any]:
        """framework: facts for the recipe matcher, taken when training starts."""
        return {}

    def in_op_window(self) -> bool:
        """framework: op-level capture is on right now."""
        return False

    # -- per-step collections -------------------------------------------------------------------
    def _reset_step(self) -> None:
        self.data: list[DataEntry] = []
        self.losses: list[Fp] = []
        self.loss_value = math.nan
        self.probes: list[tuple[str, Fp]] = []

    def add_data(self, label: str, fps: list[Fp], numel: int) -> None:
        self.data_entry(label, fps, numel)

    def data_entry(self, label: str, fps: list[Fp], numel: int) -> DataEntry:
        """``add_data``, returning the entry (torch marks it later if it dies unread)."""
        entry = DataEntry(label, fps, numel)
        self.data.append(entry)
        return entry

    # -- boundaries ----------------------------------------------------------------------------
    def start_training(self) -> None:
        """Close the init phase: send the init row (the state when training starts)."""
        if self.started:
            return
        if threading.current_thread() is not threading.main_thread():
            # a worker thread that makes its optimizer trains there: it owns the steps from
            # now on (the main thread, which often only sets up, does not)
            self._refuse_if_clash()
        self.started = True
        self._end_step()
        self._announce()

    def _announce(self) -> None:
        """Training has started: what the framework looks like now, and that this framework
        is the one that trains (``framework`` fact: the run's framework in the capture)."""
        self.session.send_meta({"env": self.environment()})
        self.session.send_facts({"framework": self.name, **self.facts()})

    def boundary(self) -> None:
        """End the current training step and start the next one."""
        if not self.started:
            self.start_training()
        self._refuse_if_clash()
        self._end_step()

    def _refuse_if_clash(self) -> None:
        if STEP_THREAD.clashed(self.session.send_meta):  # two threads train at once
            raise StopRun()

    def explicit_step(self) -> None:
        if self.disabled:
            return
        self.explicit = True
        with self.guarded():
            if not self.started:
                # Nothing marked the start of training (no optimizer, loader or module
                # call): what ran before the first nondet.step() is step 0, not init.
                self.started = True
                self.session.step = 0
                self._announce()
            self.boundary()

    def _end_step(self) -> None:
        session = self.session
        step = session.step
        row = session.new_step_row()
        state = self._step_state(step, session.captures_ops(step))
        ops = self._take_records(step)
        self.data = [entry for entry in self.data if not entry.unread]
        data_fps = [combine(fp.value or 0 for fp in entry.fps) for entry in self.data]
        row["data_fp"] = group_fp(data_fps)
        row["loss_fp"] = group_fp([fp.value or 0 for fp in self.losses])
        row["loss"] = self.loss_value
        row["grads_fp"] = state.grads
        row["params_fp"] = state.params
        row["buffers_fp"] = state.buffers
        row["optim_fp"] = state.optim
        row["rng_fp"] = combine([*state.rng, *host_rng_fps()])
        row["probes_fp"] = group_fp([fp.value or 0 for _, fp in self.probes])
        row["params_sum"] = state.params_sum
        row["n_records"] = len(ops)
        tensors = self._tensor_rows(step, state, data_fps, session.captures_ops(step))
        self._reset_step()
        self.phase = Phase.FORWARD
        try:
            session.end_step(row, tensors, ops)
        finally:
            self._sync_capture()

    def _tensor_rows(self, step: int, state: StepState, data_fps: list[int],
                     detailed: bool) -> np.ndarray:
        """Per-tensor rows: the state in detailed steps; data entries in every step (a few
        rows, so a differing batch can be named even without op-level capture)."""
        intern = self.session.intern
        rows = []
        if detailed:
            probes = [TensorRow(Group.PROBE, name, fp.value or 0) for name, fp in self.probes]
            for t in (*state.tensors, *probes):
                rows.append((step, int(t.group), intern(t.name), t.fp, t.total, t.maxabs,
                             t.numel))
        for entry, value in zip(self.data, data_fps, strict=True):
            rows.append((step, int(Group.DATA), intern(entry.label), value, math.nan,
                         math.nan, entry.numel))
        return np.array(rows, dtype=TENSOR_DTYPE) if rows else np.zeros(0, dtype=TENSOR_DTYPE)

    # -- API for scripts -----------------------------------------------------------------------
    def probe(self, value: Any, name: str) -> bool:
        if self.disabled:
            return False
        with self.guarded():
            fp = self._probe_fp(value)
            if fp is None:
                return False
            self.probes.append((name, fp))
            if self.in_op_window():
                self._record_probe(name, fp, value)
        return True

    def finish(self, status: str) -> str:
        if self.disabled:
            return status
        session = self.session
        with self.guarded():
            if status == "complete" and not session.trained_elsewhere(self):
                try:
                    if not self.started:
                        self.start_training()  # no training step at all: the init row is all
                    else:
                        self._end_pending_step()
                except StopRun:
                    pass
                final = self._final_params_fp()
                if final is not None:
                    session.final = {"final_params_fp": final}
                    # in the capture too: the analysis compares the runs' final weights
                    session.send_facts({"final_params_fp": f"{final:016x}"})
                buffers = self._final_buffers_fp()
                if buffers is not None:  # BatchNorm statistics set after the last step
                    session.send_facts({"final_buffers_fp": f"{buffers:016x}"})
            else:
                ops = self._take_records(session.step)
                if len(ops):
                    session.flush_ops(ops)  # a partial step: what ran before the end
            session.send_meta({"env": self.environment()})
        return status

    def kept(self, step: int, index: int) -> list[np.ndarray]:
        return []

    def disable(self) -> None:
        self.disabled = True

    # -- containment -----------------------------------------------------------------------------
    def hook_failed(self) -> None:
        """A hook raised: report it once (a nondet bug: exit 3, with a log) and stop
        capturing, so that the script itself runs on."""
        if not self.disabled:
            self.disable()
            with contextlib.suppress(Exception):  # the report itself must not reach the script
                self.session.send_meta({channel.META_HOOK_ERROR: traceback.format_exc()})

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """Runs nondet's part of a hook: an exception in it never reaches the script.
        (``StopRun`` is a BaseException and passes: ending the run is nondet's to do.) One
        of the script's own exception classes does: a signal handler of the script's (a
        step watchdog on SIGALRM) raised it while nondet's code ran."""
        try:
            yield
        except Exception as exc:
            if raised_by_script(exc, self.session.sources):
                raise
            self.hook_failed()

    def note_once(self, key: str, text: str) -> None:
        """A note on the capture itself, shown with the report (analysis.capture_notes)."""
        if key not in self._noted:
            self._noted.add(key)
            self.session.send_facts({f"capture_note.{key}": text})
