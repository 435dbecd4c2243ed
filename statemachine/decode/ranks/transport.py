"""ZMQ PUSH transport from a decode process to prefill ranks (``spec/zmq.md``).

One cached ``PUSH`` socket per endpoint ``(ip, port)``, each with its own lock (ZMQ sockets are
not thread-safe); a small lock guards only the creation and retirement of cache entries, never
a send (ZMQ-1). Options: ``IMMEDIATE=1`` (ZMQ-2), ``LINGER=0`` (ZMQ-3), sends bounded by
``SNDTIMEO`` (ZMQ-4).

Every socket is monitored:

* **Liveness (ZMQ-16).** Every socket has a ZMQ monitor socket; one thread per transport
  (:class:`~statemachine.decode.ranks.monitor.SocketMonitor`) reads them all and judges each
  endpoint dead or alive by the rule of :mod:`statemachine.decode.ranks.liveness`. Listeners
  registered with :meth:`ZmqTransport.subscribe` hear ``(endpoint, alive, reason)`` on that
  thread.
* **Circuit breaker (ZMQ-19).** An endpoint judged dead — by its monitor or by a send that found
  no live connection within ``SNDTIMEO`` — fails every send in microseconds until a handshake
  with it succeeds again. A send never waits on a socket already judged dead: it waits for a
  connection in short poll slices and gives up as soon as the monitor's verdict arrives, so
  only a send that races the verdict waits, and never longer than ``SNDTIMEO``.
* **Silence (ZMQ-25).** With ``heartbeat_ivl_ms`` (and ``heartbeat_timeout_ms``), libzmq
  PINGs every connection and drops one that stays silent, which the monitor then judges as
  any disconnect: a stopped or cut-off rank is found within ivl + timeout + ``dead_grace_ms``
  without a message of ours. ``connect_timeout_ms`` and ``reconnect_ivl_max_ms`` bound how
  long a reconnect attempt into a cut lasts and how long the next waits, so the first
  handshake after the path returns follows within their sum.
  :mod:`statemachine.decode.liveness_bound` derives all of them from one bound.
* **Exit or silence (ZMQ-26).** A dead verdict is an *exit* only when the rank's port refuses
  a connect (:mod:`statemachine.decode.ranks.exit_probe` reads the errno the monitor does not
  give); listeners registered with :meth:`ZmqTransport.subscribe_exits` hear it, before the
  verdict itself. Every other dead verdict (a heartbeat expiry, no reconnect within the grace,
  a send that found no connection) is silence: the process may still run and write.
* **Resources follow generations (ZMQ-20).** :meth:`ZmqTransport.retain` / :meth:`release`
  count the live generations that use an endpoint; at zero its socket and monitor are closed.
  A dead endpoint nobody retains is closed at once (no reconnect attempts while idle); its
  verdict is remembered for ``down_hold_ms`` so sends to it still fail in microseconds. Sockets
  nobody retains are an LRU bounded by ``max_sockets``.

The comparison baselines (SGLang's queueing sockets, and the previous transport without a
monitor) are subclasses in :mod:`statemachine.demo.baselines`, beside the demo and benchmarks
that compare against them: they override :attr:`ZmqTransport.monitored` and
:meth:`ZmqTransport._queue_option`. Without the monitor a send blocks up to ``SNDTIMEO`` and a
failed one closes and evicts its socket (ZMQ-6/ZMQ-7). Every ``zmq.ZMQError`` on a connect
or a send becomes :class:`~statemachine.errors.SendFailed`, with the socket closed (ZMQ-18).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, NoReturn

import zmq

from statemachine.decode.ranks.endpoints import (
    check_endpoint_shape,
    endpoint_address,
    generation_endpoints,
)
from statemachine.decode.ranks.exit_probe import connect_refused
from statemachine.decode.ranks.liveness import ATTEMPT_FAILED, EVENTS, Liveness
from statemachine.decode.ranks.monitor import SocketMonitor
from statemachine.decode.tally import Tally
from statemachine.errors import InvalidArgument, SendFailed
from statemachine.wire.endpoint import Endpoint, endpoint_url

__all__ = [
    "EXIT_PROVEN",
    "Endpoint",
    "EndpointListener",
    "ExitListener",
    "TransportStats",
    "ZmqTransport",
    "endpoint_url",
    "generation_endpoints",
]

#: ``(endpoint, alive, reason)``, called on the transport's monitor thread.
EndpointListener = Callable[[Endpoint, bool, str], None]
#: ``(endpoint, reason)``: the rank's process at ``endpoint`` is proven exited (ZMQ-26).
ExitListener = Callable[[Endpoint, str], None]
#: Ends the reason of a dead verdict proven to be an exit (what ``subscribe`` listeners hear).
EXIT_PROVEN = "the port refuses connections: the process exited"

#: What SGLang sets on its context; each monitored endpoint uses three ZMQ sockets.
CONTEXT_MAX_SOCKETS = 16384
_EVICTED_RETRIES = 3
_RETRIES = tuple(range(_EVICTED_RETRIES))  # a tuple iterates cheaper than a new range
# A message goes to libzmq one frame at a time with plain int flags, through the backend's
# ``Socket.send``. pyzmq's ``send_multipart`` does the same libzmq calls but computes
# ``zmq.SNDMORE | flags`` per frame as ``enum.Flag`` arithmetic and goes through the Python-level
# ``Socket.send`` wrapper: 10 µs for a 10-frame message here, against 2 µs this way
# (``benchmarks/bench_vs_sglang.py``, docs/performance.md).
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
# Poll slices while a send waits for a connection: short at first (a fresh loopback connection
# takes ~0.2 ms), then at most this long between looks at the monitor's verdict.
_FIRST_SLICE_MS = 1
_MAX_SLICE_MS = 8

_log = logging.getLogger(__name__)

# What every SendFailed tells the caller to do. Not "invalidate and refetch": a receiver has
# already failed its request and dropped the generation by the time the caller sees this, and
# the ranks come from the HTTP bootstrap server or from etcd, which the transport cannot tell.
NEXT_STEP = (
    "the request that sent it failed and its cached ranks of this prefill were dropped: retry "
    "the request, which refetches the prefill's current ranks (from its bootstrap server, or from "
    "etcd when the manager watches etcd); if every retry fails the same way, the prefill rank "
    "is not running"
)


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Counters since the transport was created (``sockets_open``, ``endpoints_down``,
    ``retained``: now)."""

    sends: int  # messages handed to ZMQ successfully
    failures: int  # sends that raised SendFailed, for whatever reason
    sockets_open: int
    sockets_created: int
    evictions: int  # sockets closed: failure (unmonitored), release, verdict, LRU, close()
    circuit_failures: int = 0  # failures in microseconds: the endpoint was already down
    dead_verdicts: int = 0  # endpoints judged dead (monitor or failed send)
    reconnects: int = 0  # endpoints judged dead that came back (alive=True reported)
    endpoints_down: int = 0  # open sockets judged dead + remembered verdicts still held
    retained: int = 0  # endpoints with a positive retain count
    lru_evictions: int = 0  # unretained sockets closed to stay within max_sockets
    listener_errors: int = 0  # exceptions raised by subscribed listeners (contained)
    monitor_events: int = 0  # ZMQ monitor events read
    exits: int = 0  # dead verdicts proven to be a process exit (a refused connect, ZMQ-26)


