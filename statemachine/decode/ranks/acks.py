"""Decode-side completion listener: what prefill ranks PUSH to the decode's own PULL endpoint.

SGLang 0.5.23's prefill ranks push a *status* per room to the endpoint named in the metadata
(Mooncake ``[room, status, prefill_rank]``, NIXL ``[KV_STATUS, room, status, prefill_rank,
reason]``) and an ``ABORT_ACK`` once an aborted room drained; the reference prefill rank
(:mod:`statemachine.prefill.rank`) pushes a small ack ``[b"ack", room, tp_rank, pp_rank]``
(ASCII integers, ZMQ-11). :class:`AckListener` listens on an ephemeral port as a ``PULL`` peer
(a ``ZMQ_STREAM`` socket, see ACK-2 below) and, on a daemon thread, turns every message into a
:data:`~statemachine.completion.PrefillEvent` through a *decoder* - the manager passes its
backend's ``decode_message``, so each backend parses its own wire; without one, the reference
layout's replies are read (:func:`~statemachine.backend.decode_reply`).

Two ways to consume the events. A :class:`~statemachine.decode.manager.DecodeManager` passes
``on_event`` and gets every event (it counts distinct prefill responses per room itself,
``spec/manager.md`` MGR-13). Standalone, ``expect(room, n, callback)`` fires ``callback(room)``
once, when successes from ``n`` *distinct* prefill ranks arrived (a rank that reports twice
counts once); events for rooms nobody expects are counted and dropped, so memory is bounded by
the rooms currently expected (ZMQ-12). Call ``expect`` *before* sending the metadata: an ack
that arrives first is dropped as unknown.

Bounded memory per message (ACK-2): libzmq delivers a multipart message only once all of
its frames arrived, and ``MAXMSGSIZE`` bounds each frame, not their number, so one message of
200,000 small frames made a ``PULL`` socket buffer ~130 MB. The listener therefore binds a
``ZMQ_STREAM`` socket (raw TCP bytes, read in small chunks with a low high-water mark) and
speaks the receiving side of ZMTP 3.0 itself (:class:`_ZmtpPull`): greeting, NULL handshake,
then frames parsed as they arrive. A peer whose message has more than :data:`MAX_FRAMES` frames,
or a frame larger than :data:`MAX_FRAME_BYTES`, is disconnected at that frame; nothing of it is
buffered. The bounds fit the largest message a 0.5.23 prefill sends the decode's PULL endpoint
besides staging and AUX_DATA, which this listener does not take: NIXL's 5-frame status whose
last frame is the failure reason (a line of text). Senders are
ordinary libzmq ``PUSH`` sockets and see a normal ``PULL`` peer.

Trust boundary (ACK-3): a message is not authenticated. Anyone who can reach the ack port can
complete or fail a room that is currently in flight (never one that is not, and a rank counts
once), or release a held room's KV early with its current abort generation. Like
SGLang's own ZMQ channels, the ack port belongs on the cluster-internal network between
prefill and decode; bind it to that interface, never to a public one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from statemachine.backend import MalformedFrames, decode_reply
from statemachine.completion import STATUS_SUCCESS, PrefillEvent, PrefillStatus
from statemachine.validation import require_rank_ip

ACK_KIND = b"ack"
ACK_FRAMES = 4
#: Most frames one message may have (NIXL's status is 5; one spare for a trailing frame).
MAX_FRAMES = 6
#: Largest frame (a failure reason is one line of text; a room is at most 20 digits).
MAX_FRAME_BYTES = 2048
#: Largest ZMTP command we read (a peer's READY with its metadata).
_MAX_COMMAND_BYTES = 1024
#: Connected senders at a time; past it a new one displaces the longest-silent one.
MAX_PEERS = 1024
#: Seconds a sender has to complete the ZMTP handshake before it is disconnected.
HANDSHAKE_TIMEOUT = 5.0
#: Chunks libzmq may hold per sender before it stops reading that sender's TCP socket.
_STREAM_RCVHWM = 16

# ZMTP 3.0 (rfc.zeromq.org/spec/23): a 64-byte greeting, then a READY command (NULL mechanism).
_GREETING = (
    b"\xff"
    + bytes(8)
    + b"\x7f"  # signature
    + b"\x03\x00"  # version 3.0
    + b"NULL".ljust(20, b"\x00")  # mechanism
    + b"\x00"  # as-server: no
    + bytes(31)  # filler
)
_FLAG_MORE, _FLAG_LONG, _FLAG_COMMAND = 0x01, 0x02, 0x04


def _ready_command(socket_type: bytes) -> bytes:
    prop = b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    body = b"\x05READY" + prop
    return bytes((_FLAG_COMMAND, len(body))) + body


_HANDSHAKE = _GREETING + _ready_command(b"PULL")

_log = logging.getLogger(__name__)

AckCallback = Callable[[int], None]
#: One multipart message -> an event, or None (not a message of this wire: dropped).
Decoder = Callable[[Sequence[bytes]], PrefillEvent | None]
#: Takes one event; returns False if it was dropped (no such room: counted as unknown).
EventCallback = Callable[[PrefillEvent], bool]


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
    received: int  # well-formed messages (acks, statuses, abort acks)
    completed: int  # rooms whose callback fired
    unknown: int  # events for rooms nobody expected or in flight (dropped)
    duplicates: int  # second success from the same rank for an expected room (ignored)
    malformed: int  # messages the decoder did not take (dropped)
    callback_errors: int  # callbacks that raised (logged, the listener keeps running)
    expected: int  # rooms currently expected (standalone ``expect``; 0 under a manager)


class _Pending:
    __slots__ = ("callback", "needed", "ranks")

    def __init__(self, needed: int, callback: AckCallback) -> None:
        self.needed = needed
        self.callback = callback
        self.ranks: set[int] = set()


class AckListener:
    """PULL socket + daemon thread that completes rooms; see the module docstring."""

    def __init__(
        self,
        ip: str = "127.0.0.1",
        *,
        max_peers: int = MAX_PEERS,
        decoder: Decoder | None = None,
        on_event: EventCallback | None = None,
    ) -> None:
        self._decode: Decoder = decode_reply if decoder is None else decoder
        self._on_event = on_event
        # The ip travels in every metadata message as the address prefill ranks connect to:
        # a peer IP literal (not 0.0.0.0, not a name), checked before any socket exists.
        # Named as the user passed it: most reach here through DecodeManager(ack_ip=...).
        self.ip = require_rank_ip(
            "ack_ip (DecodeManager(ack_ip=...), AckListener(ip))",
            ip,
            next_step="give an IP address of this decode host that the prefill ranks can reach "
            "(the default 127.0.0.1 serves prefills on this host only)",
        )
        # An own context: close() can then wake the thread through an inproc pair and
        # terminate the context without touching anybody else's sockets.
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._context.socket(zmq.STREAM)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, _STREAM_RCVHWM)
        if ":" in ip:
            self._pull.setsockopt(zmq.IPV6, 1)
        host = f"[{ip}]" if ":" in ip else ip
        try:
            self.port: int = self._pull.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._pull.close(linger=0)
            self._context.term()
            raise
        self._zmtp = _ZmtpPull(self._pull, self._on_message, self._on_malformed, max_peers)
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
                # Wake at least once a second while a sender is mid-handshake, to cut it off
                # at HANDSHAKE_TIMEOUT; otherwise sleep until something arrives.
                ready = dict(poller.poll(1000 if self._zmtp.handshaking() else None))
                self._zmtp.sweep()
                if self._wake_rx in ready:
                    return
                # Drain what is there without going back to poll for each chunk.
                while True:
                    try:
                        peer, data = self._pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:  # not [routing id, data]: cannot happen on STREAM
                        continue
                    self._zmtp.on_chunk(peer, data)
        finally:
            self._pull.close()
            self._wake_rx.close()

    def _on_malformed(self) -> None:
        with self._lock:
            self._malformed += 1

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            event = self._decode(frames)
        except Exception:  # a decoder must not raise; if one does, the thread lives on
            _log.exception("ack decoder raised")
            event = None
        if event is None:
            self._on_malformed()
            return
        with self._lock:
            self._received += 1
        if self._on_event is not None:
            if not self._call(self._on_event, event, event.room):
                with self._lock:
                    self._unknown += 1
            return
        if not isinstance(event, PrefillStatus) or event.status != STATUS_SUCCESS:
            with self._lock:
                self._unknown += 1  # standalone, only successes complete a room
            return
        with self._lock:
            pending = self._pending.get(event.room)
            if pending is None:
                self._unknown += 1
                return
            if event.prefill_rank in pending.ranks:
                self._duplicates += 1
                return
            pending.ranks.add(event.prefill_rank)
            if len(pending.ranks) < pending.needed:
                return
            del self._pending[event.room]
            self._completed += 1
        # Outside the lock: a callback may call expect()/forget() itself.
        self._call(pending.callback, event.room, event.room)

    def _call(self, callback: Callable[[Any], object], argument: object, room: int) -> bool:
        """``callback(argument)``; False if it returned False. A callback that raises is
        logged and counted, and the listener serves on."""
        try:
            return callback(argument) is not False
        except Exception:
            with self._lock:
                self._callback_errors += 1
            _log.exception("ack callback for room %d raised", room)
            return True


# --- the receiving side of ZMTP 3.0 over a ZMQ_STREAM socket ----------------------------------


class _Cut(Exception):
    """The peer broke the protocol or a bound: disconnect it."""


class _PeerState:
    __slots__ = ("buffer", "frames", "last", "since", "stage")

    def __init__(self, now: float) -> None:
        self.buffer = bytearray()
        self.frames: list[bytes] = []
        self.stage = 0  # 0: greeting, 1: waiting for READY, 2: messages
        self.since = now  # connected at
        self.last = now  # last bytes at


class _ZmtpPull:
    """ZMTP 3.0 PULL side for the peers of one ``ZMQ_STREAM`` socket (listener thread only).

    Each peer's bytes are parsed as they arrive; a buffer never holds more than one chunk plus
    one partial frame header and body (at most a few hundred bytes past the chunk), and a
    message is handed on as soon as its last frame is in: at most MAX_FRAMES frames of at most
    MAX_FRAME_BYTES each, or the peer is cut off there.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        on_message: Callable[[list[bytes]], None],
        on_malformed: Callable[[], None],
        max_peers: int = MAX_PEERS,
    ) -> None:
        self._sock = sock
        self._on_message = on_message
        self._on_malformed = on_malformed
        self._max_peers = max_peers
        self._peers: dict[bytes, _PeerState] = {}

    def handshaking(self) -> bool:
        return any(peer.stage < 2 for peer in self._peers.values())

    def sweep(self) -> None:
        """Cut off senders that did not complete the handshake within HANDSHAKE_TIMEOUT."""
        if not self._peers:
            return
        too_old = time.monotonic() - HANDSHAKE_TIMEOUT
        for peer_id, peer in list(self._peers.items()):
            if peer.stage < 2 and peer.since < too_old:
                self._cut(peer_id)

    def on_chunk(self, peer_id: bytes, data: bytes) -> None:
        peer = self._peers.get(peer_id)
        if not data:  # STREAM's connect / disconnect notification
            if peer is not None:
                del self._peers[peer_id]
                return
            if len(self._peers) >= self._max_peers:
                # Make room: the longest-silent sender, those still mid-handshake first (a
                # flood of idle connections cannot lock the prefill ranks out).
                victim = min(
                    self._peers, key=lambda i: (self._peers[i].stage == 2, self._peers[i].last)
                )
                self._cut(victim)
            self._peers[peer_id] = _PeerState(time.monotonic())
            self._send(peer_id, _HANDSHAKE)
            return
        if peer is None:
            return  # a peer we cut off: its last bytes
        peer.last = time.monotonic()
        peer.buffer += data
        try:
            self._parse(peer)
        except _Cut:
            self._on_malformed()
            self._cut(peer_id)

    def _cut(self, peer_id: bytes) -> None:
        self._peers.pop(peer_id, None)
        self._disconnect(peer_id)

    def _parse(self, peer: _PeerState) -> None:
        buf = peer.buffer
        pos = 0
        if peer.stage == 0:
            if len(buf) < len(_GREETING):
                if buf and buf[0] != 0xFF:
                    raise _Cut
                return
            if buf[0] != 0xFF or not buf[9] & 1 or buf[10] < 3 or buf[12:16] != b"NULL":
                raise _Cut  # not ZMTP 3 with the NULL mechanism
            pos = len(_GREETING)
            peer.stage = 1
        end = len(buf)
        while end - pos >= 2:
            flags = buf[pos]
            if flags & ~(_FLAG_MORE | _FLAG_LONG | _FLAG_COMMAND):
                raise _Cut
            if flags & _FLAG_LONG:
                if end - pos < 9:
                    break
                size = int.from_bytes(buf[pos + 1 : pos + 9], "big")
                header = 9
            else:
                size = buf[pos + 1]
                header = 2
            command = bool(flags & _FLAG_COMMAND)
            if size > (_MAX_COMMAND_BYTES if command else MAX_FRAME_BYTES):
                raise _Cut  # cut at the header: the body is never buffered
            if end - pos < header + size:
                break
            body = bytes(buf[pos + header : pos + header + size])
            pos += header + size
            if command:
                if peer.stage == 1:
                    if not body.startswith(b"\x05READY"):
                        raise _Cut
                    peer.stage = 2
                continue  # later commands (PING, ...) carry nothing for us
            if peer.stage != 2:
                raise _Cut
            frames = peer.frames
            frames.append(body)
            if len(frames) > MAX_FRAMES:
                raise _Cut  # no message we take is this long; the rest is never read
            if not flags & _FLAG_MORE:
                peer.frames = []
                self._on_message(frames)
        del buf[:pos]

    def _send(self, peer_id: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([peer_id, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            self._peers.pop(peer_id, None)

    def _disconnect(self, peer_id: bytes) -> None:
        # On a STREAM socket an empty message to a peer closes its connection.
        self._send(peer_id, b"")
