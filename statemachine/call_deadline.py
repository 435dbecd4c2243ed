"""One deadline per public call, shared by every exchange the call makes (spec/manager.md MGR-21).

A receiver's ``init()`` may ask its source several questions (the topology, then every rank of
its plan). Each HTTP exchange has its own deadline (the client's, HTTP-35), so without more a
call of N questions could take N deadlines. The receiver opens a *window* when its first
question is about to be asked (never on a cache hit, which asks nothing) and every exchange
inside it ends by the window's end: the client reads :func:`current` and arms the smaller of its
own deadline and the time left (``BootstrapClient._exchange``). Per thread, like the client's
sessions and its per-exchange deadline; below both the decode side and the sources, so neither
imports the other.
"""

from __future__ import annotations

import threading

__all__ = ["Until", "current"]

_LOCAL = threading.local()


def current() -> float | None:
    """The calling thread's call deadline (``time.monotonic()`` seconds), or ``None``."""
    at: float | None = getattr(_LOCAL, "at", None)
    return at


class Until:
    """Context manager: the calling thread's exchanges end by ``at`` (``time.monotonic()``)
    while inside; an enclosing, earlier deadline stays in force. Restores the previous one."""

    __slots__ = ("_at", "_previous")

    def __init__(self, at: float) -> None:
        self._at = at
        self._previous: float | None = None

    def __enter__(self) -> Until:
        previous = self._previous = current()
        _LOCAL.at = self._at if previous is None else min(previous, self._at)
        return self

    def __exit__(self, *exc: object) -> None:
        _LOCAL.at = self._previous
