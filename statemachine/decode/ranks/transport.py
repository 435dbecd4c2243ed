"""ZMQ PUSH transport from a decode process to prefill ranks (``spec/zmq.md``).

:class:`ZmqTransport` moves the bytes a decode sends (:mod:`statemachine.decode.ranks.outbox`
builds them) and reports what it learns about the endpoints. Its parts, one module each: the
socket of one endpoint, its options and how a message goes through it
(:mod:`~statemachine.decode.ranks.sockets`); the cache of those sockets and how long each lives
(:mod:`~statemachine.decode.ranks.socket_cache`, ZMQ-1, ZMQ-20); the verdicts remembered after a
socket closed (:mod:`~statemachine.decode.ranks.breaker`); the verdicts told and to whom
(:mod:`~statemachine.decode.ranks.verdicts`); the exit probe
(:mod:`~statemachine.decode.ranks.exit_probe`). Sends are bounded by ``SNDTIMEO`` (ZMQ-4).

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
* **Exit or silence (ZMQ-26).** A dead verdict is an *exit* only when the rank's port refuses a
  connect (:mod:`statemachine.decode.ranks.exit_probe` reads the errno the monitor does not
  give); listeners registered with :meth:`ZmqTransport.subscribe_exits` hear it, before the
  verdict itself, which carries it as a typed flag (``Verdict.exit_proven``). Every other dead
  verdict (a heartbeat expiry, no reconnect within the grace, a send that found no connection)
  is silence: the process may still run and write.
* **Resources follow generations (ZMQ-20).** :meth:`ZmqTransport.retain` / :meth:`release`
  count the live generations that use an endpoint; at zero its socket and monitor are closed.
  A dead endpoint nobody retains is closed at once (no reconnect attempts while idle); its
  verdict is remembered for ``down_hold_ms`` so sends to it still fail in microseconds.

The comparison baselines (SGLang's queueing sockets, and the previous transport without a
monitor) pass their own :class:`~statemachine.decode.ranks.sockets.SocketPolicy`
(:mod:`statemachine.demo.baselines`, beside the demo and benchmarks that compare against
them). Without the monitor a send blocks up to ``SNDTIMEO`` and a
failed one closes and evicts its socket (ZMQ-6/ZMQ-7). Every ``zmq.ZMQError`` on a connect
or a send becomes :class:`~statemachine.errors.SendFailed`, with the socket closed (ZMQ-18).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import zmq

from statemachine.decode.ranks.breaker import RememberedVerdicts
from statemachine.decode.ranks.endpoints import generation_endpoints
from statemachine.decode.ranks.exit_probe import proves_exit
from statemachine.decode.ranks.monitor import SocketMonitor
from statemachine.decode.ranks.socket_cache import (
    CONTEXT_MAX_SOCKETS,
    NEXT_STEP,
    SocketCache,
    SocketOptions,
)
from statemachine.decode.ranks.sockets import (
    MONITORED,
    SocketEntry,
    SocketPolicy,
    check_frames,
    heartbeat_options,
    push,
)
from statemachine.decode.ranks.verdicts import (
    EXIT_PROVEN,
    EndpointListener,
    ExitListener,
    Listeners,
    Verdict,
)
from statemachine.decode.tally import Tally
from statemachine.errors import InvalidArgument, SendFailed
from statemachine.wire.endpoint import Endpoint, endpoint_url

__all__ = [
    "EXIT_PROVEN",
    "Endpoint",
    "EndpointListener",
    "ExitListener",
    "TransportStats",
    "Verdict",
    "ZmqTransport",
    "endpoint_url",
    "generation_endpoints",
]

_EVICTED_RETRIES = 3
_RETRIES = tuple(range(_EVICTED_RETRIES))  # a tuple iterates cheaper than a new range
# Poll slices while a send waits for a connection: short at first (a fresh loopback connection
# takes ~0.2 ms), then at most this long between looks at the monitor's verdict.
_FIRST_SLICE_MS = 1
_MAX_SLICE_MS = 8


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


class ZmqTransport:
    """Cached PUSH sockets per endpoint with liveness and a circuit breaker; see the module."""

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
        policy: SocketPolicy = MONITORED,
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
        self._hold_s = down_hold_ms / 1000
        self._own_context = context is None
        if context is None:
            context = zmq.Context()
            context.set(zmq.MAX_SOCKETS, CONTEXT_MAX_SOCKETS)
        self._context: zmq.Context[zmq.Socket[bytes]] = context
        self._listeners = Listeners()
        self._remembered = RememberedVerdicts(self._hold_s, max_sockets)
        self._exits = 0
        self._dead_verdicts = 0
        self._reconnects = 0
        # Counted without the lock (a Tally's add is one atomic C call).
        self._failures = Tally()
        self._circuit_failures = Tally()
        self._monitor: SocketMonitor[SocketEntry] | None = (
            SocketMonitor(self._on_verdict, name="zmq-endpoint-monitor")
            if policy.monitored
            else None
        )
        self._cache = SocketCache(
            context=context,
            options=SocketOptions(
                policy=policy,
                send_timeout_ms=send_timeout_ms,
                reconnect_ivl_ms=reconnect_ivl_ms,
                reconnect_ivl_max_ms=max(reconnect_ivl_max_ms, reconnect_ivl_ms),
                connect_timeout_ms=(
                    send_timeout_ms if connect_timeout_ms is None else connect_timeout_ms
                ),
                # ZMTP heartbeats (ZMQ-25): None leaves libzmq's default, no heartbeats.
                heartbeat=heartbeat_options(
                    heartbeat_ivl_ms, heartbeat_timeout_ms, heartbeat_ttl_ms
                ),
                grace_s=dead_grace_ms / 1000,
            ),
            max_sockets=max_sockets,
            monitor=self._monitor,
            remembered=self._remembered,
            failures=self._failures,
            circuit_failures=self._circuit_failures,
        )
        #: the cache's sockets by endpoint: every send's one dict get
        self._entries = self._cache.entries
        self._lock = self._cache.lock  # guards the cache and the counters here, never a send
        self._ticks = self._cache.ticks  # each send's use stamp (the LRU order)

    # --- liveness interface (what the manager subscribes to, spec/zmq.md ZMQ-16, ZMQ-19) ------

    def subscribe(self, listener: EndpointListener) -> None:
        """Call ``listener(endpoint, alive, reason)`` on the monitor thread at each change.

        ``alive=False`` when an endpoint is judged dead (ZMQ-16), ``alive=True`` when an
        endpoint reported dead completes a handshake again. An exception in a listener is
        logged and counted (``listener_errors``); the other listeners still run.
        """
        self._listeners.subscribe(listener)

    def subscribe_verdicts(self, listener: Callable[[Verdict], None]) -> None:
        """As :meth:`subscribe`, with the :class:`Verdict` whole (a dead verdict proven an exit
        says so in ``exit_proven``, ZMQ-26)."""
        self._listeners.subscribe_verdicts(listener)

    def subscribe_exits(self, listener: ExitListener) -> None:
        """Call ``listener(endpoint, reason)`` on the monitor thread when a dead verdict is
        proven to be the rank's process exiting (its port refused a connect, ZMQ-26), before
        the ``subscribe`` listeners hear the verdict. Contained like those."""
        self._listeners.subscribe_exits(listener)

    def is_down(self, endpoint: Endpoint) -> bool:
        """True while sends to ``endpoint`` fail in microseconds (the circuit is open)."""
        entry = self._entries.get(endpoint)
        if entry is not None:
            return entry.down is not None
        return self._remembered.refusal(endpoint) is not None

    def retain(self, endpoints: Iterable[Endpoint]) -> None:
        """A live generation uses ``endpoints``: keep their sockets (ZMQ-20)."""
        self._cache.retain(endpoints)

    def release(self, endpoints: Iterable[Endpoint]) -> None:
        """A generation that used ``endpoints`` ended: close the sockets no one retains (never
        waiting on a send in progress; without the monitor they stay cached, as SGLang's)."""
        self._cache.release(endpoints)

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
                check_frames(frames)
                break
        # An entry retired while we waited for its lock is replaced; bounded so that a caller
        # evicting in a tight loop cannot keep a sender spinning.
        for _ in _RETRIES:
            entry = self._entries.get(endpoint)  # dict.get is atomic: no lock on the hit path
            if entry is None:
                entry = self._cache.open(endpoint)
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
                            sent = push(entry.send_frame, entry.socket, frames)
                        except zmq.ZMQError as exc:
                            self._send_error(entry, exc)
                        if not sent:
                            self._send_waiting(entry, frames)
                    entry.sends += 1
                    entry.last_used = next(self._ticks)
                    return
            finally:
                if entry.doomed and not entry.closed:
                    self._cache.close_if_free(entry)
        self._failures.add()
        raise SendFailed(
            "socket evicted repeatedly during send; retry", endpoint=endpoint_url(endpoint)
        )

    def _send_blocking(self, entry: SocketEntry, frames: Sequence[bytes]) -> None:
        """Unmonitored (the baselines): a blocking send; any failure closes and evicts (ZMQ-6).

        pyzmq's ``send_multipart``, as SGLang sends: this path is the baselines' (SGLang's
        queueing transport, and the previous one without a monitor), so it keeps their cost."""
        try:
            entry.socket.send_multipart(frames)
        except zmq.ZMQError as exc:
            entry.failed = True
            self._cache.close_socket(entry)
            self._failures.add()
            raise SendFailed(
                f"no live peer at {entry.url} within SNDTIMEO={self.send_timeout_ms} ms "
                f"({exc}); {NEXT_STEP}",
                endpoint=entry.url,
            ) from exc

    def _send_waiting(self, entry: SocketEntry, frames: Sequence[bytes]) -> None:
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
                if push(entry.send_frame, socket, frames):
                    return
                slice_ms = min(slice_ms * 2, _MAX_SLICE_MS)
            except zmq.ZMQError as exc:
                self._send_error(entry, exc)

    def _send_timed_out(self, entry: SocketEntry) -> NoReturn:
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

    def _send_error(self, entry: SocketEntry, exc: zmq.ZMQError) -> NoReturn:
        """Any other ZMQError: the socket is unusable; close it (ZMQ-18)."""
        entry.failed = True
        self._cache.close_socket(entry)
        self._failures.add()
        raise SendFailed(
            f"send to {entry.url} failed ({exc}), so its socket was closed; {NEXT_STEP}",
            endpoint=entry.url,
        ) from exc

    # --- the cache and the transport's life --------------------------------------------------

    def evict(self, endpoint: Endpoint) -> None:
        """Close and forget the socket for ``endpoint`` (no-op if there is none).

        Waits for a send in progress on it (at most ``SNDTIMEO``).
        """
        self._cache.evict(endpoint)

    def close(self) -> None:
        """Close every socket (LINGER=0: nothing is flushed), the monitor thread, and an owned
        context. Waits at most about ``SNDTIMEO`` for a send in progress; never hangs."""
        with self._lock:
            if self._cache.closed:
                return
        self._cache.close_all()
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
        cache = self._cache
        with self._lock:
            live = list(cache.entries.values())
            monitor = self._monitor
            # Live counters are read without their locks: each is a single int load.
            return TransportStats(
                sends=cache.retired_sends + sum(e.sends for e in live),
                failures=self._failures.value(),
                sockets_open=cache.open_sockets,
                sockets_created=cache.created,
                evictions=cache.evictions,
                circuit_failures=self._circuit_failures.value(),
                dead_verdicts=self._dead_verdicts,
                reconnects=self._reconnects,
                endpoints_down=sum(1 for e in live if e.down is not None) + self._remembered.held(),
                retained=len(cache.refs),
                lru_evictions=cache.lru_evictions,
                listener_errors=self._listeners.errors,
                monitor_events=monitor.events if monitor is not None else 0,
                exits=self._exits,
            )

    # --- verdicts -----------------------------------------------------------------------------

    def _on_verdict(self, entry: SocketEntry, alive: bool, reason: str) -> None:
        """Monitor thread: apply a verdict, retire a dead unretained socket, tell listeners."""
        endpoint = entry.endpoint
        exited = False
        if alive:
            entry.down = None
            if not entry.reported_dead:
                return  # not a change anyone was told about (a first connect, a slow peer)
            entry.reported_dead = False
            entry.exited = False
            with self._lock:
                self._reconnects += 1
                self._remembered.forget(endpoint)
        else:
            entry.down = f"peer at {entry.url} is down ({reason}); {NEXT_STEP}"
            exited = not entry.exited and proves_exit(reason, endpoint)
            if exited:
                entry.exited = True
                reason = f"{reason}; {EXIT_PROVEN}"
                with self._lock:
                    self._exits += 1
                self._listeners.tell_exit(endpoint, reason)
            if entry.reported_dead:
                return  # silence judged earlier, now (maybe) an exit: told above if so
            entry.reported_dead = True
            with self._lock:
                self._dead_verdicts += 1
                # Nobody needs it: close it now rather than reconnecting while idle.
                retire = self._cache.drop_unretained(entry)
            if retire:
                self._cache.retire(entry)
        self._listeners.tell(Verdict(endpoint, alive, reason, exit_proven=exited))