class _Tombstone(NamedTuple):
    """A dead endpoint whose socket was closed: its verdict, held until ``until``."""

    message: str
    until: float


class _Entry:
    """One cached socket; ``sends``/``last_used`` change under ``lock``.

    ``down`` is the ``SendFailed`` message while the endpoint is judged dead (a single
    attribute store, read without the lock by the circuit breaker). ``doomed`` marks an entry
    already removed from the cache whose socket the next holder of ``lock`` must close.
    """

    __slots__ = (
        "closed",
        "doomed",
        "down",
        "endpoint",
        "exited",
        "failed",
        "last_used",
        "lock",
        "reported_dead",
        "send_frame",
        "sends",
        "socket",
        "url",
    )

    def __init__(self, endpoint: Endpoint, socket: zmq.Socket[bytes], url: str) -> None:
        self.endpoint = endpoint
        self.socket = socket
        #: ``send_frame(socket, frame, flags)``: one frame to libzmq (see :func:`_frame_sender`)
        self.send_frame = _frame_sender(socket)
        self.url = url
        self.lock = threading.Lock()
        self.closed = False
        self.failed = False  # closed because a send failed (unmonitored: ZMQ-7)
        self.doomed = False
        self.down: str | None = None
        self.reported_dead = False
        self.exited = False  # the dead verdict was proven an exit (ZMQ-26)
        self.sends = 0
        self.last_used = 0


