"""Orders the script's own source leaves to the machine: set iteration, directory listings.

A set of strings iterates in an order that depends on ``PYTHONHASHSEED``, which Python draws
afresh at every start: ``vocab = list(set(words))`` numbers the words differently in each
plain run, and the weights differ. nondet gives both runs the same ``PYTHONHASHSEED`` (it must
be set before the interpreter starts: DESIGN.md), so they repeat, and "deterministic" alone
would hide what plain runs do. Nothing at run time tells a set's iteration apart (CPython
has no hook for it), so the script's own source is read once, before it runs: a ``for``
loop, a list/dict comprehension or generator, or a ``list``/``tuple``/``enumerate``/``zip``/
``iter``/``map``/``join`` call over an expression that makes a set (``set(...)``,
``frozenset(...)``, a set literal or comprehension, a set operator between them, or a name
the script bound to one). ``sorted(...)`` orders it and is never named; nor are sets of
numbers written as such (``set(range(n))``, ``{1, 2}``: integers hash to themselves).
The sites go to the fact ``python.set_iteration``; ``seed_diff.unseeded_script_notes`` turns
them into a note when the user did not choose a ``PYTHONHASHSEED`` of their own.

The same read names the script's directory listings that nothing sorts (``os.listdir``,
``os.scandir``, ``os.walk``, ``glob.glob``/``iglob``, ``Path.glob``/``rglob``/``iterdir``/
``walk`` not handed
straight to ``sorted``): their order is the file system's. The fact
``python.unsorted_listing`` is the evidence the recipe PY-FS-ORDER asks for, which it
otherwise offered for any value that entered with a difference nothing else explained.
And the results it takes in the order threads or processes finish them
(``concurrent.futures.as_completed``, ``Pool.imap_unordered``, asyncio's ``as_completed``):
``python.completion_order``, the evidence for PY-COMPLETION-ORDER (a trial's shards loaded
in threads and trained on as they came got the OpenCV recipe). And what it orders by
object identity (``sorted(params, key=id)``, ``key=hash``, ``key=lambda p: id(p)``):
``python.address_order``, a note whatever the verdict. Addresses differ from one plain
run to the next, but nondet's two runs allocate alike and mostly agree, so a trial's
script whose plain runs differed 5 times in 10 was "deterministic" (or got a fix that
happened to hold), with no word on the line. And the threads it starts
(``ThreadPoolExecutor``, ``threading.Thread``): ``python.threads``, the evidence for
PY-THREAD-WORK (ops run in the script's threads are not recorded; a trial's threads drawing
``torch.randperm`` from the global generator got the OpenCV recipe). And its calls of the
builtin ``hash()``: ``python.hash_calls``, a note like the set iterations' (a string's hash
follows the same salt: token ids or a seed from ``hash(word)`` differed in every plain run
of two trials' scripts, and nondet said "deterministic" with no word).
"""

from __future__ import annotations

import ast
import os
from typing import Any, NamedTuple

FACT = "python.set_iteration"
LISTING_FACT = "python.unsorted_listing"
COMPLETION_FACT = "python.completion_order"
ADDRESS_FACT = "python.address_order"
THREADS_FACT = "python.threads"
HASH_SEED_FACT = "python.hash_seed_by_nondet"
HASH_CALLS_FACT = "python.hash_calls"
CLOCK_FACT = "python.clock_reads"
TIMERS_FACT = "python.timers"
THREAD_COUNT_FACT = "python.thread_count_computed"
FORK_FACT = "torch.jit_fork"
#: Calls that list a directory in the file system's order.
_LISTINGS = frozenset({"listdir", "scandir", "glob", "iglob", "rglob", "iterdir", "walk"})
#: Calls that hand results over in the order threads or processes finish them.
_COMPLETIONS = frozenset({"as_completed", "imap_unordered"})
#: Calls that order what they are given by a ``key=``, and the keys that are identities.
_KEYED = frozenset({"sorted", "sort", "min", "max", "nsmallest", "nlargest"})
_IDENTITY_KEYS = frozenset({"id", "hash"})
#: Calls that start threads of the script's own.
_THREADS = frozenset({"ThreadPoolExecutor", "Thread", "ProcessPoolExecutor", "Pool"})
#: Calls that act after a wall-clock delay, by module (``threading.Timer``,
#: ``signal.alarm``): ``timeit.Timer`` and torch's benchmark ``Timer`` only measure.
_TIMERS = {"threading": frozenset({"Timer"}), "signal": frozenset({"alarm", "setitimer"})}
#: Calls that set a framework's thread count (torch's, TensorFlow's).
_THREAD_COUNTS = frozenset({"set_num_threads", "set_num_interop_threads",
                            "set_intra_op_parallelism_threads",
                            "set_inter_op_parallelism_threads"})
