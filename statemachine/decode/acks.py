"""Decode-side completion listener: prefill ranks PUSH an ack per request when its KV is sent.

In SGLang the decode learns that a transfer finished from its transfer backend; the reference
prefill rank process (:mod:`statemachine.prefill.rank`) stands in for that with a small ack
message ``[b"ack", room, tp_rank, pp_rank]`` (ASCII integers, ZMQ-11) pushed to the ack
endpoint named in the metadata. :class:`AckListener` binds a ``PULL`` socket on an ephemeral
port and, on a daemon thread, counts acks per room: ``expect(room, n_acks, callback)`` fires
``callback(room)`` once, when acks from ``n_acks`` *distinct* ranks arrived (a rank that acks
twice counts once). Acks for rooms nobody expects are counted and dropped, so memory is bounded
by the rooms currently expected (ZMQ-12).

Call ``expect`` *before* sending the metadata: an ack that arrives first is dropped as unknown.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from statemachine.backend import MalformedFrames

ACK_KIND = b"ack"
ACK_FRAMES = 4
_MAX_ACK_BYTES = 256

_log = logging.getLogger(__name__)

AckCallback = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Ack:
    room: int
    tp_rank: int
    pp_rank: int


def ack_frames(room: int, tp_rank: int, pp_rank: int) -> list[bytes]:
    """The frames of one ack."""
    return [ACK_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank]


def parse_ack(frames: Sequence[bytes]) -> Ack:
    """Parse an ack; :class:`~statemachine.backend.MalformedFrames` if it is not one."""
    if len(frames) != ACK_FRAMES or frames[0] != ACK_KIND:
        raise MalformedFrames(f"ack: bad shape ({len(frames)} frames)", kind="ack")
    values = []
    for frame in frames[1:]:
        # isdigit() on bytes is ASCII-only; it also rejects b"", b"-1", b" 1" and b"1_0".
        if not frame.isdigit() or len(frame) > 20:
            raise MalformedFrames(
                f"ack: not a non-negative ASCII integer: {frame[:32]!r}", kind="ack"
            )
        values.append(int(frame))
    return Ack(values[0], values[1], values[2])


@dataclass(frozen=True, slots=True)
class AckStats:
    received: int  # well-formed acks
    completed: int  # rooms whose callback fired
    unknown: int  # acks for rooms nobody expected (dropped)
    duplicates: int  # second ack from the same rank for an expected room (ignored)
    malformed: int  # messages that were not acks (dropped)
    callback_errors: int  # callbacks that raised (logged, the listener keeps running)
    expected: int  # rooms currently expected


class _Pending:
    __slots__ = ("callback", "needed", "ranks")

    def __init__(self, needed: int, callback: AckCallback) -> None:
        self.needed = needed
        self.callback = callback
        self.ranks: set[tuple[int, int]] = set()


class AckListener:
    """PULL socket + daemon thread that completes rooms; see the module docstring."""

    def __init__(self, ip: str = "127.0.0.1") -> None:
        self.ip = ip
        # An own context: close() can then wake the thread through an inproc pair and
        # terminate the context without touching anybody else's sockets.
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # An ack is a few dozen bytes; a peer sending anything much larger is disconnected by
        # libzmq before it is buffered, which keeps the listener's memory bounded.
        self._pull.setsockopt(zmq.MAXMSGSIZE, _MAX_ACK_BYTES)
        self.port: int = self._pull.bind_to_random_port(f"tcp://{ip}")
        wake_url = f"inproc://ack-listener-wake-{id(self)}"
        self._wake_rx = self._context.socket(zmq.PAIR)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(wake_url)
        self._wake_tx = self._context.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_url)

        self._lock = threading.Lock()  # guards _pending and the counters
        self._pending: dict[int, _Pending] = {}
        self._received = 0
        self._completed = 0
        self._unknown = 0
        self._duplicates = 0
        self._malformed = 0
        self._callback_errors = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"ack-listener-{self.port}")
        self._thread.daemon = True
        self._thread.start()

    @property
    def endpoint(self) -> tuple[str, int]:
        return (self.ip, self.port)

    def expect(self, room: int, n_acks: int, callback: AckCallback) -> None:
        """Call ``callback(room)`` once acks from ``n_acks`` distinct ranks arrived for ``room``.

        Expecting a room again replaces the earlier expectation (and its acks so far).
        """
        if not isinstance(room, int) or isinstance(room, bool) or room < 0:
            raise ValueError(f"room must be a non-negative int, not {room!r}")
        if not isinstance(n_acks, int) or isinstance(n_acks, bool) or n_acks < 1:
            raise ValueError(f"n_acks must be a positive int, not {n_acks!r}")
        if not callable(callback):
            raise TypeError("callback must be callable")
        with self._lock:
            if self._closed:
                raise RuntimeError("AckListener is closed")
            self._pending[room] = _Pending(n_acks, callback)

    def forget(self, room: int) -> bool:
        """Stop expecting ``room``; True if it was expected. Later acks for it are unknown."""
        with self._lock:
            return self._pending.pop(room, None) is not None

    def close(self) -> None:
        """Stop the thread (woken at once, not by a poll timeout), join it, close the sockets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
        self._wake_tx.send(b"")
        if threading.current_thread() is self._thread:
            # Called from a callback: joining would deadlock. The thread exits when the
            # callback returns and closes its own sockets; the then socket-less context is
            # left to the garbage collector (term() here would wait for those sockets).
            self._wake_tx.close()
            return
        self._thread.join()
        self._wake_tx.close()
        self._context.term()

    def __enter__(self) -> AckListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> AckStats:
        with self._lock:
            return AckStats(
                received=self._received,
                completed=self._completed,
                unknown=self._unknown,
                duplicates=self._duplicates,
                malformed=self._malformed,
                callback_errors=self._callback_errors,
                expected=len(self._pending),
            )

    # --- the listener thread ------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_rx in ready:
                    return
                # Drain what is there without going back to poll for each message.
                while True:
                    try:
                        frames = self._pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
        finally:
            self._pull.close()
            self._wake_rx.close()

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            ack = parse_ack(frames)
        except MalformedFrames:
            with self._lock:
                self._malformed += 1
            return
        with self._lock:
            self._received += 1
            pending = self._pending.get(ack.room)
            if pending is None:
                self._unknown += 1
                return
            rank = (ack.tp_rank, ack.pp_rank)
            if rank in pending.ranks:
                self._duplicates += 1
                return
            pending.ranks.add(rank)
            if len(pending.ranks) < pending.needed:
                return
            del self._pending[ack.room]
            self._completed += 1
        # Outside the lock: a callback may call expect()/forget() itself.
        try:
            pending.callback(ack.room)
        except Exception:
            with self._lock:
                self._callback_errors += 1
            _log.exception("ack callback for room %d raised", ack.room)
