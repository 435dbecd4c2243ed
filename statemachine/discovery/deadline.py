"""End an HTTP exchange that a thread is blocked in: at a total deadline, or when its owner
closes (docs/etcd.md, "Limits").

``requests``' read timeout is per ``recv``: a peer that sends one byte a second never trips
it, so a reply has no total deadline of its own. Here every exchange the etcd gateway makes is
an :class:`Exchange` holding its socket; shutting that socket down from another thread wakes
the blocked ``recv`` at once, and the call fails. One process-wide daemon thread
(:data:`WATCHDOG`) does that at each armed deadline; ``close()`` of a source does it at once.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time

__all__ = ["WATCHDOG", "Exchange", "Timer", "Watchdog"]


class Exchange:
    """One HTTP exchange's socket (attached once connected), and why it was ended, if it was.

    ``end(reason)`` from any thread: the first reason stays, the socket is shut down (a
    ``recv`` blocked on it returns), and a socket attached later is shut down at once.
    """

    __slots__ = ("_lock", "_sock", "ended")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
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
    stops calling etcd keeps no thread). A timer pushed later is re-queued when its old time
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
                thread = threading.Thread(target=self._run, name="etcd-deadlines", daemon=True)
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


#: The process's watchdog, shared by every gateway.
WATCHDOG = Watchdog()
