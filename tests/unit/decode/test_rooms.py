"""``Rooms`` (statemachine/decode/rooms.py, spec/manager.md MGR-2, MGR-7, MGR-12, MGR-18): the
receivers in flight, how they ended, and the lookups the other parts scan them with."""

from __future__ import annotations

import logging

import pytest

from statemachine.decode.rooms import (
    MAX_ROOM,
    Rooms,
    check_room,
    distinct_ranks,
    generations_at,
)
from statemachine.errors import InvalidRoom, ManagerClosed, PeerLost, RankDead, TransferFailed
from statemachine.pool import BootstrapPool

from .fakes import ADDR, OTHER_ADDR, FakeReceiver, ManualClock, generation, key


def admitted(rooms: Rooms, receiver: FakeReceiver) -> FakeReceiver:
    """How a receiver admits itself: one store into the table."""
    assert rooms.by_room.setdefault(receiver.room, receiver) is receiver
    return receiver


def test_mgr_7_refuse_says_why_the_receiver_was_not_admitted() -> None:
    rooms = Rooms(ManualClock())
    admitted(rooms, FakeReceiver(7))
    with pytest.raises(InvalidRoom, match="already in flight"):
        rooms.refuse(FakeReceiver(7))
    rooms.close(PeerLost("closing"))
    with pytest.raises(ManagerClosed, match="create a new one"):
        rooms.refuse(FakeReceiver(8))


def test_ended_forgets_only_the_receiver_that_ended_and_counts_how() -> None:
    rooms = Rooms(ManualClock())
    first = admitted(rooms, FakeReceiver(7))
    rooms.ended(FakeReceiver(7), None)  # another receiver of room 7: counted, table untouched
    assert rooms.get(7) is first
    rooms.ended(first, None)
    second = admitted(rooms, FakeReceiver(7))
    rooms.ended(second, RankDead("gone", endpoint="tcp://127.0.0.1:5001"))
    rooms.ended(FakeReceiver(9), RankDead("gone", endpoint="tcp://127.0.0.1:5001"))
    assert rooms.counts() == (2, {"RankDead": 2}, 0)


def test_mgr_12_detection_time_is_measured_from_the_evidence() -> None:
    clock = ManualClock()
    rooms = Rooms(clock)
    error = RankDead("gone", endpoint="tcp://127.0.0.1:5001")
    error.evidence_at = clock()
    clock.advance(0.25)
    rooms.ended(admitted(rooms, FakeReceiver(1)), error)
    rooms.ended(admitted(rooms, FakeReceiver(2)), PeerLost("no evidence"))  # not a detection
    assert rooms.detections == 1
    assert rooms.detection_total_s == pytest.approx(0.25)
    assert rooms.detection_max_s == pytest.approx(0.25)


def test_mgr_18_a_raising_callback_is_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rooms = Rooms(ManualClock())
    with caplog.at_level(logging.ERROR, logger="statemachine.decode.rooms"):
        for _ in range(3):
            rooms.callback_raised(FakeReceiver(7), RuntimeError("user bug"))
    assert rooms.callback_errors == 3
    assert len(caplog.records) == 1 and "fix the callback" in caplog.records[0].getMessage()


def test_close_admits_no_more_and_fails_every_receiver_in_flight() -> None:
    rooms = Rooms(ManualClock())
    receivers = [admitted(rooms, FakeReceiver(room)) for room in (1, 2)]
    reason = PeerLost("manager closed")
    rooms.close(reason)
    assert rooms.closed
    assert [r.lost for r in receivers] == [[reason], [reason]]


def test_held_by_answers_the_entries_of_one_address() -> None:
    rooms = Rooms(ManualClock())
    mine, theirs = generation(5001), generation(5002)
    admitted(rooms, FakeReceiver(1, ADDR, {key(0): mine}))
    admitted(rooms, FakeReceiver(2, OTHER_ADDR, {key(0, addr=OTHER_ADDR): theirs}))
    assert rooms.held_by(ADDR) == [(key(0), mine)]


def test_generations_at_scans_the_pool_and_the_receivers_in_flight() -> None:
    rooms = Rooms(ManualClock())
    pool = BootstrapPool()
    pooled, held, elsewhere = generation(5001), generation(5001, 5002), generation(5003)
    pool.publish(key(0), pooled)
    pool.publish(key(1), elsewhere)
    admitted(rooms, FakeReceiver(1, entries={key(2): held}))
    assert generations_at("tcp://127.0.0.1:5001", pool, rooms) == {pooled, held}
    assert generations_at("tcp://127.0.0.1:5009", pool, rooms) == set()


@pytest.mark.parametrize("room", [-1, MAX_ROOM + 1, 1.0, "7", True, None])
def test_check_room_refuses_what_is_not_a_room(room: object) -> None:
    with pytest.raises(InvalidRoom, match="bootstrap_room"):
        check_room(room)


@pytest.mark.parametrize("room", [0, 7, MAX_ROOM])
def test_check_room_accepts_an_unsigned_64_bit_int(room: int) -> None:
    assert check_room(room) == room


def test_distinct_ranks_names_each_endpoint_once() -> None:
    first, second = generation(5001, 5002), generation(5002, 5003)
    ranks = distinct_ranks([first, second])
    assert [(g, r.port) for g, r in ranks] == [(first, 5001), (first, 5002), (second, 5003)]


def test_transfer_failed_is_a_peer_lost() -> None:
    # The failures a room ends with are counted by their type name: a TransferFailed is one.
    rooms = Rooms(ManualClock())
    error = TransferFailed("x", addr=ADDR, reason="r", prefill_rank=0)
    rooms.ended(admitted(rooms, FakeReceiver(1)), error)
    assert rooms.counts()[1] == {"TransferFailed": 1}
