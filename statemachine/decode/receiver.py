"""``BootstrapReceiver``: one per request; ties each lifecycle step to its effect.

The lifecycle (``statemachine.lifecycle``) says *which* steps exist; this class does them:
pool lookups, HTTP fetches through :class:`~statemachine.decode.client.BootstrapClient`, ZMQ sends
through :class:`~statemachine.decode.transport.ZmqTransport`, and on any failure the identity-safe
invalidation of exactly the generations this receiver used (``spec/lifecycle.md`` lists the
effect of every event).

The API follows SGLang's decode-side receiver (``init``, ``send_metadata``, ``poll``,
``failure_exception``, ``abort``, ``clear``, ``invalidate_cached_bootstrap_infos``) so a decode
worker can adopt it with little glue. One thread drives a receiver; the only cross-thread input
is :meth:`mark_transferred`, a flag the ack listener sets and ``poll()`` consumes, so no lock is
needed per receiver.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from statemachine import lifecycle as life
from statemachine import trace
from statemachine.backend import KVBackend, MetadataRequest
from statemachine.decode.client import BootstrapClient
from statemachine.decode.transport import ZmqTransport
from statemachine.errors import (
    Aborted,
    BootstrapError,
    BootstrapHTTPError,
    InvalidTransition,
    SendFailed,
    WaitingTimeout,
)
from statemachine.lifecycle import KVPoll
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo

#: SGLang's default ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``.
DEFAULT_WAITING_TIMEOUT_S = 300.0

_receiver_ids = itertools.count(1)


@dataclass(frozen=True)
class RankPlan:
    """Which prefill ranks one decode rank talks to (SGLang derives this from both topologies).

    One pool key per cp rank, named by the first target tp rank (as SGLang keys it); its
    generation lists every (tp rank × pp rank) of that cp rank.
    Ranks in ``dummy_tp_ranks`` are fetched (their address is part of the generation) but get
    no messages: SGLang marks them dummy when several decode ranks share one prefill rank.
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


#: One rank, no cp/pp split: the plan of a receiver created without one.
DEFAULT_PLAN = RankPlan()


@dataclass(frozen=True)
class Decode:
    """What every receiver of one decode process shares."""

    pool: BootstrapPool
    client: BootstrapClient
    transport: ZmqTransport
    backend: KVBackend
    waiting_timeout_s: float = DEFAULT_WAITING_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic


