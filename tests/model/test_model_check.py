"""The mirror's checker on the real cfgs: counts, verdicts, replayable counterexamples, CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from statemachine.errors import CfgError
from statemachine.model.cfg import parse_cfg, read_cfg, recorded_states
from statemachine.model.check import load, run
from statemachine.model.checker import Counterexample, Result, format_counterexample
from statemachine.model.spec import BootstrapCache

TLA_DIR = Path(__file__).resolve().parents[2] / "TLA"
REPO = TLA_DIR.parent
#: cfg -> the property its first violation must name (None: everything holds).
CI_CONFIGS: dict[str, str | None] = {
    "MCSmall.cfg": None,
    "MCImmediate.cfg": None,
    "MCTwoKeys.cfg": None,
    "MCNoInvalidation.cfg": "StaleEntryEvicted",
    "MCInvalidateByKey.cfg": "IdentitySafe",
    "MCPrefixNodeFailure.cfg": "ExactNodeFailure",
    "MCRetireStaleObservation.cfg": "ExactNodeFailure",
    "MCReusedPortAcks.cfg": "NoStaleSuccess",
    "MCEtcd.cfg": None,
    "MCEtcdRetireByKey.cfg": "ExactNodeFailure",
    "MCOne.cfg": None,
    "MCResponses.cfg": None,
    "MCHandshake.cfg": None,
    "MCTwoReceivers.cfg": None,
    "MCKVRelease.cfg": None,
    "MCKVReleaseTwoRanks.cfg": None,
}
_results: dict[str, tuple[BootstrapCache, Result]] = {}


def checked(name: str) -> tuple[BootstrapCache, Result]:
    if name not in _results:
        loaded = load(TLA_DIR / name)
        _results[name] = (loaded.model, run(loaded))
    return _results[name]


@pytest.mark.parametrize("name", sorted(CI_CONFIGS))
def test_recorded_state_count_is_the_mirrors(name: str) -> None:
    _, result = checked(name)
    assert recorded_states(read_cfg(TLA_DIR / name)) == result.distinct_states


def test_large_config_records_a_count() -> None:
    # MCLarge takes ~8 s in the mirror and ~90 s in TLC: `make tlc` checks it, CI does not.
    count = recorded_states(read_cfg(TLA_DIR / "MCLarge.cfg"))
    assert count is not None and count > checked("MCSmall.cfg")[1].distinct_states


@pytest.mark.parametrize("name", sorted(CI_CONFIGS))
def test_verdict(name: str) -> None:
    _, result = checked(name)
    expected = CI_CONFIGS[name]
    violation = result.first_violation()
    if expected is None:
        assert result.ok and violation is None
        assert all(result.verdicts.values())
        cfg = read_cfg(TLA_DIR / name)
        assert list(result.verdicts) == [*cfg.invariants, *cfg.properties]
        # Every cfg checks every safety property; the KV-release cfgs leave RequestsSucceed
        # out (a rank that exits and is never restarted leaves nothing to succeed with).
        assert len(result.verdicts) == (18 if name.startswith("MCKVRelease") else 19)
    else:
        assert violation is not None and violation.property == expected
        # Safety properties other than the expected one still hold in the variant.
        safety = (
            "TypeOK",
            "AdoptionCorrect",
            "IdentitySafe",
            "ExactNodeFailure",
            "NoStaleSuccess",
            "NoStaleStart",
            "FollowerGetsLeaderResult",
            "FinishedFlightGone",
            "MarkOfLiveRequest",
            "OnlyStaleMarked",
            "NoReleaseWhileWriterMayWrite",
            "HeldRoomNotReused",
            "ReleaseCountsOnlyAbortsSent",
        )
        for other in safety:
            if other != expected:
                assert result.verdicts[other], other


def _replay(model: BootstrapCache, cex: Counterexample) -> None:
    """Every step is an allowed transition of the mirror, from an initial state."""
    assert cex.states[0] in model.init_states()
    assert len(cex.steps) == len(cex.states) - 1
    for step, before, after in zip(cex.steps, cex.states[:-1], cex.states[1:], strict=True):
        assert model.apply(before, step) == after, step
        assert (step, after) in list(model.successors(before))


@pytest.mark.parametrize(
    "name",
    [
        "MCInvalidateByKey.cfg",
        "MCPrefixNodeFailure.cfg",
        "MCRetireStaleObservation.cfg",
        "MCReusedPortAcks.cfg",
        "MCEtcdRetireByKey.cfg",
    ],
)
def test_safety_counterexample_replays_and_ends_in_the_violation(name: str) -> None:
    model, result = checked(name)
    cex = result.first_violation()
    assert cex is not None and cex.kind == "action"
    _replay(model, cex)
    predicate = model.action_property(cex.property)
    assert not predicate(cex.states[-2], cex.states[-1])
    assert all(predicate(s, t) for s, t in zip(cex.states[:-2], cex.states[1:-1], strict=True))
    text = format_counterexample(model, cex)
    assert f"{cex.property} violated" in text and str(cex.steps[-1]) in text


def test_identity_counterexample_clobbers_another_receivers_object() -> None:
    model, result = checked("MCInvalidateByKey.cfg")
    cex = result.first_violation()
    assert cex is not None
    last = cex.steps[-1]
    assert last.action == "Invalidate"
    before, after = cex.states[-2], cex.states[-1]
    i = model.receivers.index(str(last.params[0]))
    j = model.addr_index[before.rkey[i]]
    assert before.pool[j] not in (0, before.rgen[i]) and after.pool[j] == 0


def test_prefix_counterexample_drops_the_longer_address() -> None:
    _, result = checked("MCPrefixNodeFailure.cfg")
    cex = result.first_violation()
    assert cex is not None and str(cex.steps[-1]) == "NodeFailure(80)"
    assert cex.states[-2].pool[1] != 0 and cex.states[-1].pool[1] == 0  # pool[8000]


def test_liveness_counterexample_is_a_fair_lasso() -> None:
    model, result = checked("MCNoInvalidation.cfg")
    cex = result.first_violation()
    assert cex is not None and cex.kind == "liveness" and cex.cycle_start is not None
    _replay(model, cex)
    cycle = cex.states[cex.cycle_start :]
    # The lasso closes, and the stale entry of the only address is never evicted on it.
    assert len(cycle) == 1 or cycle[-1] == cycle[0]
    assert all(model.stale(s, 0) for s in cycle)
    # Fair: every receiver takes its own steps and the key is looked up on the cycle.
    taken = {str(step.params[0]) for step in cex.steps[cex.cycle_start :]}
    assert set(model.receivers) <= taken
    assert any(step.action == "Hit" for step in cex.steps[cex.cycle_start :])


def test_requests_succeed_is_also_violated_without_invalidation() -> None:
    _, result = checked("MCNoInvalidation.cfg")
    assert not result.verdicts["RequestsSucceed"]


# --- CLI ----------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "statemachine", "check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_default_config_passes() -> None:
    done = _cli()
    assert done.returncode == 0, done.stderr
    assert "7268 distinct states found" in done.stdout
    assert "RequestsSucceed" in done.stdout and "VIOLATED" not in done.stdout


def test_cli_variant_exits_1_with_trace() -> None:
    done = _cli("--config", str(TLA_DIR / "MCInvalidateByKey.cfg"), "--quiet")
    assert done.returncode == 1
    assert "IdentitySafe violated" in done.stdout and "Invalidate(" in done.stdout


def test_cli_usage_and_cfg_errors_exit_2(tmp_path: Path) -> None:
    assert _cli("--bogus").returncode == 2
    assert _cli("--config", str(tmp_path / "missing.cfg")).returncode == 2
    bad = tmp_path / "bad.cfg"
    bad.write_text("SPECIFICATION Spec\nCONSTANTS Receivers = {r1}\n", encoding="utf-8")
    done = _cli("--config", str(bad))
    assert done.returncode == 2 and "constants missing" in done.stderr


# --- cfg reader ---------------------------------------------------------------------------------

GOOD = """
\\* a comment
(* a block
   comment *)
