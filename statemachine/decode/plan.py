"""Which prefill ranks one decode rank talks to: :class:`RankPlan`, derived or given.

:func:`derive_plan` is SGLang 0.5.23's rank mapping (``spec/plans.md``, rules PLAN-1 ..
PLAN-9; SGLang's ``disaggregation/common/conn.py`` ``_resolve_rank_mapping`` and
``_setup_bootstrap_infos``): from the prefill's :class:`~statemachine.validation.Topology`
and this decode's :class:`DecodeLayout` it checks the KV format, then maps

* the tp rank: equal sizes one-to-one; decode tp ``k`` times larger, ``k`` decode ranks share
  one prefill rank and each is a *real* peer of it (the prefill waits for ``k``); decode tp
  ``k`` times smaller, one decode rank pulls ``k`` prefill ranks (MLA: the first is real, the
  others dummy, one response); MLA with prefill KV-cache sharding, every tp rank and one key
  for all of them;
* the cp rank: cp rank 0 only, unless one of SGLang's all-cp switches is on;
* the pp rank: its own pp rank when both pp sizes are equal, every pp rank when the decode's is 1.

A layout the prefill cannot serve raises :class:`~statemachine.errors.TopologyMismatch` (a
deployment error: retrying does not help). :func:`plan_without_layout` is what a manager made
without a layout may do: plan a one-rank prefill, refuse anything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from statemachine.errors import InvalidArgument, TopologyMismatch
from statemachine.pool import EVERY_TP_RANK, PoolKey
from statemachine.validation import Topology


@dataclass(frozen=True)
class RankPlan:
    """Which prefill ranks one decode rank talks to, and how many answers complete a room.

    One pool key per cp rank, named by ``target_tp_rank`` (as SGLang keys it); its generation
    lists every (tp rank x pp rank) of that cp rank, fetched tp ascending and pp descending.
    Ranks in ``dummy_tp_ranks`` are fetched and messaged with the dummy flag set; they transfer
    nothing and send no completion.

    ``required_dst_info_num`` is how many decode ranks each target prefill rank waits for (it
    goes out in every metadata message). ``required_prefill_response_num`` - how many distinct
    prefill ranks must report success before the room is complete - is not a field: it is the
    number of non-dummy (tp, cp, pp) targets, which is what SGLang 0.5.23 computes in every mode
    (``spec/plans.md``), so a hand-made plan cannot contradict itself.
    """

    tp_ranks: tuple[int, ...] = (0,)
    cp_ranks: tuple[int, ...] = (0,)
    pp_ranks: tuple[int, ...] = (0,)
    dummy_tp_ranks: frozenset[int] = frozenset()
    #: the tp rank that names the pool key; None when one key covers every tp rank (SGLang's
    #: MLA KV-cache sharding). ``-1`` (the default) means ``tp_ranks[0]``.
    target_tp_rank: int | None = -1
    required_dst_info_num: int = 1

    def __post_init__(self) -> None:
        if not self.tp_ranks or not self.cp_ranks or not self.pp_ranks:
            raise ValueError(f"empty rank plan: {self}")
        if self.required_dst_info_num < 1:
            raise ValueError(f"required_dst_info_num must be >= 1: {self}")
        if not self.dummy_tp_ranks <= set(self.tp_ranks):
            raise ValueError(f"dummy_tp_ranks must be a subset of tp_ranks: {self}")
        if self.target_tp_rank == -1:
            object.__setattr__(self, "target_tp_rank", self.tp_ranks[0])
        real_tp = len(self.tp_ranks) - len(self.dummy_tp_ranks)
        object.__setattr__(self, "_responses", real_tp * len(self.cp_ranks) * len(self.pp_ranks))
        # Keys are built once per (address, dp rank), not per request: a PoolKey costs ~1 µs
        # to construct, a dict hit on a 2-tuple a fraction of that. Few addresses, few dp ranks.
        object.__setattr__(self, "_keys", {})

    @property
    def required_prefill_response_num(self) -> int:
        """Distinct prefill ranks whose success completes a room (0 for an all-dummy plan)."""
        responses: int = self._responses  # type: ignore[attr-defined]
        return responses

    @property
    def fetch_order(self) -> tuple[tuple[int, int], ...]:
        """The (tp rank, pp rank) pairs of one cp rank in SGLang's fetch order."""
        return tuple((tp, pp) for tp in self.tp_ranks for pp in sorted(self.pp_ranks, reverse=True))

    def keys_for(self, addr: str, dp_rank: int) -> tuple[PoolKey, ...]:
        """The pool keys of a request to ``addr`` served by prefill dp rank ``dp_rank``."""
        cache: dict[tuple[str, int], tuple[PoolKey, ...]] = self._keys  # type: ignore[attr-defined]
        keys = cache.get((addr, dp_rank))
        if keys is None:
            # SGLang names the key by the target tp rank, the string "None" under MLA KV-cache
            # sharding: EVERY_TP_RANK here, so a sharded plan and a rank-0 plan never share an
            # entry.
            target = EVERY_TP_RANK if self.target_tp_rank is None else self.target_tp_rank
            keys = tuple(PoolKey(addr, dp_rank, cp_rank, target) for cp_rank in self.cp_ranks)
            cache[(addr, dp_rank)] = keys
        return keys


