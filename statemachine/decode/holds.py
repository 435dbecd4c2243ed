"""Deferred KV release: rooms whose pages the prefill may still be writing after an ABORT.

SGLang 0.5.23 (``common/conn.py:979-1019``, ``decode.py:2996-3108``) arms a new abort sequence
number (its code calls it the *generation*) for a room when it sends an ABORT after the room's
metadata went out, and keeps the room's KV pages until every prefill rank it told acknowledged
that number (ABORT_ACK) or a timeout (30 s by default) passed: a rank may be mid-write into
those pages, and freeing them early lets the next request's KV be overwritten.
:class:`AbortHolds` is that bookkeeping for one manager: ``hold`` arms a sequence number,
``acked`` records an ABORT_ACK of the current one (any other is stale and ignored),
``released`` answers whether the pages may be freed now.

Bounded: at most ``max_rooms`` rooms are held; past it the oldest hold is given up (its room
counts as released, as after its timeout) and counted in ``evicted``. A released room is
forgotten, so the table holds only rooms still waiting for acks.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from statemachine.completion import AbortAck

#: Rooms held at once before the oldest hold is given up.
MAX_HELD_ROOMS = 65536


class _Hold:
    __slots__ = ("abort_seq", "acked", "deadline", "ranks")

    def __init__(self, abort_seq: int, ranks: int, deadline: float) -> None:
        self.abort_seq = abort_seq
        self.ranks = ranks
        self.deadline = deadline
        self.acked: set[int] = set()


@dataclass(frozen=True, slots=True)
class HoldStats:
    held: int  # rooms waiting for acks now
    released_by_acks: int
    released_by_timeout: int
    evicted: int  # holds given up at the size bound
    stale_acks: int  # acks of another abort sequence number, of a room not held, or naming no rank


class AbortHolds:
    """The held rooms of one decode manager; thread-safe (the ack listener and the owner)."""

    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float],
        *,
        max_rooms: int = MAX_HELD_ROOMS,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self._max_rooms = max_rooms
        self._lock = threading.Lock()
        self._holds: dict[int, _Hold] = {}
        # One counter per manager, from 1, a new value per armed ABORT (as SGLang's).
        self._abort_seqs = itertools.count(1)
        self._by_acks = 0
        self._by_timeout = 0
        self._evicted = 0
        self._stale = 0

    def hold(self, room: int, ranks: int) -> int:
        """Arm a new abort sequence number for ``room``, told to ``ranks`` prefill ranks;
        return it."""
        with self._lock:
            abort_seq = next(self._abort_seqs)
            self._holds.pop(room, None)  # a new sequence number replaces the old one
            while len(self._holds) >= self._max_rooms:
                del self._holds[next(iter(self._holds))]  # the oldest hold
                self._evicted += 1
            self._holds[room] = _Hold(abort_seq, ranks, self._clock() + self.timeout_s)
            return abort_seq

    def acked(self, ack: AbortAck) -> bool:
        """Record an ABORT_ACK; False if it is stale (not the room's current sequence number)."""
        with self._lock:
            hold = self._holds.get(ack.room)
            if (
                hold is None
                or ack.abort_seq is None  # a legacy ack names no sequence number
                or ack.abort_seq != hold.abort_seq
                or ack.prefill_rank is None
            ):
                self._stale += 1
                return False
            hold.acked.add(ack.prefill_rank)
            return True

    def released(self, room: int) -> bool:
        """Whether ``room``'s pages may be freed now (then the hold is forgotten)."""
        with self._lock:
            hold = self._holds.get(room)
            if hold is None:
                return True
            if len(hold.acked) >= hold.ranks:
                self._by_acks += 1
            elif self._clock() >= hold.deadline:
                self._by_timeout += 1
            else:
                return False
            del self._holds[room]
            return True

    def abort_seq(self, room: int) -> int | None:
        """The abort sequence number ``room`` is held for, or None."""
        with self._lock:
            hold = self._holds.get(room)
            return None if hold is None else hold.abort_seq

    def stats(self) -> HoldStats:
        with self._lock:
            return HoldStats(
                len(self._holds), self._by_acks, self._by_timeout, self._evicted, self._stale
            )
