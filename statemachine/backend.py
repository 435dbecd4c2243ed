"""What the decode sends to prefill ranks over ZMQ: the KV-backend frame layouts.

The bootstrap layer only carries frames; their layout belongs to the transfer backend
(Mooncake, NIXL and MORI each have their own). :class:`KVBackend` is the seam:
:class:`~statemachine.decode.ranks.transport.ZmqTransport` asks a backend for the frames of each
message and sends them, nothing more.

:class:`SimpleBackend` is a small reference layout in SGLang's style, used by the reference
prefill rank process (:mod:`statemachine.prefill.rank`), the tests, the demo and the
benchmarks. Every message is multipart; its first frame names the kind; integers are ASCII
decimal; pointer and index lists are packed little-endian with :mod:`struct`. The layouts are
specified in ``spec/zmq.md`` (ZMQ-9, ZMQ-10, ZMQ-21) and ``spec/manager.md`` (the dummy flag
and the abort message, MGR-5/MGR-6), and parsed back, strictly, by :func:`parse_register`,
:func:`parse_metadata` and :func:`parse_abort`, which raise :class:`MalformedFrames`.

As in SGLang, *every* rank of a generation gets the register and metadata messages, dummy
ranks included: the last frame says whether this decode rank is a dummy peer for that prefill
rank, so the prefill rank knows how many decode peers to wait for and transfers (and acks) only
to the non-dummy one.

Every message may end with one more frame: the *target instance id*, the instance id of the
generation the decode is sending to (``Generation.instance_id``: the bootstrap server's
``X-Bootstrap-Instance-Id``, or the etcd registration's instance id). In queueing mode libzmq
delivers frames queued for a dead rank's port to whatever process binds that port next; the
target instance lets that process see the frames are not for it and drop them (ZMQ-21), instead
of acking a transfer it never did. A generation without an instance id gives the layout without
the frame, which is also what a decode from before this frame sends.

The backend also owns the other direction: :meth:`KVBackend.decode_message` turns one message the
prefill pushed to the decode's own endpoint into a wire-independent completion event
(:mod:`statemachine.completion`), so the decode's listener never needs to know a layout. SGLang's
own layouts, per SGLang release, live in :mod:`statemachine.sglang` (``spec/sglang-wire.md``).
"""

from __future__ import annotations

import operator
import re
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from statemachine.completion import (
    STATUS_FAILED,
    STATUS_SUCCESS,
    STATUS_WAITING_FOR_INPUT,
    AbortAck,
    PrefillEvent,
    PrefillStatus,
)
from statemachine.errors import BootstrapError, InvalidKVIndices
from statemachine.pool import RankInfo

REGISTER_KIND = b"register"
METADATA_KIND = b"metadata"
ABORT_KIND = b"abort"
BOOTSTRAP_KIND = b"bootstrap"
# What the reference prefill rank pushes back (ZMQ-11, ZMQ-22). ``b"ack"`` is the success ack of
# :func:`statemachine.decode.ranks.acks.ack_frames`; it is repeated here, not imported, because
# that module imports this one.
SUCCESS_KIND = b"ack"
READY_KIND = b"ready"
FAILED_KIND = b"failed"
ABORT_ACK_KIND = b"abort_ack"
#: Longest failure reason a ``failed`` message may carry (UTF-8 bytes).
MAX_REASON_BYTES = 1024
_FLAG = {False: b"0", True: b"1"}

_INT32_MIN = -(2**31)
#: What a caller does about bad page indices (every InvalidKVIndices message ends with it).
_KV_NEXT = (
    "pass the request's KV page indices as a sequence of ints or a 1-d integer numpy array "
    "(nothing was sent; the request is unchanged)"
)
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
_INT64_MAX = 2**63 - 1
# Strict ASCII decimal: int() alone would also accept b" 7", b"+7" and b"1_000".
_ASCII_INT = re.compile(rb"-?[0-9]{1,20}")
_MAX_HOST_LEN = 253
#: Longest target instance id a frame may carry (UTF-8 bytes). The bootstrap server's ids are 32
#: hex chars and the etcd registrar's at most 128; the bound only keeps a hostile frame small.
MAX_INSTANCE_ID_BYTES = 256
# Encoded instance ids, so the hot path does not encode the same str per rank per request.
# Instance ids change only on restarts; the cache is cleared past this size.
_MAX_CACHED_IDS = 64


