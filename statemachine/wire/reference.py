"""The reference ZMQ wire, both directions: what the decode sends a prefill rank and what the
rank pushes back (``spec/zmq.md`` ZMQ-9 ... ZMQ-11, ZMQ-21, ZMQ-22; ``spec/manager.md`` MGR-5/6).

:class:`SimpleBackend` is a small reference :class:`~statemachine.backend.KVBackend` in SGLang's
style, used by the reference prefill rank process (:mod:`statemachine.prefill.rank`), the tests,
the demo and the benchmarks. Every message is multipart; its first frame names the kind;
integers are ASCII decimal; pointer and index lists are packed little-endian with
:mod:`struct`.

Each message is written once, its encoder beside its decoder (as SGLang pairs ``to_zmq`` and
``from_zmq`` in one struct per message):

============  =========================================  ========================================
message       built by                                   read by
============  =========================================  ========================================
register      ``SimpleBackend.register_frames``          :func:`parse_register`
metadata      ``SimpleBackend.metadata_frames``          :func:`parse_metadata`
abort         ``SimpleBackend.abort_frames``             :func:`parse_abort`
bootstrap     ``SimpleBackend.bootstrap_frames``         :func:`parse_bootstrap`
ack           :func:`ack_frames`                         :func:`parse_ack`, :func:`decode_reply`
ready         :func:`ready_frames`                       :func:`decode_reply`
failed        :func:`failed_frames`                      :func:`decode_reply`
abort_ack     :func:`abort_ack_frames`                   :func:`decode_reply`
============  =========================================  ========================================

The parsers of the decode's messages (prefill side) are strict and raise
:class:`MalformedFrames`; :func:`decode_reply` (decode side, the listener's decoder) never
raises and returns None for anything that is not a reply.

As in SGLang, *every* rank of a generation gets the register and metadata messages, dummy
ranks included: the last frame says whether this decode rank is a dummy peer for that prefill
rank, so the prefill rank knows how many decode peers to wait for and transfers (and acks) only
to the non-dummy one.

Every message to a rank may end with one more frame: the *target instance id*, the instance id
of the generation the decode is sending to (``Generation.instance_id``: the bootstrap server's
``X-Bootstrap-Instance-Id``, or the etcd registration's instance id). In queueing mode libzmq
delivers frames queued for a dead rank's port to whatever process binds that port next; the
target instance lets that process see the frames are not for it and drop them (ZMQ-21), instead
of acking a transfer it never did. A generation without an instance id gives the layout without
the frame, which is also what a decode from before this frame sends.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from statemachine.completion import (
    AbortAck,
    KVPoll,
    PrefillEvent,
    PrefillStatus,
)
from statemachine.errors import MalformedFrames
from statemachine.pool import RankInfo
from statemachine.wire.metadata import INT32_MAX, INT64_MAX, UINT64_MAX, MetadataRequest, check_int

REGISTER_KIND = b"register"
METADATA_KIND = b"metadata"
ABORT_KIND = b"abort"
BOOTSTRAP_KIND = b"bootstrap"
# What the reference prefill rank pushes back (ZMQ-11, ZMQ-22).
ACK_KIND = b"ack"
READY_KIND = b"ready"
FAILED_KIND = b"failed"
ABORT_ACK_KIND = b"abort_ack"
#: Longest failure reason a ``failed`` message may carry (UTF-8 bytes).
MAX_REASON_BYTES = 1024
_FLAG = {False: b"0", True: b"1"}
# Strict ASCII decimal: int() alone would also accept b" 7", b"+7" and b"1_000".
_ASCII_INT = re.compile(rb"-?[0-9]{1,20}")
_MAX_HOST_LEN = 253
#: Longest target instance id a frame may carry (UTF-8 bytes). The bootstrap server's ids are 32
#: hex chars and the etcd registrar's at most 128; the bound only keeps a hostile frame small.
MAX_INSTANCE_ID_BYTES = 256
# Encoded instance ids, so the hot path does not encode the same str per rank per request.
# Instance ids change only on restarts; the cache is cleared past this size.
_MAX_CACHED_IDS = 64


@dataclass(frozen=True, slots=True)
class RegisterMessage:
    """A parsed register message (the decode's KV args)."""

    decode_ip: str
    decode_port: int
    session_id: str
    decode_tp_rank: int
    decode_tp_size: int
    target_pp_rank: int
    kv_item_len: int
    kv_ptrs: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    is_dummy: bool
    #: the instance the frames are addressed to; None from a decode that names none
    instance_id: str | None = None


@dataclass(frozen=True, slots=True)
class MetadataMessage:
    """A parsed metadata message: the request, and where its completion ack goes."""

    room: int
    decode_ip: str
    decode_port: int
    session_id: str
    target_pp_rank: int
    kv_indices: tuple[int, ...]
    aux_index: int
    prefix_len: int
    is_dummy: bool
    #: the instance the frames are addressed to; None from a decode that names none
    instance_id: str | None = None


@dataclass(frozen=True, slots=True)
class AbortMessage:
    """A parsed abort notification: the decode gave up on ``room``."""

    room: int
    session_id: str
    target_pp_rank: int
    #: the instance the frames are addressed to; None from a decode that names none
    instance_id: str | None = None
    #: the abort sequence number to echo in the ABORT_ACK; None: a legacy abort, acknowledged by
    #: none
    abort_seq: int | None = None


@dataclass(frozen=True, slots=True)
class BootstrapMessage:
    """A parsed BOOTSTRAP: the decode waits for ``room``; the ready status goes to its endpoint."""

    room: int
    decode_ip: str
    decode_port: int
    session_id: str
    target_pp_rank: int
    #: the instance the frames are addressed to; None from a decode that names none
    instance_id: str | None = None


# Frame counts, including the kind frame, without the optional target instance frame (ZMQ-21),
# which makes each one frame longer.
REGISTER_FRAMES = 11
METADATA_FRAMES = 10
ABORT_FRAMES = 4
BOOTSTRAP_FRAMES = 6
#: An abort with a sequence number: the 4 frames, the target instance frame (``b""`` when the
#: pool entry has no instance id) and the abort sequence number.
ABORT_GENERATION_FRAMES = 6
_MAX_PREFILL_RANK_PART = 2**32 - 1


class SimpleBackend:
    """The reference layout. ``decode_ip``/``decode_port`` name the decode's ack endpoint.

    Register frames are built once per (target pp rank, dummy flag, instance) and reused, so
    registering a new generation allocates nothing but the list.
    """

    __slots__ = (
        "_ids",
        "_register_cache",
        "_session",
        "_tail",
        "decode_ip",
        "decode_port",
        "session_id",
    )

    def __init__(
        self,
        decode_ip: str,
        decode_port: int,
        session_id: str,
        kv_ptrs: Sequence[int] = (),
        aux_ptrs: Sequence[int] = (),
        *,
        kv_item_len: int = 0,
        decode_tp_rank: int = 0,
        decode_tp_size: int = 1,
    ) -> None:
        _check_host(decode_ip)
        check_int("decode_port", decode_port, 1, 65535)
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty str")
        for ptr in (*kv_ptrs, *aux_ptrs):
            check_int("pointer", ptr, 0, UINT64_MAX)
        check_int("kv_item_len", kv_item_len, 0, INT32_MAX)
        check_int("decode_tp_size", decode_tp_size, 1, INT32_MAX)
        check_int("decode_tp_rank", decode_tp_rank, 0, decode_tp_size - 1)
        self.decode_ip = decode_ip
        self.decode_port = decode_port
        self.session_id = session_id
        # (ip, port, session) follow the kind frame in both messages.
        self._session = (decode_ip.encode(), b"%d" % decode_port, session_id.encode())
        self._tail = (
            b"%d" % decode_tp_rank,
            b"%d" % decode_tp_size,
            b"%d" % kv_item_len,
            _pack_u64(kv_ptrs),
            _pack_u64(aux_ptrs),
        )
        self._register_cache: dict[tuple[int, bool, str | None], list[bytes]] = {}
        self._ids: dict[str, bytes] = {}

    def _target(self, instance_id: str | None) -> tuple[bytes, ...]:
        """The optional last frame (ZMQ-21): ``()`` without a usable instance id."""
        if instance_id is None:
            return ()
        encoded = self._ids.get(instance_id)
        if encoded is None:
            encoded = self._encode(instance_id)
        return (encoded,) if encoded else ()

    def _encode(self, instance_id: str) -> bytes:
        encoded = encode_instance_id(instance_id)
        if len(self._ids) >= _MAX_CACHED_IDS:
            self._ids.clear()
        self._ids[instance_id] = encoded
        return encoded

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        cache_key = (rank.pp_rank, rank.is_dummy, instance_id)
        frames = self._register_cache.get(cache_key)
        if frames is None:
            tp_rank, tp_size, item_len, kv, aux = self._tail
            frames = [
                REGISTER_KIND,
                *self._session,
                tp_rank,
                tp_size,
                b"%d" % rank.pp_rank,
                item_len,
                kv,
                aux,
                _FLAG[rank.is_dummy],
                *self._target(instance_id),
            ]
            if len(self._register_cache) >= _MAX_CACHED_IDS:
                self._register_cache.clear()  # bounded: instance ids change with restarts
            self._register_cache[cache_key] = frames
        return list(frames)  # a copy: the caller may hold on to it

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        frames = [
            METADATA_KIND,
            request.ascii_room,
            *self._session,
            b"%d" % rank.pp_rank,
            request.kv_bytes,
            request.ascii_aux_index,
            request.ascii_prefix_len,
            _FLAG[rank.is_dummy],
        ]
        if instance_id is not None:  # the hot path: one dict.get, no call (ZMQ-21)
            encoded = self._ids.get(instance_id)
            if encoded is None:
                encoded = self._encode(instance_id)
            if encoded:
                frames.append(encoded)
        return frames

    def abort_frames(
        self,
        rank: RankInfo,
        room: int,
        *,
        instance_id: str | None = None,
        abort_seq: int | None = None,
    ) -> list[bytes]:
        check_int("room", room, 0, UINT64_MAX)
        frames = [ABORT_KIND, b"%d" % room, self._session[2], b"%d" % rank.pp_rank]
        target = self._target(instance_id)
        if abort_seq is None:
            frames.extend(target)
            return frames
        check_int("abort_seq", abort_seq, 0, INT64_MAX)
        # The instance frame is always present here (b"" for none), so the frame count alone
        # says which layout this is (ZMQ-22).
        frames.append(target[0] if target else b"")
        frames.append(b"%d" % abort_seq)
        return frames

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        check_int("room", room, 0, UINT64_MAX)
        return [
            BOOTSTRAP_KIND,
            b"%d" % room,
            *self._session,
            b"%d" % rank.pp_rank,
            *self._target(instance_id),
        ]

    def decode_message(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        return decode_reply(frames)


def prefill_rank_id(tp_rank: int, pp_rank: int) -> int:
    """The prefill-rank id of a reference rank's replies: distinct per (tp rank, pp rank).

    The reference layout names the sender by its tp and pp ranks (ZMQ-11), not by SGLang's
    single id (whose formula needs the prefill's pp and cp sizes); this packs the pair into one
    int so completion can count distinct senders the same way for every backend.
    """
    return (tp_rank << 32) | pp_rank


@dataclass(frozen=True, slots=True)
class Ack:
    """A parsed success ack: ``tp_rank``/``pp_rank`` of the prefill rank that finished ``room``."""

    room: int
    tp_rank: int
    pp_rank: int


#: Frames of an ack, kind included.
ACK_FRAMES = 4


def ack_frames(room: int, tp_rank: int, pp_rank: int) -> list[bytes]:
    """The reference rank's success ack: the transfer of ``room`` is done (ZMQ-11)."""
    return [ACK_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank]


def parse_ack(frames: Sequence[bytes]) -> Ack:
    """Parse an ack strictly; :class:`MalformedFrames` if it is not one."""
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


def ready_frames(room: int, tp_rank: int, pp_rank: int) -> list[bytes]:
    """The reference rank's answer to BOOTSTRAP: WaitingForInput for ``room`` (ZMQ-22)."""
    return [READY_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank]


def failed_frames(room: int, tp_rank: int, pp_rank: int, reason: str) -> list[bytes]:
    """A reference-layout failure status carrying the prefill's reason (ZMQ-22)."""
    return [FAILED_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank, _reason_bytes(reason)]


def abort_ack_frames(room: int, tp_rank: int, pp_rank: int, abort_seq: int) -> list[bytes]:
    """The reference rank's acknowledgement of an abort with a sequence number (ZMQ-22)."""
    return [ABORT_ACK_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank, b"%d" % abort_seq]


def _reason_bytes(reason: str) -> bytes:
    encoded = reason.encode("utf-8", errors="replace")[:MAX_REASON_BYTES]
    return encoded.decode("utf-8", errors="ignore").encode("utf-8")  # no cut character


def decode_reply(frames: Sequence[bytes]) -> PrefillEvent | None:
    """A reference-layout reply (ZMQ-11, ZMQ-22) as a completion event; None if it is not one.

    ``[b"ack", room, tp, pp]`` is Success, ``[b"ready", room, tp, pp]`` WaitingForInput,
    ``[b"failed", room, tp, pp, reason]`` Failed and ``[b"abort_ack", room, tp, pp, abort_seq]``
    an :class:`AbortAck`. Every integer is strict non-negative ASCII decimal; tp and pp ranks
    below 2**32. Never raises.
    """
    count = len(frames)
    if count not in (4, 5):
        return None
    kind = bytes(frames[0])
    expected = 5 if kind in (FAILED_KIND, ABORT_ACK_KIND) else 4
    if count != expected:
        return None
    room = _reply_int(frames[1], UINT64_MAX)
    tp_rank = _reply_int(frames[2], _MAX_PREFILL_RANK_PART)
    pp_rank = _reply_int(frames[3], _MAX_PREFILL_RANK_PART)
    if room is None or tp_rank is None or pp_rank is None:
        return None
    sender = prefill_rank_id(tp_rank, pp_rank)
    if kind == ACK_KIND:
        return PrefillStatus(room, KVPoll.Success, sender)
    if kind == READY_KIND:
        return PrefillStatus(room, KVPoll.WaitingForInput, sender)
    if kind == FAILED_KIND:
        raw = bytes(frames[4])
        if len(raw) > MAX_REASON_BYTES:
            return None
        reason = raw.decode("utf-8", errors="replace") or None
        return PrefillStatus(room, KVPoll.Failed, sender, reason)
    if kind == ABORT_ACK_KIND:
        abort_seq = _reply_int(frames[4], INT64_MAX)
        return None if abort_seq is None else AbortAck(room, sender, abort_seq)
    return None


def _reply_int(frame: bytes, high: int) -> int | None:
    """A strict non-negative ASCII integer ``<= high``, else None (never raises)."""
    raw = bytes(frame)
    if not raw.isdigit() or len(raw) > 20:  # bytes.isdigit() is ASCII-only
        return None
    value = int(raw)
    return value if value <= high else None


def encode_instance_id(instance_id: str) -> bytes:
    """The target-instance frame for ``instance_id`` (UTF-8), or ``b""`` if it cannot be one.

    An id no frame can carry (empty, longer than :data:`MAX_INSTANCE_ID_BYTES`, not encodable)
    comes from a source that gave no usable id: the message goes without the frame, as from a
    decode that names no instance, rather than failing the request with an untyped error.
    """
    try:
        encoded = instance_id.encode("utf-8")
    except UnicodeEncodeError:
        return b""
    return encoded if len(encoded) <= MAX_INSTANCE_ID_BYTES else b""


# --- parsing (prefill side) -------------------------------------------------------------------


def parse_register(frames: Sequence[bytes]) -> RegisterMessage:
    """Parse a :class:`SimpleBackend` register message; :class:`MalformedFrames` if it is not."""
    kind = "register"
    _check_shape(frames, REGISTER_KIND, REGISTER_FRAMES, kind)
    instance_id = _instance(frames, REGISTER_FRAMES, kind)
    decode_tp_size = _int(frames[5], kind, "decode_tp_size", 1, INT32_MAX)
    return RegisterMessage(
        decode_ip=_host(frames[1], kind),
        decode_port=_int(frames[2], kind, "decode_port", 1, 65535),
        session_id=_text(frames[3], kind, "session_id"),
        decode_tp_rank=_int(frames[4], kind, "decode_tp_rank", 0, decode_tp_size - 1),
        decode_tp_size=decode_tp_size,
        target_pp_rank=_int(frames[6], kind, "target_pp_rank", 0, INT32_MAX),
        kv_item_len=_int(frames[7], kind, "kv_item_len", 0, INT32_MAX),
        kv_ptrs=_unpack(frames[8], "Q", 8, kind, "kv_ptrs"),
        aux_ptrs=_unpack(frames[9], "Q", 8, kind, "aux_ptrs"),
        is_dummy=_flag(frames[10], kind),
        instance_id=instance_id,
    )


def parse_metadata(frames: Sequence[bytes]) -> MetadataMessage:
    """Parse a :class:`SimpleBackend` metadata message; :class:`MalformedFrames` if it is not."""
    kind = "metadata"
    _check_shape(frames, METADATA_KIND, METADATA_FRAMES, kind)
    instance_id = _instance(frames, METADATA_FRAMES, kind)
    return MetadataMessage(
        room=_int(frames[1], kind, "room", 0, UINT64_MAX),
        decode_ip=_host(frames[2], kind),
        decode_port=_int(frames[3], kind, "decode_port", 1, 65535),
        session_id=_text(frames[4], kind, "session_id"),
        target_pp_rank=_int(frames[5], kind, "target_pp_rank", 0, INT32_MAX),
        kv_indices=_unpack(frames[6], "i", 4, kind, "kv_indices"),
        aux_index=_int(frames[7], kind, "aux_index", 0, INT32_MAX),
        prefix_len=_int(frames[8], kind, "prefix_len", 0, INT32_MAX),
        is_dummy=_flag(frames[9], kind),
        instance_id=instance_id,
    )


def parse_abort(frames: Sequence[bytes]) -> AbortMessage:
    """Parse a :class:`SimpleBackend` abort message; :class:`MalformedFrames` if it is not.

    4 frames (5 with the target instance) is a legacy abort; 6 frames carry the target instance
    (``b""`` for none) and the abort sequence number (ZMQ-22).
    """
    kind = "abort"
    if len(frames) == ABORT_GENERATION_FRAMES and frames[0] == ABORT_KIND:
        target = bytes(frames[4])
        instance_id = _instance(frames[:5], ABORT_FRAMES, kind) if target else None
        abort_seq: int | None = _int(frames[5], kind, "abort_seq", 0, INT64_MAX)
    else:
        _check_shape(frames, ABORT_KIND, ABORT_FRAMES, kind)
        instance_id = _instance(frames, ABORT_FRAMES, kind)
        abort_seq = None
    return AbortMessage(
        room=_int(frames[1], kind, "room", 0, UINT64_MAX),
        session_id=_text(frames[2], kind, "session_id"),
        target_pp_rank=_int(frames[3], kind, "target_pp_rank", 0, INT32_MAX),
        instance_id=instance_id,
        abort_seq=abort_seq,
    )


def parse_bootstrap(frames: Sequence[bytes]) -> BootstrapMessage:
    """Parse a :class:`SimpleBackend` BOOTSTRAP; :class:`MalformedFrames` if it is not."""
    kind = "bootstrap"
    _check_shape(frames, BOOTSTRAP_KIND, BOOTSTRAP_FRAMES, kind)
    return BootstrapMessage(
        room=_int(frames[1], kind, "room", 0, UINT64_MAX),
        decode_ip=_host(frames[2], kind),
        decode_port=_int(frames[3], kind, "decode_port", 1, 65535),
        session_id=_text(frames[4], kind, "session_id"),
        target_pp_rank=_int(frames[5], kind, "target_pp_rank", 0, INT32_MAX),
        instance_id=_instance(frames, BOOTSTRAP_FRAMES, kind),
    )


def message_kind(frames: Sequence[bytes]) -> bytes:
    """The kind frame of a message (``b""`` for an empty message), for dispatch."""
    return bytes(frames[0]) if frames else b""


# --- helpers ---------------------------------------------------------------------------------


def _check_host(host: object) -> None:
    if not isinstance(host, str) or not host or len(host) > _MAX_HOST_LEN:
        raise ValueError(f"bad host {host!r}")
    if not host.isascii() or any(c.isspace() for c in host):
        raise ValueError(f"bad host {host!r}")


def _pack_u64(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def _check_shape(frames: Sequence[bytes], kind_frame: bytes, count: int, kind: str) -> None:
    """``count`` frames, or ``count + 1`` with the target instance frame (ZMQ-21)."""
    if len(frames) not in (count, count + 1):
        raise MalformedFrames(
            f"{kind}: expected {count} or {count + 1} frames, got {len(frames)}", kind=kind
        )
    if frames[0] != kind_frame:
        raise MalformedFrames(f"{kind}: first frame is {bytes(frames[0])[:32]!r}", kind=kind)


def _int(frame: bytes, kind: str, name: str, low: int, high: int) -> int:
    if _ASCII_INT.fullmatch(frame) is None:
        raise MalformedFrames(f"{kind}: {name} is not an ASCII integer: {frame[:32]!r}", kind=kind)
    value = int(frame)
    if not low <= value <= high:
        raise MalformedFrames(f"{kind}: {name} {value} out of range", kind=kind)
    return value


def _instance(frames: Sequence[bytes], count: int, kind: str) -> str | None:
    """The target instance id of a message with the optional last frame, else None."""
    if len(frames) == count:
        return None
    frame = bytes(frames[count])
    if not frame or len(frame) > MAX_INSTANCE_ID_BYTES:
        raise MalformedFrames(
            f"{kind}: target instance id of {len(frame)} bytes (1-{MAX_INSTANCE_ID_BYTES})",
            kind=kind,
        )
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedFrames(f"{kind}: target instance id is not UTF-8", kind=kind) from None


def _flag(frame: bytes, kind: str) -> bool:
    if frame == b"1":
        return True
    if frame == b"0":
        return False
    raise MalformedFrames(f"{kind}: dummy flag must be b'0' or b'1': {frame[:8]!r}", kind=kind)


def _text(frame: bytes, kind: str, name: str) -> str:
    try:
        text = bytes(frame).decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedFrames(f"{kind}: {name} is not UTF-8", kind=kind) from None
    if not text:
        raise MalformedFrames(f"{kind}: {name} is empty", kind=kind)
    return text


def _host(frame: bytes, kind: str) -> str:
    try:
        host = bytes(frame).decode("ascii")
        _check_host(host)
    except (UnicodeDecodeError, ValueError):
        raise MalformedFrames(f"{kind}: bad decode_ip {frame[:64]!r}", kind=kind) from None
    return host


def _unpack(frame: bytes, code: str, size: int, kind: str, name: str) -> tuple[int, ...]:
    if len(frame) % size:
        raise MalformedFrames(
            f"{kind}: {name} length {len(frame)} not a multiple of {size}", kind=kind
        )
    values: tuple[int, ...] = struct.unpack(f"<{len(frame) // size}{code}", frame)
    return values
