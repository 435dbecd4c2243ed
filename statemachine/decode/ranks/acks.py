"""Decode-side completion listener: what prefill ranks PUSH to the decode's own PULL endpoint.

SGLang 0.5.23's prefill ranks push a *status* per room to the endpoint named in the metadata
(Mooncake ``[room, status, prefill_rank]``, NIXL ``[KV_STATUS, room, status, prefill_rank,
reason]``) and an ``ABORT_ACK`` once an aborted room drained; the reference prefill rank
(:mod:`statemachine.prefill.rank`) pushes a small ack ``[b"ack", room, tp_rank, pp_rank]``
(ASCII integers, ZMQ-11; :mod:`statemachine.wire.reference`). :class:`AckListener` listens on
an ephemeral port as a ``PULL`` peer (a ``ZMQ_STREAM`` socket, see ACK-2 below) and, on a daemon
thread, turns every message into a
:data:`~statemachine.completion.PrefillEvent` through a *decoder* - the manager passes its
backend's ``decode_message``, so each backend parses its own wire; without one, the reference
layout's replies are read (:func:`~statemachine.wire.reference.decode_reply`).

Two ways to consume the events. A :class:`~statemachine.decode.manager.DecodeManager` passes
``on_event`` and gets every event (it counts distinct prefill responses per room itself,
``spec/manager.md`` MGR-13). Standalone, ``expect(room, n, callback)`` fires ``callback(room)``
once, when successes from ``n`` *distinct* prefill ranks arrived (a rank that reports twice
counts once); events for rooms nobody expects are counted and dropped, so memory is bounded by
the rooms currently expected (ZMQ-12). Call ``expect`` *before* sending the metadata: an ack
that arrives first is dropped as unknown.

Bounded memory per message (ACK-2): libzmq delivers a multipart message only once all of its
frames arrived, and ``MAXMSGSIZE`` bounds each frame, not their number, so one message of
200,000 small frames made a ``PULL`` socket buffer ~130 MB. The listener therefore binds a
``ZMQ_STREAM`` socket (raw TCP bytes, read in small chunks with a low high-water mark) and
speaks the receiving side of ZMTP 3.1 itself (:class:`~statemachine.wire.zmtp.ZmtpPull`, with
the other wire code): greeting, NULL handshake, then frames parsed as they arrive. A peer whose
message has more than :data:`MAX_FRAMES` frames, or a frame larger than
:data:`MAX_FRAME_BYTES`, is disconnected at that frame; nothing of it is buffered. The bounds
fit the largest message a 0.5.23 prefill sends the decode's PULL endpoint besides staging and
AUX_DATA, which this listener does not take: NIXL's 5-frame status whose last frame is the
failure reason (a line of text). A complete message the decoder refuses (None) breaks the
protocol as well: its sender is cut at that message (ZMQ-24). Senders are ordinary libzmq
``PUSH`` sockets and see a normal ``PULL`` peer.

Holding connections (ACK-5, ACK-6): each sender holds an fd of this process, so the peer cap
follows the fd limit (:func:`default_max_peers`), and at the cap the sender cut to admit a
newcomer is one that has not yet delivered anything for a room in flight: a flood of silent
or chattering connections cannot exhaust the process nor displace a prefill rank that
delivered. A sender silent for :data:`SILENT_TIMEOUT` after its handshake is cut. ZMTP 3.1
PINGs (libzmq's ``ZMQ_HEARTBEAT_IVL``) are answered with PONGs, so heartbeating senders keep
their connection.

Trust boundary (ACK-3): a message is not authenticated. Anyone who can reach the ack port can
complete or fail a room that is currently in flight (never one that is not, and a rank counts
once), or release a held room's KV early with its current abort sequence number. Like
SGLang's own ZMQ channels, the ack port belongs on the cluster-internal network between
prefill and decode; bind it to that interface, never to a public one.
"""

from __future__ import annotations

import logging
import resource
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from statemachine.completion import KVPoll, PrefillEvent, PrefillStatus
from statemachine.validation import require_rank_ip
from statemachine.wire.reference import decode_reply
from statemachine.wire.zmtp import (
    DROPPED,
    REFUSED,
    SILENT_TIMEOUT,
    TAKEN,
    ZmtpPull,
)

#: Most connected senders at a time, whatever the fd limit (ACK-5).
MAX_PEERS = 4096
#: Fewest: the cap never goes below this, even under a tiny fd limit.
MIN_PEERS = 16
#: Chunks libzmq may hold per sender before it stops reading that sender's TCP socket.
_STREAM_RCVHWM = 16


