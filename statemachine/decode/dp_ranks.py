"""``DpRankQueries``: rooms whose prefill dp rank is unknown, asked in one batch per address.

A room whose prefill neither has one dp rank nor follows the bootstrap room waits here; once
per scheduler step (``DecodeManager.step``) one ``POST /query_dp_ranks`` per address asks for
every pending room of that address, on the background workers, as SGLang 0.5.23's scheduler
prefetches them (``decode.py:3130-3133``). Answers are applied on the stepping thread: each
answered receiver gets ``dp_rank_answered(dp_rank)`` (a single store its owner's next ``init``
reads).
"""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent.futures import Future

from statemachine.decode.background import Background
from statemachine.decode.rooms import InFlight
from statemachine.decode.source import BootstrapQueries
from statemachine.errors import BootstrapError

__all__ = ["DpRankQueries"]


class DpRankQueries:
    """The pending rooms and the batched query in flight per address."""

    def __init__(self, source: BootstrapQueries, background: Background) -> None:
        self._source = source
        self._background = background
        self._lock = threading.Lock()
        self._pending: dict[str, dict[int, InFlight]] = {}
        #: the batched query in flight per address, and the rooms it asks about
        self._in_flight: dict[str, tuple[Future[dict[int, int]], dict[int, InFlight]]] = {}
        #: batched queries started
        self.started = 0

    def wait_for(self, receiver: InFlight) -> None:
        """The receiver's room waits for the next :meth:`step`'s batched query."""
        with self._lock:
            self._pending.setdefault(receiver.addr, {})[receiver.room] = receiver

    def forget(self, receiver: InFlight) -> None:
        """The receiver ended while its room was pending."""
        with self._lock:
            rooms = self._pending.get(receiver.addr)
            if rooms is not None and rooms.get(receiver.room) is receiver:
                del rooms[receiver.room]

    def step(self, *, wait: bool = False) -> int:
        """Collect the finished queries, start one per address with pending rooms and none in
        flight; how many rooms were resolved (see ``DecodeManager.step``)."""
        resolved = self._collect()
        with self._lock:
            starts = {
                addr: dict(rooms)
                for addr, rooms in self._pending.items()
                if rooms and addr not in self._in_flight
            }
        for addr, rooms in starts.items():
            future = self._background.submit(self._source.query_dp_ranks, addr, list(rooms))
            with self._lock:
                self.started += 1
                self._in_flight[addr] = (future, rooms)
        if wait:
            with self._lock:
                futures = [future for future, _ in self._in_flight.values()]
            concurrent.futures.wait(futures)
            resolved += self._collect()
        return resolved

    def _collect(self) -> int:
        """Apply every finished query (on the caller's thread); how many rooms resolved."""
        with self._lock:
            finished = [(addr, query) for addr, query in self._in_flight.items() if query[0].done()]
            for addr, _ in finished:
                del self._in_flight[addr]
        resolved = 0
        for addr, (future, rooms) in finished:
            if future.cancelled():
                continue
            error = future.exception()
            if isinstance(error, BootstrapError):
                continue  # the rooms stay pending: the next step asks again
            answer = future.result()  # raises what is not a BootstrapError: a source's bug
            with self._lock:
                waiting = self._pending.get(addr, {})
                for room, dp_rank in answer.items():
                    receiver = rooms.get(room)
                    if receiver is not None and waiting.get(room) is receiver:
                        del waiting[room]
                        receiver.dp_rank_answered(dp_rank)
                        resolved += 1
        return resolved

    def counts(self) -> tuple[int, int, int]:
        """(rooms pending, queries in flight, queries started)."""
        with self._lock:
            pending = sum(len(rooms) for rooms in self._pending.values())
            return pending, len(self._in_flight), self.started

    def close(self) -> None:
        with self._lock:
            self._in_flight.clear()
