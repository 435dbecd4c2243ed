"""The one deadline mechanism of every HTTP call: the bootstrap client's and the etcd gateway's.

Two parts, used together:

* **A call window per thread** (:class:`Until`, :func:`current`; spec/manager.md MGR-21). A
  receiver's ``init()`` may ask its source several questions (the topology, then every rank of
  its plan); each exchange has its own deadline, so without more a call of N questions could take
  N deadlines. The receiver opens a window when its first question is about to be asked (never
  on a cache hit, which asks nothing) and every exchange inside it ends by the window's end.

* **An exchange ended from outside** (:class:`Exchange`, :data:`WATCHDOG`). ``requests``' and
  urllib3's timeouts (``urllib3.util.Timeout``: connect, and read *between consecutive reads*)
  bound one socket operation each, never a whole reply: a peer that sends one byte a second
  trips neither. Every exchange is therefore an :class:`Exchange` holding its socket, and one
  process-wide daemon thread shuts that socket down at the exchange's deadline (the smaller of
  its own and the call window's), which wakes the blocked ``recv`` at once, TLS or not; the
  exchange's owner does the same from any thread with ``end()`` (a source's ``close()``). The
  HTTP plumbing that hands each exchange its socket is :mod:`statemachine.http_exchange`.

Per thread, like the HTTP sessions; below the decode side, the sources and the prefill, so none
of them imports another for it.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Iterator

__all__ = [
    "WATCHDOG",
    "Exchange",
    "Timer",
    "Until",
    "Watchdog",
    "current",
    "running",
    "running_exchange",
]

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


# --- exchanges ended from outside ------------------------------------------------------------


class Exchange:
    """One HTTP exchange's socket (attached once connected), and why it was ended, if it was.

    ``end(reason)`` from any thread: the first reason stays, the socket is shut down (a
    ``recv`` blocked on it returns), and a socket attached later is shut down at once.
    """

    __slots__ = ("_lock", "_sock", "at", "ended")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        #: when the exchange's deadline ends it (``time.monotonic()``), None if it has none
        self.at: float | None = None
        #: why the exchange was ended ("deadline", "idle", "closed", "finished"), None while
        #: it runs
        self.ended: str | None = None

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            ended = self.ended is not None
        if ended:
            _shutdown(sock)

    def finish(self) -> None:
        """The exchange is over: forget its socket, which a kept-alive connection reuses, so
        a deadline that fires late cannot shut down the next exchange's."""
        with self._lock:
            self._sock = None
            if self.ended is None:
                self.ended = "finished"

    def end(self, reason: str) -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.ended = reason
            sock = self._sock
        if sock is not None:
            _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError, ValueError):
        sock.shutdown(socket.SHUT_RDWR)


class Timer:
    """An armed deadline. ``push(seconds)`` moves it later (one attribute store: cheap enough
    to do per watch message); ``cancel()`` disarms it."""

    __slots__ = ("_watchdog", "armed", "exchange", "reason", "when")

    def __init__(self, watchdog: Watchdog, exchange: Exchange, reason: str, when: float) -> None:
        self._watchdog = watchdog
        self.exchange = exchange
        self.reason = reason
        self.when = when
        self.armed = True

    def push(self, seconds: float) -> None:
        self.when = time.monotonic() + seconds

    def cancel(self) -> None:
        self._watchdog._disarm(self)


class Watchdog:
    """Ends each armed :class:`Exchange` whose deadline passes. One daemon thread, started on
    first use and ended ``linger`` seconds after the last timer was disarmed (a process that
    stops calling keeps no thread). A timer pushed later is re-queued when its old time
    comes, so moving a deadline costs no lock."""

    def __init__(self, linger: float = 0.5) -> None:
        self._linger = linger
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._armed = 0
        self._thread: threading.Thread | None = None

    def arm(self, exchange: Exchange, seconds: float, reason: str) -> Timer:
        timer = Timer(self, exchange, reason, time.monotonic() + seconds)
        with self._cond:
            heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
            self._armed += 1
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="http-deadlines", daemon=True)
                thread.start()
                self._thread = thread
            if self._heap[0][2] is timer:
                self._cond.notify()
        return timer

    def _disarm(self, timer: Timer) -> bool:
        """Disarm ``timer`` (under the lock: a cancel racing the firing counts once)."""
        with self._cond:
            if not timer.armed:
                return False
            timer.armed = False
            self._armed -= 1
            # Exchanges end in about the order they started: dropping disarmed timers from
            # the front keeps the heap as small as the exchanges in flight.
            while self._heap and not self._heap[0][2].armed:
                heapq.heappop(self._heap)
            if not self._armed:
                self._cond.notify()
            return True

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._armed:
                    self._heap.clear()  # only disarmed timers are left
                    if not self._cond.wait(self._linger) and not self._armed:
                        self._thread = None
                        return
                    continue
                when, _, timer = self._heap[0]
                now = time.monotonic()
                if when > now:
                    self._cond.wait(when - now)
                    continue
                heapq.heappop(self._heap)
                if not timer.armed:
                    continue
                if timer.when > now:  # pushed later meanwhile
                    heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
                    continue
                timer.armed = False
                self._armed -= 1
                timer.exchange.end(timer.reason)


#: The process's watchdog, shared by every HTTP client of the package.
WATCHDOG = Watchdog()


_RUNNING = threading.local()


@contextlib.contextmanager
def running(exchange: Exchange) -> Iterator[Exchange]:
    """The calling thread runs ``exchange``: the sockets it opens or reuses meanwhile are
    handed to it (:func:`running_exchange`)."""
    previous: Exchange | None = getattr(_RUNNING, "exchange", None)
    _RUNNING.exchange = exchange
    try:
        yield exchange
    finally:
        _RUNNING.exchange = previous


def running_exchange() -> Exchange | None:
    """The exchange the calling thread runs, if any."""
    exchange: Exchange | None = getattr(_RUNNING, "exchange", None)
    return exchange
