"""Every source (nondet.sources): the search after the first verified fix, on synthetic
captures, with the pipeline's steps replaced by a fake that records what it was asked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nondet import recipe, sources, verify
from nondet.exitcodes import ExitCode
from nondet.launch import Plan, RunResult
from nondet.records import Kind
from nondet.report import Divergence, Report, RunSummary
from nondet.report.junit import summary_line
from nondet.report.text import lines
from nondet.store import Capture, open_capture
from tests.conftest import OpStream, step_rows, write_capture


def _suggestions(*ids: str) -> list[recipe.Suggestion]:
    by_id = {r.id: r for r in recipe.load()}
    return [recipe.Suggestion(by_id[i], by_id[i].fix, by_id[i].fix_kind, "", True)
            for i in ids]


class _Files:
    def __init__(self, folder: Path) -> None:
        self.folder, self.count = folder, 0

    def pair(self, a: list[int], b: list[int], wall: float = 1.0) -> tuple[Path, Path]:
        self.count += 1
        out = []
        for name, params in (("a", a), ("b", b)):
            rows = step_rows(*({"step": i, "params_fp": p, "wall": (i + 1) * wall}
                               for i, p in enumerate(params)))
            out.append(write_capture(self.folder / f"{name}{self.count}.h5", rows))
        return out[0], out[1]


def _results(pa: Path, pb: Path) -> tuple[RunResult, RunResult]:
    out = []
    for p in (pa, pb):
        p.with_suffix(".log").write_text("")
        out.append(RunResult(p.stem, p, p.with_suffix(".log"), "complete", 0, 3))
    return out[0], out[1]


SAME = [1, 2, 3, 4, 5, 6]


class _Job:
    """A job with sources at step 0 (threads, fixed by torch.deterministic), step 2 (data
    order, fixed by torch.dataloader_in_order) and, if ``third``, step 4 (fixed by nothing
    nondet can apply)."""

    def __init__(self, files: _Files, third: bool = False, wall_all: float = 1.2) -> None:
        self.files, self.third, self.wall_all = files, third, wall_all
        self.explained: list[tuple[str, ...]] = []
        self.ran_on: list[tuple[str, ...]] = []

    def _pair(self, applied: tuple[str, ...], wall: float = 1.0) -> tuple[Path, Path]:
        parts = [s for s, fix in ((0, "torch.deterministic"), (2, "torch.dataloader_in_order"),
                                  (4, "none") if self.third else (99, "")) if fix not in applied]
        if not parts or parts[0] >= len(SAME):
            return self.files.pair(SAME, SAME, wall)
        at = parts[0]
        return self.files.pair(SAME, SAME[:at] + [x + 100 for x in SAME[at:]], wall)

    def run_on(self, apply: tuple[str, ...], folder: Path,
               stop_after: int | None) -> tuple[Path, Path]:
        assert folder.is_dir()
        self.ran_on.append(apply)
        return self._pair(apply, self.wall_all)

    def explain(self, apply: tuple[str, ...], folder: Path, a: Capture, b: Capture,
                ) -> tuple[Divergence | None, list[recipe.Suggestion], list[str]]:
        self.explained.append(apply)
        step = next(int(r["step"]) for r, s in zip(a.steps, b.steps, strict=False)
                    if r["params_fp"] != s["params_fp"])
        if step == 2:
            return (Divergence("entry", 2, "data", op="batch from DataLoader#0",
                               source="train.py:30"), _suggestions("DATA-PT-INORDER"), [])
        if step == 0:  # the first source again
            return (Divergence("op", 0, "backward", op="aten.index_put.default",
                               source="train.py:12"), _suggestions("PT-GETITEM-CPU"), [])
        return (Divergence("entry", step, "forward", op="torch.from_numpy",
                           source="train.py:40"), _suggestions("PY-NP-GENERATOR"), [])

    def verify(self, apply: tuple[str, ...], folder: Path, suggestions: list[recipe.Suggestion],
               pair: tuple[Capture, Capture], finding_step: int,
               ) -> tuple[list[recipe.Suggestion], list[str]]:
        def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]
                     ) -> tuple[RunResult, RunResult]:
            return _results(*self._pair(apply + ids))

        return verify.verify(suggestions, pair, run_pair, lambda _t: None, None, finding_step)


def _first(job: _Job) -> tuple[sources.Source, tuple[Capture, Capture]]:
    pa, pb = job._pair(())
    pair = (open_capture(pa), open_capture(pb))
    div = Divergence("op", 0, "backward", op="aten.index_put.default", source="train.py:12")
    suggestions, _ = job.verify((), job.files.folder, _suggestions("PT-GETITEM-CPU"), pair, 0)
    return sources.Source(div, suggestions), pair


def test_each_source_is_found_with_the_earlier_fixes_applied_and_combined(
        tmp_path: Path) -> None:
    job = _Job(_Files(tmp_path))
    first, pair = _first(job)
    # the fix for step 0 removed that source; the runs with it part again at step 2
    assert first.fix is not None and first.fix.parts_again == 2
    found, combined, written = sources.every_source(first, pair, job, tmp_path,
                                                    sources.Budget(), lambda _t: None)
    assert [(s.first_divergence.step, s.suggestions[0].recipe.id, s.suggestions[0].verified)
            for s in found] == [(0, "PT-GETITEM-CPU", True), (2, "DATA-PT-INORDER", True)]
    assert found[1].applied == ("torch.deterministic",)  # found with the first fix in place
    assert job.explained == [("torch.deterministic",)]
    assert job.ran_on == [("torch.deterministic", "torch.dataloader_in_order")]
    assert combined is not None and combined.verified is True
    assert (combined.verified_steps, combined.cost_ratio) == (6, 1.2)
    assert combined.code == ["torch.use_deterministic_algorithms(True)",
                             "DataLoader(..., in_order=True)  # at train.py:30"]
    assert combined.note == "" and len(written) == 4  # source 2 verified, then run on
    report = Report("nondeterministic", ExitCode.NONDETERMINISTIC,
                    [RunSummary("a", 0, 6, True, "complete")] * 2, first.first_divergence,
                    first.suggestions, sources=found, combined_fix=combined)
    out = "\n".join(lines(report))
    assert "2. step 2 (data): batch from DataLoader#0 at train.py:30" in out
    assert "with all of these, 2 runs repeat over 6 steps, step time 1.20x" in out
    # the JUnit failure message and the GitHub annotation carry the combined fix
    assert ("2 sources, all fixes: torch.use_deterministic_algorithms(True); "
            "DataLoader(..., in_order=True)  # at train.py:30 (verified together over 6 "
            "steps, step time 1.20x)") in summary_line(report)
    assert [s["first_divergence"]["step"] for s in report.to_json()["sources"]] == [0, 2]
    assert report.to_json()["combined_fix"]["verified_steps"] == 6


def test_a_verifying_pair_that_ran_to_the_end_is_the_run_with_every_fix(
        tmp_path: Path) -> None:
    """One source: the pair that verified its fix ran on to the script's end and repeated,
    so it already answers "do the runs repeat with every fix?"; no pair of runs is spent
    asking again (each such job ran 2 runs more before). A pair that stopped short of the
    end (stopped, not complete) answers nothing, and the search runs on itself."""
    files = _Files(tmp_path)
    pa, pb = files.pair(SAME, [1, 102, 103, 104, 105, 106])  # parts at step 1, one source
    pair = (open_capture(pa), open_capture(pb))
    for status, runs_on_itself in (("complete", False), ("stopped", True)):
        stops: list[int | None] = []

        def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...], status: str = status,
                     stops: list[int | None] = stops) -> tuple[RunResult, RunResult]:
            stops.append(plans[0].stop_after)
            results = _results(*files.pair(SAME, SAME))
            return replace(results[0], status=status), replace(results[1], status=status)

        (fix, *_), _ = verify.verify(_suggestions("PT-GETITEM-CPU"), pair, run_pair,
                                     lambda _t: None, None, 1, run_on=True)
        assert stops == [None]  # on to the end, not stopped after the first pair's step 5
        assert fix.verified is True and fix.ran_on is (not runs_on_itself)
        job = _Job(files)
        job._pair = lambda applied, wall=1.0: files.pair(  # type: ignore[method-assign]
            SAME, SAME, wall)  # repeats with the fix
        found, combined, more = sources.every_source(
            sources.Source(Divergence("op", 1, "backward"), [fix]), pair, job, tmp_path,
            sources.Budget(), lambda _t: None)
        assert len(found) == 1 and combined is not None and combined.verified is True
        assert combined.verified_steps == 6
        assert bool(job.ran_on) is runs_on_itself, status
        assert len(more) == (2 if runs_on_itself else 0)


def test_a_source_without_a_verifiable_fix_ends_the_search_and_says_so(tmp_path: Path) -> None:
    job = _Job(_Files(tmp_path), third=True)
    first, pair = _first(job)
    found, combined, _ = sources.every_source(first, pair, job, tmp_path, sources.Budget(),
                                              lambda _t: None)
    assert [s.first_divergence.step for s in found] == [0, 2, 4]
    assert found[2].fix is None  # PY-NP-GENERATOR's patch did not help this fake source
    assert combined is not None and combined.verified is False
    assert "source 3 has no fix nondet could verify" in combined.note
    assert combined.apply == ("torch.deterministic", "torch.dataloader_in_order")


def test_max_fixes_stops_the_search_and_says_what_was_left(tmp_path: Path) -> None:
    job = _Job(_Files(tmp_path))
    first, pair = _first(job)
    first.fix.parts_again = None  # type: ignore[union-attr]  # so the search runs on itself
    found, combined, _ = sources.every_source(first, pair, job, tmp_path,
                                              sources.Budget(max_fixes=1), lambda _t: None)
    assert len(found) == 1 and job.explained == []
    assert combined is not None and combined.verified is False
    assert "still part at step 2" in combined.note and "--max-fixes" in combined.note


def test_the_time_budget_stops_the_search_and_says_what_was_left(tmp_path: Path) -> None:
    job = _Job(_Files(tmp_path))
    first, pair = _first(job)
    found, combined, _ = sources.every_source(first, pair, job, tmp_path,
                                              sources.Budget(seconds=1e-9), lambda _t: None)
    assert len(found) == 1 and job.explained == [] and job.ran_on == []
    assert combined is not None and combined.verified is False
    assert "--verify-budget" in combined.note and "not examined" in combined.note


def test_a_fix_whose_op_parts_the_runs_again_is_withdrawn(tmp_path: Path) -> None:
    """A race that happened not to strike at its step in the verifying pair: the same op
    parts the runs later, so the fix was not verified after all."""
    job = _Job(_Files(tmp_path))
    first, pair = _first(job)
    job._pair = lambda applied, wall=1.0: job.files.pair(  # type: ignore[method-assign]
        SAME, SAME[:2] + [x + 100 for x in SAME[2:]], wall)
    job.explain = lambda apply, folder, a, b: (  # type: ignore[method-assign]
        Divergence("op", 3, "backward", op="aten.index_put.default", source="train.py:12"),
        _suggestions("PT-GETITEM-CPU"), [])
    found, combined, _ = sources.every_source(first, pair, job, tmp_path, sources.Budget(),
                                              lambda _t: None)
    assert found[0].suggestions[0].verified is False
    assert "did not hold" in found[0].suggestions[0].verify_note
    assert combined is not None and combined.verified is False


def test_when_a_fix_does_not_hold_the_untried_ones_are_verified(tmp_path: Path) -> None:
    """The first fix held only because the race parted its pair later, by chance; the
    DataLoader fixture then kept it first, "did not hold", with the fix that works never
    tried (CI). The untried suggestions are verified on the first pair instead."""
    job = _Job(_Files(tmp_path))
    job._pair = lambda applied, wall=1.0: job.files.pair(  # type: ignore[method-assign]
        SAME, SAME if "torch.dataloader_in_order" in applied
        else SAME[:2] + [x + 100 for x in SAME[2:]], wall)
    pa, pb = job._pair(())
    pair = (open_capture(pa), open_capture(pb))
    div = Divergence("op", 0, "backward", op="aten.index_put.default", source="train.py:12")
    suggestions, _ = job.verify((), job.files.folder,
                                _suggestions("PT-GETITEM-CPU", "DATA-PT-INORDER"), pair, 0)
    assert suggestions[0].recipe.id == "PT-GETITEM-CPU" and suggestions[1].verified is None
    folders: list[Path] = []  # where each re-run of the search wrote

    def explain(apply: tuple[str, ...], folder: Path, a: Capture, b: Capture,
                ) -> tuple[Divergence, list[recipe.Suggestion], list[str]]:
        folders.append(folder)
        return (Divergence("op", 2, "backward", op="aten.index_put.default",
                           source="train.py:12"), _suggestions("PT-GETITEM-CPU"), [])

    job.explain = explain  # type: ignore[method-assign]
    run_on = job.run_on

    def run_on_recorded(apply: tuple[str, ...], folder: Path,
                        stop_after: int | None) -> tuple[Path, Path]:
        folders.append(folder)
        return run_on(apply, folder, stop_after)

    job.run_on = run_on_recorded  # type: ignore[method-assign]
    found, combined, _ = sources.every_source(sources.Source(div, suggestions), pair, job,
                                              tmp_path, sources.Budget(), lambda _t: None)
    first = found[0].suggestions
    assert [(s.recipe.id, s.verified) for s in first] == [("DATA-PT-INORDER", True),
                                                          ("PT-GETITEM-CPU", False)]
    assert "did not hold" in first[1].verify_note
    assert len(found) == 1 and combined is not None and combined.verified is True
    # the search for source 2 ran again after the fix changed: in a folder of its own (it
    # wrote its captures over the open ones of the first attempt: "unable to truncate")
    assert folders and len(set(folders)) == len(folders), folders


def test_no_search_without_a_verified_first_fix(tmp_path: Path) -> None:
    job = _Job(_Files(tmp_path))
    pa, pb = job._pair(())
    pair = (open_capture(pa), open_capture(pb))
    first = sources.Source(Divergence("op", 0, "backward"), _suggestions("PY-SEED-VARIES"))
    found, combined, written = sources.every_source(first, pair, job, tmp_path,
                                                    sources.Budget(), lambda _t: None)
    assert (len(found), combined, written, job.ran_on) == (1, None, [], [])


def test_a_fix_whose_runs_still_part_at_its_own_step_is_not_verified(tmp_path: Path) -> None:
    files = _Files(tmp_path)
    pa, pb = files.pair(SAME, [*SAME[:2], 0, 0, 0, 0])
    pair = (open_capture(pa), open_capture(pb))

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        return _results(*files.pair(SAME, [*SAME[:2], 0, 0, 0, 0]))  # parts at step 2 still

    (only,), _ = verify.verify(_suggestions("DATA-PT-INORDER"), pair, run_pair,
                               lambda _t: None, None, 2)
    assert only.verified is False and only.parts_again is None


def test_bad_budgets_are_usage_errors(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for option, value in (("--max-fixes", "0"), ("--verify-steps", "0"),
                          ("--verify-budget", "-5")):
        result = run_cli("run", option, value, "--out", str(tmp_path / "out"), str(script))
        assert result.returncode == 2, (option, result.stderr)
        assert option in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_verify_pairs_a_fix_must_hold_in_every_pair(tmp_path: Path) -> None:
    """--verify-pairs N: a race that misses one pair by chance does not verify a fix."""
    files = _Files(tmp_path)
    pa, pb = files.pair(SAME, [1, 9, 9, 9, 9, 9])
    pair = (open_capture(pa), open_capture(pb))
    calls: list[str] = []

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        calls.append(plans[0].label)
        lucky = len(calls) == 1 or ids != ("torch.deterministic",)  # the first pair only
        return _results(*files.pair(SAME, SAME if lucky else [1, 9, 9, 9, 9, 9]))

    (only,), written = verify.verify(_suggestions("PT-GETITEM-CPU"), pair, run_pair,
                                     lambda _t: None, None, 1, pairs=3)
    # torch.deterministic repeated once, then parted; the warn_only variant held in all 3
    assert calls == ["a-fix1", "a-fix1-2", "a-fix2", "a-fix2-2", "a-fix2-3"]
    assert only.verified is True and only.verified_with == "torch.deterministic_warn_only"
    assert "in each of 3 pairs" in only.verify_note
    assert "did not hold in every pair (held in 1 of 2 pairs)" in only.verify_note
    assert len(written) == 10


def test_a_patched_fix_goes_where_the_capture_says_it_does() -> None:
    """An unseeded Generator made at line 40 and drawn from at line 69: the combined fix
    said "# at train.py:69" (the draw) while the fix's own detail named line 40."""
    from nondet.report import Source

    by_id = {r.id: r for r in recipe.load()}
    made_at = recipe.Suggestion(by_id["PY-NP-GENERATOR"], "rng = np.random.default_rng(seed)",
                                "code", "", True, verified=True,
                                verified_with="numpy.seed_unseeded_generators",
                                sites=["train.py:40"])
    found = Source(Divergence("entry", 0, "forward", op="tensor", source="train.py:69"),
                   [made_at])
    combined = sources._combined([found], ("numpy.seed_unseeded_generators",))
    assert combined.code == ["rng = np.random.default_rng(seed)  # at train.py:40"]
    unsited = Source(found.first_divergence, [recipe.Suggestion(
        by_id["PY-NP-GENERATOR"], "rng = np.random.default_rng(seed)", "code", "", True,
        verified=True, verified_with="numpy.seed_unseeded_generators")])
    assert sources._combined([unsited], ()).code == [
        "rng = np.random.default_rng(seed)  # at train.py:69"]  # the finding's line then


