"""The recipe table: known causes of nondeterminism and their fixes, as data.

Entries live in ``nondet/recipes/<framework>.toml`` (schema in docs/recipes.md). A finding is
turned into *facts* (op name, phase, device, kind, entry kind, loader settings, ...) and every
entry whose ``match`` holds for those facts is a suggestion, in file order (specific entries
come first). The fix shown is the variant for the installed framework version.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

_FRAMEWORK_FILES = ("torch.toml", "tensorflow.toml")
_COMPARATORS = (">=", "<=", "!=", "==", ">", "<")


@dataclass(frozen=True)
class Recipe:
    id: str
    framework: str
    title: str
    cause: str
    fix: str
    fix_kind: str
    applies: str
    sources: tuple[str, ...]
    match: tuple[dict[str, Any], ...]  # alternatives: any one of them must hold
    where: str = ""
    cost: str = ""
    note: str = ""
    variants: tuple[dict[str, Any], ...] = ()
    # fact name -> text with "{site}": lines the capture recorded for this cause (where an
    # unseeded generator was made, ...), listed under the suggestion
    sites: tuple[tuple[str, str], ...] = ()
    # interventions (nondet.interventions) that stand in for the fix when applied from
    # outside, tried in this order; empty: a code change only the user can make
    apply: tuple[str, ...] = ()

    def matches(self, facts: dict[str, Any]) -> bool:
        return self.specificity(facts) > 0

    def specificity(self, facts: dict[str, Any]) -> int:
        """0 if no match; else how specific the best matching table is (see _weight)."""
        if self.framework not in ("any", facts.get("framework")):
            return 0
        return max((_weight(m, facts) for m in self.match if _holds(m, facts)), default=0)


def _holds(m: dict[str, Any], facts: dict[str, Any]) -> bool:
    """All conditions of one ``match`` table hold for the facts."""
    if not m:
        return False  # a table with no conditions would match every finding
    op = str(facts.get("op") or "")
    if "ops" in m and not any(fnmatch.fnmatchcase(op, pattern) for pattern in m["ops"]):
        return False
    for key, fact in (("devices", "device"), ("phases", "phase"), ("kinds", "kind"),
                      ("entry_kinds", "entry_kind")):
        if key in m and facts.get(fact) not in m[key]:
            return False
    return all(_fact_holds(facts.get(name), want) for name, want in m.get("facts", {}).items())


@dataclass
class Suggestion:
    recipe: Recipe
    fix: str
    fix_kind: str
    applies: str
    applies_here: bool | None  # None when the installed version is unknown
    note: str = ""
    details: list[str] = field(default_factory=list)
    #: where the capture says the fix goes (the recipe's ``sites``: the line that made an
    #: unseeded generator), when it says so
    sites: list[str] = field(default_factory=list)
    # verification (pipeline): True the runs repeated with the fix applied, False they did
    # not (or the script failed with it), None not tried or not applicable from outside
    verified: bool | None = None
    verified_steps: int | None = None  # steps the two verifying runs compared
    cost_ratio: float | None = None  # step time with the fix / without it
    verify_note: str = ""  # what verification found, one line ("did not help", the error)
    verified_with: str = ""  # the intervention id under which the runs repeated
    parts_again: int | None = None  # verified for this source; another parts them here
    verified_captures: tuple[str, ...] = ()  # the verifying pair (to localize parts_again)
    #: the verifying pair repeated to where the runs with every fix would stop (the end of
    #: the script): it answers ``nondet.sources``' "do the runs now repeat?" itself
    ran_on: bool = False

    def to_json(self) -> dict[str, Any]:
        r = self.recipe
        return {
            "id": r.id, "cause": r.cause, "fix": self.fix, "verified": self.verified,
            "verified_steps": self.verified_steps, "cost_ratio": self.cost_ratio,
            "verify_note": self.verify_note, "verified_with": self.verified_with or None,
            "parts_again_at": self.parts_again,
            "apply": list(r.apply),
            "title": r.title, "fix_kind": self.fix_kind, "where": r.where,
            "applies": self.applies, "applies_here": self.applies_here, "cost": r.cost,
            "note": self.note or r.note, "details": self.details, "sources": list(r.sources),
        }


@functools.cache
def load() -> tuple[Recipe, ...]:
    recipes: list[Recipe] = []
    folder = resources.files("nondet") / "recipes"
    for name in _FRAMEWORK_FILES:
        path = folder / name
        if not path.is_file():
            continue
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        for entry in data.get("recipe", []):
            recipes.append(Recipe(
                id=entry["id"], framework=entry["framework"], title=entry["title"],
                cause=entry["cause"], fix=entry["fix"], fix_kind=entry["fix_kind"],
                applies=entry.get("applies", ""), sources=tuple(entry.get("sources", ())),
                match=_alternatives(entry.get("match", {})), where=entry.get("where", ""),
                cost=entry.get("cost", ""), note=entry.get("note", ""),
                variants=tuple(entry.get("variants", ())),
                sites=tuple(entry.get("sites", {}).items()),
                apply=tuple(entry.get("apply", ())),
            ))
    return tuple(recipes)


def _weight(m: dict[str, Any], facts: dict[str, Any]) -> int:
    """Naming the op counts most (more than any generic kind+device+fact entry, so an
    op-specific fix outranks "use one CPU thread"), then each fact, then each
    kind/phase/device condition. An op pattern that names no op (``aten.*``) counts like
    a kind condition.
    """
    score = sum(1 for key in ("devices", "phases", "kinds", "entry_kinds") if key in m)
    score += 2 * len(m.get("facts", {}))
    if "ops" in m:
        op = str(facts.get("op") or "")
        named = any(fnmatch.fnmatchcase(op, p) and not p.split(".", 1)[-1].startswith("*")
                    for p in m["ops"])
        score += 5 if named else 1
    return score


def _alternatives(match: dict[str, Any] | list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    return tuple(match) if isinstance(match, list) else (match,)


def suggest(facts: dict[str, Any], limit: int = 3,
            sites: dict[str, Any] | None = None) -> list[Suggestion]:
    """Suggestions for a finding: the most specific match first (the one with the most
    conditions), file order among equals; a fix for another version goes last. ``sites``
    (a capture's facts) fill in the places a recipe's ``sites`` table names."""
    matched = [(recipe, recipe.specificity(facts)) for recipe in load()]
    ranked = sorted(((r, score) for r, score in matched if score > 0),
                    key=lambda pair: -pair[1])
    out = [_choose_variant(recipe, facts) for recipe, _ in ranked]
    out.sort(key=lambda s: s.applies_here is False)
    for suggestion in out:
        for fact, text in suggestion.recipe.sites:
            found = [str(site) for site in (sites or {}).get(fact, [])]
            suggestion.details.extend(text.format(site=site) for site in found)
            suggestion.sites.extend(found)
    return out[:limit]


def _choose_variant(recipe: Recipe, facts: dict[str, Any]) -> Suggestion:
    options = [{"fix": recipe.fix, "fix_kind": recipe.fix_kind, "applies": recipe.applies,
                "note": ""}, *recipe.variants]
    verdicts = [(option, version_satisfies(option.get("applies", ""), facts)) for option in options]
    for option, ok in verdicts:
        if ok:
            return _suggestion(recipe, option, True)
    unknown = [option for option, ok in verdicts if ok is None]
    if unknown:
        return _suggestion(recipe, unknown[0], None)
    return _suggestion(recipe, options[0], False)


def _suggestion(recipe: Recipe, option: dict[str, Any], here: bool | None) -> Suggestion:
    return Suggestion(recipe=recipe, fix=option.get("fix", recipe.fix),
                      fix_kind=option.get("fix_kind", recipe.fix_kind),
                      applies=option.get("applies", recipe.applies), applies_here=here,
                      note=option.get("note", ""))


def parse_version(text: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); '2.21.0-rc1' -> (2, 21, 0)."""
    parts = []
    for piece in re.split(r"[.+-]", text.strip()):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def version_satisfies(spec: str, facts: dict[str, Any]) -> bool | None:
    """Does the installed package satisfy e.g. "torch>=1.8,<2.0"? None if unknown."""
    spec = spec.strip()
    if not spec:
        return True
    package = re.match(r"[A-Za-z_][A-Za-z0-9_.-]*", spec)
    if not package:
        return None
    installed = facts.get(f"{package.group().lower()}_version")
    if not installed:
        return None
    have = parse_version(str(installed))
    for clause in spec[package.end():].split(","):
        clause = clause.strip()
        if not clause:
            continue
        op = next((c for c in _COMPARATORS if clause.startswith(c)), None)
        if op is None:
            return None
        want = parse_version(clause[len(op):])
        width = max(len(have), len(want))
        h, w = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        ok = {">=": h >= w, "<=": h <= w, "!=": h != w, "==": h == w, ">": h > w,
              "<": h < w}[op]
        if not ok:
            return False
    return True


def _fact_holds(value: Any, want: Any) -> bool:
    if isinstance(want, str) and want.startswith(_COMPARATORS) and not isinstance(value, str):
        op = next(c for c in _COMPARATORS if want.startswith(c))
        try:
            number, target = float(value), float(want[len(op):])
        except (TypeError, ValueError):
            return False
        return {">=": number >= target, "<=": number <= target, "!=": number != target,
                "==": number == target, ">": number > target, "<": number < target}[op]
    if isinstance(want, bool):
        return isinstance(value, bool) and value == want
    return bool(value == want)
