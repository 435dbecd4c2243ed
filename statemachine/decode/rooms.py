"""``Rooms``: the receivers in flight, by room, and how the ended ones ended.

Every part that must reach the requests in flight (the fan-out, completions, the dp-rank
queries) reads them here, and knows a receiver only as :class:`InFlight`: what another
thread may read, call or set on it. Each of those calls is a single store the owner's next
``init``/``send_metadata``/``poll`` consumes (``spec/manager.md`` MGR-2), so nothing here
steps another thread's receiver.

Why no index by generation or endpoint: keeping one would cost every cache hit a few dict
updates, and fan-out is rare. The table (one store at creation, one pop at the end) is scanned
when evidence arrives instead: a few microseconds per thousand requests in flight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from statemachine.decode.tally import Tally
from statemachine.errors import BootstrapError, InvalidRoom, ManagerClosed, PeerLost
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.wire.endpoint import endpoint_url

__all__ = [
    "MAX_ROOM",
    "InFlight",
    "Rooms",
    "check_room",
    "distinct_ranks",
    "entries_of",
    "generations_at",
    "items_of",
]

#: The largest bootstrap room (SGLang's rooms are unsigned 64-bit).
MAX_ROOM = 2**64 - 1

_log = logging.getLogger(__name__)


class InFlight(Protocol):
    """What the parts may read, call or set on a receiver in flight."""

    #: The request's bootstrap room and its prefill's bootstrap address (set at creation).
    room: int
    addr: str
    #: The generation objects the receiver holds, by key (the owner's thread writes it; the
    #: parts copy it, retrying a copy that raced a resize).
    entries: dict[PoolKey, Generation]
    #: The room waits for the batched dp-rank query (``DpRankQueries``).
    awaiting_dp_rank: bool
    #: Called (from any thread) when the receiver has news for its owner.
    on_change: Callable[[], None] | None

    @property
    def ended(self) -> bool: ...

    def ranks(self) -> list[tuple[Generation, RankInfo]]:
        """Every (generation, rank) of the room, each endpoint once."""
        ...

    def mark_lost(self, error: BootstrapError) -> bool:
        """The fan-out: store ``error`` for the owner's next call and wake it. False when the
        receiver ended, was already lost, or every response arrived (nothing to fail)."""
        ...

    def dp_rank_answered(self, dp_rank: int) -> None:
        """The batched dp-rank query answered for this room."""
        ...

    def rank_succeeded(self, prefill_rank: int) -> bool:
        """A Success from ``prefill_rank``; True when it is the first from that rank."""
        ...

    def failed_by_prefill(self, error: BootstrapError) -> None:
        """A Failed status: terminal, it wins over any success."""
        ...

    def prefill_ready(self) -> None:
        """The prefill answered the BOOTSTRAP handshake."""
        ...


class Rooms:
    """The room table and the outcome counters (see the module docstring)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # guards the counters below (never on the hit path)
        #: the receivers in flight by room (a receiver stores itself here at creation)
        self.by_room: dict[int, InFlight] = {}
        self._completed = Tally()
        self._failures: dict[str, Tally] = {}
        self.detections = 0
        self.detection_total_s = 0.0
        self.detection_max_s = 0.0
        self.callback_errors = 0
        #: no receiver is admitted any more
        self.closed = False

    def refuse(self, receiver: InFlight) -> None:
        """Raise why ``receiver`` was not admitted: the table is closed (ManagerClosed), or its
        room is taken (InvalidRoom). A receiver admits itself with one store into
        :attr:`by_room` (``setdefault``) unless :attr:`closed`, and calls this otherwise."""
        if self.closed:
            raise ManagerClosed("the decode manager is closed: create a new one")
        raise InvalidRoom(
            f"room {receiver.room} is already in flight: finish, abort or clear its "
            "receiver before reusing the room"
        )

    def ended(self, receiver: InFlight, error: BootstrapError | None) -> None:
        """``receiver`` reached a final state (``error`` None: it completed): forget it, count
        how it ended, and for a loss with evidence, how long detection took."""
        if self.by_room.get(receiver.room) is receiver:
            del self.by_room[receiver.room]
        if error is None:
            self._completed.add()  # lock-free: one C call
            return
        kind = type(error).__name__
        counter = self._failures.get(kind)
        if counter is None:
            with self._lock:
                counter = self._failures.setdefault(kind, Tally())
        counter.add()
        if isinstance(error, PeerLost) and error.evidence_at is not None:
            with self._lock:
                latency = max(0.0, self._clock() - error.evidence_at)
                self.detections += 1
                self.detection_total_s += latency
                self.detection_max_s = max(self.detection_max_s, latency)

    def get(self, room: int) -> InFlight | None:
        return self.by_room.get(room)

    def snapshot(self) -> list[InFlight]:
        """The receivers in flight now (a copy: safe to scan while others come and go)."""
        return list(self.by_room.copy().values())

    def held_by(self, addr: str) -> list[tuple[PoolKey, Generation]]:
        """(key, generation) of every receiver in flight for ``addr`` (a source's question,
        on its own thread, answered from a snapshot)."""
        held: list[tuple[PoolKey, Generation]] = []
        for receiver in self.snapshot():
            if receiver.addr == addr:
                held.extend(items_of(receiver))
        return held

    def callback_raised(self, receiver: InFlight, error: Exception) -> None:
        """A receiver's ``on_change`` raised (on whatever thread woke it): contained there,
        counted here and logged once, so a broken callback neither stops the fan-out nor
        fails another request's call, nor floods the log (MGR-18)."""
        with self._lock:
            self.callback_errors += 1
            first = self.callback_errors == 1
        if first:
            _log.error(
                "room %d: on_change raised %r; contained (the receiver still fails or "
                "completes at its owner's next call); later callback errors are only counted "
                "in stats().callback_errors: fix the callback",
                receiver.room,
                error,
                exc_info=error,
            )

    def counts(self) -> tuple[int, dict[str, int], int]:
        """(completed, failures by error type, in flight)."""
        with self._lock:
            failures = {k: c.value() for k, c in self._failures.items()}
        return self._completed.value(), failures, len(self.by_room)

    def close(self, error: BootstrapError) -> None:
        """Admit no more; fail every receiver still in flight with ``error``."""
        self.closed = True
        for receiver in self.snapshot():
            receiver.mark_lost(error)

    def __len__(self) -> int:
        return len(self.by_room)


