"""``Routes`` (statemachine/decode/routes.py, spec/manager.md MGR-8, MGR-16, MGR-17, MGR-20,
MGR-21): topology → plan → address plan, resolved once per prefill instance, over a fake source
that counts its questions."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from statemachine.decode.config import PREFILL_COMPLETE
from statemachine.decode.plan import DEFAULT_PLAN, DecodeLayout, RankPlan
from statemachine.decode.routes import PREPARING, AddressPlan, Routes
from statemachine.errors import TopologyMismatch, TransportFailure
from statemachine.validation import Topology

from .fakes import ADDR, FakeSource, ManualBackground, key, topology


class Window:
    """The request's deadline window: counts how often a question to the source opened it."""

    def __init__(self) -> None:
        self.opened = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        self.opened += 1
        yield


def routes(
    prefill: Topology | None = None,
    *,
    layout: DecodeLayout | None = None,
    staging: bool = False,
) -> tuple[Routes, FakeSource, ManualBackground]:
    source, background = FakeSource(), ManualBackground()
    source.topologies[ADDR] = prefill or topology()
    part = Routes(source, layout, staging=staging, background=background)  # type: ignore[arg-type]
    return part, source, background


def test_mgr_20_an_address_is_resolved_once_and_kept_in_known() -> None:
    part, source, _ = routes(topology(dp_size=2))
    resolved = part.address_plan(ADDR)
    assert part.address_plan(ADDR) is resolved and part.known[ADDR] is resolved
    assert source.topology_calls == [ADDR]
    assert resolved.needed == 1
    assert dict(resolved.keys) == {0: (key(0),), 1: (key(1),)}


def test_mgr_20_an_answer_from_another_instance_forgets_the_topology_and_plan() -> None:
    part, source, _ = routes()
    part.address_plan(ADDR)
    part.answered_by(ADDR, "instance-a")  # the same instance: kept
    part.answered_by(ADDR, None)  # a server that sends no id proves nothing
    assert ADDR in part.known
    part.answered_by(ADDR, "instance-b")
    assert ADDR not in part.known
    part.address_plan(ADDR)
    assert source.topology_calls == [ADDR, ADDR]


def test_forget_with_a_topology_spares_a_newer_one() -> None:
    part, _, _ = routes()
    part.address_plan(ADDR)
    part.forget(ADDR, topology())  # an equal but other object: not what is cached
    assert ADDR in part.known
    part.forget(ADDR)
    assert ADDR not in part.known


def test_mgr_21_route_asks_the_source_only_inside_the_window_and_only_once() -> None:
    part, source, _ = routes()
    window = Window()
    assert part.route(ADDR, None, window=window) == DEFAULT_PLAN
    assert part.route(ADDR, None, window=window) == DEFAULT_PLAN
    assert window.opened == 1 and source.topology_calls == [ADDR]


def test_route_is_pending_while_the_address_is_prepared_in_the_background() -> None:
    part, source, background = routes()
    window = Window()
    future = part.prepare(ADDR)
    assert part.prepare(ADDR) is future  # one resolution per address
    assert part.route(ADDR, None, window=window) is PREPARING
    assert source.topology_calls == [] and window.opened == 0
    background.run()
    assert isinstance(future.result(), AddressPlan)
    assert part.route(ADDR, None, window=window) == DEFAULT_PLAN and window.opened == 0
    assert part.prepare(ADDR).result() is future.result()  # known: answered at once


@pytest.mark.parametrize(
    ("prefill", "room", "dp_rank"),
    [
        (topology(dp_size=1), 7, 0),
        (topology(dp_size=4), 7, 3),  # follow_bootstrap_room never set means True
        (topology(dp_size=4, follow_bootstrap_room=True), 9, 1),
        (topology(dp_size=4, follow_bootstrap_room=False), 7, None),  # the batched query
    ],
)
def test_mgr_8_dp_rank_in_sglangs_order(prefill: Topology, room: int, dp_rank: int | None) -> None:
    part, _, _ = routes(prefill)
    assert part.dp_rank(ADDR, room, window=Window()) == dp_rank


def test_plan_9_without_a_layout_only_a_one_rank_prefill_is_planned_and_a_refusal_forgets() -> None:
    part, source, _ = routes(topology(tp_size=2))
    for _ in range(2):
        with pytest.raises(TopologyMismatch):
            part.address_plan(ADDR)
    assert ADDR not in part.known
    assert source.topology_calls == [ADDR, ADDR]  # not remembered past its deployment


def test_mgr_16_a_prefill_complete_prefill_is_refused_by_a_decode_of_the_default_policy() -> None:
    part, _, _ = routes(topology(decode_allocation_policy=PREFILL_COMPLETE))
    with pytest.raises(TopologyMismatch, match="allocation policy mismatch"):
        part.address_plan(ADDR)
    assert ADDR not in part.known


def test_mgr_16_equal_policies_pass_and_the_backends_own_check_runs_with_the_layout() -> None:
    layout = DecodeLayout(decode_allocation_policy=PREFILL_COMPLETE)
    checked: list[tuple[str, DecodeLayout]] = []
    source, background = FakeSource(), ManualBackground()
    source.topologies[ADDR] = topology(decode_allocation_policy=PREFILL_COMPLETE)
    part = Routes(
        source,  # type: ignore[arg-type]
        layout,
        staging=False,
        background=background,  # type: ignore[arg-type]
        check_topology=lambda addr, _topology, given: checked.append((addr, given)),
    )
    part.address_plan(ADDR)
    assert checked == [(ADDR, layout)]


def test_mgr_17_staging_is_refused_where_it_would_be_used() -> None:
    part, _, _ = routes(topology(tp_size=2), layout=DecodeLayout(tp_size=1), staging=True)
    with pytest.raises(TopologyMismatch, match="staging"):
        part.check_prefill(ADDR)


def test_mgr_16_a_given_plan_without_a_layout_is_checked_once_the_topology_is_known() -> None:
    part, source, _ = routes(topology(decode_allocation_policy=PREFILL_COMPLETE))
    plan = RankPlan()
    window = Window()
    assert part.route(ADDR, plan, window=window) is plan  # unknown: nothing fetched for it
    assert source.topology_calls == [] and window.opened == 0
    part.topology(ADDR)  # learnt by some other path
    with pytest.raises(TopologyMismatch):
        part.route(ADDR, plan, window=window)


def test_a_failed_background_resolution_is_not_kept_and_the_next_request_resolves_it() -> None:
    part, source, background = routes()
    failure = TransportFailure("refused", addr=ADDR)
    source.failing[ADDR] = failure
    future = part.prepare(ADDR)
    background.run()
    assert future.exception() is failure
    window = Window()
    with pytest.raises(TransportFailure):
        part.route(ADDR, None, window=window)  # no longer PREPARING: asked inside its window
    assert window.opened == 1
    del source.failing[ADDR]
    assert part.route(ADDR, None, window=window) == DEFAULT_PLAN
