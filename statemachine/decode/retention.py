"""``SocketRetention``: the sockets of the generations this process published, kept open while
a pool entry or a receiver in flight uses them (``spec/zmq.md`` ZMQ-20).

A generation this process published retains its endpoints in the transport
(:meth:`SocketRetention.retain`); whenever pool entries are dropped or receivers fail
(the fan-out), :meth:`SocketRetention.reconcile` releases the generations nothing uses any more,
and the transport closes a socket no live generation retains.
"""

from __future__ import annotations

import threading

from statemachine.decode.ranks.transport import Endpoint, ZmqTransport
from statemachine.decode.rooms import Rooms, entries_of
from statemachine.pool import BootstrapPool, Generation

__all__ = ["SocketRetention"]


class SocketRetention:
    """The retained sockets of one decode process (see the module docstring)."""

    def __init__(self, *, pool: BootstrapPool, rooms: Rooms, transport: ZmqTransport) -> None:
        self._pool = pool
        self._rooms = rooms
        self._transport = transport
        self._lock = threading.Lock()
        self._retained: dict[Generation, tuple[Endpoint, ...]] = {}

    def retain(self, generation: Generation) -> None:
        """``generation`` was published by this process: keep its endpoints' sockets."""
        endpoints = tuple((rank.ip, rank.port) for rank in generation.ranks)
        with self._lock:
            if generation in self._retained:
                return
            self._retained[generation] = endpoints
        self._transport.retain(endpoints)

    def reconcile(self) -> int:
        """Release the sockets of retained generations nothing uses any more."""
        with self._lock:
            if not self._retained:
                return 0
        live = set(self._pool.snapshot().values())
        for receiver in self._rooms.snapshot():
            live.update(entries_of(receiver))
        with self._lock:
            dead = [g for g in self._retained if g not in live]
            released = [self._retained.pop(g) for g in dead]
        for endpoints in released:
            self._transport.release(endpoints)
        return len(released)

    def endpoints_retained(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._retained.values())

    def close(self) -> None:
        """Release every retained socket."""
        with self._lock:
            retained = list(self._retained.values())
            self._retained.clear()
        for endpoints in retained:
            self._transport.release(endpoints)
