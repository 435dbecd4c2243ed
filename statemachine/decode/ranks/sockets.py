"""One PUSH socket to a prefill rank: its options, its monitor pair, its cache entry, and how
a message goes through it (``spec/zmq.md``).

Options: ``IMMEDIATE=1`` (ZMQ-2), ``LINGER=0`` (ZMQ-3), sends bounded by ``SNDTIMEO``
(ZMQ-4); with the monitor (ZMQ-16), reconnect and connect bounds and ZMTP heartbeats (ZMQ-25),
:func:`heartbeat_options`. A :class:`SocketPolicy` says which of these a transport applies: the
product's monitored sockets (:data:`MONITORED`), or a comparison baseline's
(:mod:`statemachine.demo.baselines` passes its own: SGLang's queueing sockets, or the transport
before the monitor).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from statemachine.errors import InvalidArgument
from statemachine.wire.endpoint import Endpoint

__all__ = [
    "MONITORED",
    "FrameSender",
    "SocketEntry",
    "SocketPolicy",
    "check_frames",
    "close_monitored",
    "frame_sender",
    "heartbeat_options",
    "push",
]


@dataclass(frozen=True, slots=True)
class SocketPolicy:
    """How a transport's sockets behave.

    ``monitored``: every socket has a ZMQ monitor (liveness, ZMQ-16) and a circuit breaker
    (ZMQ-19), sends wait for a connection in poll slices, and released sockets close (ZMQ-20);
    without it, a blocking send evicted on failure (ZMQ-6, ZMQ-7), sockets cached until a send
    fails. ``immediate``: queue only on a completed connection (ZMQ-2). ``sndhwm``: the send
    high-water mark (``None``: libzmq's default)."""

    monitored: bool = True
    immediate: bool = True
    sndhwm: int | None = None

    def apply(self, socket: zmq.Socket[bytes]) -> None:
        """The queueing options, before connect."""
        if self.immediate:
            # ZMQ-2: a send to a dead rank fails instead of queueing.
            socket.setsockopt(zmq.IMMEDIATE, 1)
        if self.sndhwm is not None:
            socket.setsockopt(zmq.SNDHWM, self.sndhwm)


#: The product's sockets: monitored, ``IMMEDIATE``.
MONITORED = SocketPolicy()

# A message goes to libzmq one frame at a time with plain int flags, through the backend's
# ``Socket.send``. pyzmq's ``send_multipart`` does the same libzmq calls but computes
# ``zmq.SNDMORE | flags`` per frame as ``enum.Flag`` arithmetic and goes through the Python-level
# ``Socket.send`` wrapper: 10 µs for a 10-frame message here, against 2 µs this way
# (``benchmarks/bench_vs_sglang.py``, docs/performance.md).
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


class SocketEntry:
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
        #: ``send_frame(socket, frame, flags)``: one frame to libzmq (see :func:`frame_sender`)
        self.send_frame = frame_sender(socket)
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


def heartbeat_options(
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


def frame_sender(socket: zmq.Socket[bytes]) -> FrameSender:
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


def push(send: FrameSender, socket: zmq.Socket[bytes], frames: Sequence[bytes]) -> bool:
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


def check_frames(frames: Sequence[bytes]) -> None:
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


def close_monitored(socket: zmq.Socket[bytes], monitored: bool) -> None:
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