SPECIFICATION Spec
CONSTANTS Receivers = {r1, r2}  Addrs = {80, 8000}
    MaxRestarts = 1 MaxFaults = 0 Mode = "queueing" Discovery = "http" Variant = "Correct"
    Ranks = {p1} Policy = "early" KVRelease = FALSE
INVARIANTS TypeOK
PROPERTY IdentitySafe StaleEntryEvicted
CHECK_DEADLOCK FALSE
"""


def test_cfg_reader_reads_tlc_syntax() -> None:
    cfg = parse_cfg(GOOD)
    assert cfg.constants["Addrs"] == frozenset({80, 8000})
    assert cfg.constants["Mode"] == "queueing"
    assert {str(v) for v in cfg.constants["Receivers"]} == {"r1", "r2"}  # type: ignore[union-attr]
    assert cfg.invariants == ["TypeOK"]
    assert cfg.properties == ["IdentitySafe", "StaleEntryEvicted"]
    assert cfg.check_deadlock is False
    assert "a comment" in cfg.comments


@pytest.mark.parametrize(
    "text, message",
    [
        ("CONSTANTS X = 1", "SPECIFICATION"),
        ("SPECIFICATION Spec\nSYMMETRY Perms", "not supported"),
        ("SPECIFICATION Spec\nCONSTANTS X <- Y", "substitution"),
        ("SPECIFICATION Spec\nCONSTANTS X = {1, 2", "end of file"),
        ("SPECIFICATION Spec\nCONSTANTS X = 1 X = 2", "twice"),
        ("SPECIFICATION Spec\nINVARIANT", "names nothing"),
        ("SPECIFICATION Spec\nCHECK_DEADLOCK 3", "TRUE or FALSE"),
        ("SPECIFICATION Spec\n(* open", "unterminated"),
        ("SPECIFICATION Spec\nCONSTANTS X = ;", "unexpected text"),
    ],
)
def test_cfg_reader_rejects_bad_input(text: str, message: str) -> None:
    with pytest.raises(CfgError, match=message):
        parse_cfg(text)


@pytest.mark.parametrize(
    "change, message",
    [
        (('Mode = "queueing"', 'Mode = "lossy"'), "ASSUME"),
        (("Addrs = {80, 8000}", "Addrs = {0}"), "ASSUME"),
        (("Receivers = {r1, r2}", "Receivers = {1, 2}"), "model values"),
        (('Policy = "early"', 'Policy = "late"'), "ASSUME"),
        (("Ranks = {p1}", "Ranks = {}"), "ASSUME"),
        (("KVRelease = FALSE", 'KVRelease = "no"'), "TRUE or FALSE"),
        (("IdentitySafe", "Bogus"), "unknown property"),
        (("SPECIFICATION Spec", "SPECIFICATION Other"), "SPECIFICATION"),
    ],
)
def test_load_rejects_cfgs_the_mirror_cannot_check(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    path = tmp_path / "x.cfg"
    path.write_text(GOOD.replace(*change), encoding="utf-8")
    with pytest.raises(CfgError, match=message):
        load(path)


@pytest.mark.parametrize("mode", ["queueing", "immediate"])
def test_every_property_holds_for_larger_fault_budgets(mode: str) -> None:
    """The premise of the one-key argument (spec/model.md): the properties do not depend on
    how many spurious failures there are (a multi-key request's other keys look like them)."""
    from statemachine.model.checker import check
    from statemachine.model.spec import (
        ACTION_PROPERTIES,
        INVARIANTS,
        LIVENESS_PROPERTIES,
        Constants,
    )

    for budget in (0, 2, 3):
        model = BootstrapCache(Constants(("r1", "r2"), (80,), 1, budget, mode, "Correct"))
        result = check(
            model,
            invariants=list(INVARIANTS),
            properties=[*ACTION_PROPERTIES, *LIVENESS_PROPERTIES],
        )
        assert result.ok, (budget, result.first_violation())


def test_docs_name_every_property_and_mutation() -> None:
    from statemachine.model import spec

    model_md = (REPO / "spec" / "model.md").read_text(encoding="utf-8")
    prose = (REPO / "docs" / "formal-model.md").read_text(encoding="utf-8")
    for name in (*spec.INVARIANTS, *spec.ACTION_PROPERTIES, *spec.LIVENESS_PROPERTIES):
        assert f"`{name}`" in model_md and f"`{name}`" in prose, name
    for name in (*spec.MUTATIONS, *spec.VARIANTS[1:]):
        assert f"`{name}`" in model_md, name
    for path in sorted(TLA_DIR.glob("MC*.cfg")):
        assert f"`{path.name}`" in model_md, path.name
