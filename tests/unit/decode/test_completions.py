"""``Completions`` (statemachine/decode/completions.py, spec/manager.md MGR-13, MGR-14, MGR-15,
MGR-16): a prefill status reaches its room's receiver as a value stored on it; messages for
rooms not in flight and stale ABORT_ACKs are dropped and counted."""

from __future__ import annotations

from statemachine.completion import AbortAck, KVPoll, PrefillStatus
from statemachine.decode.completions import DEFAULT_FAILED_REASON, Completions
from statemachine.decode.holds import AbortHolds
from statemachine.decode.rooms import Rooms
from statemachine.errors import TransferFailed

from .fakes import ADDR, FakeReceiver, ManualClock, generation


def completions(*, prefill_complete: bool = False) -> tuple[Completions, Rooms, ManualClock]:
    clock = ManualClock()
    rooms = Rooms(clock)
    part = Completions(
        rooms=rooms,
        holds=AbortHolds(30.0, clock),
        prefill_complete=prefill_complete,
        clock=clock,
    )
    return part, rooms, clock


def test_mgr_13_a_success_is_stored_on_the_room_per_distinct_rank() -> None:
    part, rooms, _ = completions()
    receiver = rooms.by_room.setdefault(7, FakeReceiver(7))
    assert part.on_event(PrefillStatus(7, KVPoll.Success, 0))
    assert part.on_event(PrefillStatus(7, KVPoll.Success, 0))
    assert part.complete(7, 1) is True  # the first success of rank 1
    assert part.complete(7, 1) is False  # a repeat counts once
    assert isinstance(receiver, FakeReceiver) and receiver.succeeded == [0, 1]


def test_mgr_14_a_failed_status_fails_the_room_with_the_prefills_reason() -> None:
    part, rooms, clock = completions()
    receiver = FakeReceiver(7)
    rooms.by_room[7] = receiver
    assert part.on_event(PrefillStatus(7, KVPoll.Failed, 2, "disk on fire"))
    (error,) = receiver.prefill_failures
    assert isinstance(error, TransferFailed)
    assert (error.reason, error.prefill_rank, error.addr) == ("disk on fire", 2, ADDR)
    assert error.evidence_at == clock()  # the evidence's time, for the detection stats
    assert "retry the request" in str(error)


def test_mgr_14_a_failed_status_without_a_reason_carries_sglangs_default() -> None:
    part, rooms, _ = completions()
    receiver = FakeReceiver(7)
    rooms.by_room[7] = receiver
    assert part.fail_room(7, None, prefill_rank=None)
    assert receiver.prefill_failures[0].reason == DEFAULT_FAILED_REASON  # type: ignore[attr-defined]
    assert part.fail_room(8, "no such room", prefill_rank=0) is False


def test_mgr_16_waiting_for_input_answers_the_handshake_only_under_prefill_complete() -> None:
    early, early_rooms, _ = completions()
    late, late_rooms, _ = completions(prefill_complete=True)
    early_receiver, late_receiver = FakeReceiver(7), FakeReceiver(7)
    early_rooms.by_room[7], late_rooms.by_room[7] = early_receiver, late_receiver
    early.on_event(PrefillStatus(7, KVPoll.WaitingForInput, 0))
    late.on_event(PrefillStatus(7, KVPoll.WaitingForInput, 0))
    assert (early_receiver.ready, late_receiver.ready) == (0, 1)


def test_mgr_13_a_status_for_a_room_not_in_flight_is_dropped_and_counted() -> None:
    part, _, _ = completions()
    assert part.on_event(PrefillStatus(99, KVPoll.Success, 0)) is False
    assert part.complete(99, 0) is False
    assert part.dropped == 1


def test_mgr_15_the_hold_takes_each_ranks_endpoint_and_acks_release_it() -> None:
    part, _, _ = completions()
    held = generation(5001, 5002)
    seq = part.hold(7, [(held, rank) for rank in held.ranks])
    assert part.holds.generations_at("tcp://127.0.0.1:5002") == {held}
    assert part.on_event(AbortAck(7, 0, seq))
    assert part.on_event(AbortAck(7, 0, seq + 1)) is False  # stale: dropped
    assert part.dropped == 1
    assert part.on_event(AbortAck(7, 1, seq))
    assert part.holds.released(7)


def test_a_status_the_decode_does_not_act_on_is_taken_and_ignored() -> None:
    part, rooms, _ = completions()
    receiver = FakeReceiver(7)
    rooms.by_room[7] = receiver
    assert part.on_event(PrefillStatus(7, KVPoll.Transferring, 0))
    assert (receiver.succeeded, receiver.prefill_failures, receiver.ready) == ([], [], 0)
    assert part.dropped == 0