class BootstrapReceiver:
    """Bootstraps one request against one prefill bootstrap address.

    Usage::

        receiver = BootstrapReceiver(decode, "10.0.0.5:8998", room, plan)
        receiver.init(prefill_dp_rank=0)          # lookup / fetch / register / publish
        receiver.send_metadata(request)           # per-request metadata to every rank
        while receiver.poll() == KVPoll.Transferring: ...
    """

    __slots__ = (
        "_acked",
        "_decode",
        "_failure",
        "_sent_at",
        "addr",
        "entries",
        "id",
        "lifecycle",
        "plan",
        "room",
    )

    def __init__(self, decode: Decode, addr: str, room: int, plan: RankPlan | None = None) -> None:
        self._decode = decode
        self.addr = addr
        self.room = room
        self.plan = plan if plan is not None else DEFAULT_PLAN
        self.id = next(_receiver_ids)
        self.lifecycle = life.Lifecycle()
        #: The exact generation objects this receiver used, by key: what ``Invalidate`` drops.
        self.entries: dict[PoolKey, Generation] = {}
        self._failure: BootstrapError | None = None
        self._sent_at = 0.0
        self._acked = False

    # --- lifecycle plumbing -------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.lifecycle.state

    def _fire(self, event: str) -> None:
        self.lifecycle.fire(event)
        if trace.ENABLED:
            trace.emit(
                event,
                receiver=self.id,
                entries=self.entries,
                state=self.lifecycle.state,
            )

    def _fail(self, event: str, error: BootstrapError) -> None:
        """Take a failure event, then drop this receiver's own generations (LIFE-3)."""
        self._failure = error
        self._fire(event)
        self._invalidate()

    def _invalidate(self) -> int:
        removed = self._decode.pool.invalidate(self.entries)
        self._fire(life.INVALIDATE)
        self.entries = {}
        return removed

    # --- the SGLang-shaped API ------------------------------------------------------------

    def init(self, prefill_dp_rank: int | None = None) -> KVPoll:
        """Set up the bootstrap infos: pool hit, or fetch + register + publish.

        ``prefill_dp_rank=None`` asks the bootstrap server which dp rank serves this room
        (``POST /query_dp_ranks``). Returns ``poll()``: WaitingForInput on success, else Failed.
        """
        if self.lifecycle.state != life.IDLE:
            raise InvalidTransition(self.lifecycle.state, "init")
        pool = self._decode.pool
        if prefill_dp_rank is None:
            try:
                prefill_dp_rank = self._resolve_dp_rank()
            except BootstrapError as error:
                self._fail(life.FETCH_FAIL, error)
                return KVPoll.Failed
        keys = self.plan.keys_for(self.addr, prefill_dp_rank)
        missing: list[PoolKey] = []
        for key in keys:
            generation = pool.lookup(key)
            if generation is None:
                missing.append(key)
            else:
                self.entries[key] = generation
        if not missing:
            self._fire(life.HIT)
            return KVPoll.WaitingForInput
        self._fire(life.MISS)
        try:
            fresh = self._fetch(missing)
        except BootstrapError as error:
            self._fail(life.FETCH_FAIL, error)
            return KVPoll.Failed
        self.entries.update(fresh)
        self._fire(life.FETCH_OK)
        try:
            for generation in fresh.values():
                self._decode.transport.register(generation, self._decode.backend)
        except SendFailed as error:
            self._fail(life.REGISTER_FAIL, error)
            return KVPoll.Failed
        self._fire(life.REGISTER_OK)
        for key, generation in fresh.items():
            # setdefault: a concurrent winner's generation replaces ours in our records.
            self.entries[key] = pool.publish(key, generation)
        self._fire(life.PUBLISH)
        return KVPoll.WaitingForInput

    def send_metadata(self, request: MetadataRequest) -> KVPoll:
        """Send per-request metadata to every rank; starts the waiting clock."""
        if self.lifecycle.state != life.CACHED:
            raise InvalidTransition(self.lifecycle.state, life.SEND_OK)
        try:
            for generation in self.entries.values():
                self._decode.transport.send_metadata(generation, self._decode.backend, request)
        except SendFailed as error:
            self._fail(life.SEND_FAIL, error)
            return KVPoll.Failed
        self._sent_at = self._decode.clock()
        self._fire(life.SEND_OK)
        return KVPoll.Transferring

    def mark_transferred(self, room: int | None = None) -> None:
        """Every rank acknowledged the transfer (called from the ack listener's thread).

        ``room`` is accepted so this method can be an ``AckListener`` callback as it is.
        """
        self._acked = True

    def expected_acks(self) -> int:
        """How many acks complete this request: one per non-dummy rank of each generation."""
        return sum(1 for g in self.entries.values() for rank in g.ranks if not rank.is_dummy)

    def poll(self) -> KVPoll:
        """SGLang-compatible status; in ``waiting`` also completes or times out."""
        if self.lifecycle.state == life.WAITING:
            if self._acked:
                self._fire(life.COMPLETE)
            elif self._decode.clock() - self._sent_at > self._decode.waiting_timeout_s:
                self._fail(
                    life.TIMEOUT,
                    WaitingTimeout(
                        f"room {self.room}: no transfer from {self.addr} within "
                        f"{self._decode.waiting_timeout_s:g} s"
                    ),
                )
        return life.POLL_OF_STATE[self.lifecycle.state]

    @property
    def failure(self) -> BootstrapError | None:
        """Why this request failed or was aborted, or ``None``."""
        return self._failure

    def failure_exception(self) -> None:
        """Raise the recorded failure (as SGLang's receiver does)."""
        if self._failure is not None:
            raise self._failure
        raise BootstrapError(f"room {self.room}: no failure recorded (state {self.state})")

    def abort(self) -> None:
        """The owner gives up. No invalidation: an abort says nothing about the prefill."""
        if self.lifecycle.state in life.ACTIVE_STATES:
            self._failure = Aborted(f"room {self.room} aborted in state {self.state}")
            self._fire(life.ABORT)

    def clear(self) -> None:
        """Forget this request's records without touching the pool."""
        self.entries = {}
        self._acked = False

    def invalidate_cached_bootstrap_infos(self) -> int:
        """Drop this receiver's generations from the pool, by identity; return how many.

        Only allowed after a failure (the receiver does it by itself then); idempotent in
        ``invalidated``.
        """
        if self.lifecycle.state == life.INVALIDATED:
            return 0
        if self.lifecycle.state != life.FAILED:
            raise InvalidTransition(self.lifecycle.state, life.INVALIDATE)
        return self._invalidate()

    # --- effects -----------------------------------------------------------------------------

    def _resolve_dp_rank(self) -> int:
        answer = self._decode.client.query_dp_ranks(self.addr, [self.room])
        try:
            return answer[self.room]
        except KeyError:
            raise BootstrapHTTPError(
                f"{self.addr} knows no dp rank for room {self.room}", addr=self.addr
            ) from None

    def _fetch(self, keys: list[PoolKey]) -> dict[PoolKey, Generation]:
        """Ask the bootstrap server for every (tp, pp) rank of each key; one generation each.

        Runs outside the pool lock. When the server answers as instance ``Y``, every other id
        ``X`` of the entries this receiver adopted *before* the fetch began was seen before
        ``Y`` answered, so ``X`` was replaced: its entries are retired (POOL-6), and keys this
        receiver had adopted from it are fetched again rather than used.
        """
        fresh = self._fetch_keys(keys)
        instance_ids = {g.instance_id for g in fresh.values() if g.instance_id is not None}
        if len(instance_ids) == 1:
            (instance_id,) = instance_ids
            replaced = {
                g.instance_id
                for g in self.entries.values()
                if g.instance_id is not None and g.instance_id != instance_id
            }
            for old_id in replaced:
                self._decode.pool.retire_instance(self.addr, old_id)
            stale = [key for key, g in self.entries.items() if g.instance_id in replaced]
            if stale:
                fresh.update(self._fetch_keys(stale))
        return fresh

    def _fetch_keys(self, keys: list[PoolKey]) -> dict[PoolKey, Generation]:
        client = self._decode.client
        plan = self.plan
        fresh: dict[PoolKey, Generation] = {}
        for key in keys:
            ranks: list[RankInfo] = []
            instance_ids: set[str | None] = set()
            for tp_rank in plan.tp_ranks:
                for pp_rank in range(plan.pp_size):
                    reply = client.get_rank(
                        self.addr,
                        dp_rank=key.dp_rank,
                        cp_rank=key.cp_rank,
                        tp_rank=tp_rank,
                        pp_rank=pp_rank,
                    )
                    instance_ids.add(reply.instance_id)
                    ranks.append(
                        RankInfo(
                            reply.rank_ip,
                            reply.rank_port,
                            pp_rank,
                            tp_rank in plan.dummy_tp_ranks,
                        )
                    )
            if len(instance_ids) != 1:
                # The server restarted between two rank queries: the answers mix instances.
                raise BootstrapHTTPError(
                    f"{self.addr} restarted while its ranks were fetched", addr=self.addr
                )
            fresh[key] = Generation(tuple(ranks), instance_ids.pop())
        return fresh

    def __repr__(self) -> str:
        return f"BootstrapReceiver(id={self.id}, room={self.room}, state={self.state!r})"
