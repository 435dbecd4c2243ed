"""The per-request part of a metadata message, packed once for every backend's layout.

:class:`MetadataRequest` is what a decode hands the transport for one request (which KV pages
the prefill should fill); every :class:`~statemachine.backend.KVBackend` - the reference layout
(:mod:`statemachine.wire.reference`) and SGLang's (:mod:`statemachine.sglang`) - reads its
packed bytes. The packers are SGLang's containers: little-endian int32 page indices and the
list-of-lists container of hybrid models' state indices (``spec/sglang-wire.md``).
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from statemachine.errors import InvalidKVIndices

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "UINT64_MAX",
    "MetadataRequest",
    "check_int",
    "pack_buffers",
    "pack_indices",
    "pack_int_lists",
    "unpack_int_lists",
]

_INT32_MIN = -(2**31)
#: What a caller does about bad page indices (every InvalidKVIndices message ends with it).
_KV_NEXT = (
    "pass the request's KV page indices as a sequence of ints or a 1-d integer numpy array "
    "(nothing was sent; the request is unchanged)"
)
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1


def check_int(name: str, value: object, low: int, high: int) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool), ``ValueError`` outside
    ``[low, high]``: the checks every layout applies to what it packs."""
    # bool is an int subclass, but True is never a valid port or index.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} {value} out of range [{low}, {high}]")


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
            and 0 <= room <= UINT64_MAX
            and type(aux_index) is int
            and 0 <= aux_index <= INT32_MAX
            and type(prefix_len) is int
            and 0 <= prefix_len <= INT32_MAX
            and type(required_dst_info_num) is int
            and 1 <= required_dst_info_num <= INT32_MAX
        ):
            check_int("room", room, 0, UINT64_MAX)
            check_int("aux_index", aux_index, 0, INT32_MAX)
            check_int("prefix_len", prefix_len, 0, INT32_MAX)
            check_int("required_dst_info_num", required_dst_info_num, 1, INT32_MAX)
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
        if indices.size and (int(indices.min()) < _INT32_MIN or int(indices.max()) > INT32_MAX):
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
