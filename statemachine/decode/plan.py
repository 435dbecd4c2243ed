"""Which prefill ranks one decode rank talks to: :class:`RankPlan`, derived or given.

SGLang derives this from both sides' parallel layouts (reference: SGLang's
``disaggregation/common/conn.py`` after PRs #31543 / #36029): the decode fetches the prefill's
topology once per bootstrap address, checks that the page size and KV dtype match its own, and
maps its own tp rank onto the prefill's tp ranks. :func:`derive_plan` does the same from a
:class:`~statemachine.validation.Topology` and this decode's :class:`DecodeLayout`:

* equal tp sizes: decode tp rank ``r`` talks to prefill tp rank ``r``;
* decode tp larger (``k = decode_tp / prefill_tp`` decode ranks share one prefill rank): rank
  ``r`` talks to prefill rank ``r // k`` and is a *dummy* peer for it unless ``r % k == 0`` -
  a dummy peer still registers and sends metadata (flagged), so the prefill rank knows how many
  decode peers to wait for, but gets no KV and no ack;
* decode tp smaller (``k = prefill_tp / decode_tp``): rank ``r`` talks to prefill ranks
  ``r*k .. r*k + k - 1`` (each holds a shard of the heads).

Sizes that do not divide, a page size or KV dtype that differ, raise
:class:`~statemachine.errors.TopologyMismatch` (a deployment error: retrying does not help).
"""

from __future__ import annotations

from dataclasses import dataclass

from statemachine.errors import TopologyMismatch
from statemachine.pool import PoolKey
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
            target = self.target_tp_rank if self.target_tp_rank is not None else self.tp_ranks[0]
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
    ``kv_layout`` / ``dsv41_spec_layout`` ``None`` skip that check (the prefill may not report
    them either: an old server).

    * ``is_mla`` / ``is_hybrid_mla``: the KV pool is MLA, or a hybrid linear-attention pool whose
      full-attention part is MLA (then ``is_mla`` is False, as in SGLang);
    * ``all_cp_ranks``: pull every prefill cp rank (SGLang's
      ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``, which is not in the topology reply and
      must be set on both sides); ``kv_shard_size`` > 1 implies it;
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
    dsv41_spec_layout: str | None = None
    decode_allocation_policy: str | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "kv_shard_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, not {value!r}")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), not {self.tp_rank!r}")
        if type(self.pp_rank) is not int or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, {self.pp_size}), not {self.pp_rank!r}")
        if self.is_mla and self.is_hybrid_mla:
            raise ValueError(
                "is_mla and is_hybrid_mla exclude each other (a hybrid pool is not MLA)"
            )


def derive_plan(addr: str, topology: Topology, layout: DecodeLayout) -> RankPlan:
    """The plan of ``layout``'s rank against the prefill at ``addr``; see the module docstring."""
    _check_format(addr, "page_size", topology.page_size, layout.page_size)
    _check_format(addr, "kv_cache_dtype", topology.kv_cache_dtype, layout.kv_cache_dtype)
    prefill_tp, decode_tp, rank = topology.attn_tp_size, layout.tp_size, layout.tp_rank
    dummy: frozenset[int] = frozenset()
    if decode_tp == prefill_tp:
        tp_ranks: tuple[int, ...] = (rank,)
    elif decode_tp > prefill_tp:
        if decode_tp % prefill_tp:
            raise _sizes(addr, prefill_tp, decode_tp)
        share = decode_tp // prefill_tp
        target = rank // share
        tp_ranks = (target,)
        if rank % share:
            dummy = frozenset(tp_ranks)
    else:
        if prefill_tp % decode_tp:
            raise _sizes(addr, prefill_tp, decode_tp)
        span = prefill_tp // decode_tp
        tp_ranks = tuple(range(rank * span, (rank + 1) * span))
    return RankPlan(
        tp_ranks=tp_ranks,
        cp_ranks=tuple(range(topology.attn_cp_size)),
        pp_ranks=tuple(range(topology.pp_size)),
        dummy_tp_ranks=dummy,
    )


def _check_format(addr: str, name: str, prefill: object, decode: object) -> None:
    if prefill is not None and decode is not None and prefill != decode:
        raise TopologyMismatch(
            f"{addr}: prefill {name} is {prefill!r}, this decode's is {decode!r}: the KV cache "
            f"cannot be transferred between them; configure both sides with the same {name}"
        )


def _sizes(addr: str, prefill_tp: int, decode_tp: int) -> TopologyMismatch:
    return TopologyMismatch(
        f"{addr}: prefill tp size {prefill_tp} and decode tp size {decode_tp} do not divide "
        "one another: no rank mapping exists; choose tp sizes where one is a multiple of the other"
    )