class ZmqTransport:
    """Cached PUSH sockets per endpoint with liveness and a circuit breaker; see the module."""

    #: Each socket has a ZMQ monitor (liveness, ZMQ-16) and a circuit breaker (ZMQ-19). False
    #: only in the comparison baselines (:mod:`statemachine.demo.baselines`): a blocking send,
    #: evicted on failure (ZMQ-6, ZMQ-7), sockets cached until a send fails.
    monitored: ClassVar[bool] = True

    def __init__(
        self,
        *,
        send_timeout_ms: int = 1000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        max_sockets: int = 1024,
        reconnect_ivl_ms: int = 5,
        reconnect_ivl_max_ms: int = 1000,
        dead_grace_ms: int = 100,
        down_hold_ms: int = 1000,
        connect_timeout_ms: int | None = None,
        heartbeat_ivl_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        heartbeat_ttl_ms: int | None = None,
    ) -> None:
        for name, value in (
            ("send_timeout_ms", send_timeout_ms),
            ("max_sockets", max_sockets),
            ("reconnect_ivl_ms", reconnect_ivl_ms),
            ("reconnect_ivl_max_ms", reconnect_ivl_max_ms),
            ("dead_grace_ms", dead_grace_ms),
            ("down_hold_ms", down_hold_ms),
            *(
                (name, value)
                for name, value in (
                    ("connect_timeout_ms", connect_timeout_ms),
                    ("heartbeat_ivl_ms", heartbeat_ivl_ms),
                    ("heartbeat_timeout_ms", heartbeat_timeout_ms),
                    ("heartbeat_ttl_ms", heartbeat_ttl_ms),
                )
                if value is not None  # None: libzmq's default (no heartbeats), SNDTIMEO
            ),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(
                    f"{name} must be a positive int (milliseconds or a count), not {value!r}"
                )
        self.send_timeout_ms = send_timeout_ms
        self.max_sockets = max_sockets
        self._timeout_s = send_timeout_ms / 1000
        self._reconnect_ivl_ms = reconnect_ivl_ms
        self._reconnect_ivl_max_ms = max(reconnect_ivl_max_ms, reconnect_ivl_ms)
        self._grace_s = dead_grace_ms / 1000
        self._hold_s = down_hold_ms / 1000
        self._connect_timeout_ms = (
            send_timeout_ms if connect_timeout_ms is None else connect_timeout_ms
        )
        # ZMTP heartbeats (ZMQ-25): None leaves libzmq's default, no heartbeats.
        self._heartbeat = _heartbeat_options(
            heartbeat_ivl_ms, heartbeat_timeout_ms, heartbeat_ttl_ms
        )
        self._own_context = context is None
        if context is None:
            context = zmq.Context()
            context.set(zmq.MAX_SOCKETS, CONTEXT_MAX_SOCKETS)
        self._context: zmq.Context[zmq.Socket[bytes]] = context
        self._lock = threading.Lock()  # guards the dicts and counters below, never a send
        self._entries: dict[Endpoint, _Entry] = {}
        self._refs: dict[Endpoint, int] = {}
        self._down: dict[Endpoint, _Tombstone] = {}
        self._listeners: tuple[EndpointListener, ...] = ()
        self._exit_listeners: tuple[ExitListener, ...] = ()
        self._exits = 0
        self._closed = False
        self._open_sockets = 0
        self._retired_sends = 0
        self._created = 0
        self._evictions = 0
        self._lru_evictions = 0
        self._dead_verdicts = 0
        self._reconnects = 0
        self._listener_errors = 0
        # Counted without the lock (a Tally's add is one atomic C call).
        self._failures = Tally()
        self._circuit_failures = Tally()
        self._ticks = itertools.count(1)
        self._monitor: SocketMonitor[_Entry] | None = (
            SocketMonitor(self._on_verdict, name="zmq-endpoint-monitor") if self.monitored else None
        )

    # --- liveness interface (what the manager subscribes to, spec/zmq.md ZMQ-16, ZMQ-19) ------

    def subscribe(self, listener: EndpointListener) -> None:
        """Call ``listener(endpoint, alive, reason)`` on the monitor thread at each change.

        ``alive=False`` when an endpoint is judged dead (ZMQ-16), ``alive=True`` when an
        endpoint reported dead completes a handshake again. An exception in a listener is
        logged and counted (``listener_errors``); the other listeners still run.
        """
        if not callable(listener):
            raise TypeError("listener must be callable")
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def subscribe_exits(self, listener: ExitListener) -> None:
        """Call ``listener(endpoint, reason)`` on the monitor thread when a dead verdict is
        proven to be the rank's process exiting (its port refused a connect, ZMQ-26), before
        the ``subscribe`` listeners hear the verdict. Contained like those."""
        if not callable(listener):
            raise TypeError("listener must be callable")
        with self._lock:
            self._exit_listeners = (*self._exit_listeners, listener)

    def is_down(self, endpoint: Endpoint) -> bool:
        """True while sends to ``endpoint`` fail in microseconds (the circuit is open)."""
        entry = self._entries.get(endpoint)
        if entry is not None:
            return entry.down is not None
        tomb = self._down.get(endpoint)
        return tomb is not None and time.monotonic() < tomb.until

    def retain(self, endpoints: Iterable[Endpoint]) -> None:
        """A live generation uses ``endpoints``: keep their sockets (ZMQ-20)."""
        endpoints = list(endpoints)
        for endpoint in endpoints:
            check_endpoint_shape(endpoint)
        with self._lock:
            for endpoint in endpoints:
                self._refs[endpoint] = self._refs.get(endpoint, 0) + 1

    def release(self, endpoints: Iterable[Endpoint]) -> None:
        """A generation that used ``endpoints`` ended: close the sockets no one retains.

        Never blocks on a send in progress: a socket in use is closed by its current user as
        it finishes (within one poll slice if it is waiting). Releasing more than was retained
        is ignored. Without the monitor (the baselines, :attr:`monitored` False) the counts are
        kept but sockets live as SGLang's do: cached until a send fails (or for ever).
        """
        retiring = []
        with self._lock:
            for endpoint in endpoints:
                count = self._refs.get(endpoint, 0)
                if count > 1:
                    self._refs[endpoint] = count - 1
                elif count == 1:
                    del self._refs[endpoint]
                    if self._monitor is None:
                        continue
                    entry = self._entries.pop(endpoint, None)
                    if entry is not None:
                        retiring.append(entry)
        for entry in retiring:
            self._retire(entry)

    # --- sending ------------------------------------------------------------------------------

    def send(self, endpoint: Endpoint, frames: Sequence[bytes]) -> None:
        """Send one multipart message; raise :class:`SendFailed` if it could not be queued.

        Every frame is checked before the first goes out (``TypeError`` for one that is not
        bytes-like, and nothing sent): frames go to libzmq one at a time, and a message left
        half sent could only be dropped by closing its socket.
        """
        if not frames:
            raise ValueError("a message needs at least one frame")
        for frame in frames:
            if frame.__class__ is not bytes:
                _check_frames(frames)
                break
        # An entry retired while we waited for its lock is replaced; bounded so that a caller
        # evicting in a tight loop cannot keep a sender spinning.
        for _ in _RETRIES:
            entry = self._entries.get(endpoint)  # dict.get is atomic: no lock on the hit path
            if entry is None:
                entry = self._open(endpoint)
            down = entry.down
            if down is not None:  # the circuit is open (ZMQ-19)
                self._circuit_failures.add()
                self._failures.add()
                raise SendFailed(down, endpoint=entry.url)
            try:
                with entry.lock:
                    if entry.closed or entry.doomed:
                        if entry.failed:
                            # Its socket failed while we waited for the lock (ZMQ-7).
                            self._failures.add()
                            raise SendFailed(
                                f"send to {entry.url} failed: the peer was found dead; {NEXT_STEP}",
                                endpoint=entry.url,
                            )
                        continue
                    if self._monitor is None:
                        self._send_blocking(entry, frames)
                    else:
                        # Monitored (ZMQ-19): non-blocking first, which is all a warm socket
                        # needs; without a connection, wait for one in poll slices.
                        try:
                            sent = _push(entry.send_frame, entry.socket, frames)
                        except zmq.ZMQError as exc:
                            self._send_error(entry, exc)
                        if not sent:
                            self._send_waiting(entry, frames)
                    entry.sends += 1
                    entry.last_used = next(self._ticks)
                    return
            finally:
                if entry.doomed and not entry.closed:
                    self._close_if_free(entry)
        self._failures.add()
        raise SendFailed(
            "socket evicted repeatedly during send; retry", endpoint=endpoint_url(endpoint)
        )

    def _send_blocking(self, entry: _Entry, frames: Sequence[bytes]) -> None:
        """Unmonitored (the baselines): a blocking send; any failure closes and evicts (ZMQ-6).

        pyzmq's ``send_multipart``, as SGLang sends: this path is the baselines' (SGLang's
        queueing transport, and the previous one without a monitor), so it keeps their cost."""
        try:
            entry.socket.send_multipart(frames)
        except zmq.ZMQError as exc:
            entry.failed = True
            self._close_socket(entry)
            self._failures.add()
            raise SendFailed(
                f"no live peer at {entry.url} within SNDTIMEO={self.send_timeout_ms} ms "
                f"({exc}); {NEXT_STEP}",
                endpoint=entry.url,
            ) from exc

    def _send_waiting(self, entry: _Entry, frames: Sequence[bytes]) -> None:
        """Monitored send that found no completed connection (a new socket, or the peer just
        went): wait for one in poll slices until SNDTIMEO or the monitor's verdict (ZMQ-19)."""
        socket = entry.socket
        deadline = time.monotonic() + self._timeout_s
        slice_ms = _FIRST_SLICE_MS
        while True:
            down = entry.down
            if down is not None:  # the monitor judged it dead while we waited
                self._circuit_failures.add()
                self._failures.add()
                raise SendFailed(down, endpoint=entry.url)
            if entry.doomed:
                self._failures.add()
                raise SendFailed(
                    f"the socket to {entry.url} was closed while this send waited (no live "
                    f"request uses its ranks any more); {NEXT_STEP}",
                    endpoint=entry.url,
                )
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                self._send_timed_out(entry)
            try:
                zmq.zmq_poll([(socket, zmq.POLLOUT)], min(slice_ms, math.ceil(left_ms)))
                if _push(entry.send_frame, socket, frames):
                    return
                slice_ms = min(slice_ms * 2, _MAX_SLICE_MS)
            except zmq.ZMQError as exc:
                self._send_error(entry, exc)

    def _send_timed_out(self, entry: _Entry) -> NoReturn:
        """No connection took the message within SNDTIMEO: open the circuit, tell the monitor."""
        reason = f"no live peer within SNDTIMEO={self.send_timeout_ms} ms"
        message = (
            f"no live peer at {entry.url} within SNDTIMEO={self.send_timeout_ms} ms: {NEXT_STEP}"
        )
        entry.down = message  # provisional: lifted if the monitor says a connection is up
        assert self._monitor is not None
        self._monitor.send_failed(entry, reason)
        self._failures.add()
        raise SendFailed(message, endpoint=entry.url)

    def _send_error(self, entry: _Entry, exc: zmq.ZMQError) -> NoReturn:
        """Any other ZMQError: the socket is unusable; close it (ZMQ-18)."""
        entry.failed = True
        self._close_socket(entry)
        self._failures.add()
        raise SendFailed(
            f"send to {entry.url} failed ({exc}), so its socket was closed; {NEXT_STEP}",
            endpoint=entry.url,
        ) from exc

    # --- cache management ---------------------------------------------------------------------

    def evict(self, endpoint: Endpoint) -> None:
        """Close and forget the socket for ``endpoint`` (no-op if there is none).

        Waits for a send in progress on it (at most ``SNDTIMEO``).
        """
        with self._lock:
            entry = self._entries.pop(endpoint, None)
        if entry is not None:
            entry.doomed = True
            with entry.lock:
                if not entry.closed:
                    self._close_socket(entry)

    def close(self) -> None:
        """Close every socket (LINGER=0: nothing is flushed), the monitor thread, and an owned
        context. Waits at most about ``SNDTIMEO`` for a send in progress; never hangs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            entry.doomed = True  # a monitored send waiting for a connection gives up now
        for entry in entries:
            with entry.lock:
                if not entry.closed:
                    self._close_socket(entry)
        stopped = self._monitor.close() if self._monitor is not None else True
        if self._own_context:
            if stopped:
                self._context.term()
            else:  # the monitor thread is stuck in a listener: do not wait for its sockets
                self._context.destroy(linger=0)

    def __enter__(self) -> ZmqTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> TransportStats:
        now = time.monotonic()
        with self._lock:
            live = list(self._entries.values())
            held = sum(1 for tomb in self._down.values() if now < tomb.until)
            monitor = self._monitor
            # Live counters are read without their locks: each is a single int load.
            return TransportStats(
                sends=self._retired_sends + sum(e.sends for e in live),
                failures=self._failures.value(),
                sockets_open=self._open_sockets,
                sockets_created=self._created,
                evictions=self._evictions,
                circuit_failures=self._circuit_failures.value(),
                dead_verdicts=self._dead_verdicts,
                reconnects=self._reconnects,
                endpoints_down=sum(1 for e in live if e.down is not None) + held,
                retained=len(self._refs),
                lru_evictions=self._lru_evictions,
                listener_errors=self._listener_errors,
                monitor_events=monitor.events if monitor is not None else 0,
                exits=self._exits,
            )

    # --- internals ----------------------------------------------------------------------------

    def _open(self, endpoint: Endpoint) -> _Entry:
        check_endpoint_shape(endpoint)
        tomb = self._down.get(endpoint)
        if tomb is not None and time.monotonic() < tomb.until:
            self._circuit_failures.add()
            self._failures.add()
            raise SendFailed(tomb.message, endpoint=endpoint_url(endpoint))
        try:
            address = endpoint_address(endpoint)  # IP literals only: no resolver, ever
        except ValueError as exc:
            self._failures.add()
            raise SendFailed(str(exc), endpoint=endpoint_url(endpoint)) from None
        victims: list[_Entry] = []
        try:
            with self._lock:
                if self._closed:
                    self._failures.add()
                    raise SendFailed("transport is closed", endpoint=address.url)
                entry = self._entries.get(endpoint)
                if entry is not None:  # another thread created it first
                    return entry
                if len(self._entries) >= self.max_sockets:
                    victims = self._lru_victims_locked()
                # Creating and connecting a socket does no network I/O (connect is
                # asynchronous, and never resolves a name here), so doing it under the small
                # lock keeps exactly one socket per endpoint.
                socket, monitor_socket = self._connect(address.url, address.ipv6)
                entry = _Entry(endpoint, socket, address.url)
                if self._down.pop(endpoint, None) is not None:
                    entry.reported_dead = True  # judged dead before: a handshake reports alive
                self._entries[endpoint] = entry
                self._created += 1
                self._open_sockets += 1
        finally:
            for victim in victims:
                self._retire(victim)
        if monitor_socket is not None:
            assert self._monitor is not None
            self._monitor.watch(entry, monitor_socket, Liveness(self._grace_s))
        return entry

    def _connect(self, url: str, ipv6: bool) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        """A connected PUSH socket (and its monitor socket); SendFailed with both closed."""
        socket: zmq.Socket[bytes] | None = None
        monitor_socket: zmq.Socket[bytes] | None = None
        try:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, self.send_timeout_ms)
            if ipv6:
                socket.setsockopt(zmq.IPV6, 1)  # before connect, or libzmq cannot parse it
            self._queue_option(socket)
            if self._monitor is not None:
                socket.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ivl_ms)
                socket.setsockopt(zmq.RECONNECT_IVL_MAX, self._reconnect_ivl_max_ms)
                socket.setsockopt(zmq.CONNECT_TIMEOUT, self._connect_timeout_ms)
                for option, value in self._heartbeat:
                    socket.setsockopt(option, value)
                # Before connect(), so that not even the first attempt's events are missed.
                monitor_socket = self._monitor_socket(socket)
            socket.connect(url)
        except zmq.ZMQError as exc:
            if socket is not None:  # its monitor may be started even if its reader is not
                _close_monitored(socket, self._monitor is not None)
            if monitor_socket is not None:
                monitor_socket.close(linger=0)
            self._failures.add()
            raise SendFailed(
                f"cannot connect to {url} ({exc}): the rank's address is unusable; {NEXT_STEP}",
                endpoint=url,
            ) from exc
        return socket, monitor_socket

    def _queue_option(self, socket: zmq.Socket[bytes]) -> None:
        """``IMMEDIATE=1`` (ZMQ-2): queue only on a completed connection, so a send to a dead
        rank fails instead of queueing. SGLang's queueing baseline overrides it."""
        socket.setsockopt(zmq.IMMEDIATE, 1)

    def _monitor_socket(self, socket: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        """Start ``socket``'s monitor and connect the PAIR that reads it (before connect(),
        so that not even the first attempt's events are missed).

        libzmq sends monitor events with a *blocking* send from its I/O and reaper threads, so
        the reading side must never be full or gone: its receive HWM is unlimited (a stalled
        reader costs memory, never a stalled I/O thread), and it is closed only after
        :func:`_close_monitored` stopped the monitor (ZMQ-16).
        """
        # A unique inproc name: pyzmq's default is derived from the socket's fd, which is
        # reused after a close while the old name may still be bound.
        address = f"inproc://statemachine-monitor-{id(self):x}-{next(self._ticks)}"
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

    def _lru_victims_locked(self) -> list[_Entry]:
        """Remove (under ``_lock``) the least recently used unretained entry, if any."""
        best: _Entry | None = None
        for endpoint, entry in self._entries.items():
            if endpoint not in self._refs and (best is None or entry.last_used < best.last_used):
                best = entry
        if best is None:
            return []  # every socket serves a live generation: those are not evicted
        del self._entries[best.endpoint]
        self._lru_evictions += 1
        return [best]

    def _retire(self, entry: _Entry) -> None:
        """Close a socket already removed from the cache, without waiting for its lock.

        If a sender holds the lock, ``doomed`` tells it (and every later holder) to close the
        socket on the way out; setting it *before* trying the lock means one of us always does.
        """
        entry.doomed = True
        self._close_if_free(entry)

    def _close_if_free(self, entry: _Entry) -> None:
        if entry.lock.acquire(blocking=False):
            try:
                if not entry.closed:
                    self._close_socket(entry)
            finally:
                entry.lock.release()

    def _close_socket(self, entry: _Entry) -> None:
        """Close ``entry``'s socket and forget it. Called with ``entry.lock`` held."""
        entry.closed = True
        _close_monitored(entry.socket, self._monitor is not None)
        if self._monitor is not None:
            self._monitor.unwatch(entry)  # its monitor was stopped: the reader may close
        with self._lock:
            # Identity check: a fresh entry for the same endpoint is not ours to remove.
            if self._entries.get(entry.endpoint) is entry:
                del self._entries[entry.endpoint]
            if entry.down is not None and entry.reported_dead and not self._closed:
                self._remember_down_locked(entry.endpoint, entry.down)
            self._retired_sends += entry.sends
            self._evictions += 1
            self._open_sockets -= 1

    def _remember_down_locked(self, endpoint: Endpoint, message: str) -> None:
        now = time.monotonic()
        if len(self._down) >= self.max_sockets:  # bounded: expired first, then the oldest
            for key in [k for k, tomb in self._down.items() if tomb.until <= now]:
                del self._down[key]
            while len(self._down) >= self.max_sockets:
                del self._down[next(iter(self._down))]
        self._down[endpoint] = _Tombstone(message, now + self._hold_s)

    def _on_verdict(self, entry: _Entry, alive: bool, reason: str) -> None:
        """Monitor thread: apply a verdict, retire a dead unretained socket, tell listeners."""
        endpoint = entry.endpoint
        if alive:
            entry.down = None
            if not entry.reported_dead:
                return  # not a change anyone was told about (a first connect, a slow peer)
            entry.reported_dead = False
            entry.exited = False
            with self._lock:
                self._reconnects += 1
                self._down.pop(endpoint, None)
        else:
            entry.down = f"peer at {entry.url} is down ({reason}); {NEXT_STEP}"
            exited = not entry.exited and reason in ATTEMPT_FAILED and connect_refused(endpoint)
            if exited:
                entry.exited = True
                self._exited(endpoint, reason)
                reason = f"{reason}; {EXIT_PROVEN}"
            if entry.reported_dead:
                return  # silence judged earlier, now (maybe) an exit: told above if so
            entry.reported_dead = True
            retire = False
            with self._lock:
                self._dead_verdicts += 1
                if endpoint not in self._refs and self._entries.get(endpoint) is entry:
                    # Nobody needs it: close it now rather than reconnecting while idle.
                    del self._entries[endpoint]
                    retire = True
            if retire:
                self._retire(entry)
        for listener in self._listeners:
            try:
                listener(endpoint, alive, reason)
            except Exception:
                with self._lock:
                    self._listener_errors += 1
                _log.exception("endpoint listener raised; other listeners still run")

    def _exited(self, endpoint: Endpoint, reason: str) -> None:
        with self._lock:
            self._exits += 1
        for listener in self._exit_listeners:
            try:
                listener(endpoint, f"{reason}; {EXIT_PROVEN}")
            except Exception:
                with self._lock:
                    self._listener_errors += 1
                _log.exception("exit listener raised; other listeners still run")


def _heartbeat_options(
    ivl_ms: int | None, timeout_ms: int | None, ttl_ms: int | None
) -> tuple[tuple[int, int], ...]:
    """The socket options of ZMTP heartbeats (ZMQ-25); none unless ``ivl_ms`` is given.

    libzmq sends a PING every ``ivl_ms`` on each connection and closes it (the monitor sees
    ``EVENT_DISCONNECTED``) when nothing at all arrived within ``timeout_ms`` of a PING; any
    ZMQ peer answers PINGs inside libzmq, a prefill's ``PULL`` socket included, so a stopped or
    cut-off peer is found without a message of ours. ``ttl_ms`` asks the peer to drop the
    connection once it has heard nothing from us that long (libzmq counts it in tenths of a
    second, at most 6553.5 s).
    """
    if ivl_ms is None:
        if timeout_ms is not None or ttl_ms is not None:
            raise InvalidArgument(
                "heartbeat_timeout_ms and heartbeat_ttl_ms need heartbeat_ivl_ms: give the "
                "interval between PINGs too"
            )
        return ()
    options = [(int(zmq.HEARTBEAT_IVL), ivl_ms)]
    if timeout_ms is not None:
        options.append((int(zmq.HEARTBEAT_TIMEOUT), timeout_ms))
    if ttl_ms is not None:
        options.append((int(zmq.HEARTBEAT_TTL), min(ttl_ms, 6_553_500)))
    return tuple(options)


FrameSender = Callable[[zmq.Socket[bytes], bytes, int], object]


def _frame_sender(socket: zmq.Socket[bytes]) -> FrameSender:
    """The cheapest correct way to hand ``socket`` one frame: the backend's ``Socket.send``
    when the socket's class does not override pyzmq's ``send`` (whose only addition is the
    routing-id and group arguments of draft sockets, which a PUSH socket never takes), else the
    class's own ``send``."""
    cls = type(socket)
    if cls.send is zmq.Socket.send and isinstance(socket, zmq.backend.Socket):
        backend_send: FrameSender = zmq.backend.Socket.send
        return backend_send
    own_send: FrameSender = cls.send
    return own_send


def _push(send: FrameSender, socket: zmq.Socket[bytes], frames: Sequence[bytes]) -> bool:
    """Queue ``frames`` as one message without blocking; False if no connection could take it.

    libzmq decides at the first frame: it raises ``zmq.Again`` then (IMMEDIATE, no completed
    connection, or the queue at its high-water mark), with nothing queued, so the caller may
    wait and try the whole message again. Once the first frame is in, the later ones of the same
    message are not refused for room; any error on them propagates as ``zmq.ZMQError`` (the
    caller closes the socket, which discards the part already queued: libzmq never delivers
    half a message).
    """
    if len(frames) > 1:
        try:
            send(socket, frames[0], _NOBLOCK_MORE)
        except zmq.Again:
            return False
        for frame in frames[1:-1]:
            send(socket, frame, _NOBLOCK_MORE)
        send(socket, frames[-1], _NOBLOCK)
        return True
    try:
        send(socket, frames[0], _NOBLOCK)
    except zmq.Again:
        return False
    return True


def _check_frames(frames: Sequence[bytes]) -> None:
    """``TypeError`` unless every frame is bytes-like (what libzmq can take), before any is sent."""
    for index, frame in enumerate(frames):
        if isinstance(frame, (bytes, zmq.Frame)):
            continue
        try:
            memoryview(frame)
        except TypeError:
            raise TypeError(
                f"frame {index} of the message is a {type(frame).__name__}, not bytes: a "
                "backend's frames must be bytes (nothing was sent)"
            ) from None


def _close_monitored(socket: zmq.Socket[bytes], monitored: bool) -> None:
    """Close a socket, stopping its monitor first, in the calling (owning) thread.

    Otherwise libzmq stops the monitor in the socket's destructor on its reaper thread, with
    a blocking send of ``EVENT_MONITOR_STOPPED``: if the reading PAIR is already closed, that
    send never returns and the reaper never destroys another socket (measured: 3 fds leaked
    per closed socket from then on).
    """
    if monitored:
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
    socket.close(linger=0)
