"""``BootstrapReceiver``: one per request; ties each lifecycle step to its effect.

The lifecycle (``statemachine.lifecycle``) says *which* steps exist; this class does them:
pool lookups, fetches through the manager's :class:`~statemachine.decode.source.BootstrapSource`
(single-flight per key, :mod:`statemachine.decode.flight`), ZMQ sends through
:class:`~statemachine.decode.ranks.transport.ZmqTransport`, and on any failure the identity-safe
invalidation of exactly the generations this receiver used (``spec/lifecycle.md`` lists the
effect of every event, ``spec/manager.md`` the manager's part).

Receivers are made by a :class:`~statemachine.decode.manager.DecodeManager`, which owns the
shared parts, knows every receiver in flight, and completes or fails them. The API follows
SGLang's decode-side receiver (``init``, ``send_metadata``, ``poll``, ``failure_exception``,
``abort``, ``clear``, ``invalidate_cached_bootstrap_infos``). One thread drives a receiver; the
only cross-thread inputs are two single attribute stores, each consumed by the owner's next
call: :meth:`mark_transferred` (the ack listener) and the manager's failure fan-out (``_lost``,
turned into ``PeerLost`` by ``init``/``send_metadata``/``poll``). So no lock per receiver.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statemachine import lifecycle as life
from statemachine import trace
from statemachine.backend import KVBackend, MetadataRequest
from statemachine.decode.flight import Flight
from statemachine.decode.plan import DEFAULT_PLAN, DecodeLayout, RankPlan
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.decode.source import BootstrapSource
from statemachine.errors import (
    Aborted,
    BootstrapError,
    BootstrapHTTPError,
    BootstrapTimeout,
    ConfigurationError,
    InvalidRoom,
    InvalidTransition,
    ManagerClosed,
    PeerLost,
    SendFailed,
    WaitingTimeout,
)
from statemachine.lifecycle import KVPoll
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo

if TYPE_CHECKING:
    from statemachine.decode.manager import DecodeManager

__all__ = [
    "DEFAULT_PLAN",
    "DEFAULT_WAITING_TIMEOUT_S",
    "BootstrapReceiver",
    "Decode",
    "DecodeLayout",
    "RankPlan",
]

#: SGLang's default ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``.
DEFAULT_WAITING_TIMEOUT_S = 300.0
_MAX_ROOM = 2**64 - 1

_receiver_ids = itertools.count(1)

# What must come first, per public method, for InvalidTransition messages.
_INIT_NEEDS = "init() runs once, on a new receiver; create a new receiver for a new request"
_SEND_NEEDS = "send_metadata() runs once, after init() returned WaitingForInput"
_INVALIDATE_NEEDS = "only a failed receiver has generations to invalidate (it does so itself)"
_FAILURE_NEEDS = "the request succeeded: only an unfinished or failed request has a failure"

_TERMINAL = frozenset({life.DONE, life.INVALIDATED, life.ABORTED})
#: Where ``Hit`` leads from ``idle``, read from the Machine's table once (the hit path's step).
_HIT_TO = life.TABLE[life.HIT][life.IDLE]
_INITIAL = life.INITIAL


@dataclass(frozen=True)
class Decode:
    """The parts every receiver of one decode process shares, as one bundle: the manager
    builds one from its parts (``DecodeManager.decode``).

    Checked at construction: a missing or wrong-typed part raises
    :class:`~statemachine.errors.ConfigurationError` here, not an ``AttributeError`` on the
    first request.
    """

    pool: BootstrapPool
    client: BootstrapSource
    transport: ZmqTransport
    backend: KVBackend
    waiting_timeout_s: float = DEFAULT_WAITING_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        check_parts(
            pool=self.pool,
            source=self.client,
            transport=self.transport,
            backend=self.backend,
            waiting_timeout_s=self.waiting_timeout_s,
            clock=self.clock,
        )


def _takes_keyword(function: object, keyword: str) -> bool:
    """Whether ``function`` accepts ``keyword=`` (a signature it cannot show is trusted)."""
    try:
        parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == keyword and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def check_parts(
    *,
    pool: object,
    source: object,
    transport: object,
    backend: object,
    waiting_timeout_s: object,
    clock: object,
) -> None:
    """Raise ConfigurationError naming the first missing or wrong-typed shared part."""
    if not isinstance(pool, BootstrapPool):
        raise ConfigurationError(
            f"pool must be a BootstrapPool, not {type(pool).__name__}: pass BootstrapPool()"
        )
    if not isinstance(source, BootstrapSource):
        raise ConfigurationError(
            f"source/client must have get_rank, get_topology and query_dp_ranks (a "
            f"BootstrapClient), not {type(source).__name__}"
        )
    if not isinstance(transport, ZmqTransport):
        raise ConfigurationError(
            f"transport must be a ZmqTransport, not {type(transport).__name__}"
        )
    for method in (
        "register_frames",
        "metadata_frames",
        "abort_frames",
        "bootstrap_frames",
        "decode_message",
    ):
        function = getattr(backend, method, None)
        if not callable(function):
            raise ConfigurationError(
                f"backend must be a KVBackend with {method}() (e.g. SimpleBackend), "
                f"not {type(backend).__name__}"
            )
        keywords = {"abort_frames": ("instance_id", "generation"), "decode_message": ()}
        for keyword in keywords.get(method, ("instance_id",)):
            if not _takes_keyword(function, keyword):
                # Checked here, once: otherwise the first send would raise an untyped TypeError.
                raise ConfigurationError(
                    f"{type(backend).__name__}.{method}() must accept the keyword argument "
                    f"{keyword} (spec/zmq.md ZMQ-21, ZMQ-22); a backend that has no use for it "
                    "may ignore it"
                )
    if (
        isinstance(waiting_timeout_s, bool)
        or not isinstance(waiting_timeout_s, (int, float))
        or not waiting_timeout_s > 0
    ):
        raise ConfigurationError(
            f"waiting_timeout_s must be a positive number, not {waiting_timeout_s!r}"
        )
    if not callable(clock):
        raise ConfigurationError("clock must be a callable returning seconds")


def check_room(room: object) -> int:
    """``room`` if it is an int in [0, 2**64); else :class:`InvalidRoom`."""
    if type(room) is not int or not 0 <= room <= _MAX_ROOM:
        raise InvalidRoom(
            f"bootstrap room must be an int in [0, 2**64), not {room!r}: use the request's "
            "bootstrap_room as the router assigned it"
        )
    return room


class BootstrapReceiver:
    """Bootstraps one request against one prefill bootstrap address.

    Made by :meth:`DecodeManager.receiver`::

        receiver = manager.receiver("10.0.0.5:8998", room, prefill_dp_rank=0)
        receiver.init()                              # lookup / fetch / register / publish
        receiver.send_metadata(kv_indices, aux_index)  # to every rank; expects the acks
        while receiver.poll() == KVPoll.Transferring: ...
    """

    __slots__ = (
        "_acked",
        "_dp_rank",
        "_expecting",
        "_failure",
        "_lost",
        "_m",
        "_pending",
        "_sent_at",
        "addr",
        "entries",
        "id",
        "on_change",
        "plan",
        "room",
        "state",
    )

    def __init__(
        self,
        manager: DecodeManager,
        addr: str,
        room: int,
        plan: RankPlan | None = None,
        *,
        prefill_dp_rank: int | None = None,
    ) -> None:
        if type(room) is not int or not 0 <= room <= _MAX_ROOM:
            check_room(room)
        if prefill_dp_rank is not None and (
            type(prefill_dp_rank) is not int or prefill_dp_rank < 0
        ):
            raise InvalidRoom(f"prefill_dp_rank must be an int >= 0, not {prefill_dp_rank!r}")
        if manager._closed:
            raise ManagerClosed("the decode manager is closed: create a new one")
        self._m = manager
        self.addr = addr
        self.room = room
        self.plan = plan
        self._dp_rank = prefill_dp_rank
        self.id = next(_receiver_ids)
        #: The lifecycle state (``statemachine.lifecycle``), stepped only by ``_fire``.
        self.state: str = _INITIAL
        #: The exact generation objects this receiver used, by key: what ``Invalidate`` drops.
        self.entries: dict[PoolKey, Generation] = {}
        self._failure: BootstrapError | None = None
        #: Set by the manager's fan-out (another thread): the owner's next call fires PeerLost.
        self._lost: BootstrapError | None = None
        #: when the metadata was sent (or, while the dp rank is pending, when that began)
        self._sent_at = 0.0
        self._acked = False
        self._expecting = False
        self._pending = False
        #: Called (from any thread) when this receiver has news for its owner: acks arrived or
        #: the manager failed it. A scheduler can set it to wake its wait.
        self.on_change: Callable[[], None] | None = None
        # Known to the manager by room (one dict store): what the fan-out scans.
        if manager._inflight.setdefault(room, self) is not self:
            raise InvalidRoom(
                f"room {room} is already in flight: finish, abort or clear its receiver "
                "before reusing the room"
            )

    # --- lifecycle plumbing -------------------------------------------------------------

    def _fire(self, event: str) -> None:
        """One lifecycle step through the Machine's table (LIFE-1); InvalidTransition if the
        event is not allowed here."""
        try:
            self.state = life.TABLE[event][self.state]
        except KeyError:
            raise InvalidTransition(self.state, event) from None
        if trace.ENABLED:
            trace.emit(
                event,
                receiver=self.id,
                room=self.room,  # joins a Complete with the prefill ranks' Ack events
                entries=self.entries,
                state=self.state,
            )

    def _fail(self, event: str, error: BootstrapError) -> KVPoll:
        """Take a failure event, then drop this receiver's own generations (LIFE-3)."""
        self._failure = error
        self._fire(event)
        self._invalidate(event)
        self._m._ended(self, error)
        return KVPoll.Failed

    def _invalidate(self, cause: str) -> int:
        removed = self._m.pool.invalidate(self.entries)
        self._fire(life.INVALIDATE)
        dropped = self.entries
        self.entries = {}
        self._m._invalidated(dropped, removed, cause)
        return removed

    # --- the SGLang-shaped API ------------------------------------------------------------

    def init(self, prefill_dp_rank: int | None = None) -> KVPoll:
        """Set up the bootstrap infos: pool hit, or fetch + register + publish.

        The prefill dp rank is resolved in SGLang's order: ``prefill_dp_rank`` given here or
        when the receiver was made (the router's); a prefill with one dp rank: 0;
        ``follow_bootstrap_room``: ``room % dp_size``; else the room waits for the manager's
        batched ``POST /query_dp_ranks`` (:meth:`DecodeManager.step`) and ``init`` returns
        ``Bootstrapping`` until then: call it again after a step. Returns ``poll()``:
        WaitingForInput on success, Failed on failure, Bootstrapping while the dp rank is
        pending.
        """
        if self.state != life.IDLE:
            raise InvalidTransition(self.state, life.HIT, method="init", requires=_INIT_NEEDS)
        if self._lost is not None:
            return self._fail(life.PEER_LOST, self._lost)
        if prefill_dp_rank is not None:
            self._dp_rank = prefill_dp_rank
        m = self._m
        plan = self.plan
        dp_rank = self._dp_rank
        if plan is None and m.layout is None:
            plan = self.plan = DEFAULT_PLAN
        if plan is None or dp_rank is None:
            try:
                if plan is None:
                    plan = self.plan = m.plan_for(self.addr)
                if dp_rank is None:
                    dp_rank = self._resolve_dp_rank()
                    if dp_rank is None:
                        return KVPoll.Bootstrapping
            except BootstrapError as error:
                return self._fail(life.FETCH_FAIL, error)
        pool = m.pool
        missing: list[PoolKey] | None = None
        for key in plan.keys_for(self.addr, dp_rank):
            generation = pool.lookup(key)
            if generation is None:
                if missing is None:
                    missing = [key]
                else:
                    missing.append(key)
            else:
                self.entries[key] = generation
        if missing is None:
            # The Hit step, inlined: the destination comes from the Machine's table.
            self.state = _HIT_TO
            if trace.ENABLED:
                trace.emit(life.HIT, receiver=self.id, entries=self.entries, state=_HIT_TO)
            return KVPoll.WaitingForInput
        return self._miss(plan, missing)

    def send_metadata(
        self,
        kv_indices: Sequence[int] | Any,
        aux_index: int = 0,
        *,
        prefix_len: int = 0,
    ) -> KVPoll:
        """Send this room's metadata to every rank (dummy ranks flagged); start the clock.

        ``kv_indices``: any sequence of ints or a 1-d numpy integer array (packed once, in C).
        With the manager's ack listener, the completion is expected before the first send,
        and forgotten on every terminal path. Before a successful ``init`` this fails the
        request (``SendFail`` from ``idle``, as SGLang does) instead of raising.
        """
        state = self.state
        if state == life.CACHED or state == life.IDLE:
            if self._lost is not None:
                return self._fail(life.PEER_LOST, self._lost)
            if state == life.IDLE:
                return self._fail(
                    life.SEND_FAIL,
                    InvalidTransition(
                        state,
                        life.SEND_FAIL,
                        method="send_metadata",
                        requires="init() must return WaitingForInput first; the request "
                        "failed and published nothing: retry it with a new receiver",
                    ),
                )
        else:
            raise InvalidTransition(
                state, life.SEND_OK, method="send_metadata", requires=_SEND_NEEDS
            )
        m = self._m
        if m.watermarked:
            # etcd: a watch event marked a generation we hold (retired after we adopted it):
            # fail instead of starting a transfer on it (NoStaleStart, spec/model.md).
            marked = m._marked(self)
            if marked is not None:
                return self._fail(life.PEER_LOST, marked)
        request = MetadataRequest(self.room, kv_indices, aux_index, prefix_len)
        needed = self.expected_acks()
        if needed == 0:
            self._acked = True  # every rank is a dummy for us: nothing will be transferred
        elif m.acks is not None:
            m.acks.expect(self.room, needed, self.mark_transferred)
            self._expecting = True
        transport = m.transport
        backend = m.backend
        try:
            for generation in self.entries.values():
                transport.send_metadata(generation, backend, request)
        except SendFailed as error:
            m._send_failed(error)
            return self._fail(life.SEND_FAIL, error)
        self._sent_at = m.clock()
        self._fire(life.SEND_OK)
        return KVPoll.Transferring

    def mark_transferred(self, room: int | None = None) -> None:
        """Every rank acknowledged the transfer (called from the ack listener's thread, or by
        a transfer engine that reports completion itself). ``poll()`` completes the request.

        ``room`` is accepted so this method can be an ``AckListener`` callback as it is.
        """
        self._acked = True
        self._expecting = False  # the listener dropped the expectation when it fired
        wake = self.on_change
        if wake is not None:
            wake()

    def expected_acks(self) -> int:
        """How many acks complete this request: one per non-dummy rank of each generation."""
        return sum(1 for g in self.entries.values() for rank in g.ranks if not rank.is_dummy)

    def poll(self) -> KVPoll:
        """SGLang-compatible status; completes, times out (``elapsed >= timeout``) or applies
        the manager's fan-out failure."""
        state = self.state
        if state == life.WAITING:
            if self._acked:  # every ack arrived: the transfer is done, whatever came after
                self._fire(life.COMPLETE)
                self._m._ended(self, None)
            elif self._lost is not None:
                self._fail(life.PEER_LOST, self._lost)
            elif self._m.clock() - self._sent_at >= self._m.waiting_timeout_s:
                self._fail(
                    life.TIMEOUT,
                    WaitingTimeout(
                        f"room {self.room}: no transfer from {self.addr} within "
                        f"{self._m.waiting_timeout_s:g} s: the prefill is slow or lost the "
                        "request; retry it (its generation was dropped and will be refetched)"
                    ),
                )
        elif state == life.CACHED or state == life.IDLE:
            if self._lost is not None:
                self._fail(life.PEER_LOST, self._lost)
            elif self._pending and self._bootstrap_expired():
                self._fail(life.FETCH_FAIL, self._bootstrap_timeout())
        return life.POLL_OF_STATE[self.state]

    @property
    def failure(self) -> BootstrapError | None:
        """Why this request failed or was aborted, or ``None``."""
        return self._failure

    def failure_exception(self) -> None:
        """Raise the recorded failure (as SGLang's receiver does).

        With no local reason (another rank of the room failed, as SGLang's caller infers) an
        unfinished receiver fails now with a generic :class:`PeerLost`, which is raised.
        """
        if self._failure is not None:
            raise self._failure
        state = self.state
        if state in (life.IDLE, life.CACHED, life.WAITING):
            self._fail(
                life.PEER_LOST,
                self._lost
                or PeerLost(
                    f"room {self.room}: failed with no local reason (another rank of this room "
                    "failed); retry the request",
                    addr=self.addr,
                ),
            )
            assert self._failure is not None
            raise self._failure
        raise InvalidTransition(
            state, life.PEER_LOST, method="failure_exception", requires=_FAILURE_NEEDS
        )

    def abort(self) -> None:
        """The owner gives up. Every prefill rank that got this room's metadata is told once
        (so it frees the slot); idempotent. No invalidation: an abort says nothing about the
        prefill."""
        state = self.state
        if state in life.ACTIVE_STATES:
            self._failure = Aborted(f"room {self.room} aborted in state {state}")
            self._fire(life.ABORT)
            if state == life.WAITING:
                self._m._notify_abort(self)
            self._m._ended(self, self._failure)

    def clear(self) -> None:
        """Forget this request. A terminal result is kept (Success stays Success, Failed stays
        Failed); an unfinished request becomes Failed (``Abort``), so a late completion can no
        longer complete it. The pool is not touched."""
        state = self.state
        if state in life.ACTIVE_STATES:
            self._failure = Aborted(f"room {self.room} cleared in state {state}")
            self._fire(life.ABORT)
            self._m._ended(self, self._failure)
        self.entries = {}

    def invalidate_cached_bootstrap_infos(self) -> int:
        """Drop this receiver's generations from the pool, by identity; return how many.

        Only allowed after a failure (the receiver does it by itself then); idempotent in
        ``invalidated``.
        """
        state = self.state
        if state == life.INVALIDATED:
            return 0
        if state != life.FAILED:
            raise InvalidTransition(
                state,
                life.INVALIDATE,
                method="invalidate_cached_bootstrap_infos",
                requires=_INVALIDATE_NEEDS,
            )
        return self._invalidate(life.INVALIDATE)  # pragma: no cover - _fail does it at once

    # --- effects -----------------------------------------------------------------------------

    def _resolve_dp_rank(self) -> int | None:
        """SGLang's order after a router-given rank; None while the room is pending."""
        m = self._m
        topology = m.topology(self.addr)
        if topology.dp_size == 1:
            return 0
        if topology.follow_bootstrap_room is not False:  # never set means True (SGLang)
            return self.room % topology.dp_size
        if not self._pending:
            self._pending = True
            self._sent_at = m.clock()
            m._pend(self)
        elif self._bootstrap_expired():
            raise self._bootstrap_timeout()
        return None

    def _resolved(self, dp_rank: int) -> None:
        """The manager's batched query answered (called from the stepping thread)."""
        self._dp_rank = dp_rank
        self._pending = False  # no bootstrap timeout any more: the next init() goes on
        wake = self.on_change
        if wake is not None:
            wake()

    def _bootstrap_expired(self) -> bool:
        return self._m.clock() - self._sent_at >= self._m.bootstrap_timeout_s

    def _bootstrap_timeout(self) -> BootstrapTimeout:
        return BootstrapTimeout(
            f"room {self.room}: {self.addr} did not know its dp rank within "
            f"{self._m.bootstrap_timeout_s:g} s; retry the request, or route it with an "
            "explicit prefill_dp_rank"
        )

    def _miss(self, plan: RankPlan, missing: list[PoolKey]) -> KVPoll:
        """Single-flight: follow the fetches in flight for our keys, or lead all of them."""
        m = self._m
        flights = m.flights
        if flights is None:  # the anchor's behaviour: every miss fetches for itself
            return self._lead(plan, missing, {})
        deadline = m.clock() + m.flight_timeout_s
        while True:
            led, followed = flights.claim(missing)
            if not followed:
                break
            for flight in followed:
                try:
                    self.entries[flight.key] = flight.wait(deadline - m.clock())
                except BootstrapError as error:
                    return self._fail(life.FETCH_FAIL, error)
            if self._lost is not None:
                return self._fail(life.PEER_LOST, self._lost)
            missing = [key for key in missing if key not in self.entries]
            still: list[PoolKey] = []
            for key in missing:
                generation = m.pool.lookup(key)
                if generation is None:
                    still.append(key)
                else:
                    self.entries[key] = generation
            if not still:
                self._fire(life.HIT)
                return KVPoll.WaitingForInput
            missing = still
        # We lead. A flight that closed between our lookup and our claim published first:
        # its generation is in the pool now, so look once more before fetching.
        present = {key: g for key in led if (g := m.pool.get(key)) is not None}
        if present:
            flights.resolve({key: led.pop(key) for key in present}, present)
            self.entries.update(present)
            missing = [key for key in missing if key not in present]
            if not missing:
                self._fire(life.HIT)
                return KVPoll.WaitingForInput
        try:
            return self._lead(plan, missing, led)
        finally:
            # Whatever happened, no follower may wait for a flight nobody will resolve.
            unresolved = {key: f for key, f in led.items() if not f.done}
            if unresolved:
                flights.fail(
                    unresolved,
                    self._failure
                    or PeerLost(f"{self.addr}: the fetch this request waited for was abandoned"),
                )

    def _lead(self, plan: RankPlan, missing: list[PoolKey], led: dict[PoolKey, Flight]) -> KVPoll:
        m = self._m
        flights = m.flights
        self._fire(life.MISS)
        m._watch(self.addr)
        try:
            fresh = self._fetch(plan, missing)
        except BootstrapError as error:
            if flights is not None:
                flights.fail(led, error)
            return self._fail(life.FETCH_FAIL, error)
        self.entries.update(fresh)
        self._fire(life.FETCH_OK)
        try:
            for generation in fresh.values():
                m.transport.register(generation, m.backend)
        except SendFailed as error:
            if flights is not None:
                flights.fail(led, error)
            m._send_failed(error)
            return self._fail(life.REGISTER_FAIL, error)
        self._fire(life.REGISTER_OK)
        published: dict[PoolKey, Generation] = {}
        refused: BootstrapError | None = None
        for key, generation in fresh.items():
            # setdefault: a concurrent winner's generation replaces ours in our records.
            held = m._publish(key, generation)
            if held is None:
                # etcd's watermark: the watch applied a change this fetch predates; the object
                # is not published and this request fails (the model's Publish with fresh =
                # None, then PeerLost).
                refused = refused or m._refused(self.addr, generation)
                continue
            if held is generation:
                m._retain(generation)
            self.entries[key] = published[key] = held
        if flights is not None:
            flights.resolve({k: f for k, f in led.items() if k in published}, published)
            if refused is not None:
                flights.fail({k: f for k, f in led.items() if k not in published}, refused)
        self._fire(life.PUBLISH)
        if refused is not None:
            return self._fail(life.PEER_LOST, refused)
        if self._lost is not None:  # failed by the fan-out while we fetched
            return self._fail(life.PEER_LOST, self._lost)
        return KVPoll.WaitingForInput

    def _fetch(self, plan: RankPlan, keys: list[PoolKey]) -> dict[PoolKey, Generation]:
        """Ask the source for every (tp, pp) rank of each key; one generation each.

        Runs outside the pool lock. When the answering instance differs from the instance of
        entries this receiver adopted before the fetch, that older instance was replaced:
        its entries of this address are retired (POOL-6) and ours are fetched again.
        """
        adopted = dict(self.entries)
        fresh = self._fetch_keys(plan, keys)
        instance_ids = {g.instance_id for g in fresh.values() if g.instance_id is not None}
        if len(instance_ids) == 1:
            (instance_id,) = instance_ids
            stale = [
                key
                for key, g in adopted.items()
                if g.instance_id is not None and g.instance_id != instance_id
            ]
            if stale:
                old_ids = {g.instance_id for k, g in adopted.items() if k in stale}
                self._m._retire(self.addr, old_ids, instance_id, self)
                fresh.update(self._fetch_keys(plan, stale))
        return fresh

    def _fetch_keys(self, plan: RankPlan, keys: list[PoolKey]) -> dict[PoolKey, Generation]:
        m = self._m
        source = m.source
        fresh: dict[PoolKey, Generation] = {}
        for key in keys:
            stamp = m._stamp()  # etcd: the watch's revision before the first get_rank
            ranks: list[RankInfo] = []
            instance_ids: set[str | None] = set()
            for tp_rank, pp_rank in plan.fetch_order:
                reply = source.get_rank(
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
                    f"{self.addr} restarted while its ranks were fetched; retry the request",
                    addr=self.addr,
                )
            fresh[key] = m._generation(tuple(ranks), instance_ids.pop(), stamp)
        return fresh

    @property
    def ended(self) -> bool:
        """True once the request reached a final state (done, invalidated or aborted)."""
        return self.state in _TERMINAL

    def __repr__(self) -> str:
        return f"BootstrapReceiver(id={self.id}, room={self.room}, state={self.state!r})"
