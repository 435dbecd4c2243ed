"""The receiving side of ZMTP 3.1 (rfc.zeromq.org/spec/37) over a ``ZMQ_STREAM`` socket.

:class:`ZmtpPull` speaks to ordinary libzmq ``PUSH`` senders as a ``PULL`` peer would, from
raw TCP bytes: the greeting, the NULL handshake, then frames parsed as they arrive, so that a
bound holds per frame, not per message (libzmq itself buffers a whole multipart message before
delivering it, and ``MAXMSGSIZE`` bounds each frame, not their number). A sender whose message
has more than :data:`MAX_FRAMES` frames, or a frame larger than :data:`MAX_FRAME_BYTES`, is
disconnected at that frame; nothing of it is buffered. ZMTP 3.1 PINGs are answered with PONGs.
Which senders are cut at the peer cap, and when, is ``spec/protocol.md``'s (ACK-2, ACK-5, ACK-6);
the decode's completion listener (:mod:`statemachine.decode.ranks.acks`) owns the socket and
hands each complete message to its decoder.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

__all__ = [
    "DROPPED",
    "EVICT_GRACE",
    "HANDSHAKE_TIMEOUT",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "PONG_INTERVAL",
    "REFUSED",
    "SILENT_TIMEOUT",
    "TAKEN",
    "ZmtpPull",
]

#: Most frames one message may have (NIXL's status is 5; one spare for a trailing frame).
MAX_FRAMES = 6
#: Largest frame (a failure reason is one line of text; a room is at most 20 digits).
MAX_FRAME_BYTES = 2048
#: Largest ZMTP command we read (a peer's READY with its metadata).
_MAX_COMMAND_BYTES = 1024
#: Seconds a sender has to complete the ZMTP handshake before it is disconnected.
HANDSHAKE_TIMEOUT = 5.0
#: Seconds a sender that completed the handshake has to send its first message (ACK-5).
SILENT_TIMEOUT = 30.0
#: A sender this young (seconds) is cut at the cap only when nothing else is left but proven
#: senders: a prefill rank completes the handshake and sends within milliseconds (ACK-5).
EVICT_GRACE = 0.1
#: A sender's PINGs answered at most once per this many seconds (ACK-6).
PONG_INTERVAL = 0.05

# ZMTP 3.1 (rfc.zeromq.org/spec/37): a 64-byte greeting, then a READY command (NULL mechanism);
# 3.1 adds PING/PONG, which we answer (ACK-6).
_GREETING = (
    b"\xff"
    + bytes(8)
    + b"\x7f"  # signature
    + b"\x03\x01"  # version 3.1
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
_PING = b"\x04PING"
_PONG = b"\x04PONG"
#: ZMTP 3.1: a PING's context (after its 2-byte TTL) is echoed in the PONG, up to 16 bytes.
_PING_CONTEXT_MAX = 16


class _Cut(Exception):
    """The peer broke the protocol or a bound: disconnect it."""


#: What became of one complete message, as the ``on_message`` callback answers.
TAKEN, DROPPED, REFUSED = 0, 1, 2

#: A sender's standing, lowest first: who is cut first at the cap (ACK-5).
_HANDSHAKING, _SILENT, _UNPROVEN, _PROVEN = 0, 1, 2, 3


class _PeerState:
    __slots__ = ("born", "buffer", "frames", "pong_at", "since", "stage", "tier")

    def __init__(self, now: float) -> None:
        self.buffer = bytearray()
        self.frames: list[bytes] = []
        self.stage = 0  # 0: greeting, 1: waiting for READY, 2: messages
        self.tier = _HANDSHAKING
        self.born = now  # connected at
        self.since = now  # entered its tier at
        self.pong_at = 0.0  # last PONG sent at


class ZmtpPull:
    """ZMTP 3.1 PULL side for the peers of one ``ZMQ_STREAM`` socket (one thread only).

    Each peer's bytes are parsed as they arrive; a buffer never holds more than one chunk plus
    one partial frame header and body (at most a few hundred bytes past the chunk), and a
    message is handed on as soon as its last frame is in: at most MAX_FRAMES frames of at most
    MAX_FRAME_BYTES each, or the peer is cut off there.

    Peers are kept in four insertion-ordered tiers (ACK-5): mid-handshake, *silent* (handshake
    done, no message yet), *unproven* (messages, none of them taken: no room of ours) and
    *proven* (delivered an event for a room in flight). At the cap the victim is the oldest
    *unheard* peer (mid-handshake or silent) connected more than EVICT_GRACE ago, else the
    oldest unproven one, else the oldest unheard one, and a proven one only when nothing else
    is left: a flood of connections, silent or chattering about rooms it cannot know, never
    displaces a prefill rank that delivered, nor one that connected a moment ago. Each step is
    O(1); the deadlines (handshake, first message) are swept from the front of their tier.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        on_message: Callable[[list[bytes]], int],
        on_malformed: Callable[[], None],
        max_peers: int,
        silent_timeout: float = SILENT_TIMEOUT,
    ) -> None:
        self._sock = sock
        self._on_message = on_message
        self._on_malformed = on_malformed
        self._max_peers = max_peers
        self._silent_timeout = silent_timeout
        self._peers: dict[bytes, _PeerState] = {}
        self._tiers: tuple[OrderedDict[bytes, _PeerState], ...] = tuple(
            OrderedDict() for _ in range(4)
        )
        # Counters (this thread writes them; stats() reads plain ints).
        self.evicted = 0  # cut at the cap to admit a newcomer
        self.timed_out = 0  # cut for no handshake within HANDSHAKE_TIMEOUT or no message
        self.pongs = 0  # PINGs answered

    @property
    def connected(self) -> int:
        return len(self._peers)

    def next_deadline(self) -> float | None:
        """Seconds until the next handshake or first-message deadline (None: none pending)."""
        soonest: float | None = None
        for tier, limit in ((_HANDSHAKING, HANDSHAKE_TIMEOUT), (_SILENT, self._silent_timeout)):
            for peer in self._tiers[tier].values():  # the oldest is first
                due = peer.since + limit
                soonest = due if soonest is None else min(soonest, due)
                break
        return None if soonest is None else max(0.0, soonest - time.monotonic())

    def sweep(self) -> None:
        """Cut senders past their deadline: no handshake within HANDSHAKE_TIMEOUT, or no
        message within ``silent_timeout`` of the handshake."""
        now = time.monotonic()
        for tier, limit in ((_HANDSHAKING, HANDSHAKE_TIMEOUT), (_SILENT, self._silent_timeout)):
            members = self._tiers[tier]
            while members:
                peer_id, peer = next(iter(members.items()))
                if now - peer.since < limit:
                    break
                self.timed_out += 1
                self._cut(peer_id)

    def on_chunk(self, peer_id: bytes, data: bytes) -> None:
        peer = self._peers.get(peer_id)
        if not data:  # STREAM's connect / disconnect notification
            if peer is not None:
                self._forget(peer_id)
                return
            if len(self._peers) >= self._max_peers:
                self._evict()
            peer = self._peers[peer_id] = _PeerState(time.monotonic())
            self._tiers[_HANDSHAKING][peer_id] = peer
            self._send(peer_id, _HANDSHAKE)
            return
        if peer is None:
            return  # a peer we cut off: its last bytes
        peer.buffer += data
        try:
            self._parse(peer_id, peer)
        except _Cut:
            self._on_malformed()
            self._cut(peer_id)

    def _evict(self) -> None:
        """Make room for a newcomer (see the class docstring for whom)."""
        handshaking, silent, unproven, proven = self._tiers
        unheard: tuple[bytes, _PeerState] | None = None
        for members in (handshaking, silent):
            for peer_id, peer in members.items():  # the front: the oldest of its tier
                if unheard is None or peer.born < unheard[1].born:
                    unheard = (peer_id, peer)
                break
        if unheard is not None and unheard[1].born <= time.monotonic() - EVICT_GRACE:
            victim = unheard[0]
        elif unproven:
            victim = next(iter(unproven))
        elif unheard is not None:
            victim = unheard[0]
        elif proven:
            victim = next(iter(proven))
        else:
            return
        self.evicted += 1
        self._cut(victim)

    def _promote(self, peer_id: bytes, peer: _PeerState, tier: int) -> None:
        """Move ``peer`` to the back of ``tier`` (its most recent member)."""
        del self._tiers[peer.tier][peer_id]
        peer.tier = tier
        peer.since = time.monotonic()
        self._tiers[tier][peer_id] = peer

    def _forget(self, peer_id: bytes) -> None:
        peer = self._peers.pop(peer_id, None)
        if peer is not None:
            self._tiers[peer.tier].pop(peer_id, None)

    def _cut(self, peer_id: bytes) -> None:
        self._forget(peer_id)
        self._disconnect(peer_id)

    def _parse(self, peer_id: bytes, peer: _PeerState) -> None:
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
        # A PONG that cannot be sent forgets the peer (its connection is gone): read no more.
        while end - pos >= 2 and self._peers.get(peer_id) is peer:
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
                    self._promote(peer_id, peer, _SILENT)
                elif body.startswith(_PING):
                    self._pong(peer_id, peer, body)
                continue  # other commands (PONG, ...) carry nothing for us
            if peer.stage != 2:
                raise _Cut
            frames = peer.frames
            frames.append(body)
            if len(frames) > MAX_FRAMES:
                raise _Cut  # no message we take is this long; the rest is never read
            if not flags & _FLAG_MORE:
                peer.frames = []
                verdict = self._on_message(frames)
                if verdict == REFUSED:
                    raise _Cut  # the decoder's protocol, broken: as a ZMTP violation
                if verdict == TAKEN:
                    if peer.tier == _PROVEN:
                        self._tiers[_PROVEN].move_to_end(peer_id)
                    else:
                        self._promote(peer_id, peer, _PROVEN)
                elif peer.tier == _SILENT:
                    self._promote(peer_id, peer, _UNPROVEN)
        del buf[:pos]

    def _pong(self, peer_id: bytes, peer: _PeerState, ping: bytes) -> None:
        """Answer a ZMTP 3.1 PING (``\\x04PING``, a 2-byte TTL, up to 16 bytes of context)
        with a PONG echoing its context: libzmq's heartbeat timeout then sees traffic and keeps
        the connection. At most one per PONG_INTERVAL, so a PING flood cannot fill our output."""
        now = time.monotonic()
        if now - peer.pong_at < PONG_INTERVAL:
            return
        peer.pong_at = now
        context = ping[len(_PING) + 2 : len(_PING) + 2 + _PING_CONTEXT_MAX]
        body = _PONG + context
        self.pongs += 1
        self._send(peer_id, bytes((_FLAG_COMMAND, len(body))) + body)

    def _send(self, peer_id: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([peer_id, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            self._forget(peer_id)

    def _disconnect(self, peer_id: bytes) -> None:
        # On a STREAM socket an empty message to a peer closes its connection.
        self._send(peer_id, b"")