def default_max_peers() -> int:
    """The peer cap: half the process's fd limit, within MIN_PEERS .. MAX_PEERS (ACK-5).

    Half, not the limit less a fixed reserve as the bootstrap server does: the listener shares
    its process with the decode's own sockets to every prefill rank (a libzmq socket costs a
    connection and an eventfd), which grow with the deployment, not with the attack.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_PEERS
    return max(MIN_PEERS, min(MAX_PEERS, soft // 2))


_log = logging.getLogger(__name__)

AckCallback = Callable[[int], None]
#: One multipart message -> an event, or None (not a message of this wire: its sender is cut).
Decoder = Callable[[Sequence[bytes]], PrefillEvent | None]
#: Takes one event; returns False if it was dropped (no such room: counted as unknown).
EventCallback = Callable[[PrefillEvent], bool]


@dataclass(frozen=True, slots=True)
class AckStats:
    received: int  # well-formed messages (acks, statuses, abort acks)
    completed: int  # rooms whose callback fired
    unknown: int  # events for rooms nobody expected or in flight (dropped)
    duplicates: int  # second success from the same rank for an expected room (ignored)
    malformed: int  # protocol violations (each cut its sender), decoder refusals included
    callback_errors: int  # callbacks that raised (logged, the listener keeps running)
    expected: int  # rooms currently expected (standalone ``expect``; 0 under a manager)
    peers: int = 0  # senders connected now (at most ``max_peers``)
    peers_evicted: int = 0  # senders cut at the cap to admit a newcomer (ACK-5)
    peers_timed_out: int = 0  # cut for no handshake, or no message, in time (ACK-5)
    pongs: int = 0  # ZMTP PINGs answered (ACK-6)


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
        max_peers: int | None = None,
        silent_timeout: float = SILENT_TIMEOUT,
        decoder: Decoder | None = None,
        on_event: EventCallback | None = None,
    ) -> None:
        if max_peers is None:
            max_peers = default_max_peers()
        elif type(max_peers) is not int or max_peers < 1:
            raise ValueError(f"max_peers must be an int >= 1 (or None), not {max_peers!r}")
        if not silent_timeout > 0:
            raise ValueError(f"silent_timeout must be positive, not {silent_timeout!r}")
        self.max_peers = max_peers
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
        self._zmtp = ZmtpPull(
            self._pull, self._on_message, self._on_malformed, max_peers, silent_timeout
        )
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

    def decode_with(self, decoder: Decoder) -> None:
        """Read every message from now on with ``decoder``: for a backend made after this
        listener, because it needs the listener's port (one attribute store, read by the
        listener thread per message)."""
        if not callable(decoder):
            raise TypeError("decoder must be callable")
        self._decode = decoder

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
                peers=self._zmtp.connected,
                peers_evicted=self._zmtp.evicted,
                peers_timed_out=self._zmtp.timed_out,
                pongs=self._zmtp.pongs,
            )

    # --- the listener thread ------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while True:
                # Wake for the next handshake or first-message deadline (ACK-5); otherwise
                # sleep until something arrives.
                due = self._zmtp.next_deadline()
                ready = dict(poller.poll(None if due is None else int(due * 1000.0) + 1))
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

    def _on_message(self, frames: list[bytes]) -> int:
        """Decode and deliver one message: TAKEN (a room in flight: its sender becomes
        *proven*, ACK-5), DROPPED (a well-formed event for no room of ours) or REFUSED (not a
        message of this wire: the sender broke the protocol and is cut, ACK-2)."""
        try:
            event = self._decode(frames)
        except Exception:  # a decoder must not raise; if one does, the thread lives on
            _log.exception("ack decoder raised")
            event = None
        if event is None:
            return REFUSED
        with self._lock:
            self._received += 1
        if self._on_event is not None:
            if not self._call(self._on_event, event, event.room):
                with self._lock:
                    self._unknown += 1
                return DROPPED
            return TAKEN
        if not isinstance(event, PrefillStatus) or event.status != KVPoll.Success:
            with self._lock:
                self._unknown += 1  # standalone, only successes complete a room
            return DROPPED
        with self._lock:
            pending = self._pending.get(event.room)
            if pending is None:
                self._unknown += 1
                return DROPPED
            if event.prefill_rank in pending.ranks:
                self._duplicates += 1
                return TAKEN
            pending.ranks.add(event.prefill_rank)
            if len(pending.ranks) < pending.needed:
                return TAKEN
            del self._pending[event.room]
            self._completed += 1
        # Outside the lock: a callback may call expect()/forget() itself.
        self._call(pending.callback, event.room, event.room)
        return TAKEN

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
