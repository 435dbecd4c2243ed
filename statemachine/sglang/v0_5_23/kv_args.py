"""The decode rank's KV buffers, as SGLang 0.5.23's registration message describes them.

SGLang's decode manager reads these from its ``KVArgs`` (``base/conn.py:57-120`` of the 0.5.23
wheel) when it builds the registration it sends to every prefill rank of a new pool entry. Here
they are one immutable value, checked once, so that a value the prefill's parser would choke on
(and die of: its bootstrap thread has no handler, ``spec/sglang-wire.md`` SGW-2) is refused
before anything is sent, with what to fix.

Pointers and lengths are plain integers: the library never touches the memory; only the prefill's
transfer engine does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from statemachine.errors import InvalidArgument
from statemachine.wire.metadata import pack_buffers

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
#: NIXL's memory kinds of a KV buffer (``nixl/conn.py:79``).
KV_MEM_KINDS = frozenset({"VRAM", "DRAM"})


def _ints(name: str, values: object, high: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Sequence):
        raise InvalidArgument(f"{name} must be a sequence of ints, got {type(values).__name__}")
    for value in values:
        if type(value) is not int or not 0 <= value <= high:
            raise InvalidArgument(f"{name}: {value!r} is not an int in 0..{high}")
    return tuple(values)


def _int_lists(name: str, lists: object, high: int) -> tuple[tuple[int, ...], ...]:
    if isinstance(lists, (str, bytes, bytearray)) or not isinstance(lists, Sequence):
        raise InvalidArgument(f"{name} must be a sequence of int lists, got {type(lists).__name__}")
    return tuple(_ints(f"{name}[{i}]", values, high) for i, values in enumerate(lists))


def _count(name: str, value: object, low: int) -> int:
    if type(value) is not int or not low <= value <= 2**31 - 1:
        raise InvalidArgument(f"{name} must be an int in {low}..2**31-1, got {value!r}")
    return value


def pack_u64(values: Sequence[int]) -> bytes:
    """Concatenated uint64s, little-endian (SGLang packs native ``Q``: the same bytes on the
    little-endian hosts it runs on)."""
    return struct.pack(f"<{len(values)}Q", *values)


def pack_u32(values: Sequence[int]) -> bytes:
    """Concatenated uint32s, little-endian (SGLang: native ``I``)."""
    return struct.pack(f"<{len(values)}I", *values)


def pack_lists(lists: Sequence[Sequence[int]], code: str) -> bytes:
    """SGLang's list-of-lists container (``common/utils.py:40-70``) of ``code`` lists."""
    return pack_buffers([struct.pack(f"<{len(values)}{code}", *values) for values in lists])


