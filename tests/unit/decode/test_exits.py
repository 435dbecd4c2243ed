"""``ExitProofs`` (statemachine/decode/exits.py, spec/manager.md MGR-15, spec/zmq.md ZMQ-26): a
proven exit releases the rooms whose every writer exited, and the other ranks of the same
generations are asked at once.

The ask is a real TCP connect on 127.0.0.1 (``connect_refused``: cheap and deterministic on
loopback): a port just closed refuses, a listening one answers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from statemachine.decode.exits import ExitProofs
from statemachine.decode.holds import AbortHolds
from statemachine.decode.rooms import Rooms
from statemachine.pool import BootstrapPool, Generation

from .fakes import ManualClock, generation, key


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed: a connect is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def exits() -> tuple[ExitProofs, BootstrapPool, AbortHolds]:
    clock = ManualClock()
    pool, holds = BootstrapPool(), AbortHolds(30.0, clock)
    return ExitProofs(pool=pool, rooms=Rooms(clock), holds=holds), pool, holds


def held(holds: AbortHolds, room: int, told: Generation) -> None:
    holds.hold(room, [(f"tcp://{r.ip}:{r.port}", told) for r in told.ranks])


def test_mgr_15_a_proven_exit_releases_a_room_whose_only_writer_exited() -> None:
    part, _, holds = exits()
    told = generation(5001)
    held(holds, 7, told)
    part.process_exited(("127.0.0.1", 5001), "refused")
    assert holds.released(7) and holds.stats().released_by_proof == 1


def test_zmq_26_the_other_ranks_of_the_generation_are_asked_at_once(listening_port: int) -> None:
    part, pool, holds = exits()
    gone, alive = closed_port(), listening_port
    both_gone = generation(5001, gone)
    one_alive = generation(5002, alive)
    held(holds, 1, both_gone)
    held(holds, 2, one_alive)
    pool.publish(key(0), both_gone)
    part.process_exited(("127.0.0.1", 5001), "refused")
    part.process_exited(("127.0.0.1", 5002), "refused")
    assert holds.released(1)  # its other rank refused too: proven without its own verdict
    assert not holds.released(2)  # the other rank answers: it may still write


def test_mgr_15_silence_releases_nothing() -> None:
    part, _, holds = exits()
    held(holds, 7, generation(5001))
    part.trace_silence("tcp://127.0.0.1:5001")
    assert not holds.released(7)
