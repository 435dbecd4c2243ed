"""How the reference prefill rank sends its statuses to decode peers: :class:`AckSender`, one
queue and one non-blocking ``PUSH`` socket per peer (ACK-1), each socket kept honest by
:class:`StatusSocketOptions` (ZMQ-27).

A status connection that carried statuses while the path to its decode was cut sits in TCP's
retransmission back-off: the kernel resends the oldest unacknowledged segment after 0.2 s, then
0.4, 0.8, 1.6, 3.2, 6.4 s ... and every later status queues behind it. After an 8 s cut the next
resend may come seconds after the path returned, and with it every status at once (measured:
6.8 s, docs/performance.md). :class:`StatusSocketOptions` bounds that: ZMTP heartbeats drop a
connection that answers nothing within the bound, ``ZMQ_TCP_MAXRT`` (``TCP_USER_TIMEOUT`` on
Linux) lets the kernel abort one whose data stays unacknowledged that long, and a reconnect
attempt into a cut gives up after :data:`RECONNECT_ATTEMPT_MS` so that the next starts soon
after the path returns; a status waiting meanwhile stays in the peer's queue
(``ZMQ_IMMEDIATE``) and goes out on the fresh connection.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import zmq

from statemachine.wire.endpoint import Endpoint, endpoint_url

__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "MAX_PEERS",
    "MAX_QUEUED_ACKS",
    "RECONNECT_ATTEMPT_MS",
    "AckSender",
    "StatusSocketOptions",
]

#: Decode peers with an ack socket at a time (the least recently used is closed past it).
MAX_PEERS = 1024
#: Acks waiting for one decode peer; the oldest is dropped past it.
MAX_QUEUED_ACKS = 1024
#: The project's one bound on silence, as the decode's default sets it
#: (``statemachine.decode.liveness_bound``; the reference prefill never imports the decode side,
#: tests/integration/test_prefill_rank.py keeps the two equal).
DEFAULT_LIVENESS_TIMEOUT_S = 3.0
#: One reconnect attempt into a silent path gives up after this long, and the next follows at
#: most this long later (the decode's ``RECONNECT_ATTEMPT_MS``, kept equal the same way).
RECONNECT_ATTEMPT_MS = 200


@dataclass(frozen=True, slots=True)
class StatusSocketOptions:
    """The status sockets' timeouts, derived from the bound on silence as the decode derives
    its rank sockets' (a PING every ``bound/4``, dropped ``bound/2`` after an unanswered one)."""

    #: a ZMTP PING every this many ms (the decode's listener answers each with a PONG)
    heartbeat_ivl_ms: int
    #: a connection that answered nothing this long after a PING is dropped and redialled
    heartbeat_timeout_ms: int
    #: the decode may drop our connection after this long without a word from us
    heartbeat_ttl_ms: int
    #: the kernel aborts a connection whose sent data stays unacknowledged this long
    tcp_maxrt_ms: int
    #: one reconnect attempt gives up after this long ...
    connect_timeout_ms: int
    #: ... and the next starts at most this long later
    reconnect_ivl_ms: int

    @classmethod
    def from_bound(cls, liveness_timeout_s: float) -> StatusSocketOptions:
        bound_ms = liveness_timeout_s * 1000
        return cls(
            heartbeat_ivl_ms=max(1, round(bound_ms / 4)),
            heartbeat_timeout_ms=max(1, round(bound_ms / 2)),
            heartbeat_ttl_ms=min(6_553_500, max(100, round(bound_ms))),
            tcp_maxrt_ms=max(1, round(bound_ms)),
            connect_timeout_ms=RECONNECT_ATTEMPT_MS,
            reconnect_ivl_ms=RECONNECT_ATTEMPT_MS,
        )

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Set the options on ``sock`` (before its connect)."""
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, self.heartbeat_ttl_ms)
        sock.setsockopt(zmq.TCP_MAXRT, self.tcp_maxrt_ms)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, self.connect_timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_ms)


class _Peer:
    __slots__ = ("queue", "socket")

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.socket = sock
        #: (drop-by time on time.monotonic(), frames), oldest first
        self.queue: collections.deque[tuple[float, list[bytes]]] = collections.deque()


class AckSender:
    """Per-decode-peer queues and non-blocking PUSH sockets (ACK-1).

    ``send`` queues an ack and tries a non-blocking send at once; what cannot go out now
    waits until :meth:`flush` is called for a writable socket (the serving loop polls
    :meth:`waiting` for ``POLLOUT``) or is dropped by :meth:`expire` after ``timeout_ms``.
    One thread only.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        counts: dict[str, int],
        timeout_ms: int,
        options: StatusSocketOptions | None = None,
    ) -> None:
        self._context = context
        #: None: libzmq's defaults (no heartbeats, the kernel's retransmission back-off)
        self._options = options
        self._counts = counts
        self._timeout = timeout_ms / 1000.0
        self._peers: collections.OrderedDict[Endpoint, _Peer] = collections.OrderedDict()

    def send(self, endpoint: Endpoint, frames: list[bytes]) -> None:
        peer = self._peer(endpoint)
        if peer is None:
            self._counts["ack_failures"] += 1
            return
        if len(peer.queue) >= MAX_QUEUED_ACKS:
            peer.queue.popleft()
            self._counts["ack_failures"] += 1
        peer.queue.append((time.monotonic() + self._timeout, frames))
        self._flush(endpoint, peer)

    def _peer(self, endpoint: Endpoint) -> _Peer | None:
        peer = self._peers.get(endpoint)
        if peer is not None:
            self._peers.move_to_end(endpoint)
            return peer
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        # Only completed connections take messages: nothing is queued inside libzmq for a
        # decode that is not there, so our queue (and its timeout) is the only one.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self._options is not None:
            self._options.apply(sock)
        if ":" in endpoint[0]:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(endpoint_url(endpoint))
        except zmq.ZMQError:
            sock.close(linger=0)
            return None
        peer = self._peers[endpoint] = _Peer(sock)
        while len(self._peers) > MAX_PEERS:
            _, oldest = self._peers.popitem(last=False)
            self._close(oldest)
        return peer

    def _flush(self, endpoint: Endpoint, peer: _Peer) -> None:
        queue = peer.queue
        while queue:
            try:
                peer.socket.send_multipart(queue[0][1], zmq.NOBLOCK)
            except zmq.Again:
                return  # not connected (yet): wait for POLLOUT or the timeout
            except zmq.ZMQError:
                self._counts["ack_failures"] += len(queue)
                queue.clear()
                del self._peers[endpoint]
                peer.socket.close(linger=0)
                return
            queue.popleft()
            self._counts["acks_sent"] += 1

    def waiting(self) -> list[zmq.Socket[bytes]]:
        """Sockets with queued acks: poll them for POLLOUT."""
        return [peer.socket for peer in self._peers.values() if peer.queue]

    def flush(self, writable: set[zmq.Socket[bytes]]) -> None:
        for endpoint, peer in list(self._peers.items()):
            if peer.queue and peer.socket in writable:
                self._flush(endpoint, peer)

    def expire(self) -> float | None:
        """Drop acks past their time (closing a peer left with none); seconds to the next."""
        now = time.monotonic()
        soonest: float | None = None
        for endpoint, peer in list(self._peers.items()):
            queue = peer.queue
            if not queue:
                continue
            while queue and queue[0][0] <= now:
                queue.popleft()
                self._counts["ack_failures"] += 1
            if not queue:
                # The peer took nothing for a whole timeout: forget its socket (and the
                # reconnect attempts libzmq would keep making to it).
                del self._peers[endpoint]
                self._close(peer)
                continue
            left = queue[0][0] - now
            soonest = left if soonest is None else min(soonest, left)
        return soonest

    def _close(self, peer: _Peer) -> None:
        self._counts["ack_failures"] += len(peer.queue)
        peer.queue.clear()
        peer.socket.close(linger=0)

    def close(self) -> None:
        for peer in self._peers.values():
            self._close(peer)
        self._peers.clear()