def entries_of(receiver: InFlight) -> tuple[Generation, ...]:
    """The generations a receiver (owned by another thread) holds right now."""
    for _ in range(3):
        try:
            return tuple(receiver.entries.values())
        except RuntimeError:  # pragma: no cover - resized while copied; look again
            continue
    return ()  # pragma: no cover


def items_of(receiver: InFlight) -> tuple[tuple[PoolKey, Generation], ...]:
    for _ in range(3):
        try:
            return tuple(receiver.entries.items())
        except RuntimeError:  # pragma: no cover - resized while copied; look again
            continue
    return ()  # pragma: no cover


def generations_at(url: str, pool: BootstrapPool, rooms: Rooms) -> set[Generation]:
    """The generations of the pool and of the receivers in flight with a rank at ``url``."""
    found: set[Generation] = set()
    candidates = list(pool.snapshot().values())
    for receiver in rooms.snapshot():
        candidates.extend(entries_of(receiver))
    for generation in candidates:
        for rank in generation.ranks:
            if endpoint_url((rank.ip, rank.port)) == url:
                found.add(generation)
                break
    return found


def check_room(room: object) -> int:
    """``room`` if it is an int in [0, 2**64); else :class:`InvalidRoom`."""
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        raise InvalidRoom(
            f"bootstrap room must be an int in [0, 2**64), not {room!r}: use the request's "
            "bootstrap_room as the router assigned it"
        )
    return room


def distinct_ranks(generations: Iterable[Generation]) -> list[tuple[Generation, RankInfo]]:
    """Every (generation, rank) of ``generations``, each endpoint once (what an ABORT or a
    BOOTSTRAP of a room goes to)."""
    seen: set[tuple[str, int]] = set()
    out: list[tuple[Generation, RankInfo]] = []
    for generation in generations:
        for rank in generation.ranks:
            if (rank.ip, rank.port) not in seen:
                seen.add((rank.ip, rank.port))
                out.append((generation, rank))
    return out