#: One rank, no cp/pp split: the plan of a receiver created without one or a layout.
DEFAULT_PLAN = RankPlan()


@dataclass(frozen=True)
class DecodeLayout:
    """This decode rank's own parallel layout and KV format, to plan and check the prefill against.

    The fields are what SGLang 0.5.23's decode reads from its runtime context and KV pool to map
    itself onto a prefill (``spec/plans.md``). ``page_size`` / ``kv_cache_dtype`` /
    ``kv_layout`` ``None`` skip that check (the prefill may not report them either: an old
    server). ``dsv41_spec_layout`` ``None`` means this decode does not run DSpark: as in SGLang,
    a prefill that does is refused (PLAN-2). This decode's own attention cp size is always 1
    (SGLang asserts it), so there is no cp field.

    * ``is_mla`` / ``is_hybrid_mla``: the KV pool is MLA, or a hybrid linear-attention pool whose
      full-attention part is MLA (then ``is_mla`` is False, as in SGLang);
    * ``all_cp_ranks``: pull every prefill cp rank (SGLang's
      ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``, which is not in the topology reply and
      must be set on both sides); ``kv_shard_size`` > 1 (this decode shards its own KV cache)
      and ``is_hybrid_mla`` imply it (PLAN-7);
    * ``decode_allocation_policy``: SGLang's ``disaggregation_decode_allocation_policy``; a
      prefill reporting another one fails the request.
    """

    tp_rank: int = 0
    tp_size: int = 1
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    pp_rank: int = 0
    pp_size: int = 1
    is_mla: bool = False
    is_hybrid_mla: bool = False
    kv_shard_size: int = 1
    all_cp_ranks: bool = False
    kv_layout: str | None = None
    #: SGLang's DeepSeek-V4.1 DSpark layout (a small JSON object), compared key by key.
    dsv41_spec_layout: Mapping[str, object] | None = field(default=None, hash=False)
    decode_allocation_policy: str | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "kv_shard_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgument(
                    f"DecodeLayout: {name} must be an int >= 1, not {value!r}: give this "
                    "decode's own parallel size (SGLang's --tp-size / --pp-size)"
                )
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(
                f"DecodeLayout: tp_rank must be in [0, {self.tp_size}), not {self.tp_rank!r}: "
                "give this decode process's own tp rank (0-based, below tp_size)"
            )
        if type(self.pp_rank) is not int or not 0 <= self.pp_rank < self.pp_size:
            raise InvalidArgument(
                f"DecodeLayout: pp_rank must be in [0, {self.pp_size}), not {self.pp_rank!r}: "
                "give this decode process's own pp rank (0-based, below pp_size)"
            )
        if self.dsv41_spec_layout is not None:
            # A private read-only copy: the caller's dict may change, the layout must not.
            object.__setattr__(
                self, "dsv41_spec_layout", MappingProxyType(dict(self.dsv41_spec_layout))
            )
        if self.is_mla and self.is_hybrid_mla:
            raise InvalidArgument(
                "DecodeLayout: is_mla and is_hybrid_mla exclude each other (a hybrid pool is "
                "not MLA): set the one your KV pool is"
            )


