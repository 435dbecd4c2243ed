"""``DpRankQueries`` (statemachine/decode/dp_ranks.py, spec/manager.md MGR-8): pending rooms
asked in one batch per address, started by ``step`` and applied on the stepping thread, over a
fake source and a background whose calls run when the test says."""

from __future__ import annotations

import pytest

from statemachine.decode.dp_ranks import DpRankQueries
from statemachine.errors import TransportFailure

from .fakes import ADDR, OTHER_ADDR, FakeReceiver, FakeSource, ManualBackground


def queries(*, at_once: bool = False) -> tuple[DpRankQueries, FakeSource, ManualBackground]:
    source, background = FakeSource(), ManualBackground(at_once=at_once)
    return DpRankQueries(source, background), source, background  # type: ignore[arg-type]


def test_mgr_8_one_batched_query_per_address_with_every_pending_room() -> None:
    part, source, background = queries()
    for room in (1, 2):
        part.wait_for(FakeReceiver(room, ADDR))
    part.wait_for(FakeReceiver(3, OTHER_ADDR))
    assert part.step() == 0  # started, not answered: the stepping thread never waits
    assert background.submitted == 2 and part.counts() == (3, 2, 2)
    background.run()
    assert sorted(source.dp_calls) == [(ADDR, (1, 2)), (OTHER_ADDR, (3,))]


def test_mgr_8_no_second_query_while_one_is_in_flight_for_the_address() -> None:
    part, _, background = queries()
    part.wait_for(FakeReceiver(1))
    part.step()
    part.wait_for(FakeReceiver(2))
    part.step()
    assert background.submitted == 1


def test_mgr_8_answers_are_applied_by_the_next_step_on_its_thread() -> None:
    part, source, background = queries()
    answered, unknown = FakeReceiver(1), FakeReceiver(2)
    source.dp_answers[ADDR] = {1: 3}
    part.wait_for(answered)
    part.wait_for(unknown)
    part.step()
    background.run()
    assert answered.dp_ranks == []  # not applied on the worker
    assert part.step() == 1
    assert answered.dp_ranks == [3] and unknown.dp_ranks == []
    assert part.counts()[0] == 1  # the room the prefill does not know yet stays pending
    background.run()
    assert source.dp_calls[-1] == (ADDR, (2,))  # and is asked again


def test_mgr_8_a_failed_query_leaves_the_rooms_pending_for_the_next_step() -> None:
    part, source, background = queries()
    receiver = FakeReceiver(1)
    source.failing[ADDR] = TransportFailure("refused", addr=ADDR)
    part.wait_for(receiver)
    part.step()
    background.run()
    assert part.step() == 0 and part.counts()[:2] == (1, 1)  # collected, then asked again
    del source.failing[ADDR]
    source.dp_answers[ADDR] = {1: 0}
    background.run()
    assert part.step() == 1 and receiver.dp_ranks == [0]


def test_mgr_8_a_forgotten_room_is_not_answered() -> None:
    part, source, background = queries()
    receiver = FakeReceiver(1)
    source.dp_answers[ADDR] = {1: 2}
    part.wait_for(receiver)
    part.step()
    part.forget(receiver)  # it ended while its query was in flight
    background.run()
    assert part.step() == 0 and receiver.dp_ranks == []


def test_a_source_bug_is_not_swallowed() -> None:
    part, source, background = queries()
    source.failing[ADDR] = RuntimeError("source bug")  # type: ignore[assignment]
    part.wait_for(FakeReceiver(1))
    part.step()
    background.run()
    with pytest.raises(RuntimeError, match="source bug"):
        part.step()


def test_mgr_8_step_with_wait_applies_the_answers_of_the_queries_it_started() -> None:
    part, source, _ = queries(at_once=True)
    receiver = FakeReceiver(1)
    source.dp_answers[ADDR] = {1: 1}
    part.wait_for(receiver)
    assert part.step(wait=True) == 1
    assert receiver.dp_ranks == [1] and part.counts() == (0, 0, 1)


def test_close_drops_the_queries_in_flight() -> None:
    part, _, background = queries()
    part.wait_for(FakeReceiver(1))
    part.step()
    part.close()
    background.run()
    assert part.step() == 0 and part.counts()[1] == 1  # the room is asked again, anew