#: Calls that read the clock, by their attribute or imported name (``time.time()`` only as
#: ``time.time``: a bare ``time()`` is too common a name).
_CLOCK_ATTRIBUTES = frozenset({"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                               "time_ns", "process_time", "now", "utcnow", "today"})
#: Sites named at most.
MAX_SITES = 8
#: Scripts larger than this are not read (a generated file): bytes.
MAX_SOURCE = 2_000_000

_MAKERS = frozenset({"set", "frozenset"})
_SET_METHODS = frozenset({"union", "intersection", "difference", "symmetric_difference",
                          "copy"})
_ORDERING_CALLS = frozenset({"list", "tuple", "enumerate", "zip", "iter", "next", "map",
                             "filter", "reversed"})
#: Calls whose result does not depend on the order they are handed things in.
_ORDER_FREE = frozenset({"sorted", "len", "set", "frozenset", "any", "all", "min", "max"})


def set_iterations(source: str, filename: str = "<script>") -> list[tuple[int, str]]:
    """(line, source text) of each place ``source`` iterates a set in an order that can
    follow the hash salt, at most ``MAX_SITES``, in line order. Never raises."""
    return scan(source, filename).sets


Sites = list[tuple[int, str]]


class Scan(NamedTuple):
    """What ``scan`` found: (line, text) of each place, at most ``MAX_SITES`` of each, in
    line order."""

    sets: Sites  # iterations of a set
    listings: Sites  # directory listings nothing sorts
    completions: Sites  # results taken as they complete
    addresses: Sites  # orderings by object identity
    threads: Sites  # threads the script starts (ThreadPoolExecutor, threading.Thread)
    hashes: Sites  # calls of the builtin hash()
    clocks: Sites  # clock readings (time.time(), perf_counter(), datetime.now())
    timers: Sites  # actions after a wall-clock delay (threading.Timer, signal.alarm)
    thread_counts: Sites  # a framework's thread count set from a computed value
    forks: Sites  # torch.jit.fork: work handed to torch's inter-op threads


def scan(source: str, filename: str = "<script>") -> Scan:
    """The places in ``source`` whose order the machine decides. Never raises."""
    if len(source) > MAX_SOURCE:
        return Scan([], [], [], [], [], [], [], [], [], [])
    try:
        tree = ast.parse(source, filename)
        finder = _Finder(_set_names(tree))
        finder.visit(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Scan([], [], [], [], [], [], [], [], [], [])
    lines = source.splitlines()

    def shown(found: list[int]) -> list[tuple[int, str]]:
        return [(n, lines[n - 1].strip() if 0 < n <= len(lines) else "")
                for n in sorted(set(found))[:MAX_SITES]]

    return Scan(shown(finder.lines), shown(finder.listings), shown(finder.completions),
                shown(finder.addresses), shown(finder.threads), shown(finder.hashes),
                shown(finder.clocks), shown(finder.timers), shown(finder.thread_counts),
                shown(finder.forks))


def _set_names(tree: ast.AST) -> set[str]:
    """Names the script binds to a set anywhere (``vocab = set(words)``); a name bound to
    something else too is left out (its value at the loop is not known)."""
    made: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    (made if _makes_set(node.value, set()) or _empty_set(node.value)
                     else other).add(target.id)
    return made - other


def _empty_set(node: ast.AST) -> bool:
    """``set()``: a set filled later (``vocab = set(); vocab.update(words)``)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _MAKERS and not node.args)


def _makes_set(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` evaluates to a set whose order can follow the hash salt."""
    if isinstance(node, ast.Set):
        return not all(isinstance(e, ast.Constant) and isinstance(e.value, int | float)
                       for e in node.elts)
    if isinstance(node, ast.SetComp):
        return True
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitOr, ast.BitAnd, ast.Sub,
                                                            ast.BitXor)):
        return _makes_set(node.left, names) and (
            _makes_set(node.right, names) or not isinstance(node.op, ast.BitOr))
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in _MAKERS:
            if not node.args:
                return False  # empty: filled later, through a name
            arg = node.args[0]
            return not (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name)
                        and arg.func.id == "range")
        if isinstance(func, ast.Attribute) and func.attr in _SET_METHODS:
            return _makes_set(func.value, names)
    return False


