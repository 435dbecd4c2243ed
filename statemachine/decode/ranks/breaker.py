"""The circuit breaker's memory of dead endpoints whose sockets were closed (ZMQ-19, ZMQ-20).

While an endpoint's socket is open, its verdict is on the socket's cache entry
(``SocketEntry.down``, read by every send without a lock). A dead endpoint nobody retains is
closed at once (no reconnect attempts while idle); its verdict is remembered here for
``down_hold_ms`` so that sends to it still fail in microseconds, and a new socket opened there
reports ``alive`` at its first handshake. Bounded: expired verdicts go first, then the oldest.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from statemachine.wire.endpoint import Endpoint

__all__ = ["RememberedVerdicts", "Tombstone"]


class Tombstone(NamedTuple):
    """A dead endpoint whose socket was closed: its verdict, held until ``until``."""

    message: str
    until: float


class RememberedVerdicts:
    """Dead verdicts held after their sockets closed. Writes come under the transport's lock;
    :meth:`refusal` is one dict get, safe without it."""

    __slots__ = ("_down", "_hold_s", "_max")

    def __init__(self, hold_s: float, max_entries: int) -> None:
        self._hold_s = hold_s
        self._max = max_entries
        self._down: dict[Endpoint, Tombstone] = {}

    def refusal(self, endpoint: Endpoint) -> str | None:
        """The remembered verdict's message while it is held, else ``None``."""
        tomb = self._down.get(endpoint)
        if tomb is not None and time.monotonic() < tomb.until:
            return tomb.message
        return None

    def remember(self, endpoint: Endpoint, message: str) -> None:
        now = time.monotonic()
        down = self._down
        if len(down) >= self._max:  # bounded: expired first, then the oldest
            for key in [k for k, tomb in down.items() if tomb.until <= now]:
                del down[key]
            while len(down) >= self._max:
                del down[next(iter(down))]
        down[endpoint] = Tombstone(message, now + self._hold_s)

    def forget(self, endpoint: Endpoint) -> bool:
        """Drop ``endpoint``'s verdict; whether there was one (held or expired)."""
        return self._down.pop(endpoint, None) is not None

    def held(self) -> int:
        """How many verdicts are still held now."""
        now = time.monotonic()
        return sum(1 for tomb in self._down.values() if now < tomb.until)
