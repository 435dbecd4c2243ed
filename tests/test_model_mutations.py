"""The spec-mutation table: every seeded mutation breaks its property in the mirror.

The TLC side (the mutated text through real TLC, with equal verdicts and state counts) is
``tests/test_model_tlc.py``; here, without a JVM, the mirror's flag is tied to the text edit
by evaluating the mutated text with the TLA+ interpreter on a small config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tla
from test_model_interp import SPEC_TEXT, cross_check, interpreter_for

from statemachine.model import spec
from statemachine.model.check import TLA_DIR, run
from statemachine.model.mutations import (
    MUTATION_TABLE,
    RewriteNotApplied,
    SpecMutation,
    load_mutated,
    mutated_text,
    write_mutated,
)
from statemachine.model.spec import BootstrapCache, Constants

CI_CONFIGS = {"MCSmall.cfg", "MCImmediate.cfg", "MCTwoKeys.cfg", "MCEtcd.cfg"}


def test_the_table_covers_the_required_mutations() -> None:
    names = {m.name for m in MUTATION_TABLE}
    assert names == set(spec.MUTATIONS)
    assert {
        "PublishOverwrites",
        "LoserKeepsOwn",
        "InvalidateByKey",
        "TimeoutKeepsEntry",
        "RetireStaleObservation",
        "CompleteWithoutAck",
        "PrefixNodeFailure",
        "NoFairness",
        "UnboundedFaults",
        "WeakFairLookups",
    } <= names
    # Every property has teeth: some mutation breaks it.
    named = {*spec.INVARIANTS, *spec.ACTION_PROPERTIES, *spec.LIVENESS_PROPERTIES} - {"TypeOK"}
    assert named <= {m.violates for m in MUTATION_TABLE}
    assert all(m.cfg in CI_CONFIGS for m in MUTATION_TABLE)


@pytest.mark.parametrize("mutation", MUTATION_TABLE, ids=lambda m: m.name)
def test_mutation_breaks_its_property_in_the_mirror(mutation: SpecMutation) -> None:
    result = run(load_mutated(mutation))
    assert not result.verdicts[mutation.violates], mutation.name
    # The correct spec holds everything on that config: the mutation is what breaks it.
    assert run(load_mutated_original(mutation)).ok


def load_mutated_original(mutation: SpecMutation):  # type: ignore[no-untyped-def]
    from statemachine.model.check import load

    return load(TLA_DIR / mutation.cfg)


@pytest.mark.parametrize("mutation", MUTATION_TABLE, ids=lambda m: m.name)
def test_mutated_text_parses_and_differs(mutation: SpecMutation) -> None:
    text = mutated_text(mutation)
    assert text != SPEC_TEXT
    assert tla.parse(text).name == "BootstrapCache"


#: A config small enough for the interpreter, where every receiver-side mutation shows.
SMALL = Constants(("r1", "r2"), (80,), 1, 0, "queueing", "Correct")
TWO_KEYS = Constants(("r1",), (80, 8000), 1, 0, "queueing", "Correct")


@pytest.mark.parametrize(
    "mutation",
    [m for m in MUTATION_TABLE if m.name not in ("NoFairness", "WeakFairLookups")],
    ids=lambda m: m.name,
)
def test_mirror_flag_is_the_text_edit(mutation: SpecMutation) -> None:
    """The flagged mirror and the mutated text have the same states and steps (fairness-only
    mutations change no step; their text edit is compared by TLC in test_model_tlc)."""
    constants = TWO_KEYS if mutation.cfg == "MCTwoKeys.cfg" else SMALL
    if mutation.cfg == "MCImmediate.cfg":
        constants = Constants(("r1", "r2"), (80,), 1, 0, "immediate", "Correct")
    if mutation.cfg == "MCEtcd.cfg":
        constants = Constants(("r1", "r2"), (80,), 1, 0, "queueing", "Correct", "etcd")
    model = BootstrapCache(constants, mutation=mutation.name)
    interp = interpreter_for(model, mutated_text(mutation))
    count = cross_check(model, interp, fairness=False)
    assert count > 0


def test_a_rewrite_that_no_longer_applies_is_loud() -> None:
    broken = SpecMutation("X", "MCSmall.cfg", "IdentitySafe", (("no such text", ""),), "")
    with pytest.raises(RewriteNotApplied):
        mutated_text(broken)


def test_writing_a_mutation_leaves_tla_untouched(tmp_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in TLA_DIR.iterdir()}
    cfg = write_mutated(MUTATION_TABLE[0], tmp_path)
    assert cfg.parent == tmp_path and (tmp_path / "BootstrapCache.tla").exists()
    assert {p.name: p.read_bytes() for p in TLA_DIR.iterdir()} == before