class MalformedFrames(BootstrapError, ValueError):
    """A ZMQ message did not have the layout its kind requires. Nothing was acted on."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class MetadataRequest:
    """The per-request part of a metadata message: which KV pages the prefill should fill.

    ``kv_indices`` is any sequence of ints (a tuple, a list, an ``array.array``) or a 1-d numpy
    integer array, as SGLang passes ``np.int32`` page indices. It is packed once, here, to the
    wire's little-endian int32 bytes by C code (``array`` or numpy), never element by element in
    Python; out-of-range or non-integer items raise at construction, so a bad request never
    reaches a socket. numpy is optional: it is only used for an object that already is a numpy
    array (the module is looked up in ``sys.modules``, never imported here).

    The keyword-only fields are what SGLang's layouts carry besides (``spec/sglang-wire.md``):

    * ``required_dst_info_num``: how many decode ranks the prefill rank waits for before it
      transfers (the plan's ``required_dst_info_num``; 1 unless decode tp > prefill tp);
    * ``state_indices``: one list of int32 indices per state type of a hybrid model (Mamba,
      SWA, DSA); an entry None counts as an empty list, as SGLang's NIXL builder does. Packed
      once into SGLang's list-of-lists container (:func:`pack_int_lists`, code ``i``);
    * ``device_kv_indices``: the device page indices of a HiSparse decode (Mooncake only); None
      for every other decode.

    :class:`SimpleBackend` ignores all three.
    """

    __slots__ = (
        "ascii_aux_index",
        "ascii_prefix_len",
        "ascii_required_dst_info_num",
        "ascii_room",
        "aux_index",
        "device_kv_bytes",
        "kv_bytes",
        "prefix_len",
        "required_dst_info_num",
        "room",
        "state_bytes",
    )

    def __init__(
        self,
        room: int,
        kv_indices: Sequence[int] | Any,
        aux_index: int,
        prefix_len: int = 0,
        *,
        required_dst_info_num: int = 1,
        state_indices: Sequence[Sequence[int] | Any | None] | None = (),
        device_kv_indices: Sequence[int] | Any | None = None,
    ) -> None:
        # One chained test for the usual plain ints; anything else gets the named checks.
        if not (
            type(room) is int
            and 0 <= room <= _UINT64_MAX
            and type(aux_index) is int
            and 0 <= aux_index <= _INT32_MAX
            and type(prefix_len) is int
            and 0 <= prefix_len <= _INT32_MAX
            and type(required_dst_info_num) is int
            and 1 <= required_dst_info_num <= _INT32_MAX
        ):
            _check_int("room", room, 0, _UINT64_MAX)
            _check_int("aux_index", aux_index, 0, _INT32_MAX)
            _check_int("prefix_len", prefix_len, 0, _INT32_MAX)
            _check_int("required_dst_info_num", required_dst_info_num, 1, _INT32_MAX)
        self.room = room
        self.aux_index = aux_index
        self.prefix_len = prefix_len
        self.required_dst_info_num = required_dst_info_num
        # The integers as every layout carries them (ASCII decimal), formatted once per request
        # rather than once per rank.
        self.ascii_room = b"%d" % room
        self.ascii_aux_index = b"%d" % aux_index
        self.ascii_prefix_len = b"%d" % prefix_len
        self.ascii_required_dst_info_num = b"%d" % required_dst_info_num
        #: the page indices as the wire carries them: ``<i4`` each
        self.kv_bytes: bytes = pack_indices(kv_indices)
        #: the state indices in SGLang's list-of-lists container (``b""`` for none)
        self.state_bytes: bytes = (
            b""
            if state_indices.__class__ is tuple and not state_indices  # the default, ()
            else _pack_state_indices(state_indices)
        )
        #: the HiSparse device page indices, ``<i4`` each (``b""`` for none)
        self.device_kv_bytes: bytes = (
            b"" if device_kv_indices is None else pack_indices(device_kv_indices)
        )

    @property
    def kv_indices(self) -> tuple[int, ...]:
        """The page indices as a tuple (decoded from the packed bytes; not for the hot path)."""
        values: tuple[int, ...] = struct.unpack(f"<{len(self.kv_bytes) // 4}i", self.kv_bytes)
        return values

    @property
    def state_indices(self) -> tuple[tuple[int, ...], ...]:
        """The state index lists (decoded from the packed bytes; not for the hot path)."""
        return unpack_int_lists(self.state_bytes, "i")

    def __repr__(self) -> str:
        return (
            f"MetadataRequest(room={self.room}, kv_indices=<{len(self.kv_bytes) // 4} pages>, "
            f"aux_index={self.aux_index}, prefix_len={self.prefix_len}, "
            f"required_dst_info_num={self.required_dst_info_num}, "
            f"state_indices=<{len(self.state_indices)} lists>, "
            f"device_kv_indices=<{len(self.device_kv_bytes) // 4} pages>)"
        )


def _pack_state_indices(lists: Sequence[Sequence[int] | Any | None] | None) -> bytes:
    if lists is None:
        return b""
    if isinstance(lists, (str, bytes, bytearray, memoryview)) or not isinstance(lists, Sequence):
        raise InvalidKVIndices(
            f"state_indices must be a sequence of index lists, not {type(lists).__name__}: "
            "pass one list of ints (or None) per state pool (nothing was sent; the request is "
            "unchanged)"
        )
    return pack_buffers([b"" if item is None else pack_indices(item) for item in lists])


def pack_int_lists(lists: Sequence[Sequence[int]], code: str) -> bytes:
    """Pack int lists into SGLang's list-of-lists container (``struct`` code ``i``/``I``/``Q``).

    The container: ``b""`` for no list; otherwise a little-endian uint32 count ``n``, ``n``
    uint32 byte lengths, then each list packed little-endian. Raises ``struct.error`` for a value
    the code cannot hold.
    """
    return pack_buffers([struct.pack(f"<{len(values)}{code}", *values) for values in lists])


def pack_buffers(buffers: Sequence[bytes]) -> bytes:
    """The list-of-lists container over already packed buffers (see :func:`pack_int_lists`)."""
    if not buffers:
        return b""
    header = struct.pack(f"<{len(buffers) + 1}I", len(buffers), *(len(b) for b in buffers))
    return header + b"".join(buffers)


def unpack_int_lists(data: bytes, code: str) -> tuple[tuple[int, ...], ...]:
    """Inverse of :func:`pack_int_lists`; ``ValueError`` if ``data`` is not such a container."""
    if not data:
        return ()
    width = struct.calcsize(f"<{code}")
    if len(data) < 4:
        raise ValueError("int-lists container shorter than its count")
    (count,) = struct.unpack_from("<I", data)
    if len(data) < 4 + 4 * count:
        raise ValueError(f"int-lists container too short for {count} lengths")
    lengths = struct.unpack_from(f"<{count}I", data, 4)
    offset = 4 + 4 * count
    if offset + sum(lengths) != len(data) or any(length % width for length in lengths):
        raise ValueError("int-lists container lengths do not match its data")
    lists = []
    for length in lengths:
        lists.append(struct.unpack_from(f"<{length // width}{code}", data, offset))
        offset += length
    return tuple(lists)


def _first_non_int(values: Sequence[Any]) -> str:
    """The type name of the first item that is not an integer (for the error message)."""
    for value in values:
        try:
            operator.index(value)
        except TypeError:
            return type(value).__name__
    return "ints"  # pragma: no cover - array() refused something index() accepts


def pack_indices(indices: Sequence[int] | Any) -> bytes:
    """Pack page indices to little-endian int32 bytes without a Python loop over them.

    Raises ``TypeError`` for something that is not a sequence of ints (``str``/``bytes``, floats,
    a numpy float or 2-d array) and ``ValueError`` for an item outside int32.
    """
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(indices, numpy.ndarray):
        if indices.dtype is _wire_dtype(numpy) and indices.ndim == 1:
            # What SGLang passes: already the wire's type, so every item is in range and
            # tobytes() (which also reads a strided view in order) is the whole job.
            wire: bytes = indices.tobytes()
            return wire
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise InvalidKVIndices(
                f"kv_indices must be a 1-d integer array, not {indices.ndim}-d {indices.dtype}: "
                + _KV_NEXT
            )
        if indices.size and (int(indices.min()) < _INT32_MIN or int(indices.max()) > _INT32_MAX):
            raise InvalidKVIndices("kv_indices item out of int32 range: " + _KV_NEXT)
        packed: bytes = numpy.ascontiguousarray(indices, dtype="<i4").tobytes()
        return packed
    if isinstance(indices, (str, bytes, bytearray, memoryview)) or not isinstance(
        indices, (Sequence, array)
    ):
        raise InvalidKVIndices(
            f"kv_indices must be a sequence of ints, not {type(indices).__name__}: " + _KV_NEXT
        )
    if isinstance(indices, array) and indices.typecode == "i" and indices.itemsize == 4:
        values = indices
    else:
        try:
            values = array("i", indices)  # C loop: rejects floats and non-ints, checks range
        except OverflowError:
            raise InvalidKVIndices("kv_indices item out of int32 range: " + _KV_NEXT) from None
        except TypeError:
            raise InvalidKVIndices(
                f"kv_indices items must be ints, not {_first_non_int(indices)}: " + _KV_NEXT
            ) from None
    if values.itemsize != 4:  # pragma: no cover - C int is 4 bytes on every supported platform
        raise TypeError("this platform's C int is not 4 bytes")
    if sys.byteorder == "big":  # pragma: no cover - the wire is little-endian
        values = array("i", values)
        values.byteswap()
    return values.tobytes()


_WIRE_DTYPE: Any = None


def _wire_dtype(numpy: Any) -> Any:
    """numpy's little-endian int32 dtype (the wire's ``<i4``), looked up once numpy is in use."""
    global _WIRE_DTYPE
    if _WIRE_DTYPE is None:
        _WIRE_DTYPE = numpy.dtype("<i4")
    return _WIRE_DTYPE


class KVBackend(Protocol):
    """Builds the frames of the messages the bootstrap layer sends to a prefill rank, and decodes
    the messages a prefill rank pushes back to the decode.

    ``instance_id`` is the instance id of the generation the message goes to (None when the
    source gave none). The transport always passes it; a backend whose transfer engine has its
    own way to reject a stale peer, or whose prefill would misread the frame, may ignore it.
    """

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        """KV args, sent once per new generation to every rank in it (dummy flagged)."""
        ...

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        """Per-request metadata, sent once per rank (dummy flagged)."""
        ...

    def abort_frames(
        self,
        rank: RankInfo,
        room: int,
        *,
        instance_id: str | None = None,
        generation: int | None = None,
    ) -> list[bytes]:
        """The room was aborted: the prefill rank may free its slot. Sent once per rank.

        ``generation`` None is SGLang's legacy abort (sent by ``abort()`` before the metadata:
        nothing to acknowledge); an int is the abort generation sent after the metadata, on the
        waiting timeout or on a failure, which the prefill echoes in its :class:`AbortAck` once
        the room's transfers drained.
        """
        ...

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        """SGLang's BOOTSTRAP, sent in ``init()`` under the ``prefill_complete`` allocation
        policy: the prefill answers with a WaitingForInput status once it finished the prefill."""
        ...

    def decode_message(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        """One multipart message received on the decode's own endpoint, as a completion event.

        None when the message is not one of this backend's, or is malformed: the caller drops
        it. Never raises, whatever the frames.
        """
        ...


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
    #: the abort generation to echo in the ABORT_ACK; None: a legacy abort, acknowledged by none
    generation: int | None = None


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
#: An abort with a generation: the 4 frames, the target instance frame (``b""`` when the
#: generation has no instance id) and the generation.
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
        _check_int("decode_port", decode_port, 1, 65535)
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty str")
        for ptr in (*kv_ptrs, *aux_ptrs):
            _check_int("pointer", ptr, 0, _UINT64_MAX)
        _check_int("kv_item_len", kv_item_len, 0, _INT32_MAX)
        _check_int("decode_tp_size", decode_tp_size, 1, _INT32_MAX)
        _check_int("decode_tp_rank", decode_tp_rank, 0, decode_tp_size - 1)
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
        generation: int | None = None,
    ) -> list[bytes]:
        _check_int("room", room, 0, _UINT64_MAX)
        frames = [ABORT_KIND, b"%d" % room, self._session[2], b"%d" % rank.pp_rank]
        target = self._target(instance_id)
        if generation is None:
            frames.extend(target)
            return frames
        _check_int("generation", generation, 0, _INT64_MAX)
        # The instance frame is always present here (b"" for none), so the frame count alone
        # says which layout this is (ZMQ-22).
        frames.append(target[0] if target else b"")
        frames.append(b"%d" % generation)
        return frames

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        _check_int("room", room, 0, _UINT64_MAX)
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


def ready_frames(room: int, tp_rank: int, pp_rank: int) -> list[bytes]:
    """The reference rank's answer to BOOTSTRAP: WaitingForInput for ``room`` (ZMQ-22)."""
    return [READY_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank]