class _Finder(ast.NodeVisitor):
    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.lines: list[int] = []
        self.listings: list[int] = []  # directory listings not handed to sorted()
        self.completions: list[int] = []  # results taken in the order they finish
        self.addresses: list[int] = []  # orderings by object identity (key=id)
        self.threads: list[int] = []  # threads started (their ops are not recorded)
        self.hashes: list[int] = []  # calls of the builtin hash() (a string's follows the salt)
        self.clocks: list[int] = []  # clock readings: a value made from one differs per run
        self.timers: list[int] = []  # actions after a wall-clock delay
        self.timer_names: set[str] = set()  # imported by name: from threading import Timer
        self.thread_counts: list[int] = []  # thread counts set from a computed value
        self.forks: list[int] = []  # torch.jit.fork calls
        self.order_free: set[int] = set()  # ids of nodes handed straight to sorted() & co

    def _check(self, iterated: ast.AST, at: ast.AST) -> None:
        if id(at) not in self.order_free and _makes_set(iterated, self.names):
            self.lines.append(getattr(at, "lineno", 0))

    def visit_For(self, node: ast.For) -> None:
        self._check(node.iter, node)
        self.generic_visit(node)

    visit_AsyncFor = visit_For  # type: ignore[assignment]

    def _comprehension(self, node: ast.ListComp | ast.DictComp | ast.GeneratorExp) -> None:
        for generator in node.generators:
            self._check(generator.iter, node)
        self.generic_visit(node)

    visit_ListComp = _comprehension
    visit_DictComp = _comprehension
    visit_GeneratorExp = _comprehension

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in _ORDER_FREE:
            self.order_free.update(id(arg) for arg in node.args)
        name = func.attr if isinstance(func, ast.Attribute) else (
            func.id if isinstance(func, ast.Name) else "")
        if name in _LISTINGS and id(node) not in self.order_free:
            self.listings.append(node.lineno)
        if name in _COMPLETIONS and id(node) not in self.order_free:
            self.completions.append(node.lineno)
        if name in _KEYED and any(k.arg == "key" and _identity(k.value) for k in node.keywords):
            self.addresses.append(node.lineno)
        if name in _THREADS:
            self.threads.append(node.lineno)
        if isinstance(func, ast.Name) and func.id == "hash" and node.args:
            self.hashes.append(node.lineno)
        if _reads_clock(func):
            self.clocks.append(node.lineno)
        if _starts_timer(func, self.timer_names):
            self.timers.append(node.lineno)
        if name in _THREAD_COUNTS and node.args and _computed(node.args[0]):
            self.thread_counts.append(node.lineno)
        if name in ("fork", "_fork") and isinstance(func, ast.Attribute) \
                and isinstance(func.value, ast.Attribute) and func.value.attr == "jit":
            self.forks.append(node.lineno)
        ordering = (isinstance(func, ast.Name) and func.id in _ORDERING_CALLS) or (
            isinstance(func, ast.Attribute) and func.attr == "join")
        if ordering:
            for arg in node.args:
                self._check(arg, node)
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                self._check(arg.value, node)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name in _TIMERS.get(node.module or "", ()):
                self.timer_names.add(alias.asname or alias.name)

    def visit_List(self, node: ast.List) -> None:
        for element in node.elts:
            if isinstance(element, ast.Starred):
                self._check(element.value, node)
        self.generic_visit(node)


