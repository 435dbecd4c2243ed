"""The fair-cycle (Emerson-Lei) search on hand-built graphs, and fairness on the real model."""

from __future__ import annotations

import pytest

from statemachine.model.checker import Graph, _fair_component, check
from statemachine.model.spec import BootstrapCache, Constants, Fairness


def graph(n: int, edges: dict[tuple[int, int], int], enabled: list[int]) -> Graph:
    g = Graph()
    for _ in range(n):
        g.add(None, None, 0)  # type: ignore[arg-type]  # states are irrelevant here
    for (u, v), mask in edges.items():
        g.edges[u][v] = mask
    g.enabled = list(enabled)
    return g


def test_wf_met_by_taking_the_action() -> None:
    g = graph(2, {(0, 1): 1, (1, 0): 0}, [1, 1])
    assert _fair_component({0, 1}, g, ["WF"]) is not None


def test_wf_violated_when_continuously_enabled_and_never_taken() -> None:
    g = graph(2, {(0, 1): 0, (1, 0): 0}, [1, 1])
    assert _fair_component({0, 1}, g, ["WF"]) is None


def test_wf_met_by_a_state_where_the_action_is_disabled() -> None:
    g = graph(2, {(0, 1): 0, (1, 0): 0}, [1, 0])
    found = _fair_component({0, 1}, g, ["WF"])
    assert found is not None and found[2] == [1]


def test_sf_needs_the_action_taken_unless_disabled_throughout() -> None:
    # Enabled at 0 only, never taken: the whole cycle is unfair, but staying at 1 forever
    # (stuttering) keeps the action disabled, which strong fairness allows.
    g = graph(2, {(0, 1): 0, (1, 0): 0}, [1, 0])
    found = _fair_component({0, 1}, g, ["SF"])
    assert found is not None and found[0] == {1}


def test_sf_removal_then_wf_decides() -> None:
    # As above, but a WF action is enabled (and not taken) at 1: nothing fair remains.
    g = graph(2, {(0, 1): 0, (1, 0): 0}, [0b01, 0b10])
    assert _fair_component({0, 1}, g, ["SF", "WF"]) is None


def test_singleton_stutters_only_when_fair_actions_are_disabled() -> None:
    assert _fair_component({0}, graph(1, {}, [0]), ["WF"]) is not None
    assert _fair_component({0}, graph(1, {}, [1]), ["WF"]) is None


def test_strong_fairness_on_lookups_is_what_evicts_a_key_nobody_asks_for() -> None:
    # One receiver, two keys. With SF on each key's lookups a stale entry is evicted; with
    # weak fairness alone the receiver may ask for the other key forever.
    constants = Constants(("r1",), (80, 8000), 1, 0, "queueing", "Correct")
    model = BootstrapCache(constants)
    fair = check(model, invariants=[], properties=["StaleEntryEvicted", "RequestsSucceed"])
    assert fair.ok

    class WeakOnly(BootstrapCache):
        def fairness(self) -> list[Fairness]:
            return [f for f in super().fairness() if f.kind == "WF"]

    weak = check(WeakOnly(constants), invariants=[], properties=["StaleEntryEvicted"])
    assert not weak.verdicts["StaleEntryEvicted"]
    assert weak.distinct_states == fair.distinct_states


@pytest.mark.parametrize("mode", ["queueing", "immediate"])
def test_without_a_fault_budget_requests_can_fail_forever(mode: str) -> None:
    # The budget is what makes weak fairness enough: drop it (here: give spurious failures
    # free rein by raising the budget per step) and a receiver may time out forever.
    class Unbounded(BootstrapCache):
        def failure(self, s, genuine):  # type: ignore[no-untyped-def]
            return s.faults  # spurious failures always allowed, never counted

    constants = Constants(("r1",), (80,), 0, 1, mode, "Correct")
    result = check(Unbounded(constants), invariants=[], properties=["RequestsSucceed"])
    assert not result.verdicts["RequestsSucceed"]
    bounded = check(BootstrapCache(constants), invariants=[], properties=["RequestsSucceed"])
    assert bounded.verdicts["RequestsSucceed"]
