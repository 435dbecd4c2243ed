"""``AbortHolds`` (statemachine/decode/holds.py, spec/manager.md MGR-15): a room's KV is held
after an ABORT until every writer acked the current abort sequence number, every writer is
proven gone, or the timeout passed, on a manual clock; silence is never proof."""

from __future__ import annotations

from statemachine.completion import AbortAck
from statemachine.decode.holds import RESET_SEEN, AbortHolds

from .fakes import ManualClock, generation

URL_A, URL_B = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"
GEN = generation(5001, 5002)
WRITERS = [(URL_A, GEN), (URL_B, GEN)]


def test_mgr_15_each_hold_arms_a_new_abort_sequence_number() -> None:
    holds = AbortHolds(30.0, ManualClock())
    first = holds.hold(7, WRITERS)
    second = holds.hold(7, WRITERS)  # replaces the first
    assert second > first and holds.abort_seq(7) == second
    assert holds.stats().held == 1


def test_mgr_15_released_when_every_writer_acked_the_current_number() -> None:
    holds = AbortHolds(30.0, ManualClock())
    seq = holds.hold(7, WRITERS)
    assert holds.acked(AbortAck(7, 0, seq))
    assert not holds.released(7)  # one of two writers acked
    assert holds.acked(AbortAck(7, 1, seq))
    assert holds.released(7)
    stats = holds.stats()
    assert (stats.held, stats.released_by_acks) == (0, 1)
    assert holds.abort_seq(7) is None  # a released room is forgotten


def test_mgr_15_stale_acks_are_ignored_and_counted() -> None:
    holds = AbortHolds(30.0, ManualClock())
    old = holds.hold(7, WRITERS)
    new = holds.hold(7, WRITERS)
    assert not holds.acked(AbortAck(7, 0, old))  # an older sequence number
    assert not holds.acked(AbortAck(7, 0, None))  # a legacy ack names none
    assert not holds.acked(AbortAck(7, None, new))  # the sender did not name itself
    assert not holds.acked(AbortAck(8, 0, new))  # a room not held
    assert holds.stats().stale_acks == 4
    assert not holds.released(7)


def test_mgr_15_released_at_the_timeout_not_before() -> None:
    clock = ManualClock()
    holds = AbortHolds(30.0, clock)
    holds.hold(7, WRITERS)
    clock.advance(29.999)
    assert not holds.released(7)
    clock.advance(0.001)
    assert holds.released(7) and holds.stats().released_by_timeout == 1


def test_mgr_15_released_when_every_writer_is_proven_gone() -> None:
    holds = AbortHolds(30.0, ManualClock())
    holds.hold(7, WRITERS)
    holds.proven_gone(URL_A, [], RESET_SEEN)
    assert not holds.released(7)  # one writer may still write
    holds.proven_gone(URL_B, [], RESET_SEEN)
    assert holds.released(7) and holds.stats().released_by_proof == 1


def test_mgr_15_an_ack_and_a_proof_are_never_mixed() -> None:
    holds = AbortHolds(30.0, ManualClock())
    seq = holds.hold(7, WRITERS)
    holds.acked(AbortAck(7, 0, seq))
    holds.proven_gone(URL_B, [], RESET_SEEN)
    assert not holds.released(7)  # acks name no endpoint: waits for the timeout


def test_mgr_15_a_proof_covers_a_room_held_later_on_the_same_generation_only() -> None:
    holds = AbortHolds(30.0, ManualClock())
    old = generation(5001)
    newer = generation(5001, instance_id="instance-b")  # a new process at the same endpoint
    holds.proven_gone(URL_A, [old], RESET_SEEN)
    holds.hold(1, [(URL_A, old)])
    holds.hold(2, [(URL_A, newer)])
    assert holds.released(1)
    assert not holds.released(2)


def test_mgr_15_bounded_the_oldest_hold_is_given_up() -> None:
    holds = AbortHolds(30.0, ManualClock(), max_rooms=2)
    for room in (1, 2, 3):
        holds.hold(room, WRITERS)
    stats = holds.stats()
    assert (stats.held, stats.evicted) == (2, 1)
    assert holds.released(1)  # given up: counts as released
    assert not holds.released(2) and not holds.released(3)


def test_mgr_15_generations_at_names_the_held_writers_at_an_endpoint() -> None:
    holds = AbortHolds(30.0, ManualClock())
    other = generation(5003)
    holds.hold(1, WRITERS)
    holds.hold(2, [("tcp://127.0.0.1:5003", other)])
    assert holds.generations_at(URL_A) == {GEN}
    assert holds.generations_at("tcp://127.0.0.1:5003") == {other}
