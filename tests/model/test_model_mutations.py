"""The spec-mutation table: every seeded mutation breaks its property in the mirror.

The TLC side (the mutated text through real TLC, with equal verdicts and state counts) is
``tests/model/test_model_tlc.py`` (it also ties the mirror's flag to the text edit: the flagged
mirror and TLC on the mutated text must find the same states and verdicts); here, without a
JVM, every rewrite applies and parses, and the flagged mirror breaks its property.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import tla

from statemachine.model import spec
from statemachine.model.cfg import read_cfg, recorded_states
from statemachine.model.check import TLA_DIR, run
from statemachine.model.mutations import (
    MUTATION_TABLE,
    RewriteNotApplied,
    SpecMutation,
    load_mutated,
    mutated_text,
    write_mutated,
)

SPEC_TEXT = (TLA_DIR / "BootstrapCache.tla").read_text(encoding="utf-8")
#: The correct-variant configs CI checks (MCLarge is left out of CI for its size).
CI_CONFIGS = {
    p.name
    for p in TLA_DIR.glob("MC*.cfg")
    if p.name != "MCLarge.cfg" and '"Correct"' in p.read_text(encoding="utf-8")
}


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
        "FirstResponseCompletes",
        "LateAckCompletes",
        "AbortBeforeSendSilent",
        "TimeoutSilent",
        "SendWithoutHandshake",
        "LeaderFailureUntold",
        "FlightStaysRegistered",
        "PublishHandsFollowersNothing",
        "WatchMarksCurrent",
        "MarkOutlivesRequest",
        "ReleaseOnSilence",
        "ReleaseOnOneRankGone",
        "HeartbeatDisconnectIsProof",
        "NewRequestOnHeldRoom",
        "AckOfUnsentAbort",
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
    assert original_holds(mutation.cfg)


@functools.cache
def original_holds(cfg: str) -> bool:
    """The unmutated spec on ``cfg`` holds everything (checked once per cfg: 27 mutations
    share 10 configs, MCOne alone 12 of them)."""
    return run(load_mutated_original_name(cfg)).ok


@pytest.mark.parametrize("mutation", MUTATION_TABLE, ids=lambda m: m.name)
def test_mutated_text_parses_and_differs(mutation: SpecMutation) -> None:
    text = mutated_text(mutation)
    assert text != SPEC_TEXT
    assert tla.parse(text).name == "BootstrapCache"


def test_each_mutation_runs_on_the_smallest_ci_config_that_catches_it() -> None:
    """Mutations run on small configs to keep TLC's CI table short; a bigger config would
    only cost time. The smallest CI config is the first one (by state count) that shows it.

    The sizes are the counts each cfg records, which tests/model/test_model_check.py requires to be
    the mirror's (test_recorded_state_count_is_the_mirrors): exploring every CI config again
    here only to order them cost ~4 s."""
    sizes = {name: recorded_states(read_cfg(TLA_DIR / name)) or 0 for name in CI_CONFIGS}
    assert all(sizes.values()), sizes
    for mutation in MUTATION_TABLE:
        for name in sorted(CI_CONFIGS, key=lambda n: sizes[n]):
            if sizes[name] >= sizes[mutation.cfg]:
                break
            flagged = load_mutated_original_name(name)
            flagged.model = spec.BootstrapCache(flagged.model.constants, mutation=mutation.name)
            assert run(flagged).verdicts.get(mutation.violates, True), (mutation.name, name)


def load_mutated_original_name(name: str):  # type: ignore[no-untyped-def]
    from statemachine.model.check import load

    return load(TLA_DIR / name)


def test_a_rewrite_that_no_longer_applies_is_loud() -> None:
    broken = SpecMutation("X", "MCSmall.cfg", "IdentitySafe", (("no such text", ""),), "")
    with pytest.raises(RewriteNotApplied):
        mutated_text(broken)


def test_writing_a_mutation_leaves_tla_untouched(tmp_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in TLA_DIR.iterdir()}
    cfg = write_mutated(MUTATION_TABLE[0], tmp_path)
    assert cfg.parent == tmp_path and (tmp_path / "BootstrapCache.tla").exists()
    assert {p.name: p.read_bytes() for p in TLA_DIR.iterdir()} == before