def derive_plan(addr: str, topology: Topology, layout: DecodeLayout) -> RankPlan:
    """The plan of ``layout``'s rank against the prefill at ``addr`` (``spec/plans.md``)."""
    _check_formats(addr, topology, layout)
    tp_ranks, target, dst_num, dummy = _tp_rule(addr, topology, layout)
    return RankPlan(
        tp_ranks=tp_ranks,
        cp_ranks=_cp_rule(topology, layout),
        pp_ranks=_pp_rule(addr, topology, layout),
        dummy_tp_ranks=dummy,
        target_tp_rank=target,
        required_dst_info_num=dst_num,
    )


def plan_without_layout(addr: str, topology: Topology) -> RankPlan:
    """The plan of a decode that stated no layout (PLAN-9): one rank against a prefill of one
    tp, cp and pp rank; anything else could under-fetch silently, so it is refused."""
    if topology.attn_tp_size == topology.attn_cp_size == topology.pp_size == 1:
        return DEFAULT_PLAN
    raise TopologyMismatch(
        f"{addr}: the prefill has attn tp={topology.attn_tp_size} cp={topology.attn_cp_size} "
        f"pp={topology.pp_size} and this decode manager has no layout, so it cannot tell which "
        "of those ranks hold its share of the KV cache; pass "
        "DecodeManager(layout=DecodeLayout(tp_rank=..., tp_size=..., ...)) with this decode "
        "rank's own layout, or give each receiver an explicit RankPlan"
    )


# --- PLAN-2: the KV format ----------------------------------------------------------------------


def _check_formats(addr: str, topology: Topology, layout: DecodeLayout) -> None:
    _check_format(addr, "page_size", topology.page_size, layout.page_size)
    _check_format(addr, "kv_cache_dtype", topology.kv_cache_dtype, layout.kv_cache_dtype)
    _check_format(addr, "kv_layout", topology.kv_layout, layout.kv_layout)
    prefill_spec, decode_spec = topology.dsv41_spec_layout, layout.dsv41_spec_layout
    if prefill_spec is None and decode_spec is None:
        return
    # Unlike the fields above, an absent DSpark layout is a statement (DSpark off), so a
    # layout on one side only is a mismatch too, as in SGLang.
    prefill_dict = None if prefill_spec is None else dict(prefill_spec)
    decode_dict = None if decode_spec is None else dict(decode_spec)
    if prefill_dict != decode_dict:
        raise TopologyMismatch(
            f"{addr}: prefill dsv41_spec_layout is {prefill_dict!r}, this decode's is "
            f"{decode_dict!r}: DSpark needs the same block size and target/draft KV layout on "
            "both sides (or neither side running it); upgrade and configure both servers "
            "together, and give DecodeLayout(dsv41_spec_layout=...) this decode's layout"
        )
    # DSpark moves whole heads: the tp sizes must match, except an (hybrid) MLA decode whose tp
    # equals the prefill's whole tp x cp world (SGLang's one exception).
    mla = layout.is_mla or layout.is_hybrid_mla
    world = topology.attn_tp_size * topology.attn_cp_size
    aligned = topology.attn_cp_size > 1 and mla and world == layout.tp_size
    if topology.attn_tp_size != layout.tp_size and not aligned:
        raise TopologyMismatch(
            f"{addr}: DSpark (dsv41_spec_layout) needs equal attention tp sizes, but the "
            f"prefill has {topology.attn_tp_size} and this decode {layout.tp_size}; run both "
            "with the same tp size (an MLA decode may instead match the prefill's tp x cp)"
        )


