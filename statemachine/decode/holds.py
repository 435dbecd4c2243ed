"""Deferred KV release: rooms whose pages the prefill may still be writing after an ABORT.

SGLang 0.5.23 (``common/conn.py:979-1019``, ``decode.py:2996-3108``) arms a new abort sequence
number (its code calls it the *generation*) for a room when it sends an ABORT after the room's
metadata went out, and keeps the room's KV pages until every prefill rank it told acknowledged
that number (ABORT_ACK) or a timeout (30 s by default) passed: a rank may be mid-write into
those pages, and freeing them early lets the next request's KV be overwritten.
:class:`AbortHolds` is that bookkeeping for one manager: ``hold`` arms a sequence number for the
room's *writers* (each rank's endpoint and the pool generation that named it), ``acked`` records
an ABORT_ACK of the current one (any other is stale and ignored), ``released`` answers whether
the pages may be freed now.

A dead process sends no ABORT_ACK, so SGLang holds a killed prefill's rooms the full timeout.
Here a room is also released as soon as every writer is **proven gone** (MGR-15, the model's
``ReleaseOnProvenGone``): ``proven_gone`` records the proof the transport found — the rank's
port refused a connect, so its process exited (ZMQ-26) — for the generations that named that
endpoint when the proof came, so a room held later on them is released too, and a room told a
newer process at the same endpoint is not. Silence (a heartbeat expiry, a timeout) is never
proof: a stopped or cut-off process may resume and write, so such a room waits for its
ABORT_ACKs or the timeout (``NoReleaseWhileWriterMayWrite``).

An ABORT_ACK names its sender by a backend's rank id, not by endpoint, so acks are counted (all
writers acked → released) and never mixed with proofs: a room with one rank acked and another
proven gone waits for the timeout, as SGLang's does.

Bounded: at most ``max_rooms`` rooms are held, and as many proofs remembered; past it the oldest
hold is given up (its room counts as released, as after its timeout) and counted in
``evicted``, and the oldest proof forgotten (its rooms then wait for acks or the timeout). A
released room is forgotten, so the table holds only rooms still waiting.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from statemachine import trace
from statemachine.completion import AbortAck
from statemachine.pool import Generation

#: Rooms held at once before the oldest hold is given up; proofs remembered at once.
MAX_HELD_ROOMS = 65536

#: How a writer was proven gone (the trace actions of the model's evidence steps).
RESET_SEEN = "ResetSeen"
NEW_INSTANCE_SEEN = "NewInstanceSeen"

#: One rank told a room's metadata: its endpoint URL and the generation that named it.
Writer = tuple[str, Generation]


class _Hold:
    __slots__ = ("abort_seq", "acked", "deadline", "writers")

    def __init__(self, abort_seq: int, writers: tuple[Writer, ...], deadline: float) -> None:
        self.abort_seq = abort_seq
        self.writers = writers
        self.deadline = deadline
        self.acked: set[int] = set()


@dataclass(frozen=True, slots=True)
class HoldStats:
    held: int  # rooms waiting for acks now
    released_by_acks: int
    released_by_timeout: int
    evicted: int  # holds given up at the size bound
    stale_acks: int  # acks of another abort sequence number, of a room not held, or none
    released_by_proof: int = 0  # every writer proven gone before its ack or the timeout


class AbortHolds:
    """The held rooms of one decode manager; thread-safe (the ack listener, the transport's
    monitor thread and the owner)."""

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
        #: writers proven gone, oldest first (bounded like the holds)
        self._proofs: dict[Writer, str] = {}
        # One counter per manager, from 1, a new value per armed ABORT (as SGLang's).
        self._abort_seqs = itertools.count(1)
        self._by_acks = 0
        self._by_timeout = 0
        self._by_proof = 0
        self._evicted = 0
        self._stale = 0

    def hold(self, room: int, writers: Sequence[Writer]) -> int:
        """Arm a new abort sequence number for ``room``, whose metadata told ``writers``;
        return it."""
        with self._lock:
            abort_seq = next(self._abort_seqs)
            self._holds.pop(room, None)  # a new sequence number replaces the old one
            while len(self._holds) >= self._max_rooms:
                del self._holds[next(iter(self._holds))]  # the oldest hold
                self._evicted += 1
            deadline = self._clock() + self.timeout_s
            self._holds[room] = _Hold(abort_seq, tuple(writers), deadline)
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

    def proven_gone(self, url: str, generations: Iterable[Generation], how: str) -> None:
        """The process at endpoint ``url`` is gone (``how``: :data:`RESET_SEEN`). Recorded for
        ``generations`` (those in use at ``url`` now: the pool's and the requests' in flight)
        and for every held room's writer at ``url``: each was told before this proof."""
        with self._lock:
            named = set(generations) | self._generations_at_locked(url)
            for generation in named:
                self._proofs.pop((url, generation), None)  # re-inserted as the newest
                self._proofs[(url, generation)] = how
            while len(self._proofs) > self._max_rooms:
                del self._proofs[next(iter(self._proofs))]
        if trace.ENABLED:
            for generation in named:
                trace.emit(how, endpoint=url, instance=instance_label(generation))

    def generations_at(self, url: str) -> set[Generation]:
        """The generations of the held rooms' writers at endpoint ``url``."""
        with self._lock:
            return self._generations_at_locked(url)

    def released(self, room: int) -> bool:
        """Whether ``room``'s pages may be freed now (then the hold is forgotten)."""
        with self._lock:
            hold = self._holds.get(room)
            if hold is None:
                return True
            if len(hold.acked) >= len(hold.writers):
                self._by_acks += 1
                how = "ReleaseOnAbortAck"
            elif all(writer in self._proofs for writer in hold.writers):
                self._by_proof += 1
                how = "ReleaseOnProvenGone"
            elif self._clock() >= hold.deadline:
                self._by_timeout += 1
                how = "ReleaseOnTimeout"
            else:
                return False
            del self._holds[room]
        if trace.ENABLED:
            _trace_release(how, room, hold.writers)
        return True

    def abort_seq(self, room: int) -> int | None:
        """The abort sequence number ``room`` is held for, or None."""
        with self._lock:
            hold = self._holds.get(room)
            return None if hold is None else hold.abort_seq

    def stats(self) -> HoldStats:
        with self._lock:
            return HoldStats(
                len(self._holds),
                self._by_acks,
                self._by_timeout,
                self._evicted,
                self._stale,
                self._by_proof,
            )

    def _generations_at_locked(self, url: str) -> set[Generation]:
        return {g for hold in self._holds.values() for u, g in hold.writers if u == url}


def instance_label(generation: Generation) -> str:
    """The instance a trace names for ``generation``: its instance id, or (a server that sends
    none, SGLang's) the generation itself, so evidence and release match the same fetch."""
    return generation.instance_id or f"generation-{trace.token(generation)}"


def _trace_release(how: str, room: int, writers: tuple[Writer, ...]) -> None:
    if how != "ReleaseOnProvenGone":
        trace.emit(how, room=room)
        return
    # One event per instance the writers were told by (one, unless a restart fell between
    # two of the room's pool keys); every writer is listed: acks name no endpoint (above).
    by_instance: dict[str, list[str]] = {}
    for url, generation in writers:
        by_instance.setdefault(instance_label(generation), []).append(url)
    for instance, urls in by_instance.items():
        trace.emit(how, room=room, instance=instance, writers=urls)