def test_suggestions_carry_the_sites_the_capture_names() -> None:
    facts = {"framework": "torch", "kind": "entry", "entry_kind": "external",
             "numpy.unseeded_generator": True}
    first = recipe.suggest(facts, sites={"numpy.unseeded_generator": ["train.py:40"]})[0]
    assert first.recipe.id == "PY-NP-GENERATOR" and first.sites == ["train.py:40"]


def _two_sources(folder: Path, name: str, shuffle_differs: bool, race_differs: bool
                 ) -> tuple[Path, Path]:
    """A pair parting at step 0 with op records there: an entry (an unseeded shuffle, at
    record 1) and a racing op (``index_put_``, record 3) whose inputs match."""
    paths = []
    for run, flip in (("a", 0), ("b", 1)):
        ops = (OpStream()
               .add(0, "aten.randn.default", 11, source="train.py:5")
               .add(0, "numpy:torch.from_numpy", 20 + flip * shuffle_differs,
                    kind=Kind.ENTRY, source="train.py:8")
               .add(0, "aten.new_zeros.default", 13, source="train.py:9")
               .add(0, "aten.index_put_.default", 30 + flip * race_differs, 13,
                    source="train.py:9"))
        rows = step_rows({"step": -1, "params_fp": 1},
                         {"step": 0, "params_fp": 2 + flip, "wall": 1.0})
        paths.append(write_capture(folder / f"{name}-{run}.h5", rows, ops))
    return paths[0], paths[1]


