"""Parent side of recorded child processes: their frames stored as captures, and compared.

A process the script starts itself (Hogwild workers, ``mp.spawn``; not DataLoader workers)
records its own steps and ops under a Session of its own (``frameworks/torch/children.py``)
and writes the same frames a run sends over its pipe into a file beside the run's capture,
``run-a.child0.frames`` (K = creation order among the processes the run started, so the
two runs' children line up whatever the scheduling). When the run has ended the parent
stores each file as a capture, ``run-a.child0.h5``, and deletes the frames file it made.

The analysis compares child K of run a with child K of run b exactly like two runs
(``analysis.compare_pair``); the first child, in creation order, whose training state
differs is the finding, named ``child#K`` (``Divergence.process``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from nondet import channel, outdir
from nondet.errors import NondetError
from nondet.report import Divergence
from nondet.store import Capture, CaptureWriter, open_capture
from nondet.stream import STORE_SECONDS, RunStream

#: Root attributes of the run's capture a child's capture repeats (``launch._open_writer``).
_INHERITED = ("command", "script", "module", "script_sha256", "seed", "started", "cwd",
              "rank", "world_size", "op_steps")
_CHUNK = 1 << 16


class _FileStream(RunStream):
    """A child's frames read back from its file (nothing to stop: the child has ended)."""

    def request_stop(self) -> None:
        pass


def store(run_capture: Path) -> list[Path]:
    """Store every frames file the run's child processes wrote as a capture beside the
    run's; returns the captures written. Never raises: a child that cannot be stored is
    left out (its frames file stays, for a bug report)."""
    written = []
    for frames in sorted(run_capture.parent.glob(f"{run_capture.stem}.child*.frames")):
        try:
            written.append(_store_one(frames, run_capture))
            frames.unlink()
        except Exception:  # nondet's own trouble with one child: never the run's end
            frames.with_suffix(".h5").unlink(missing_ok=True)  # half stored: not compared
            continue
    return written


def _store_one(frames: Path, run_capture: Path) -> Path:
    from nondet.store.writer import _h5py, decode_attr

    with _h5py().File(run_capture, "r") as f:
        attrs = {k: decode_attr(f.attrs[k]) for k in _INHERITED if k in f.attrs}
    target = frames.with_suffix(".h5")
    outdir.claim(target)  # nondet's own, for pruning later
    label = frames.stem.removeprefix("run-")
    stream = _FileStream(target)
    stream.writer = CaptureWriter(target, {**attrs, "label": label}, store_every=STORE_SECONDS)
    status, code = channel.CRASHED, None
    try:
        parser = channel.FrameParser()
        with open(frames, "rb") as file:
            while chunk := file.read(_CHUNK):
                for kind, payload in parser.feed(chunk):
                    stream._handle(kind, payload)
        # No END: the child was killed (a daemon ended with its parent) or called os._exit.
        if stream.end is not None:
            status, code = stream.end.status, stream.end.exit_code
    finally:
        stream._close_writer(status, code)
    if stream.hook_error:
        (target.parent / f"{target.stem}.hook_error.txt").write_text(stream.hook_error)
    return target


_CHILD = re.compile(r"\.child(\d+)$")


def children_of(capture: Capture) -> dict[int, Path]:
    """The captures of the child processes this run started itself, by creation order."""
    found: dict[int, Path] = {}
    path = Path(capture.path)
    for candidate in path.parent.glob(f"{path.stem}.child*.h5"):
        match = _CHILD.search(candidate.stem.removeprefix(path.stem))
        if match and candidate.stem == f"{path.stem}.child{match.group(1)}":
            found[int(match.group(1))] = candidate
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class Children:
    """What the runs' child processes show: the first differing child's finding (None if
    every child pair repeated), how many pairs recorded steps, notes, op records compared."""

    divergence: Divergence | None
    trained: int
    notes: list[str]
    op_records: int


def compare(a: Capture, b: Capture) -> Children:
    """Compare child K of run a with child K of run b, for every K both runs have."""
    from nondet.analysis import compare_pair  # the one comparison; it imports this module

    kids_a, kids_b = children_of(a), children_of(b)
    notes: list[str] = []
    trained = op_records = 0
    first: Divergence | None = None
    if kids_a and kids_b and set(kids_a) != set(kids_b):  # (a baseline keeps none)
        notes.append(f"run a recorded {len(kids_a)} child processes, run b {len(kids_b)}: "
                     "only the children both started are compared")
    for index in sorted(set(kids_a) & set(kids_b)):
        name = f"child#{index}"
        broken = [p for p in (kids_a[index], kids_b[index])
                  if (p.parent / f"{p.stem}.hook_error.txt").exists()]
        if broken:
            notes.append(f"{name}: nondet's recording failed inside the child process "
                         f"({broken[0].stem}.hook_error.txt); that child is not compared")
            continue
        try:
            found = compare_pair(open_capture(kids_a[index]), open_capture(kids_b[index]))
        except NondetError:
            continue  # no training step in that child (it made data, logged, ...)
        trained += 1
        op_records += found.op_records
        notes += [f"{name}: {note}" for note in found.notes]
        if first is None and found.first_divergence is not None:
            first = _named(found.first_divergence, index,
                           (kids_a[index].name, kids_b[index].name))
    return Children(first, trained, notes, op_records)


def _named(div: Divergence, index: int, files: tuple[str, str]) -> Divergence:
    """A child's finding as the run's: which process, and that steps there are its own."""
    note = (f"in child process child#{index} (the script started it; #{index} in creation "
            f"order): its steps, ops and lines were recorded in captures of their own "
            f"({files[0]}, {files[1]} beside the runs'), and step numbers count that "
            "process's own steps")
    return replace(div, process=f"child#{index}", notes=[note, *div.notes])
