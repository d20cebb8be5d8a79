"""Entry point of a recorded run: ``python -m nondet.boot`` (started by nondet, not by users).

Seeds every RNG nondet knows, installs framework hooks for when a framework is imported,
runs the user's script or module as ``__main__`` with its own ``sys.argv``, and always ends
with an END message that says how the run ended.
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import runpy
import signal
import sys
import threading
import traceback
from types import TracebackType
from typing import Any

from nondet import (
    channel,
    clock,
    environment,
    exit_place,
    fdguard,
    frameworks,
    importpath,
    inherited,
    interventions,
    loop_end,
    orphan,
    own_group,
    own_os,
    pyhooks,
    readback,
    seeding,
    unordered,
)
from nondet import session as session_module
from nondet.frameworks.base import StopRun
from nondet.session import CONFIG_ENV, ChildConfig, Session


def _exit_code(exc: SystemExit) -> int:
    """The status ``python script.py`` ends with for this ``sys.exit``: the operating
    system keeps the low 8 bits (``sys.exit(256)`` is a success, not "failed with exit
    code 0"), and Python exits 255 for a number too big for a C long."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF if -2**63 <= exc.code < 2**63 else 255
    try:
        print(exc.code, file=sys.stderr)  # as Python does with sys.exit("message")
    except (OSError, ValueError, AttributeError):  # a stderr the script closed
        pass
    return 1


def _plain_orig_argv(orig: list[str], config: ChildConfig) -> list[str]:
    """The command line ``python train.py ARGS`` would have had: a script that re-runs
    itself with ``os.execv(sys.executable, sys.orig_argv)`` (to set an environment variable
    first) ran ``-m nondet.boot`` again, which failed without nondet's config ("the script
    failed: KeyError: 'NONDET_CHILD_CONFIG'")."""
    for i in range(len(orig) - 1):
        if orig[i] in ("-m", "--module") and orig[i + 1] == "nondet.boot":
            what = ["-m", config.module] if config.module else [str(config.script)]
            return [*orig[:i], *what, *config.args]
    return orig


def main() -> int:
    config = ChildConfig.from_env()
    # The config names the run (label, descriptors, paths): left in the environment, a
    # script that derives anything from ``os.environ`` (a seed from its checksum) saw two
    # environments and "a different seed", a false alarm. Nothing later reads it: a
    # recorded child process gets its own config (torch/children.py).
    os.environ.pop(CONFIG_ENV, None)
    if config.args_in_argv:  # python -m nondet.boot ARGS...: the script's arguments
        config.args, config.args_in_argv = sys.argv[1:], False
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started from a background job (shells ignore SIGINT there): nondet forwards
        # SIGINT to end a run cleanly (on SIGTERM), so it must raise KeyboardInterrupt here.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.socket:
        # A rank of a torchrun job: no inherited pipes, dial the parent (nondet.distributed).
        config.channel_fd, config.control_fd = channel.connect(config.socket, _rank_hello())
    session = Session(config)
    session_module._CURRENT = session
    fdguard.install((config.channel_fd, config.control_fd))  # daemon-style closerange
    fdguard.watch((config.channel_fd, config.control_fd))  # ... and closes from C
    if not config.socket:
        own_group.install()  # os.killpg(0, sig) ends this run, not nondet and the other run
        orphan.watch()  # nondet SIGKILLed: the run ends, even between step boundaries
    os.register_at_fork(after_in_child=_forget_session)

    random.seed(config.seed)
    try:
        import numpy as np

        np.random.seed(config.seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    readback.install(session)  # before the clock shift: it compares real mtimes
    # Read now; left in the environment, a new time at each invocation reached a script
    # deriving a seed from os.environ: its baseline from another invocation differed
    os.environ.pop(readback.STARTED_ENV, None)
    offset = clock.offset_for(config.label)
    clock.shift(offset)  # run b's wall clock runs ahead: a seed read from it differs
    session.send_facts({clock.CLOCK_FACT: offset})
    clock.watch_reads(session.sources.user_file)  # a seed read from it is named (seeding)
    pyhooks.install(session)
    exit_place.install(session)
    loop_end.install(session)
    frameworks.install_import_hooks(session)
    _quiet_stop_in_threads()
    interventions.apply_requested(config.seed)  # --apply / verification: before the script
    inherited.as_started()  # SIGCHLD as nondet was started with it (nondet.inherited)
    session.send_meta({"env": environment.base()})
    unordered.send(session, config.script, config.seed)  # what PYTHONHASHSEED would change

    status, code, error = "complete", 0, ""
    try:
        sys.orig_argv = _plain_orig_argv(sys.orig_argv, config)
        if config.module:
            sys.argv = [config.module, *config.args]
            importpath.as_plain_python(config.startup_env, os.getcwd())
            runpy.run_module(config.module, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(str(config.script))
            sys.argv = [script, *config.args]
            entry = importpath.script_entry(script)
            importpath.as_plain_python(config.startup_env, entry)
            if entry is None:  # a directory or zip file run by its __main__.py
                runpy.run_path(script, run_name="__main__")
            else:
                _run_as_main(script)
        loop_end.send(session)  # ended on its own: how its step loop ended, if known
    except StopRun:
        status = "stopped"
    except SystemExit as exc:
        exit_place.note_system_exit(session, exc)
        code = _exit_code(exc)
        status = "complete" if code == 0 else "failed"
    except KeyboardInterrupt:
        status, code = "interrupted", 130
        # a second SIGINT (Ctrl-C pressed again, or nondet's own: launch.INTERRUPT_WAIT)
        # must not cut short what the run still sends: how it ended, its last rows
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except BaseException as exc:
        error = _uncaught(exc)
        status, code = "failed", 1
    if status in ("complete", "failed"):  # the main module is done: Python's exit stage
        status, code = _python_shutdown(status, code)
    if "jax" in sys.modules:  # a framework nondet does not record: said if nothing trained
        session.send_facts({channel.JAX_FACT: True})
    seeding.collect_workers(session)  # seeding calls of forked DataLoader workers
    status = frameworks.finish_all(session, status)
    session.finish(status, code, error)
    _flush_streams()
    if status == channel.STOPPED:
        _end_stopped_run(code)
    return code


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the script
            pass


def _end_stopped_run(code: int) -> None:
    """End a run nondet stopped at a step boundary, its END sent: run the script's
    ``atexit`` functions (a logger's flush, ``multiprocessing`` ending its workers), then
    leave without Python's finalization, which has nothing left to record and can hang.

    Finalization frees what the stopped script still held, in no set order. A tf.data
    iterator stopped mid-epoch with a ``numpy_function`` in flight is destroyed while the
    main thread holds the GIL, and waits for its prefetch thread, which needs the GIL: the
    process never exited and nondet waited two minutes per run to end it (the
    ``string_ids`` fixture: 4.5 min for 40 s of CPU). A plain run never meets this: its
    dataset ends before it exits. The script's non-daemon threads are not waited for
    either: nondet told them to stop too."""
    try:
        with _StopRunUnraisable():
            atexit._run_exitfuncs()  # each once: Python clears them
    except BaseException:  # Ctrl-C, StopRun: the run is over, its exit goes on
        pass
    _flush_streams()
    _flush_open_files()
    own_os.exit_now(code)


def _flush_open_files() -> None:
    """Write out what the script wrote to files it never closed (a log opened at the top):
    finalization would have, ``os._exit`` drops it. Text layers first: they hand their
    text to the binary buffer under them."""
    import gc
    import io

    texts, buffers = [], []
    for obj in gc.get_objects():
        if isinstance(obj, io.TextIOWrapper):
            texts.append(obj)
        elif isinstance(obj, (io.BufferedWriter, io.BufferedRandom)):
            buffers.append(obj)
    for file in (*texts, *buffers):
        try:
            if not file.closed:
                file.flush()
        except Exception:  # closed under us, a broken pipe, a full disk: as finalization
            pass


class _StopRunUnraisable:
    """While active, ``StopRun`` reported as unraisable (Python ignores an exception
    raised in an ``atexit`` function or ``__del__``) is noted in ``seen`` and kept out of
    the script's output; anything else goes to the hook that was there."""

    def __init__(self) -> None:
        self.seen = False
        self._previous = sys.unraisablehook

    def __enter__(self) -> _StopRunUnraisable:
        self._previous = sys.unraisablehook
        sys.unraisablehook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        sys.unraisablehook = self._previous

    def _hook(self, info: Any) -> None:
        if isinstance(info.exc_value, StopRun):
            self.seen = True
        else:
            self._previous(info)


def _run_as_main(script: str) -> None:
    """Run a script file as ``python script.py`` does: in a module named ``__main__`` that
    stays ``sys.modules["__main__"]`` for the rest of the process, with the builtins module
    as its ``__builtins__``. ``runpy.run_path`` puts nondet's module back when the script's
    module code returns: an ``atexit`` function or a thread still running then could not
    pickle a class the script defined (``torch.save(model)`` left a truncated file while
    nondet said "deterministic"), and ``setattr(__builtins__, ...)`` met a dict."""
    import builtins
    import importlib.machinery
    import io
    import types

    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=script, __cached__=None, __package__=None, __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", script),
        __builtins__=builtins)
    with io.open_code(script) as file:
        source = file.read()
    code = compile(source, script, "exec", dont_inherit=True)
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def _python_shutdown(status: str, code: int) -> tuple[str, int]:
    """What Python does once the main module is done, done while the run is still recorded:
    wait for the script's non-daemon threads, then run its ``atexit`` functions (each
    once: Python clears them). Training there (an unjoined training thread, a last
    fine-tune registered with ``atexit``) went on after the run had sent its end and final
    weights, unrecorded or racing them: "one run ended, the other went on", a false alarm.
    Returns how the run ended: as before, or ``stopped`` if nondet stopped it at a step
    boundary in there (``StopRun``, which Python reports as an ignored exception and nondet
    keeps out of the script's output), or ``interrupted`` by a Ctrl-C while it waited."""
    stopped = False
    try:
        with _StopRunUnraisable() as unraisable:
            threading._shutdown()  # type: ignore[attr-defined]  # Python's own, at exit
            atexit._run_exitfuncs()
        stopped = unraisable.seen
    except StopRun:
        stopped = True
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as main's: let the run say how it ended
        return "interrupted", 130
    return ("stopped" if stopped else status), code


def _uncaught(exc: BaseException) -> str:
    """Do what Python does with an exception the script did not catch: the script's own
    ``sys.excepthook`` if it set one (a logger, an error tracker: it was never called under
    nondet), else the traceback on stderr; both from the script's first frame, without
    nondet's and runpy's (as ``python train.py`` shows it). Returns that traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
            or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    tb = _without_own_frames(tb)
    exc = exc.with_traceback(tb)
    seen = {id(exc)}
    chained = exc.__cause__ or exc.__context__
    while chained is not None and id(chained) not in seen:  # "During handling of ..." too
        seen.add(id(chained))
        chained.with_traceback(_without_own_frames(chained.__traceback__))
        chained = chained.__cause__ or chained.__context__
    text = "".join(traceback.format_exception(exc))
    hook = sys.excepthook
    if hook is not sys.__excepthook__:
        try:
            hook(type(exc), exc, tb)
            return text
        except BaseException:  # a hook that fails: Python reports the original too
            pass
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # closed (or None): the run still says why
        pass
    return text


_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _without_own_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without the frames of nondet's wrappers the exception passed through
    (``torch.autograd.backward``, a Keras layer's call): the script's error showed nondet's
    code between its own frames, read as nondet failing. The innermost frame stays, wherever
    it is: where the exception was raised."""
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    kept = [frame for i, frame in enumerate(frames) if i == len(frames) - 1
            or not frame.tb_frame.f_code.co_filename.startswith(_OWN_DIR)]
    for outer, inner in itertools.pairwise(kept):
        outer.tb_next = inner
    return kept[0] if kept else None


def _quiet_stop_in_threads() -> None:
    """A training thread ended by nondet (``StopRun`` at its step boundary) ends quietly:
    without this, Python prints "Exception in thread ..." with nondet's own traceback into
    the user's log. Every other exception goes to the hook that was there."""
    previous = threading.excepthook

    def excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, StopRun):
            return
        previous(args)

    threading.excepthook = excepthook


def _rank_hello() -> dict[str, int]:
    """Who this rank is, from the variables torchrun sets for each worker."""
    def number(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default
    return {"rank": number("RANK", 0), "world_size": number("WORLD_SIZE", 1),
            "local_rank": number("LOCAL_RANK", 0), "pid": own_os.getpid()}


def _forget_session() -> None:
    # Forked children (DataLoader workers, multiprocessing) must not write to our pipe.
    session_module._CURRENT = None
    frameworks.disable_after_fork()


if __name__ == "__main__":
    sys.exit(main())