def failed_frames(room: int, tp_rank: int, pp_rank: int, reason: str) -> list[bytes]:
    """A reference-layout failure status carrying the prefill's reason (ZMQ-22)."""
    return [FAILED_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank, _reason_bytes(reason)]


def abort_ack_frames(room: int, tp_rank: int, pp_rank: int, generation: int) -> list[bytes]:
    """The reference rank's acknowledgement of an abort with a generation (ZMQ-22)."""
    return [ABORT_ACK_KIND, b"%d" % room, b"%d" % tp_rank, b"%d" % pp_rank, b"%d" % generation]


def _reason_bytes(reason: str) -> bytes:
    encoded = reason.encode("utf-8", errors="replace")[:MAX_REASON_BYTES]
    return encoded.decode("utf-8", errors="ignore").encode("utf-8")  # no cut character


def decode_reply(frames: Sequence[bytes]) -> PrefillEvent | None:
    """A reference-layout reply (ZMQ-11, ZMQ-22) as a completion event; None if it is not one.

    ``[b"ack", room, tp, pp]`` is Success, ``[b"ready", room, tp, pp]`` WaitingForInput,
    ``[b"failed", room, tp, pp, reason]`` Failed and ``[b"abort_ack", room, tp, pp, generation]``
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
    room = _reply_int(frames[1], _UINT64_MAX)
    tp_rank = _reply_int(frames[2], _MAX_PREFILL_RANK_PART)
    pp_rank = _reply_int(frames[3], _MAX_PREFILL_RANK_PART)
    if room is None or tp_rank is None or pp_rank is None:
        return None
    sender = prefill_rank_id(tp_rank, pp_rank)
    if kind == SUCCESS_KIND:
        return PrefillStatus(room, STATUS_SUCCESS, sender)
    if kind == READY_KIND:
        return PrefillStatus(room, STATUS_WAITING_FOR_INPUT, sender)
    if kind == FAILED_KIND:
        raw = bytes(frames[4])
        if len(raw) > MAX_REASON_BYTES:
            return None
        reason = raw.decode("utf-8", errors="replace") or None
        return PrefillStatus(room, STATUS_FAILED, sender, reason)
    if kind == ABORT_ACK_KIND:
        generation = _reply_int(frames[4], _INT64_MAX)
        return None if generation is None else AbortAck(room, sender, generation)
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
    decode_tp_size = _int(frames[5], kind, "decode_tp_size", 1, _INT32_MAX)
    return RegisterMessage(
        decode_ip=_host(frames[1], kind),
        decode_port=_int(frames[2], kind, "decode_port", 1, 65535),
        session_id=_text(frames[3], kind, "session_id"),
        decode_tp_rank=_int(frames[4], kind, "decode_tp_rank", 0, decode_tp_size - 1),
        decode_tp_size=decode_tp_size,
        target_pp_rank=_int(frames[6], kind, "target_pp_rank", 0, _INT32_MAX),
        kv_item_len=_int(frames[7], kind, "kv_item_len", 0, _INT32_MAX),
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
        room=_int(frames[1], kind, "room", 0, _UINT64_MAX),
        decode_ip=_host(frames[2], kind),
        decode_port=_int(frames[3], kind, "decode_port", 1, 65535),
        session_id=_text(frames[4], kind, "session_id"),
        target_pp_rank=_int(frames[5], kind, "target_pp_rank", 0, _INT32_MAX),
        kv_indices=_unpack(frames[6], "i", 4, kind, "kv_indices"),
        aux_index=_int(frames[7], kind, "aux_index", 0, _INT32_MAX),
        prefix_len=_int(frames[8], kind, "prefix_len", 0, _INT32_MAX),
        is_dummy=_flag(frames[9], kind),
        instance_id=instance_id,
    )


def parse_abort(frames: Sequence[bytes]) -> AbortMessage:
    """Parse a :class:`SimpleBackend` abort message; :class:`MalformedFrames` if it is not.

    4 frames (5 with the target instance) is a legacy abort; 6 frames carry the target instance
    (``b""`` for none) and the generation (ZMQ-22).
    """
    kind = "abort"
    if len(frames) == ABORT_GENERATION_FRAMES and frames[0] == ABORT_KIND:
        target = bytes(frames[4])
        instance_id = _instance(frames[:5], ABORT_FRAMES, kind) if target else None
        generation: int | None = _int(frames[5], kind, "generation", 0, _INT64_MAX)
    else:
        _check_shape(frames, ABORT_KIND, ABORT_FRAMES, kind)
        instance_id = _instance(frames, ABORT_FRAMES, kind)
        generation = None
    return AbortMessage(
        room=_int(frames[1], kind, "room", 0, _UINT64_MAX),
        session_id=_text(frames[2], kind, "session_id"),
        target_pp_rank=_int(frames[3], kind, "target_pp_rank", 0, _INT32_MAX),
        instance_id=instance_id,
        generation=generation,
    )


def parse_bootstrap(frames: Sequence[bytes]) -> BootstrapMessage:
    """Parse a :class:`SimpleBackend` BOOTSTRAP; :class:`MalformedFrames` if it is not."""
    kind = "bootstrap"
    _check_shape(frames, BOOTSTRAP_KIND, BOOTSTRAP_FRAMES, kind)
    return BootstrapMessage(
        room=_int(frames[1], kind, "room", 0, _UINT64_MAX),
        decode_ip=_host(frames[2], kind),
        decode_port=_int(frames[3], kind, "decode_port", 1, 65535),
        session_id=_text(frames[4], kind, "session_id"),
        target_pp_rank=_int(frames[5], kind, "target_pp_rank", 0, _INT32_MAX),
        instance_id=_instance(frames, BOOTSTRAP_FRAMES, kind),
    )


def message_kind(frames: Sequence[bytes]) -> bytes:
    """The kind frame of a message (``b""`` for an empty message), for dispatch."""
    return bytes(frames[0]) if frames else b""


# --- helpers ---------------------------------------------------------------------------------


def _check_int(name: str, value: object, low: int, high: int) -> None:
    # bool is an int subclass, but True is never a valid port or index.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} {value} out of range [{low}, {high}]")


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
