"""ZMQ PUSH transport from a decode process to prefill ranks.

One cached ``PUSH`` socket per endpoint ``(ip, port)``, each with its own lock (ZMQ sockets are
not thread-safe); a small lock guards only the creation and eviction of cache entries, never a
send. Options (ZMQ-1..ZMQ-4 in ``spec/zmq.md``):

* ``IMMEDIATE=1`` (default ``mode="immediate"``): messages are only queued on *completed*
  connections, so a send to a dead prefill blocks for ``SNDTIMEO`` and fails, on the *first*
  send, instead of silently queueing ~1000 frames that a new process on a reused port would
  later receive. ``mode="queueing"`` keeps SGLang's behaviour (no IMMEDIATE, ``SNDHWM=1000``)
  for comparison.
* ``SNDTIMEO`` bounded (default 1000 ms): every send returns or fails within about that time.
* ``LINGER=0``: closing a socket (eviction, shutdown) drops what it still holds at once.

Connecting is asynchronous, so with ``IMMEDIATE=1`` a send right after ``connect()`` finds no
completed connection yet: a non-blocking send fails 200 times out of 200 on loopback. A
*blocking* send with ``SNDTIMEO`` waits for the connection instead (libzmq blocks until a pipe
is attached, i.e. until the handshake completed, or the timeout): 200 of 200 succeeded, median
0.19 ms, worst 3.6 ms. So the transport always sends blocking with the timeout; the wait for a
new connection costs nothing extra on a warm socket, a live peer is never reported dead unless
it cannot complete a loopback handshake within ``SNDTIMEO``, and a dead one fails after
``SNDTIMEO`` (ZMQ-5).

On any ``zmq.ZMQError`` (``zmq.Again`` included) the endpoint's socket is closed and evicted
and :class:`~statemachine.errors.SendFailed` reaches the caller (ZMQ-6), which invalidates the
generation it used. Threads that were queued on the same socket's lock when it failed get
``SendFailed`` at once rather than each waiting another ``SNDTIMEO`` on a fresh socket to the
same dead peer (ZMQ-7).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import zmq

from statemachine.backend import KVBackend, MetadataRequest
from statemachine.errors import SendFailed
from statemachine.pool import Generation

Endpoint = tuple[str, int]
Mode = Literal["immediate", "queueing"]
#: ``(endpoint, alive, reason)``: what the transport learned about an endpoint.
EndpointListener = Callable[[Endpoint, bool, str], None]

#: libzmq's default send high-water mark, set explicitly so "queueing" means what SGLang has.
QUEUEING_SNDHWM = 1000
_EVICTED_RETRIES = 3


def endpoint_url(endpoint: Endpoint) -> str:
    """``tcp://ip:port`` (IPv6 literals in brackets)."""
    ip, port = endpoint
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Counters since the transport was created."""

    sends: int  # messages handed to ZMQ successfully
    failures: int  # sends that raised SendFailed (each evicts or finds an evicted socket)
    sockets_open: int
    sockets_created: int
    evictions: int  # sockets closed: a send failed, evict(), or close()


class _Entry:
    """One cached socket. ``sends``/``failures`` change only under ``lock``."""

    __slots__ = ("failed", "failures", "lock", "sends", "socket", "url")

    def __init__(self, socket: zmq.Socket[bytes], url: str) -> None:
        self.socket = socket
        self.url = url
        self.lock = threading.Lock()
        # Set (under ``lock``) when the socket was closed; ``failed`` says it was a send failure.
        self.failed: bool | None = None
        self.sends = 0
        self.failures = 0


class ZmqTransport:
    """Cached PUSH sockets per endpoint; see the module docstring."""

    def __init__(
        self,
        *,
        mode: Mode = "immediate",
        send_timeout_ms: int = 1000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if mode not in ("immediate", "queueing"):
            raise ValueError(f"mode must be 'immediate' or 'queueing', not {mode!r}")
        if (
            not isinstance(send_timeout_ms, int)
            or isinstance(send_timeout_ms, bool)
            or send_timeout_ms <= 0
        ):
            raise ValueError(f"send_timeout_ms must be a positive int, not {send_timeout_ms!r}")
        self.mode: Mode = mode
        self.send_timeout_ms = send_timeout_ms
        self._own_context = context is None
        self._context: zmq.Context[zmq.Socket[bytes]] = (
            zmq.Context() if context is None else context
        )
        self._lock = threading.Lock()  # guards _entries and the retired counters only
        self._entries: dict[Endpoint, _Entry] = {}
        self._closed = False
        # Counters of entries already evicted (folded in at eviction, under _lock).
        self._retired_sends = 0
        self._retired_failures = 0
        self._created = 0
        self._evictions = 0
        self._init_liveness()

    # --- sending ------------------------------------------------------------------------------

    def send(self, endpoint: Endpoint, frames: Sequence[bytes]) -> None:
        """Send one multipart message; raise :class:`SendFailed` if it could not be queued."""
        if not frames:
            raise ValueError("a message needs at least one frame")
        # A socket evicted on purpose (evict()) while we waited for it is replaced; bounded so
        # that a caller evicting in a tight loop cannot keep a sender spinning.
        for _ in range(_EVICTED_RETRIES):
            entry = self._entries.get(endpoint)  # dict.get is atomic: no lock on the hit path
            if entry is None:
                entry = self._open(endpoint)
            error: zmq.ZMQError | None = None
            with entry.lock:
                if entry.failed is None:
                    try:
                        entry.socket.send_multipart(frames)
                    except zmq.ZMQError as exc:
                        entry.failures += 1
                        self._close_entry(endpoint, entry, failed=True)
                        error = exc
                    else:
                        entry.sends += 1
                failed = entry.failed
            # Listeners are told outside the socket's lock (they may call back in).
            if error is not None:
                reason = f"send to {entry.url} failed: {error}"
                self._report(endpoint, False, reason)
                raise SendFailed(reason, endpoint=entry.url) from error
            if failed is None:
                if self._down and endpoint in self._down:
                    self._report(endpoint, True, f"send to {entry.url} succeeded")
                return
            if failed:
                # Its socket failed while this thread waited for the lock: the peer was just
                # found dead, so fail now instead of waiting SNDTIMEO again (ZMQ-7).
                with self._lock:
                    self._retired_failures += 1
                raise SendFailed(f"send to {entry.url} failed: peer found dead", endpoint=entry.url)
        with self._lock:
            self._retired_failures += 1
        raise SendFailed("socket evicted repeatedly during send", endpoint=endpoint_url(endpoint))

    def register(self, generation: Generation, backend: KVBackend) -> None:
        """Send the backend's KV args to every rank of ``generation``, dummy ranks included
        (the backend's frames carry the dummy flag, as SGLang does).

        Stops at the first failure (its :class:`SendFailed` propagates): the caller invalidates
        the whole generation anyway.
        """
        for rank in generation.ranks:
            self.send((rank.ip, rank.port), backend.register_frames(rank))

    def send_metadata(
        self, generation: Generation, backend: KVBackend, request: MetadataRequest
    ) -> None:
        """Send one metadata message per rank of ``generation``, dummy ranks included."""
        for rank in generation.ranks:
            self.send((rank.ip, rank.port), backend.metadata_frames(rank, request))

    # --- cache management ---------------------------------------------------------------------

    def evict(self, endpoint: Endpoint) -> None:
        """Close and forget the socket for ``endpoint`` (no-op if there is none)."""
        entry = self._entries.get(endpoint)
        if entry is not None:
            with entry.lock:
                if entry.failed is None:
                    self._close_entry(endpoint, entry, failed=False)

    def close(self) -> None:
        """Close every socket (LINGER=0: nothing is flushed) and an owned context."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._entries.items())
        for endpoint, entry in entries:
            with entry.lock:
                if entry.failed is None:
                    self._close_entry(endpoint, entry, failed=False)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> ZmqTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> TransportStats:
        with self._lock:
            live = list(self._entries.values())
            # Live counters are read without their locks: each is a single int load.
            return TransportStats(
                sends=self._retired_sends + sum(e.sends for e in live),
                failures=self._retired_failures + sum(e.failures for e in live),
                sockets_open=len(live),
                sockets_created=self._created,
                evictions=self._evictions,
            )

    # --- endpoint liveness and socket refcounts ------------------------------------------------
    #
    # MANAGER-BRANCH MINIMAL VERSION. The transport branch builds the full one (ZMQ socket
    # monitor, circuit breaker, bounded cache); at merge its version replaces this block. Here:
    # listeners hear of a failed send (alive=False) and of the next successful send to the same
    # endpoint (alive=True), on the sending thread; ``is_down`` is "the last send failed";
    # ``retain``/``release`` count the live generations using an endpoint and close its socket
    # when the count reaches zero.

    def _init_liveness(self) -> None:
        self._listeners: list[EndpointListener] = []
        self._down: set[Endpoint] = set()
        self._refs: dict[Endpoint, int] = {}

    def subscribe(self, listener: EndpointListener) -> None:
        """Call ``listener(endpoint, alive, reason)`` when an endpoint is found dead or alive."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

    def is_down(self, endpoint: Endpoint) -> bool:
        """True while the last send to ``endpoint`` failed."""
        return endpoint in self._down

    def retain(self, endpoints: Iterable[Endpoint]) -> None:
        """A live generation uses ``endpoints``: keep their sockets."""
        with self._lock:
            for endpoint in endpoints:
                self._refs[endpoint] = self._refs.get(endpoint, 0) + 1

    def release(self, endpoints: Iterable[Endpoint]) -> None:
        """A generation using ``endpoints`` ended: close each socket no live generation uses."""
        idle: list[Endpoint] = []
        with self._lock:
            for endpoint in endpoints:
                count = self._refs.get(endpoint, 0) - 1
                if count > 0:
                    self._refs[endpoint] = count
                else:
                    self._refs.pop(endpoint, None)
                    self._down.discard(endpoint)
                    idle.append(endpoint)
        for endpoint in idle:
            self.evict(endpoint)

    def _report(self, endpoint: Endpoint, alive: bool, reason: str) -> None:
        if alive:
            self._down.discard(endpoint)
        else:
            self._down.add(endpoint)
        for listener in self._listeners:
            listener(endpoint, alive, reason)

    # --- internals ----------------------------------------------------------------------------

    def _open(self, endpoint: Endpoint) -> _Entry:
        _check_endpoint(endpoint)
        with self._lock:
            if self._closed:
                raise SendFailed("transport is closed", endpoint=endpoint_url(endpoint))
            entry = self._entries.get(endpoint)
            if entry is not None:  # another thread created it first
                return entry
            # Creating and connecting a socket does no network I/O (connect is asynchronous),
            # so doing it under the small lock keeps exactly one socket per endpoint.
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, self.send_timeout_ms)
            if self.mode == "immediate":
                socket.setsockopt(zmq.IMMEDIATE, 1)
            else:
                socket.setsockopt(zmq.SNDHWM, QUEUEING_SNDHWM)
            url = endpoint_url(endpoint)
            socket.connect(url)
            entry = _Entry(socket, url)
            self._entries[endpoint] = entry
            self._created += 1
            return entry

    def _close_entry(self, endpoint: Endpoint, entry: _Entry, *, failed: bool) -> None:
        """Close ``entry``'s socket and evict it. Called with ``entry.lock`` held."""
        entry.failed = failed
        entry.socket.close(linger=0)
        with self._lock:
            # Identity check: a fresh entry for the same endpoint is not ours to remove.
            if self._entries.get(endpoint) is entry:
                del self._entries[endpoint]
            self._retired_sends += entry.sends
            self._retired_failures += entry.failures
            self._evictions += 1


def _check_endpoint(endpoint: object) -> None:
    if (
        not isinstance(endpoint, tuple)
        or len(endpoint) != 2
        or not isinstance(endpoint[0], str)
        or not endpoint[0]
        or not isinstance(endpoint[1], int)
        or isinstance(endpoint[1], bool)
        or not 1 <= endpoint[1] <= 65535
    ):
        raise ValueError(f"endpoint must be (ip: str, port: 1..65535), not {endpoint!r}")
