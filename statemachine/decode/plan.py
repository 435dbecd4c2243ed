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
    """Which prefill ranks one decode rank talks to.

    One pool key per cp rank, named by the first target tp rank (as SGLang keys it); its
    generation lists every (tp rank x pp rank) of that cp rank. Ranks in ``dummy_tp_ranks``
    are fetched and messaged with the dummy flag set; they transfer nothing and send no ack.
    """

    tp_ranks: tuple[int, ...] = (0,)
    cp_ranks: tuple[int, ...] = (0,)
    pp_size: int = 1
    dummy_tp_ranks: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.tp_ranks or not self.cp_ranks or self.pp_size < 1:
            raise ValueError(f"empty rank plan: {self}")
        # Keys are built once per (address, dp rank), not per request: a PoolKey costs ~1 µs
        # to construct, a dict hit on a 2-tuple a fraction of that. Few addresses, few dp ranks.
        object.__setattr__(self, "_keys", {})

    def keys_for(self, addr: str, dp_rank: int) -> tuple[PoolKey, ...]:
        """The pool keys of a request to ``addr`` served by prefill dp rank ``dp_rank``."""
        cache: dict[tuple[str, int], tuple[PoolKey, ...]] = self._keys  # type: ignore[attr-defined]
        keys = cache.get((addr, dp_rank))
        if keys is None:
            keys = tuple(
                PoolKey(addr, dp_rank, cp_rank, self.tp_ranks[0]) for cp_rank in self.cp_ranks
            )
            cache[(addr, dp_rank)] = keys
        return keys


#: One rank, no cp/pp split: the plan of a receiver created without one or a layout.
DEFAULT_PLAN = RankPlan()


@dataclass(frozen=True)
class DecodeLayout:
    """This decode rank's own parallel layout and KV format, to check the prefill against.

    ``page_size`` / ``kv_cache_dtype`` ``None`` skip that check (the prefill may not report
    them either: an old server).
    """

    tp_rank: int = 0
    tp_size: int = 1
    page_size: int | None = None
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if type(self.tp_size) is not int or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, not {self.tp_size!r}")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), not {self.tp_rank!r}")


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
        pp_size=topology.pp_size,
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
