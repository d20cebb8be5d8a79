"""A generator made without a seed in the script's own code, read by DataLoader workers:
its recipe comes first, not per-worker seeding (DATA-PT-WORKERSEED), which cannot reach an
instance the dataset made itself. Found with a Dataset keeping ``random.Random()`` (a
T5 span-corruption collator, pytorch/examples style): the first fix shown did not work."""

from __future__ import annotations

import pytest

from nondet import recipe

_BATCH = {"framework": "torch", "kind": "entry", "entry_kind": "dataloader",
          "phase": "data", "loader.num_workers": 2, "torch_version": "2.13.0"}


@pytest.mark.parametrize(("fact", "first"), [("python.unseeded_random", "PY-ENTROPY"),
                                             ("numpy.unseeded_generator", "PY-NP-GENERATOR")])
def test_an_unseeded_generator_read_by_workers_is_the_first_cause(fact: str,
                                                                   first: str) -> None:
    ranked = [s.recipe.id for s in recipe.suggest({**_BATCH, fact: True}, limit=5)]
    assert ranked[0] == first and "DATA-PT-WORKERSEED" in ranked, ranked


def test_without_an_unseeded_generator_workers_are_seeded() -> None:
    ranked = [s.recipe.id for s in recipe.suggest(_BATCH, limit=5)]
    assert ranked[0] == "DATA-PT-WORKERSEED", ranked


def test_the_fix_says_how_a_generator_object_is_seeded() -> None:
    fix = recipe.suggest({**_BATCH, "python.unseeded_random": True})[0].fix
    assert "random.Random(seed)" in fix