def test_a_fix_that_moves_the_difference_to_a_later_op_of_its_step_holds(
        tmp_path: Path) -> None:
    """Both sources in step 0: with the shuffle seeded the pair still parts at step 0,
    now first at the racing op. The fix removed its source (it was reported "did not help"
    and the race was never examined)."""
    first = tuple(open_capture(p) for p in _two_sources(tmp_path, "first", True, True))
    fixed = _two_sources(tmp_path, "fixed", False, True)
    unfixed = _two_sources(tmp_path, "unfixed", True, True)

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        return _results(*(fixed if ids == ("numpy.seed_unseeded_generators",) else unfixed))

    suggestions = _suggestions("PY-NP-GENERATOR")
    out, _ = verify.verify(suggestions, (first[0], first[1]), run_pair, lambda _: None,
                           op_steps=[-1, 0], finding_step=0)
    fix = out[0]
    assert fix.verified is True, fix.verify_note
    assert "aten.index_put_.default at train.py:9" in fix.verify_note
    assert fix.parts_again == 0 and fix.cost_ratio is None

    # the same op parting them again is no fix at all
    suggestions = _suggestions("PY-NP-GENERATOR")
    fixed = unfixed
    out, _ = verify.verify(suggestions, (first[0], first[1]), run_pair, lambda _: None,
                           op_steps=[-1, 0], finding_step=0)
    assert out[0].verified is False and "did not help" in out[0].verify_note


