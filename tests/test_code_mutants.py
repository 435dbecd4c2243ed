"""The code-mutation table (``make mutate``, ``tests/code_mutants``) still fits the sources.

``make mutate`` itself takes minutes (each mutant runs its tests against a mutated copy of the
tree) and is not part of ``make test``; this cheap check is, so that a refactor that moves a
mutated line, or renames a targeted test, fails here instead of leaving a mutant that tests
nothing: every rewrite's text is found exactly once, the mutated module still compiles, and
every test a mutant names exists.
"""

from __future__ import annotations

import re

import pytest

from tests.code_mutants import (
    MUTANTS,
    CodeMutant,
    RewriteNotApplied,
    mutated_source,
    named_tests,
)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_rewrite_applies_exactly_once_and_compiles(mutant: CodeMutant) -> None:
    original = mutated_source(CodeMutant(mutant.name, mutant.module, (), (), ""))
    text = mutated_source(mutant)
    assert text != original, mutant.name
    compile(text, mutant.module, "exec")


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_targeted_test_exists(mutant: CodeMutant) -> None:
    assert mutant.tests, f"{mutant.name} names no test"
    for path, name in named_tests(mutant):
        assert path.is_file(), f"{mutant.name}: no {path}"
        assert re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M), (
            f"{mutant.name}: {path.name} has no test {name}"
        )


def test_names_are_unique_and_a_missing_anchor_is_refused() -> None:
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    with pytest.raises(RewriteNotApplied):
        mutated_source(MUTANTS[0], source="def nothing(): pass\n")
