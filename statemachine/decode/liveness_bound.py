"""One bound on silence, ``liveness_timeout_s``, and every timeout derived from it (ZMQ-25).

A prefill that stops answering without closing anything — a process stopped, a host cut off
with no reset — is found only by asking and timing out. Each part that asks has its own
timeouts: libzmq's ZMTP heartbeats on the rank sockets, the health probe of the bootstrap
server, the bootstrap client's fetches. :meth:`LivenessBound.from_timeout` derives all of them
from the one number a user sets, so that each part reaches its verdict within that bound:

* **rank sockets** (:class:`~statemachine.decode.ranks.transport.ZmqTransport`): a PING every
  ``bound/4``; a connection that stays silent ``bound/2`` after one is dropped by libzmq, and the
  monitor judges the endpoint dead ``dead_grace_ms`` later unless a handshake came back — at
  most ``3/4 bound + 0.1 s``. Any ZMQ peer answers PINGs inside libzmq (SGLang's prefill and
  the reference prefill alike), so this is no protocol of ours;
* **health probes** (:class:`~statemachine.decode.health.HealthMonitor`): two failed probes in a
  row, ``bound/4`` apart, each bounded by ``bound/4`` (connect, read and the whole exchange):
  at most ``2 × (bound/4 + bound/4) = bound`` after the server last answered. Once an address
  is judged dead it is probed every :data:`RECONNECT_ATTEMPT_MS`, each connect bounded by as
  much, so that its next answer (which lifts the manager's hold-off on it) comes at once;
* **fetches** (:class:`~statemachine.decode.client.BootstrapClient`): a connect gives up after
  ``min(2 s, bound/2)``, a silent read after ``min(5 s, bound)``: a request never waits on one
  silent server longer than the bound (the client drops the connection that timed out, so the
  next fetch starts on a fresh one).

Recovery does not scale with the bound: a reconnect into a cut gives up after
:data:`RECONNECT_ATTEMPT_MS` and the next starts at most :data:`RECONNECT_ATTEMPT_MS` later, and
a dead verdict is held that long before a fresh socket tries again, so the first handshake after
the path or the process returns follows within about ``2 × RECONNECT_ATTEMPT_MS`` (measured:
``benchmarks/bench_liveness.py``). A handshake that is pending when a stopped process continues
completes at once.

TCP keepalive is not set: the heartbeats find a silent ZMQ connection sooner than keepalive
can (its probes start after idle seconds), and every HTTP exchange is already bounded by the
read timeout above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from statemachine.errors import InvalidArgument

__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "RECONNECT_ATTEMPT_MS",
    "ClientOptions",
    "HealthOptions",
    "LivenessBound",
    "TransportOptions",
]

#: The default bound on silence: a few seconds, so that a prefill busy for a moment (a GC
#: pause, a long step) is not declared dead; shorter bounds fail more requests that would have
#: finished (docs/performance.md).
DEFAULT_LIVENESS_TIMEOUT_S = 3.0
#: The smallest bound accepted: below it the transport's fixed 0.1 s grace after a disconnect
#: (ZMQ-16) no longer fits (3/4 bound + 0.1 s), and PINGs and probes would come every few ms.
MIN_LIVENESS_TIMEOUT_S = 0.5
#: How long one reconnect attempt into a silent path lasts, and the longest wait between two:
#: their sum bounds the first success after the path returns (the goal is 0.5 s). On a data
#: centre network a connect takes well under a millisecond; a lost SYN is retried sooner this
#: way than by the kernel's first retransmission (1 s).
RECONNECT_ATTEMPT_MS = 200
_MAX_CONNECT_TIMEOUT_S = 2.0
_MAX_READ_TIMEOUT_S = 5.0


class TransportOptions(TypedDict):
    heartbeat_ivl_ms: int
    heartbeat_timeout_ms: int
    heartbeat_ttl_ms: int
    connect_timeout_ms: int
    reconnect_ivl_max_ms: int
    down_hold_ms: int


class HealthOptions(TypedDict):
    interval_s: float
    failures_to_dead: int
    probe_timeout_s: float
    recheck_s: float


class ClientOptions(TypedDict):
    connect_timeout: float
    read_timeout: float


@dataclass(frozen=True, slots=True)
class LivenessBound:
    """Every timeout of silence detection, derived from ``liveness_timeout_s``; see the module."""

    liveness_timeout_s: float
    #: ZmqTransport: a ZMTP PING every this many ms on each rank connection
    heartbeat_ivl_ms: int
    #: ZmqTransport: a connection silent this long after a PING is dropped
    heartbeat_timeout_ms: int
    #: ZmqTransport: the peer drops our connection after this long without a word from us
    heartbeat_ttl_ms: int
    #: ZmqTransport: one reconnect attempt gives up after this long
    connect_timeout_ms: int
    #: ZmqTransport: the longest wait between two reconnect attempts
    reconnect_ivl_max_ms: int
    #: ZmqTransport: a dead verdict on a closed socket is held this long
    down_hold_ms: int
    #: HealthMonitor: seconds between probes of one bootstrap address
    health_interval_s: float
    #: HealthMonitor: failed probes in a row that make an address dead
    failures_to_dead: int
    #: HealthMonitor: bound of one probe (connect, read, whole exchange)
    probe_timeout_s: float
    #: HealthMonitor: an address judged dead is probed this often, each connect bounded by it
    health_recheck_s: float
    #: BootstrapClient (fetches): connect timeout
    fetch_connect_timeout_s: float
    #: BootstrapClient (fetches): the longest silence while reading a reply
    fetch_read_timeout_s: float

    @classmethod
    def from_timeout(cls, liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S) -> LivenessBound:
        """The timeouts for ``liveness_timeout_s`` seconds (``InvalidArgument`` if it is not a
        number >= :data:`MIN_LIVENESS_TIMEOUT_S`)."""
        bound = liveness_timeout_s
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            raise InvalidArgument(
                f"liveness_timeout_s must be a number of seconds, not {bound!r}: e.g. 3.0"
            )
        if not bound >= MIN_LIVENESS_TIMEOUT_S:
            raise InvalidArgument(
                f"liveness_timeout_s must be at least {MIN_LIVENESS_TIMEOUT_S} s, not {bound!r}: "
                "a shorter bound would declare a prefill dead during an ordinary pause; use "
                f"{DEFAULT_LIVENESS_TIMEOUT_S} (the default) or a bound of about a second"
            )
        bound_ms = bound * 1000
        quarter_s = bound / 4
        return cls(
            liveness_timeout_s=float(bound),
            heartbeat_ivl_ms=max(1, round(bound_ms / 4)),
            heartbeat_timeout_ms=max(1, round(bound_ms / 2)),
            heartbeat_ttl_ms=max(100, round(bound_ms)),
            connect_timeout_ms=RECONNECT_ATTEMPT_MS,
            reconnect_ivl_max_ms=RECONNECT_ATTEMPT_MS,
            down_hold_ms=RECONNECT_ATTEMPT_MS,
            health_interval_s=quarter_s,
            failures_to_dead=2,
            probe_timeout_s=quarter_s,
            health_recheck_s=min(quarter_s, RECONNECT_ATTEMPT_MS / 1000),
            fetch_connect_timeout_s=min(_MAX_CONNECT_TIMEOUT_S, bound / 2),
            fetch_read_timeout_s=min(_MAX_READ_TIMEOUT_S, float(bound)),
        )

    def transport_options(self) -> TransportOptions:
        """Keyword arguments for :class:`~statemachine.decode.ranks.transport.ZmqTransport`."""
        return {
            "heartbeat_ivl_ms": self.heartbeat_ivl_ms,
            "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
            "heartbeat_ttl_ms": self.heartbeat_ttl_ms,
            "connect_timeout_ms": self.connect_timeout_ms,
            "reconnect_ivl_max_ms": self.reconnect_ivl_max_ms,
            "down_hold_ms": self.down_hold_ms,
        }

    def health_options(self) -> HealthOptions:
        """Keyword arguments for :class:`~statemachine.decode.health.HealthMonitor`."""
        return {
            "interval_s": self.health_interval_s,
            "failures_to_dead": self.failures_to_dead,
            "probe_timeout_s": self.probe_timeout_s,
            "recheck_s": self.health_recheck_s,
        }

    def client_options(self) -> ClientOptions:
        """Keyword arguments for the fetches' client
        (:class:`~statemachine.decode.client.BootstrapClient`)."""
        return {
            "connect_timeout": self.fetch_connect_timeout_s,
            "read_timeout": self.fetch_read_timeout_s,
        }

    @property
    def rank_detection_s(self) -> float:
        """The latest a silent rank connection is judged dead (with the transport's default
        ``dead_grace_ms`` of 100 ms)."""
        return (self.heartbeat_ivl_ms + self.heartbeat_timeout_ms + 100) / 1000

    @property
    def health_detection_s(self) -> float:
        """The latest a silent bootstrap server is judged dead by the health probes."""
        return self.failures_to_dead * (self.health_interval_s + self.probe_timeout_s)