def test_a_race_that_parts_its_step_elsewhere_each_time_moved_nothing(tmp_path: Path) -> None:
    """A DataLoader handing out batches in completion order parts a step at one record in
    one pair and at another in the next: an irrelevant fix looked like it moved the
    difference (the batch fixture got PY-ENTROPY first, then "did not hold")."""
    def pair(name: str, differing: int) -> tuple[Path, Path]:
        paths = []
        for run, flip in (("a", 0), ("b", 1)):
            ops = OpStream()
            for i in range(3):  # three batches, x then y, at one line
                ops.add(0, "batch from DataLoader#0", 10 * i + flip * (i == differing),
                        kind=Kind.ENTRY, source="train.py:9")
            ops.add(0, "aten.addmm.default", 50 + flip, 7, source="train.py:10")
            rows = step_rows({"step": -1, "params_fp": 1},
                             {"step": 0, "params_fp": 2 + flip, "wall": 1.0})
            paths.append(write_capture(tmp_path / f"{name}-{run}.h5", rows, ops))
        return paths[0], paths[1]

    first = tuple(open_capture(p) for p in pair("first", 0))
    later = pair("later", 2)  # the same kind of record, further on: the same race

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        return _results(*later)

    out, _ = verify.verify(_suggestions("PY-ENTROPY"), (first[0], first[1]), run_pair,
                           lambda _: None, op_steps=[-1, 0], finding_step=0)
    assert out[0].verified is False, out[0].verify_note