@dataclass(frozen=True, slots=True)
class DecodeKVArgs:
    """What a prefill rank must know of this decode rank's KV buffers to write into them.

    Mirrors the fields of SGLang's ``KVArgs`` that 0.5.23's registration carries:

    * ``engine_rank``: this decode rank's attention-tp rank; ``attn_tp_size`` the decode's
      attention-tp width (the prefill slices heads by them);
    * ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``: one entry per KV buffer (layer, K
      and V); ``kv_item_lens`` is the bytes of one page, and empty for a pool that ships per
      pool instead (SGLang then reports 0). ``kv_data_lens`` is only used by NIXL, for its slot
      count. ``kv_layer_ids``: the model layer of each buffer (empty: in order);
    * ``aux_data_ptrs``: the metadata buffers;
    * ``state_*``: one list per state type of a hybrid model (Mamba, SWA, DSA): buffer pointers,
      item lengths, per-tensor dims, layer ids, and (NIXL) data lengths;
    * ``kv_mem_kinds`` (NIXL): ``"VRAM"``/``"DRAM"`` per KV buffer, empty for all VRAM;
      ``gpu_id`` (NIXL) the device of the buffers;
    * ``dcp_size`` / ``dcp_rank``: decode context parallelism (1 / 0 without it).

    Construction raises :class:`~statemachine.validation.InvalidArgument` naming the field.
    """

    engine_rank: int
    attn_tp_size: int
    kv_data_ptrs: Sequence[int] = ()
    kv_data_lens: Sequence[int] = ()
    kv_item_lens: Sequence[int] = ()
    kv_layer_ids: Sequence[int] = ()
    aux_data_ptrs: Sequence[int] = ()
    state_data_ptrs: Sequence[Sequence[int]] = ()
    state_data_lens: Sequence[Sequence[int]] = ()
    state_item_lens: Sequence[Sequence[int]] = ()
    state_dim_per_tensor: Sequence[Sequence[int]] = ()
    state_layer_ids: Sequence[Sequence[int]] = ()
    kv_mem_kinds: Sequence[str] = ()
    gpu_id: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalise the sequences to tuples once, here
        attn_tp_size = _count("attn_tp_size", self.attn_tp_size, 1)
        engine_rank = _count("engine_rank", self.engine_rank, 0)
        if engine_rank >= attn_tp_size:
            raise InvalidArgument(
                f"engine_rank {engine_rank} must be below attn_tp_size {attn_tp_size}: "
                "pass this decode rank's attention-tp rank and width"
            )
        dcp_size = _count("dcp_size", self.dcp_size, 1)
        if _count("dcp_rank", self.dcp_rank, 0) >= dcp_size:
            raise InvalidArgument(f"dcp_rank {self.dcp_rank} must be below dcp_size {dcp_size}")
        _count("gpu_id", self.gpu_id, 0)
        for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens", "aux_data_ptrs"):
            put(self, name, _ints(name, getattr(self, name), _U64_MAX))
        put(self, "kv_layer_ids", _ints("kv_layer_ids", self.kv_layer_ids, _U32_MAX))
        for name in ("state_data_ptrs", "state_data_lens"):
            put(self, name, _int_lists(name, getattr(self, name), _U64_MAX))
        for name in ("state_item_lens", "state_dim_per_tensor", "state_layer_ids"):
            put(self, name, _int_lists(name, getattr(self, name), _U32_MAX))
        if any(length == 0 for length in self.kv_item_lens):
            raise InvalidArgument("kv_item_lens must be positive (bytes of one page)")
        kinds = self.kv_mem_kinds
        if isinstance(kinds, str) or not isinstance(kinds, Sequence):
            raise InvalidArgument("kv_mem_kinds must be a sequence of 'VRAM'/'DRAM'")
        if not set(kinds) <= KV_MEM_KINDS:
            raise InvalidArgument(
                f"kv_mem_kinds {sorted(set(map(str, kinds)) - KV_MEM_KINDS)} unknown: "
                "each is 'VRAM' or 'DRAM'"
            )
        put(self, "kv_mem_kinds", tuple(kinds))

    @property
    def kv_item_len(self) -> int:
        """The first KV item length, 0 for none: what both registrations carry as one int."""
        return self.kv_item_lens[0] if self.kv_item_lens else 0

    def nixl_slot_count(self) -> int:
        """The KV slots every buffer can address (shortest ``data_len // item_len``, 0 without
        item lengths), as NIXL's ``num_kv_slots`` (``nixl/conn.py:483-496``) computes it."""
        if not self.kv_item_lens:
            return 0
        # zip stops at the shorter list, as SGLang's does.
        pairs = zip(self.kv_data_lens, self.kv_item_lens, strict=False)
        return min((data // item for data, item in pairs), default=0)

    def check_for_nixl(self) -> None:
        """The rules NIXL's prefill parser enforces by raising (which ends its bootstrap thread,
        ``nixl/conn.py:375-456``): per-buffer item lengths and memory kinds, when given, come
        one per KV pointer."""
        count = len(self.kv_data_ptrs)
        if self.kv_item_lens and len(self.kv_item_lens) != count:
            raise InvalidArgument(
                f"NIXL needs one kv_item_lens entry per KV pointer: {len(self.kv_item_lens)} "
                f"lengths for {count} pointers"
            )
        if self.kv_mem_kinds and len(self.kv_mem_kinds) != count:
            raise InvalidArgument(
                f"NIXL needs one kv_mem_kinds entry per KV pointer: {len(self.kv_mem_kinds)} "
                f"kinds for {count} pointers (or none: all VRAM)"
            )