def _check_format(addr: str, name: str, prefill: object, decode: object) -> None:
    if prefill is not None and decode is not None and prefill != decode:
        raise TopologyMismatch(
            f"{addr}: prefill {name} is {prefill!r}, this decode's is {decode!r}: the KV cache "
            f"cannot be transferred between them; configure both sides with the same {name}. "
            "The prefill's bootstrap server keeps the first topology its ranks registered until "
            "it restarts: after changing the prefill's setting, restart its bootstrap server too"
        )


# --- PLAN-3 .. PLAN-6: the tp rule --------------------------------------------------------------


def _tp_rule(
    addr: str, topology: Topology, layout: DecodeLayout
) -> tuple[tuple[int, ...], int | None, int, frozenset[int]]:
    """(tp ranks, target tp rank, required_dst_info_num, dummy tp ranks)."""
    prefill_tp, decode_tp, rank = topology.attn_tp_size, layout.tp_size, layout.tp_rank
    if layout.is_mla and topology.enable_kv_cache_sharding and topology.attn_cp_size == 1:
        # PLAN-6: every prefill tp rank owns some of the pages, so all are real senders, and
        # one pool key (tp part None) covers them; each waits for every decode rank.
        if decode_tp != prefill_tp:
            raise TopologyMismatch(
                f"{addr}: the prefill shards its MLA KV cache over {prefill_tp} tp ranks "
                f"(enable_kv_cache_sharding) and this decode has tp {decode_tp}: sharded MLA "
                "needs equal attention tp sizes; run the decode with the prefill's tp size or "
                "turn sharding off on the prefill"
            )
        return tuple(range(prefill_tp)), None, decode_tp, frozenset()
    if decode_tp == prefill_tp:  # PLAN-3
        return (rank,), rank, 1, frozenset()
    if decode_tp > prefill_tp:  # PLAN-4: every sharer is a real peer (no dummy)
        share = _ratio(addr, prefill_tp, decode_tp)
        target = rank // share
        return (target,), target, share, frozenset()
    span = _ratio(addr, prefill_tp, decode_tp)  # PLAN-5
    tp_ranks = tuple(range(rank * span, (rank + 1) * span))
    # MLA: every prefill rank holds the whole latent KV, so one sends and the others are dummy
    # (still messaged, so that they know this decode peer exists); not for hybrid MLA.
    dummy = frozenset(tp_ranks[1:]) if layout.is_mla else frozenset()
    return tp_ranks, tp_ranks[0], 1, dummy


def _ratio(addr: str, prefill_tp: int, decode_tp: int) -> int:
    """The larger tp size over the smaller, refused when it leaves a remainder (a deliberate
    difference, PLAN-5: SGLang integer-divides and then points a decode rank at a prefill rank
    that does not exist, or leaves some prefill rank's heads unfetched)."""
    larger, smaller = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if larger % smaller:
        raise TopologyMismatch(
            f"{addr}: the prefill's attention tp size {prefill_tp} and this decode's "
            f"{decode_tp} do not divide one another, so no decode rank owns a whole share of "
            "the KV heads; choose tp sizes where one is a multiple of the other"
        )
    return larger // smaller


# --- PLAN-7, PLAN-8: cp and pp ------------------------------------------------------------------


def _cp_rule(topology: Topology, layout: DecodeLayout) -> tuple[int, ...]:
    """Prefill cp rank 0 only, unless a switch says every cp rank holds part of the KV."""
    if topology.attn_cp_size == 1:
        return (0,)
    every = (
        layout.all_cp_ranks
        or layout.is_hybrid_mla
        or layout.kv_shard_size > 1
        or bool(topology.enable_dsa_cache_layer_split)
        or bool(topology.enable_kv_cache_sharding)
    )
    return tuple(range(topology.attn_cp_size)) if every else (0,)


def _pp_rule(addr: str, topology: Topology, layout: DecodeLayout) -> tuple[int, ...]:
    if topology.pp_size == layout.pp_size:
        return (layout.pp_rank,)
    if layout.pp_size == 1:
        return tuple(range(topology.pp_size))
    raise TopologyMismatch(
        f"{addr}: the prefill has pp size {topology.pp_size} and this decode {layout.pp_size}: "
        "a decode's pp size must equal the prefill's or be 1; change one of them"
    )
