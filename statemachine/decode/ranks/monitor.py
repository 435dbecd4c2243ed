"""One thread that reads the ZMQ monitor sockets of every socket of a transport (ZMQ-16).

A thread per socket would cost a thread per prefill rank; one ``zmq.Poller`` over all monitor
sockets costs one thread per transport. The thread owns the monitor ``PAIR`` sockets (ZMQ
sockets are not thread-safe) and the :class:`~statemachine.decode.ranks.liveness.Liveness` state of
each; other threads talk to it only through a queue and a wake-up pipe, so :meth:`watch`,
:meth:`unwatch` and :meth:`send_failed` never block.

Verdicts are handed to ``on_verdict(key, alive, reason)`` on this thread. An exception there
is contained and counted (``callback_errors``): a listener bug must not stop liveness for
every other endpoint.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from statemachine.decode.ranks.liveness import Liveness

K = TypeVar("K", bound=Hashable)

_log = logging.getLogger(__name__)

# Inbox message kinds.
_WATCH, _UNWATCH, _SEND_FAILED, _STOP = range(4)


class _Watched:
    __slots__ = ("liveness", "socket")

    def __init__(self, socket: zmq.Socket[bytes], liveness: Liveness) -> None:
        self.socket = socket
        self.liveness = liveness


class SocketMonitor(Generic[K]):
    """Reads monitor sockets and reports verdict changes; see the module docstring."""

    def __init__(self, on_verdict: Callable[[K, bool, str], None], *, name: str) -> None:
        self._on_verdict = on_verdict
        self._inbox: collections.deque[tuple[int, K | None, object]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Guards writing to and closing the pipe: a closed fd number may be reused at once.
        self._wake_lock = threading.Lock()
        self._closed = False
        self.events = 0  # monitor events read
        self.verdicts = 0  # dead/alive changes reported
        self.callback_errors = 0
        self.errors = 0  # unexpected exceptions in the monitor's own loop (contained)
        self.watched = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- any thread ---------------------------------------------------------------------------

    def watch(self, key: K, monitor_socket: zmq.Socket[bytes], liveness: Liveness) -> None:
        """Start reading ``monitor_socket`` (ownership passes to the monitor thread)."""
        self._post(_WATCH, key, _Watched(monitor_socket, liveness))

    def unwatch(self, key: K) -> None:
        """Stop reading ``key``'s monitor socket and close it (no verdict is reported)."""
        self._post(_UNWATCH, key, None)

    def send_failed(self, key: K, reason: str) -> None:
        """A send through ``key``'s socket found no live connection within its timeout."""
        self._post(_SEND_FAILED, key, reason)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the thread; it closes every monitor socket it holds. True if it stopped.

        Called from the monitor thread itself (a listener closing the transport), it cannot
        wait for itself: it returns False and the thread stops when the listener returns.
        """
        if not self._closed:
            self._closed = True
            self._post(_STOP, None, None)
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _post(self, kind: int, key: K | None, payload: object) -> None:
        self._inbox.append((kind, key, payload))  # deque.append is atomic
        with self._wake_lock:
            if self._wake_w < 0:
                return  # the thread has ended
            # A full pipe means a wake-up is already pending.
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    def _close_pipe(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                os.close(self._wake_w)
                os.close(self._wake_r)
                self._wake_w = self._wake_r = -1

    # --- the monitor thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        watched: dict[K, _Watched] = {}
        by_socket: dict[zmq.Socket[bytes], K] = {}
        try:
            while True:
                try:
                    if not self._step(poller, watched, by_socket):
                        return
                except zmq.ContextTerminated:
                    return
                except Exception:  # a bug here must not end liveness for every endpoint
                    self.errors += 1
                    _log.exception("socket monitor step failed; the monitor keeps running")
                    time.sleep(0.01)  # never spin on a repeating error
        finally:
            for key in list(watched):
                self._forget(key, watched, by_socket, poller)
            self._close_pipe()

    def _step(
        self,
        poller: zmq.Poller,
        watched: dict[K, _Watched],
        by_socket: dict[zmq.Socket[bytes], K],
    ) -> bool:
        """One wait and what it brought; False once asked to stop."""
        ready = poller.poll(self._timeout_ms(watched))
        now = time.monotonic()
        for item, _ in ready:
            if item == self._wake_r:
                self._drain_pipe()
                continue
            key = by_socket.get(item)
            if key is not None and not self._read_events(key, watched[key], now):
                self._forget(key, watched, by_socket, poller)
        if not self._handle_inbox(watched, by_socket, poller, now):
            return False
        for key, entry in list(watched.items()):
            self._report(key, entry.liveness.tick(now), entry.liveness)
        return True

    def _timeout_ms(self, watched: dict[K, _Watched]) -> int | None:
        deadlines = [
            d for entry in watched.values() if (d := entry.liveness.deadline()) is not None
        ]
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _read_events(self, key: K, entry: _Watched, now: float) -> bool:
        """Read every pending event; False once the monitor stopped (the socket was closed)."""
        while True:
            try:
                frames = entry.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            except zmq.ZMQError:
                return False
            self.events += 1
            event = int(parse_monitor_message(frames)["event"])
            if event == zmq.EVENT_MONITOR_STOPPED:
                return False
            self._report(key, entry.liveness.on_event(event, now), entry.liveness)

    def _handle_inbox(
        self,
        watched: dict[K, _Watched],
        by_socket: dict[zmq.Socket[bytes], K],
        poller: zmq.Poller,
        now: float,
    ) -> bool:
        while self._inbox:
            kind, key, payload = self._inbox.popleft()
            if kind == _STOP:
                return False
            assert key is not None
            if kind == _WATCH:
                assert isinstance(payload, _Watched)
                watched[key] = payload
                by_socket[payload.socket] = key
                poller.register(payload.socket, zmq.POLLIN)
                self.watched += 1
                # Events may already be queued (a refused first connect takes ~0.1 ms).
                if not self._read_events(key, watched[key], now):
                    self._forget(key, watched, by_socket, poller)
            elif kind == _UNWATCH:
                if key in watched:
                    self._forget(key, watched, by_socket, poller)
            elif kind == _SEND_FAILED and key in watched:
                state = watched[key].liveness
                self._report(key, state.send_failed(str(payload)), state)
        return True

    def _forget(
        self,
        key: K,
        watched: dict[K, _Watched],
        by_socket: dict[zmq.Socket[bytes], K],
        poller: zmq.Poller,
    ) -> None:
        entry = watched.pop(key)
        by_socket.pop(entry.socket, None)
        poller.unregister(entry.socket)
        entry.socket.close(linger=0)
        self.watched -= 1

    def _report(self, key: K, verdict: bool | None, liveness: Liveness) -> None:
        if verdict is None:
            return
        self.verdicts += 1
        reason = "handshake succeeded" if verdict else (liveness.dead_reason or "dead")
        try:
            self._on_verdict(key, verdict, reason)
        except Exception:
            self.callback_errors += 1
            _log.exception("endpoint verdict handler raised; the monitor keeps running")
