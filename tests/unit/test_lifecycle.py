"""The lifecycle table is derived from, and behaves exactly like, the transitions Machine.

Requirement IDs: see spec/lifecycle.md (LIFE-n).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transitions import Machine, MachineError

from statemachine import lifecycle
from statemachine.completion import KVPoll
from statemachine.errors import InvalidTransition
from statemachine.lifecycle import (
    EVENTS,
    INITIAL,
    MACHINE,
    POLL_OF_STATE,
    STATES,
    TABLE,
    Lifecycle,
    build_machine,
    derive_table,
)

ROOT = Path(__file__).resolve().parents[2]
logging.getLogger("transitions").setLevel(logging.WARNING)


def machine_transitions(machine: Machine) -> set[tuple[str, str, str]]:
    """(event, source, dest) for every transition, read through the Machine's introspection."""
    return {
        (trigger, source, transition.dest)
        for trigger, event in machine.events.items()
        for source, transitions in event.transitions.items()
        for transition in transitions
    }


def table_transitions() -> set[tuple[str, str, str]]:
    return {(event, src, dst) for event, row in TABLE.items() for src, dst in row.items()}


def test_life_1_table_equals_machine_transition_set() -> None:
    """LIFE-1: the dispatch table is exactly the Machine's transition set."""
    assert table_transitions() == machine_transitions(MACHINE)
    assert set(MACHINE.states) == set(STATES)
    assert MACHINE.initial == INITIAL
    assert tuple(MACHINE.events) == EVENTS


def test_life_1_required_states_and_events_exist() -> None:
    """LIFE-1: the states the design names are all there, and every state is reachable."""
    for name in ("fetching", "registered", "cached", "failed", "invalidated", "idle", "done"):
        assert name in STATES
    reachable = {INITIAL}
    frontier = [INITIAL]
    while frontier:
        state = frontier.pop()
        for event in lifecycle.allowed_events(state):
            dest = TABLE[event][state]
            if dest not in reachable:
                reachable.add(dest)
                frontier.append(dest)
    assert reachable == set(STATES)


def test_life_2_every_active_state_can_fail_or_abort() -> None:
    """LIFE-2: from every non-final state the request can end (fail or abort)."""
    for state in lifecycle.ACTIVE_STATES:
        assert TABLE[lifecycle.ABORT][state] == lifecycle.ABORTED
    failing = {src for event, row in TABLE.items() for src, dst in row.items() if dst == "failed"}
    # handshaking/ready: SGLang's prefill_complete handshake; done: failure_exception() on a
    # succeeded receiver fails it "from another rank" (SGLang 0.5.23).
    assert failing == {
        "idle", "fetching", "fetched", "cached", "handshaking", "ready", "waiting", "done"
    }  # fmt: skip
    # registered -> cached is the setdefault publish, which cannot fail.
    assert lifecycle.allowed_events("registered") == (lifecycle.PUBLISH, lifecycle.ABORT)


def test_life_3_failed_leads_only_to_invalidated() -> None:
    """LIFE-3: a failed receiver's only way on is Invalidate (its entries are dropped)."""
    assert lifecycle.allowed_events("failed") == (lifecycle.INVALIDATE,)
    assert TABLE[lifecycle.INVALIDATE] == {"failed": "invalidated"}


def test_life_4_invalid_event_raises_typed_error_naming_state_and_event() -> None:
    """LIFE-4: an event not allowed in the current state raises InvalidTransition, state kept."""
    life = Lifecycle()
    with pytest.raises(InvalidTransition) as caught:
        life.fire(lifecycle.COMPLETE)
    assert caught.value.state == "idle"
    assert caught.value.event == "Complete"
    assert "Complete" in str(caught.value) and "idle" in str(caught.value)
    assert life.state == "idle"
    with pytest.raises(InvalidTransition):
        life.fire("NoSuchEvent")
    with pytest.raises(InvalidTransition):
        lifecycle.next_state("nowhere", lifecycle.HIT)


def test_life_5_poll_values_match_sglang_kvpoll() -> None:
    """LIFE-5: poll() values are SGLang's KVPoll numbers, defined for every state."""
    assert set(POLL_OF_STATE) == set(STATES)
    assert [int(v) for v in KVPoll] == [0, 1, 2, 3, 4]
    assert POLL_OF_STATE["cached"] is KVPoll.WaitingForInput
    assert POLL_OF_STATE["done"] is KVPoll.Success
    for state in ("failed", "invalidated", "aborted"):
        assert POLL_OF_STATE[state] is KVPoll.Failed


def test_derive_table_rejects_guarded_transitions() -> None:
    """The table cannot express guards, so deriving from a guarded Machine must fail loudly."""
    guarded = Machine(
        model=None,
        states=["a", "b"],
        transitions=[{"trigger": "go", "source": "a", "dest": "b", "conditions": "ok"}],
        initial="a",
        auto_transitions=False,
    )
    with pytest.raises(ValueError, match="guarded"):
        derive_table(guarded)


class _Model:
    """A receiver-like model for the reference Machine in the differential test."""

    state: str


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from((*EVENTS, "Bogus")), max_size=40))
def test_life_1_table_and_machine_agree_on_random_event_sequences(events: list[str]) -> None:
    """LIFE-1 (differential): same accept/reject and same state as the Machine, step by step."""
    model = _Model()
    build_machine(model=model)  # attaches trigger methods and .state to the model
    life = Lifecycle()
    for event in events:
        try:
            model.trigger(event)  # type: ignore[attr-defined]
            machine_ok = True
        except (MachineError, AttributeError):
            machine_ok = False
        try:
            life.fire(event)
            table_ok = True
        except InvalidTransition:
            table_ok = False
        assert machine_ok == table_ok, (event, model.state, life.state)
        assert model.state == life.state


def test_life_6_committed_diagram_is_current() -> None:
    """LIFE-6: docs/lifecycle.mmd is regenerated from the Machine; stale means this fails.

    Regenerate with: .venv/bin/python -m statemachine table --mermaid > docs/lifecycle.mmd
    """
    committed = (ROOT / "docs" / "lifecycle.mmd").read_text(encoding="utf-8")
    assert committed == lifecycle.mermaid()


def test_life_6_spec_table_is_current() -> None:
    """LIFE-6: the table in spec/lifecycle.md is the one derived from the Machine."""
    spec = (ROOT / "spec" / "lifecycle.md").read_text(encoding="utf-8")
    assert lifecycle.table_markdown() in spec


def test_life_6_readme_diagram_matches_machine() -> None:
    """LIFE-6: the README's hand-trimmed diagram shows exactly the Machine's transitions,
    except the Abort edges (noted in the README text)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("```mermaid", 1)[1].split("```", 1)[0]
    edges = set()
    for line in block.splitlines():
        line = line.strip()
        if "-->" in line and ":" in line and not line.startswith("[*]"):
            arrow, event = line.split(":", 1)
            source, dest = (part.strip() for part in arrow.split("-->"))
            edges.add((event.strip(), source, dest))
    assert edges == {t for t in table_transitions() if t[0] != lifecycle.ABORT}