#: Calls that only convert a value: ``int(os.environ["THREADS"])`` is as fixed as its input.
_CONVERSIONS = frozenset({"int", "float", "str", "bool", "abs", "round"})


def _computed(value: ast.AST) -> bool:
    """A thread count the machine decides: the argument calls something (``os.cpu_count()``,
    ``os.getpid()``, ``psutil.cpu_percent()``), not a constant, a variable, an environment
    variable or a command-line option (``args.threads``: the same in every plain run)."""
    return any(isinstance(node, ast.Call) and not _reads_fixed(node.func)
               for node in ast.walk(value))


def _reads_fixed(func: ast.AST) -> bool:
    """A conversion, or a read of the environment (``os.environ.get``, ``os.getenv``)."""
    if isinstance(func, ast.Name):
        return func.id in _CONVERSIONS or func.id == "getenv"
    return isinstance(func, ast.Attribute) and (func.attr == "getenv" or (
        func.attr == "get" and isinstance(func.value, ast.Attribute)
        and func.value.attr == "environ"))


def _starts_timer(func: ast.AST, imported: set[str]) -> bool:
    """``threading.Timer(...)``, ``signal.alarm(...)``, ``signal.setitimer(...)``, or one
    of them imported by name."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr in _TIMERS.get(func.value.id, ())
    return isinstance(func, ast.Name) and func.id in imported


def _reads_clock(func: ast.AST) -> bool:
    """``time.time``, ``time.perf_counter``, ``datetime.now`` and the like, or an imported
    ``perf_counter``/``monotonic``/``time_ns``."""
    if isinstance(func, ast.Attribute):
        return func.attr in _CLOCK_ATTRIBUTES or (
            func.attr == "time" and isinstance(func.value, ast.Name) and func.value.id == "time")
    return isinstance(func, ast.Name) and func.id in _CLOCK_ATTRIBUTES - {"now", "today"}


def _identity(key: ast.AST) -> bool:
    """``id``, ``hash``, or a lambda returning ``id(x)``/``hash(x)`` of its argument."""
    if isinstance(key, ast.Name):
        return key.id in _IDENTITY_KEYS
    if isinstance(key, ast.Lambda) and isinstance(key.body, ast.Call):
        func = key.body.func
        return isinstance(func, ast.Name) and func.id in _IDENTITY_KEYS
    return False


def send(session: Any, script: str | None, seed: int) -> None:
    """Before the script runs: its set iterations as the fact ``FACT`` ("train.py:5" each),
    its unsorted listings as ``LISTING_FACT`` and the results it takes as they complete as
    ``COMPLETION_FACT``; ``HASH_SEED_FACT`` says whether ``PYTHONHASHSEED`` is the one
    nondet chose for both runs (a user's own choice holds in plain runs too: no note then).
    Never raises."""
    try:
        if not script:
            return
        with open(script, "rb") as file:
            raw = file.read(MAX_SOURCE + 1)
        found = scan(raw.decode("utf-8", "replace"), script)
        facts: dict[str, Any] = {
            fact: [session.string(session.sources.intern_location(script, line))
                   for line, _ in sites]
            for fact, sites in ((FACT, found.sets), (LISTING_FACT, found.listings),
                                (COMPLETION_FACT, found.completions),
                                (ADDRESS_FACT, found.addresses), (THREADS_FACT, found.threads),
                                (HASH_CALLS_FACT, found.hashes), (CLOCK_FACT, found.clocks),
                                (TIMERS_FACT, found.timers),
                                (THREAD_COUNT_FACT, found.thread_counts),
                                (FORK_FACT, found.forks))
            if sites}
        if facts:
            facts[HASH_SEED_FACT] = os.environ.get("PYTHONHASHSEED") == str(seed % 2**32)
            session.send_facts(facts)
    except Exception:
        pass  # the script's source is the script's: nondet only reads it, and may not


def _where(facts: dict[str, Any], fact: str) -> str | None:
    """The sites of ``fact`` as the notes name them ("train.py:5, train.py:9 and 2 more"),
    or None where the capture (untrusted input) holds none, or not as a list of strings."""
    sites = facts.get(fact)
    if not isinstance(sites, list) or not sites or not all(isinstance(s, str) for s in sites):
        return None
    return ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")


def note(facts: dict[str, Any]) -> str | None:
    """The report's note for a capture's set iterations (None: none)."""
    # The scan cannot tell what the set holds: a set of tensors, modules or other objects
    # iterates in their hash order too, which is their memory addresses (address_note)
    return _salted(facts, FACT, "iterates a set: a set iterates in its items' hash order, "
                   "which for strings follows", "", "sorted(...) gives the set one order (a "
                   "set of tensors, modules or other objects follows their memory addresses "
                   "instead, which can differ between plain runs: iterate a list, or sort by a "
                   "stable key such as a name)")


def hash_note(facts: dict[str, Any]) -> str | None:
    """The report's note for a capture's calls of ``hash()`` (None: none)."""
    return _salted(facts, HASH_CALLS_FACT, "calls hash(): the hash of a string or bytes "
                   "follows", " if the value feeds training (token ids, a seed)",
                   "use a stable hash there (zlib.crc32(text.encode()), hashlib)")


def _salted(facts: dict[str, Any], fact: str, what: str, when: str, fix: str) -> str | None:
    """A note for sites whose values follow the string hash salt, when nondet chose it."""
    where = _where(facts, fact)
    if facts.get(HASH_SEED_FACT) is not True or where is None:
        return None
    return (f"{where} {what} Python's string hash salt, which nondet fixed alike for both "
            "runs (PYTHONHASHSEED) and which plain runs draw afresh at every start, so plain "
            f"runs may differ where these repeated{when} [PY-HASHSEED]; {fix} "
            "(PYTHONHASHSEED=random nondet run ... shows whether it matters)")


def thread_count_note(facts: dict[str, Any]) -> str | None:
    """The report's note for thread counts the script computes (None: none)."""
    where = _where(facts, THREAD_COUNT_FACT)
    if where is None:
        return None
    return (f"{where} sets the framework's thread count from a computed value (the machine's "
            "cores, its load, the process id): a sum split over another number of threads "
            "adds in another order, so plain runs on another machine or under another load "
            "can differ where nondet's two runs, side by side, got the same count; give it "
            "a constant")


def timer_note(facts: dict[str, Any]) -> str | None:
    """The report's note for a capture's timers (None: none): what a timer does lands at
    another step in each plain run, while nondet's two runs, paced alike, agree."""
    where = _where(facts, TIMERS_FACT)
    if where is None:
        return None
    return (f"{where} starts a timer (threading.Timer, signal.alarm or setitimer): what it "
            "does happens after a wall-clock delay, so at another training step in each plain "
            "run, while nondet's two runs, paced alike, may agree; if it changes training (a "
            "learning rate, a flag), trigger it by the step count instead")


def address_note(facts: dict[str, Any]) -> str | None:
    """The report's note for a capture's orderings by object identity (None: none)."""
    where = _where(facts, ADDRESS_FACT)
    if where is None:
        return None
    return (f"{where} orders objects by id() or hash(): by their memory addresses, which "
            "differ from one plain run to the next while nondet's two runs, allocating alike, "
            "mostly agree; so plain runs may differ where these repeated, and a fix verified "
            "here may have held by chance. Order by a stable key instead (a parameter's name "
            "from named_parameters(), an index)")
