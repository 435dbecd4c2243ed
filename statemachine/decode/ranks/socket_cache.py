"""``SocketCache``: one PUSH socket per prefill-rank endpoint, and how long it lives
(``spec/zmq.md`` ZMQ-1, ZMQ-20).

A socket is made on the first send to its endpoint; a small lock guards only the creation and
retirement of entries, never a send (each entry has its own lock: ZMQ sockets are not
thread-safe). **Resources follow generations:** :meth:`SocketCache.retain` /
:meth:`SocketCache.release` count the live generations that use an endpoint; at zero its socket
and monitor are closed. Sockets nobody retains are an LRU bounded by ``max_sockets``. A socket
retired while a sender holds its lock is closed by that sender on the way out (``doomed``).
Every ``zmq.ZMQError`` on a connect becomes :class:`~statemachine.errors.SendFailed`, with the
socket closed (ZMQ-18).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

import zmq

from statemachine.decode.ranks.breaker import RememberedVerdicts
from statemachine.decode.ranks.endpoints import check_endpoint_shape, endpoint_address
from statemachine.decode.ranks.liveness import EVENTS, Liveness
from statemachine.decode.ranks.monitor import SocketMonitor
from statemachine.decode.ranks.sockets import SocketEntry, SocketPolicy, close_monitored
from statemachine.decode.tally import Tally
from statemachine.errors import SendFailed
from statemachine.wire.endpoint import Endpoint, endpoint_url

__all__ = ["CONTEXT_MAX_SOCKETS", "NEXT_STEP", "SocketCache", "SocketOptions"]

#: What SGLang sets on its context; each monitored endpoint uses three ZMQ sockets.
CONTEXT_MAX_SOCKETS = 16384

# What every SendFailed tells the caller to do. Not "invalidate and refetch": a receiver has
# already failed its request and dropped the generation by the time the caller sees this, and
# the ranks come from the HTTP bootstrap server or from etcd, which the transport cannot tell.
NEXT_STEP = (
    "the request that sent it failed and its cached ranks of this prefill were dropped: retry "
    "the request, which refetches the prefill's current ranks (from its bootstrap server, or from "
    "etcd when the manager watches etcd); if every retry fails the same way, the prefill rank "
    "is not running"
)


class SocketOptions:
    """The options of every socket of one transport (validated by the transport)."""

    __slots__ = (
        "connect_timeout_ms",
        "grace_s",
        "heartbeat",
        "policy",
        "reconnect_ivl_max_ms",
        "reconnect_ivl_ms",
        "send_timeout_ms",
    )

    def __init__(
        self,
        *,
        policy: SocketPolicy,
        send_timeout_ms: int,
        reconnect_ivl_ms: int,
        reconnect_ivl_max_ms: int,
        connect_timeout_ms: int,
        heartbeat: tuple[tuple[int, int], ...],
        grace_s: float,
    ) -> None:
        self.policy = policy
        self.send_timeout_ms = send_timeout_ms
        self.reconnect_ivl_ms = reconnect_ivl_ms
        self.reconnect_ivl_max_ms = reconnect_ivl_max_ms
        self.connect_timeout_ms = connect_timeout_ms
        self.heartbeat = heartbeat
        self.grace_s = grace_s


class SocketCache:
    """The sockets of one transport (see the module docstring)."""

    def __init__(
        self,
        *,
        context: zmq.Context[zmq.Socket[bytes]],
        options: SocketOptions,
        max_sockets: int,
        monitor: SocketMonitor[SocketEntry] | None,
        remembered: RememberedVerdicts,
        failures: Tally,
        circuit_failures: Tally,
    ) -> None:
        self._context = context
        self._options = options
        self.max_sockets = max_sockets
        self._monitor = monitor
        self._remembered = remembered
        self._failures = failures
        self._circuit_failures = circuit_failures
        self.lock = threading.Lock()  # guards the dicts and counters below, never a send
        #: the open sockets by endpoint (read lock-free by every send: one dict get)
        self.entries: dict[Endpoint, SocketEntry] = {}
        #: how many live generations use each endpoint (ZMQ-20)
        self.refs: dict[Endpoint, int] = {}
        self.closed = False
        self.open_sockets = 0
        self.retired_sends = 0
        self.created = 0
        self.evictions = 0
        self.lru_evictions = 0
        self.ticks = itertools.count(1)

    def retain(self, endpoints: Iterable[Endpoint]) -> None:
        """A live generation uses ``endpoints``: keep their sockets (ZMQ-20)."""
        endpoints = list(endpoints)
        for endpoint in endpoints:
            check_endpoint_shape(endpoint)
        with self.lock:
            for endpoint in endpoints:
                self.refs[endpoint] = self.refs.get(endpoint, 0) + 1

    def release(self, endpoints: Iterable[Endpoint]) -> None:
        """A generation that used ``endpoints`` ended: close the sockets no one retains.

        Never blocks on a send in progress: a socket in use is closed by its current user as
        it finishes (within one poll slice if it is waiting). Releasing more than was retained
        is ignored. Without the monitor (a baseline's :class:`SocketPolicy`) the counts are
        kept but sockets live as SGLang's do: cached until a send fails (or for ever).
        """
        retiring = []
        with self.lock:
            for endpoint in endpoints:
                count = self.refs.get(endpoint, 0)
                if count > 1:
                    self.refs[endpoint] = count - 1
                elif count == 1:
                    del self.refs[endpoint]
                    if self._monitor is None:
                        continue
                    entry = self.entries.pop(endpoint, None)
                    if entry is not None:
                        retiring.append(entry)
        for entry in retiring:
            self.retire(entry)

    def open(self, endpoint: Endpoint) -> SocketEntry:
        """The endpoint's socket, made and connected now if there is none (no network I/O:
        connect is asynchronous); :class:`SendFailed` while a remembered verdict holds."""
        check_endpoint_shape(endpoint)
        down = self._remembered.refusal(endpoint)
        if down is not None:
            self._circuit_failures.add()
            self._failures.add()
            raise SendFailed(down, endpoint=endpoint_url(endpoint))
        try:
            address = endpoint_address(endpoint)  # IP literals only: no resolver, ever
        except ValueError as exc:
            self._failures.add()
            raise SendFailed(str(exc), endpoint=endpoint_url(endpoint)) from None
        victims: list[SocketEntry] = []
        try:
            with self.lock:
                if self.closed:
                    self._failures.add()
                    raise SendFailed("transport is closed", endpoint=address.url)
                entry = self.entries.get(endpoint)
                if entry is not None:  # another thread created it first
                    return entry
                if len(self.entries) >= self.max_sockets:
                    victims = self._lru_victims_locked()
                # Creating and connecting a socket does no network I/O (connect is
                # asynchronous, and never resolves a name here), so doing it under the small
                # lock keeps exactly one socket per endpoint.
                socket, monitor_socket = self._connect(address.url, address.ipv6)
                entry = SocketEntry(endpoint, socket, address.url)
                if self._remembered.forget(endpoint):
                    entry.reported_dead = True  # judged dead before: a handshake reports alive
                self.entries[endpoint] = entry
                self.created += 1
                self.open_sockets += 1
        finally:
            for victim in victims:
                self.retire(victim)
        if monitor_socket is not None:
            assert self._monitor is not None
            self._monitor.watch(entry, monitor_socket, Liveness(self._options.grace_s))
        return entry

    def evict(self, endpoint: Endpoint) -> None:
        """Close and forget the socket for ``endpoint`` (no-op if there is none).

        Waits for a send in progress on it (at most ``SNDTIMEO``).
        """
        with self.lock:
            entry = self.entries.pop(endpoint, None)
        if entry is not None:
            entry.doomed = True
            with entry.lock:
                if not entry.closed:
                    self.close_socket(entry)

    def close_all(self) -> None:
        """Close every socket (LINGER=0: nothing is flushed); no socket is made after this.
        Waits at most about ``SNDTIMEO`` for a send in progress."""
        with self.lock:
            self.closed = True
            entries = list(self.entries.values())
            self.entries.clear()
        for entry in entries:
            entry.doomed = True  # a monitored send waiting for a connection gives up now
        for entry in entries:
            with entry.lock:
                if not entry.closed:
                    self.close_socket(entry)

    def drop_unretained(self, entry: SocketEntry) -> bool:
        """Remove ``entry`` from the cache if no live generation uses its endpoint (then the
        caller retires it): a dead endpoint nobody needs is closed rather than reconnected
        while idle. Called under :attr:`lock`."""
        endpoint = entry.endpoint
        if endpoint not in self.refs and self.entries.get(endpoint) is entry:
            del self.entries[endpoint]
            return True
        return False

    def retire(self, entry: SocketEntry) -> None:
        """Close a socket already removed from the cache, without waiting for its lock.

        If a sender holds the lock, ``doomed`` tells it (and every later holder) to close the
        socket on the way out; setting it *before* trying the lock means one of us always does.
        """
        entry.doomed = True
        self.close_if_free(entry)

    def close_if_free(self, entry: SocketEntry) -> None:
        if entry.lock.acquire(blocking=False):
            try:
                if not entry.closed:
                    self.close_socket(entry)
            finally:
                entry.lock.release()

    def close_socket(self, entry: SocketEntry) -> None:
        """Close ``entry``'s socket and forget it. Called with ``entry.lock`` held."""
        entry.closed = True
        close_monitored(entry.socket, self._monitor is not None)
        if self._monitor is not None:
            self._monitor.unwatch(entry)  # its monitor was stopped: the reader may close
        with self.lock:
            # Identity check: a fresh entry for the same endpoint is not ours to remove.
            if self.entries.get(entry.endpoint) is entry:
                del self.entries[entry.endpoint]
            if entry.down is not None and entry.reported_dead and not self.closed:
                self._remembered.remember(entry.endpoint, entry.down)
            self.retired_sends += entry.sends
            self.evictions += 1
            self.open_sockets -= 1

    def _connect(self, url: str, ipv6: bool) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        """A connected PUSH socket (and its monitor socket); SendFailed with both closed."""
        options = self._options
        socket: zmq.Socket[bytes] | None = None
        monitor_socket: zmq.Socket[bytes] | None = None
        try:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, options.send_timeout_ms)
            if ipv6:
                socket.setsockopt(zmq.IPV6, 1)  # before connect, or libzmq cannot parse it
            options.policy.apply(socket)
            if self._monitor is not None:
                socket.setsockopt(zmq.RECONNECT_IVL, options.reconnect_ivl_ms)
                socket.setsockopt(zmq.RECONNECT_IVL_MAX, options.reconnect_ivl_max_ms)
                socket.setsockopt(zmq.CONNECT_TIMEOUT, options.connect_timeout_ms)
                for option, value in options.heartbeat:
                    socket.setsockopt(option, value)
                # Before connect(), so that not even the first attempt's events are missed.
                monitor_socket = self._monitor_socket(socket)
            socket.connect(url)
        except zmq.ZMQError as exc:
            if socket is not None:  # its monitor may be started even if its reader is not
                close_monitored(socket, self._monitor is not None)
            if monitor_socket is not None:
                monitor_socket.close(linger=0)
            self._failures.add()
            raise SendFailed(
                f"cannot connect to {url} ({exc}): the rank's address is unusable; {NEXT_STEP}",
                endpoint=url,
            ) from exc
        return socket, monitor_socket

    def _monitor_socket(self, socket: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        """Start ``socket``'s monitor and connect the PAIR that reads it (before connect(),
        so that not even the first attempt's events are missed).

        libzmq sends monitor events with a *blocking* send from its I/O and reaper threads, so
        the reading side must never be full or gone: its receive HWM is unlimited (a stalled
        reader costs memory, never a stalled I/O thread), and it is closed only after
        :func:`~statemachine.decode.ranks.sockets.close_monitored` stopped the monitor (ZMQ-16).
        """
        # A unique inproc name: pyzmq's default is derived from the socket's fd, which is
        # reused after a close while the old name may still be bound.
        address = f"inproc://statemachine-monitor-{id(self):x}-{next(self.ticks)}"
        socket.monitor(address, EVENTS)
        reader = self._context.socket(zmq.PAIR)
        try:
            reader.setsockopt(zmq.LINGER, 0)
            reader.setsockopt(zmq.RCVHWM, 0)
            reader.connect(address)
        except zmq.ZMQError:
            reader.close(linger=0)
            raise
        return reader

    def _lru_victims_locked(self) -> list[SocketEntry]:
        """Remove (under ``lock``) the least recently used unretained entry, if any."""
        best: SocketEntry | None = None
        for endpoint, entry in self.entries.items():
            if endpoint not in self.refs and (best is None or entry.last_used < best.last_used):
                best = entry
        if best is None:
            return []  # every socket serves a live generation: those are not evicted
        del self.entries[best.endpoint]
        self.lru_evictions += 1
        return [best]
