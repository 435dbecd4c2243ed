"""``Fetcher``: the miss path, whole. A request whose keys missed the pool comes here once.

In order (``spec/lifecycle.md``, ``spec/manager.md``):

1. **known dead** - a key whose rank is known dead fails at once (``dead_keys``, MGR-1), and
   so does every key of a bootstrap address judged silent (``silent``, MGR-22);
2. **single-flight** (:mod:`statemachine.decode.flight`) - follow the fetches in flight for
   our keys and adopt what they publish (``Hit``), or lead all of them;
3. **fetch** (``Miss`` → ``FetchOk``) - every (tp, pp) rank of each key from the source,
   inside the request's deadline window (MGR-21); an answer from a new instance retires the
   entries of the old one (POOL-6) and re-plans the address (MGR-20); ranks the transport
   already judged dead fail the request as retryable (the one retry rule, MGR-19);
4. **register** (``RegisterOk``) - with every rank, over the transport;
5. **publish** (``Publish``) - through the source (its watermark may refuse a stale fetch),
   adopting a concurrent winner's generation; what this process published keeps its sockets.

The fetcher steps the receiver it was handed through the receiver's own lifecycle steps
(:class:`Missing`: ``fire``/``fail``), and reports evidence to the fan-out; it knows nothing
above it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from statemachine import call_deadline
from statemachine import lifecycle as life
from statemachine.backend import KVBackend
from statemachine.completion import KVPoll
from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.fanout import FanOut
from statemachine.decode.flight import Flight, Flights
from statemachine.decode.health import HealthMonitor
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.transport import ZmqTransport, endpoint_url
from statemachine.decode.rooms import InFlight
from statemachine.decode.routes import Routes
from statemachine.decode.silent import SilentAddresses
from statemachine.decode.source import BootstrapSource
from statemachine.errors import (
    BootstrapError,
    BootstrapHTTPError,
    PeerLost,
    RanksUnreachable,
    SendFailed,
    TransportFailure,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo

__all__ = ["Fetcher", "Missing", "unreachable"]


class Missing(InFlight, Protocol):
    """What the fetcher does to the receiver whose keys missed."""

    @property
    def lost(self) -> BootstrapError | None:
        """The fan-out's reason, stored while this request fetched (or ``None``)."""
        ...

    @property
    def failure(self) -> BootstrapError | None: ...

    def fire(self, event: str) -> None:
        """One lifecycle step (the Machine's table; traced)."""
        ...

    def fail(self, event: str, error: BootstrapError) -> KVPoll:
        """A failure step, with its effects (invalidation, ABORT); returns ``Failed``."""
        ...

    def window(self) -> call_deadline.Until:
        """This init() call's deadline window for questions to the source (MGR-21)."""
        ...


