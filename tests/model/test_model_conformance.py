"""The model's per-receiver steps equal the lifecycle Machine's transitions, by name."""

from __future__ import annotations

from pathlib import Path

from transitions import Machine

from statemachine.lifecycle import MACHINE, build_machine
from statemachine.model.check import load
from statemachine.model.conformance import compare, machine_transitions, project
from statemachine.model.spec import ENV_ACTIONS, HELPER_ACTIONS

TLA_DIR = Path(__file__).resolve().parents[2] / "TLA"


#: One config per allocation policy: each reaches every transition its policy allows (the
#: handshake states exist only under "prefill_complete"), so together they must reach every
#: Machine transition, and each must take nothing the Machine does not have.
EARLY, HANDSHAKE = "MCSmall.cfg", "MCHandshake.cfg"
HANDSHAKE_STATES = {"handshaking", "ready"}


def test_every_machine_transition_is_reachable_and_nothing_else() -> None:
    early = compare(load(TLA_DIR / EARLY).model, MACHINE)
    handshake = compare(load(TLA_DIR / HANDSHAKE).model, MACHINE)
    for name, report in ((EARLY, early), (HANDSHAKE, handshake)):
        assert not report.only_in_model and not report.unmapped_actions, (name, report)
        assert not report.env_violations and not report.cross_violations, name
    # Nothing the Machine has is missing from both.
    assert not early.only_in_machine & handshake.only_in_machine
    # Under "early" exactly the handshake's transitions are unreachable.
    assert early.only_in_machine == {
        t for t in machine_transitions(MACHINE) if {t[1], t[2]} & HANDSHAKE_STATES
    }
    # Under "prefill_complete" only SendOk straight from cached is.
    assert handshake.only_in_machine == {("SendOk", "cached", "waiting")}
    # MCImmediate (IMMEDIATE sends) reaches what MCSmall reaches.
    immediate = compare(load(TLA_DIR / "MCImmediate.cfg").model, MACHINE)
    assert immediate.only_in_machine == early.only_in_machine and not immediate.only_in_model


def test_machine_has_the_transitions_we_think() -> None:
    found = machine_transitions(MACHINE)
    assert ("FetchFail", "idle", "failed") in found
    assert ("Abort", "waiting", "aborted") in found
    assert ("SendFail", "idle", "failed") in found
    assert {("PeerLost", s, "failed") for s in ("idle", "cached", "waiting", "done")} <= found
    assert ("Timeout", "handshaking", "failed") in found
    assert ("Abort", "done", "aborted") in found
    # 17 events; FetchFail 2 sources, SendOk 2, SendFail 4, Timeout 2, PeerLost 6, Abort 9,
    # NewRequest 3, the other ten 1 each
    assert len(found) == 38


def test_environment_and_helper_actions_change_no_lifecycle_state() -> None:
    projection = project(load(TLA_DIR / "MCSmall.cfg").model)
    assert not projection.env_violations and not projection.cross_violations
    outside = set(ENV_ACTIONS) | set(HELPER_ACTIONS)
    assert not {action for action, _, _ in projection.transitions} & outside


def test_a_machine_that_drifts_is_caught() -> None:
    # Same lifecycle but without FetchFail from idle: the model's step is then unexplained.
    machine = build_machine()
    machine.events["FetchFail"].transitions.pop("idle")
    report = compare(load(TLA_DIR / "MCSmall.cfg").model, machine)
    assert not report.ok and report.only_in_model == {("FetchFail", "idle", "failed")}
    # And an extra Machine transition the model never takes.
    extra = Machine(
        states=["idle", "cached"],
        transitions=[{"trigger": "Hit", "source": "cached", "dest": "idle"}],
        initial="idle",
        auto_transitions=False,
    )
    report = compare(load(TLA_DIR / "MCSmall.cfg").model, extra)
    assert ("Hit", "cached", "idle") in report.only_in_machine
    assert report.unmapped_actions  # the model's other actions have no trigger there


def test_every_other_ci_config_takes_only_machine_transitions() -> None:
    """Configs without a fault budget cannot reach the spurious transitions, but whatever they
    reach (the etcd watch's marks and PeerLost included) is a Machine transition."""
    for name in (
        "MCTwoKeys.cfg",
        "MCEtcd.cfg",
        "MCReusedPortAcks.cfg",
        "MCOne.cfg",
        "MCResponses.cfg",
        "MCTwoReceivers.cfg",
        "MCKVRelease.cfg",
        "MCKVReleaseTwoRanks.cfg",
    ):
        report = compare(load(TLA_DIR / name).model, MACHINE)
        assert not report.only_in_model, (name, report.only_in_model)
        assert not report.env_violations and not report.cross_violations, name