class Fetcher:
    """The miss path of one decode process (see the module docstring)."""

    def __init__(
        self,
        *,
        pool: BootstrapPool,
        source: BootstrapSource,
        transport: ZmqTransport,
        backend: KVBackend,
        flights: Flights,
        fanout: FanOut,
        routes: Routes,
        dead_keys: DeadKeys,
        health: HealthMonitor | None,
        clock: Callable[[], float],
        flight_timeout_s: float,
        silent: SilentAddresses | None = None,
    ) -> None:
        self._pool = pool
        self._source = source
        self._transport = transport
        self._backend = backend
        self.flights = flights
        self._fanout = fanout
        self._routes = routes
        self._dead_keys = dead_keys
        #: addresses judged silent: asked by no request until a probe answers (MGR-22)
        self.silent = SilentAddresses(clock=clock) if silent is None else silent
        self._health = health
        self._clock = clock
        self._flight_timeout_s = flight_timeout_s
        self._lock = threading.Lock()
        self._watched: set[str] = set()

    def miss(self, receiver: Missing, plan: RankPlan, missing: list[PoolKey]) -> KVPoll:
        """``missing`` (in the plan's order) were not in the pool: fetch, register, publish
        them, or adopt what another request's fetch publishes; the receiver's next state."""
        silent = self.silent.refusal(receiver.addr)
        if silent is not None:  # judged dead by its probes, none answered since: ask nothing
            return receiver.fail(life.FETCH_FAIL, silent)
        dead = self._dead_keys.refusal(receiver.addr, missing)
        if dead is not None:  # a rank the source still names is known dead: no refetch
            return receiver.fail(life.FETCH_FAIL, dead)
        return self.single_flight(receiver, plan, missing)

    def single_flight(self, receiver: Missing, plan: RankPlan, missing: list[PoolKey]) -> KVPoll:
        """Follow the fetches in flight for our keys, or lead all of them."""
        flights = self.flights
        entries = receiver.entries
        deadline = self._clock() + self._flight_timeout_s
        while True:
            led, followed = flights.claim(missing)
            if not followed:
                break
            for flight in followed:
                try:
                    entries[flight.key] = flight.wait(deadline - self._clock())
                except BootstrapError as error:
                    return receiver.fail(life.FETCH_FAIL, error)
            if receiver.lost is not None:
                return receiver.fail(life.PEER_LOST, receiver.lost)
            still = [key for key in missing if key not in entries]
            missing = []
            for key in still:
                generation = self._pool.lookup(key)
                if generation is None:
                    missing.append(key)
                else:
                    entries[key] = generation
            if not missing:
                receiver.fire(life.HIT)
                return KVPoll.WaitingForInput
        # We lead. A flight that closed between our lookup and our claim published first:
        # its generation is in the pool now, so look once more before fetching.
        present = {key: g for key in led if (g := self._pool.get(key)) is not None}
        if present:
            flights.resolve({key: led.pop(key) for key in present}, present)
            entries.update(present)
            missing = [key for key in missing if key not in present]
            if not missing:
                receiver.fire(life.HIT)
                return KVPoll.WaitingForInput
        try:
            return self.lead(receiver, plan, missing, led)
        finally:
            # Whatever happened, no follower may wait for a flight nobody will resolve.
            unresolved = {key: f for key, f in led.items() if not f.done}
            if unresolved:
                flights.fail(
                    unresolved,
                    receiver.failure
                    or PeerLost(
                        f"{receiver.addr}: the fetch this request waited for was abandoned"
                    ),
                )

    def lead(
        self,
        receiver: Missing,
        plan: RankPlan,
        missing: list[PoolKey],
        led: dict[PoolKey, Flight],
    ) -> KVPoll:
        """Fetch, register and publish ``missing`` (the flights ``led`` follow the result)."""
        addr = receiver.addr
        flights = self.flights
        receiver.fire(life.MISS)
        try:
            with receiver.window():  # every rank's query ends by this call's deadline (MGR-21)
                fresh = self._fetch(receiver, plan, missing)
            # One retry rule on every source (MGR-19): ranks the transport already judged
            # dead, answered again (a store still listing a crashed prefill, a server that
            # kept a dead rank's port), fail this request as retryable, in microseconds.
            try:
                _refuse_known_dead(addr, self._transport, fresh.values())
            except RanksUnreachable as error:
                self._fanout.named_dead_again(fresh, error)  # may hold the key off (MGR-1)
                raise
        except BootstrapError as error:
            # The verdict came while this fetch waited on the silent server: fail with it (what
            # to do next), the fetch's own error as its cause.
            silent = self.silent.refusal(addr) if isinstance(error, TransportFailure) else None
            if silent is not None:
                silent.__cause__ = error
                error = silent
            flights.fail(led, error)
            return receiver.fail(life.FETCH_FAIL, error)
        # Health-watch the address with the instance id just fetched as the baseline: no probe
        # runs inside this request (MGR-21).
        self._watch(addr, next(iter(fresh.values())).instance_id if fresh else None)
        receiver.entries.update(fresh)
        receiver.fire(life.FETCH_OK)
        try:
            for generation in fresh.values():
                self._transport.register(generation, self._backend)
        except SendFailed as error:
            self._fanout.send_failed(error)  # the evidence, for the other requests there
            # Nothing of this request reached a prefill: retryable, as above (MGR-19).
            refused = unreachable(addr, error.endpoint, "registering with it failed")
            refused.__cause__ = error
            flights.fail(led, refused)
            return receiver.fail(life.REGISTER_FAIL, refused)
        receiver.fire(life.REGISTER_OK)
        published: dict[PoolKey, Generation] = {}
        stale: BootstrapError | None = None
        for key, generation in fresh.items():
            # setdefault: a concurrent winner's generation replaces ours in our records.
            held = self._source.publish(self._pool, key, generation)
            if held is None:
                # The source's watermark (etcd: the watch applied a change this fetch
                # predates): the object is not published and this request fails (the model's
                # Publish with fresh = None, then PeerLost).
                stale = stale or self._source.refusal(addr, generation)
                continue
            if held is generation:
                self._fanout.retain_sockets(generation)
            receiver.entries[key] = published[key] = held
        flights.resolve({k: f for k, f in led.items() if k in published}, published)
        if stale is not None:
            flights.fail({k: f for k, f in led.items() if k not in published}, stale)
        receiver.fire(life.PUBLISH)
        if stale is not None:
            return receiver.fail(life.PEER_LOST, stale)
        if receiver.lost is not None:  # failed by the fan-out while we fetched
            return receiver.fail(life.PEER_LOST, receiver.lost)
        return KVPoll.WaitingForInput

    def _fetch(
        self, receiver: Missing, plan: RankPlan, keys: list[PoolKey]
    ) -> dict[PoolKey, Generation]:
        """Ask the source for every (tp, pp) rank of each key; one generation each.

        Runs outside the pool lock. When the answering instance differs from the instance of
        entries this receiver adopted before the fetch, that older instance was replaced:
        its entries of this address are retired (POOL-6) and ours are fetched again.
        """
        adopted = dict(receiver.entries)
        fresh = self._fetch_keys(receiver.addr, plan, keys)
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
                self._fanout.instance_replaced(receiver.addr, old_ids, instance_id, receiver)
                fresh.update(self._fetch_keys(receiver.addr, plan, stale))
        return fresh

    def _fetch_keys(
        self, addr: str, plan: RankPlan, keys: list[PoolKey]
    ) -> dict[PoolKey, Generation]:
        source = self._source
        fresh: dict[PoolKey, Generation] = {}
        for key in keys:
            stamp = source.stamp()  # etcd: the watch's revision before the first get_rank
            ranks: list[RankInfo] = []
            instance_ids: set[str | None] = set()
            for tp_rank, pp_rank in plan.fetch_order:
                reply = source.get_rank(
                    addr,
                    dp_rank=key.dp_rank,
                    cp_rank=key.cp_rank,
                    tp_rank=tp_rank,
                    pp_rank=pp_rank,
                )
                if reply.instance_id not in instance_ids:
                    instance_ids.add(reply.instance_id)
                    self._routes.answered_by(addr, reply.instance_id)  # new instance: re-plan
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
                    f"{addr} restarted while its ranks were fetched; retry the request",
                    addr=addr,
                )
            fresh[key] = source.generation(tuple(ranks), instance_ids.pop(), stamp)
        return fresh

    def _watch(self, addr: str, instance_id: str | None) -> None:
        """Health-watch every address this process fetched from (off the hit path), with the
        instance id the fetch saw as the baseline: no probe runs inside the request (MGR-21;
        a server that sends no id gets its baseline from the watch thread's first probe)."""
        if self._health is None or addr in self._watched:
            return
        with self._lock:
            if addr in self._watched:
                return
            self._watched.add(addr)
        self._health.watch(addr, instance_id=instance_id, baseline_now=False)


def unreachable(addr: str, endpoint: str, why: str) -> RanksUnreachable:
    return RanksUnreachable(
        f"{addr}: prefill rank {endpoint} cannot be reached ({why}) and no newer registration "
        "is visible yet; nothing of this request was sent: retry shortly (the first request "
        "after the prefill registers again gets through)",
        addr=addr,
        endpoint=endpoint,
    )


def _refuse_known_dead(addr: str, transport: ZmqTransport, fresh: Iterable[Generation]) -> None:
    """``RanksUnreachable`` if a rank of ``fresh`` is at an endpoint the transport judged dead
    (its circuit is open, ZMQ-19): registering there would fail anyway."""
    for generation in fresh:
        for rank in generation.ranks:
            if transport.is_down((rank.ip, rank.port)):
                raise unreachable(
                    addr,
                    endpoint_url((rank.ip, rank.port)),
                    "the transport's socket monitor judged it dead",
                )
