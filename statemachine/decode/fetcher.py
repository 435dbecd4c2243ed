"""``Fetcher``: the miss path, step by step. Each step answers with a value; the receiver
steps its own lifecycle between them (``BootstrapReceiver._miss``, ``spec/lifecycle.md``) and
no step is handed the receiver.

Before it, the receiver refuses at once what is known to fail (once each, ``spec/manager.md``):
an address judged silent (``silent``, MGR-22) and keys whose rank is known dead (``dead_keys``,
MGR-1). Then:

1. :meth:`Fetcher.claim` - **single-flight** (:mod:`statemachine.decode.flight`): follow the
   fetches in flight for our keys and adopt what they publish (``Hit`` once nothing is left), or
   lead all of them: a :class:`Claim`, or the leader's error;
2. :meth:`Fetcher.fetch` (``Miss`` → ``FetchOk``) - every (tp, pp) rank of each key from the
   source, inside the request's deadline window (MGR-21); an answer from a new instance retires
   the entries of the old one (POOL-6) and re-plans the address (MGR-20); ranks the transport
   already judged dead fail the request as retryable (the one retry rule, MGR-19): the
   generations fetched (every key answered by one instance, MGR-23), or the typed error;
3. :meth:`Fetcher.register` (``RegisterOk``) - with every rank, over the transport: ``None``, or
   the typed error;
4. :meth:`Fetcher.publish` (``Publish``) - through the source (its watermark may refuse a stale
   fetch), adopting a concurrent winner's generation; what this process published keeps its
   sockets: a :class:`Published`;
5. :meth:`Fetcher.abandon` - whatever happened, the flights a claim led and nobody resolved
   fail, so no follower waits for them.

The fetcher reports evidence to the fan-out (a failed register, an instance replaced, ranks
named dead again); it knows nothing above it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from statemachine.decode.fanout import FanOut
from statemachine.decode.flight import Flight, Flights
from statemachine.decode.health import HealthMonitor
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.outbox import Outbox
from statemachine.decode.ranks.transport import ZmqTransport, endpoint_url
from statemachine.decode.retention import SocketRetention
from statemachine.decode.routes import Routes
from statemachine.decode.silent import SilentAddresses
from statemachine.decode.source import BootstrapSource
from statemachine.errors import (
    BootstrapError,
    BootstrapHTTPError,
    PeerLost,
    PrefillRestarted,
    RanksUnreachable,
    SendFailed,
    TransportFailure,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo

__all__ = ["Claim", "Fetched", "Fetcher", "Published", "unreachable"]

#: What a fetch answers: one generation per key.
Fetched = dict[PoolKey, Generation]


@dataclass(slots=True)
class Claim:
    """One look at the flights of a request's missing keys (:meth:`Fetcher.claim`)."""

    #: the keys still missing: what this request fetches itself if it leads
    missing: list[PoolKey]
    #: the flights this request leads (their followers adopt what it publishes); empty when
    #: it followed
    led: dict[PoolKey, Flight]
    #: another request's flight was followed: the request looks again (the fan-out may have
    #: failed it while it waited)
    followed: bool


@dataclass(frozen=True, slots=True)
class Published:
    """What :meth:`Fetcher.publish` did: the generation each published key holds now (ours,
    or a concurrent winner's), and why a key was not published (a stale fetch), if one was
    not."""

    entries: Mapping[PoolKey, Generation]
    stale: BootstrapError | None


class Fetcher:
    """The miss path of one decode process (see the module docstring)."""

    def __init__(
        self,
        *,
        pool: BootstrapPool,
        source: BootstrapSource,
        transport: ZmqTransport,
        outbox: Outbox,
        flights: Flights,
        fanout: FanOut,
        retention: SocketRetention,
        routes: Routes,
        silent: SilentAddresses,
        health: HealthMonitor | None,
        clock: Callable[[], float],
    ) -> None:
        self._pool = pool
        self._source = source
        self._transport = transport
        self._outbox = outbox
        self.flights = flights
        self._fanout = fanout
        self._retention = retention
        self._routes = routes
        #: addresses judged silent: a fetch that failed while its server was judged silent
        #: fails with that verdict (MGR-22)
        self._silent = silent
        self._health = health
        self._clock = clock
        self._lock = threading.Lock()
        self._watched: set[str] = set()

    def claim(
        self,
        missing: list[PoolKey],
        entries: dict[PoolKey, Generation],
        deadline: float,
    ) -> Claim | BootstrapError:
        """Follow the fetches in flight for ``missing``, or lead all of them.

        A follower waits (until ``deadline``) for the flights it follows and adopts what they
        publish into ``entries`` - the request's own record, so that evidence about an adopted
        generation finds the request from the moment it adopted it (MGR-1) - then what is still
        missing is looked up in the pool once more; the answer says what is left. The leader's
        error when a followed flight failed (or the wait timed out)."""
        flights = self.flights
        led, followed = flights.claim(missing)
        if followed:
            for flight in followed:
                try:
                    entries[flight.key] = flight.wait(deadline - self._clock())
                except BootstrapError as error:
                    return error
            still: list[PoolKey] = []
            for key in missing:
                if key in entries:
                    continue
                generation = self._pool.lookup(key)
                if generation is None:
                    still.append(key)
                else:
                    entries[key] = generation
            return Claim(still, {}, followed=True)
        # We lead. A flight that closed between our lookup and our claim published first:
        # its generation is in the pool now, so look once more before fetching.
        present = {key: g for key in led if (g := self._pool.get(key)) is not None}
        if present:
            flights.resolve({key: led.pop(key) for key in present}, present)
            entries.update(present)
            missing = [key for key in missing if key not in present]
        return Claim(missing, led, followed=False)

    def fetch(
        self,
        addr: str,
        plan: RankPlan,
        claim: Claim,
        *,
        room: int,
        adopted: Mapping[PoolKey, Generation],
    ) -> Fetched | BootstrapError:
        """Every rank of the claimed keys from the source (inside the caller's deadline
        window, MGR-21), refused when a rank is at an endpoint already judged dead (MGR-19).
        ``adopted``: what the request holds already (a new instance's answer retires those of
        an older one, POOL-6); ``room`` is spared by the fan-out that retirement starts (the
        request refetches its stale keys itself). On an error the led flights fail with it."""
        try:
            fresh = self._fetch(addr, plan, claim.missing, room=room, adopted=adopted)
            # One retry rule on every source (MGR-19): ranks the transport already judged
            # dead, answered again (a store still listing a crashed prefill, a server that
            # kept a dead rank's port), fail this request as retryable, in microseconds -
            # as a refused or unready HTTP server does: one kill-window rule (MGR-24), the
            # caller's retry is served by the replacement.
            try:
                _refuse_known_dead(addr, self._transport, fresh.values())
            except RanksUnreachable as error:
                self._fanout.named_dead_again(fresh, error)  # may hold the key off (MGR-1)
                raise
        except BootstrapError as error:
            # The verdict came while this fetch waited on the silent server: fail with it (what
            # to do next), the fetch's own error as its cause.
            silent = self._silent.refusal(addr) if isinstance(error, TransportFailure) else None
            if silent is not None:
                silent.__cause__ = error
                error = silent
            self.flights.fail(claim.led, error)
            return error
        # Health-watch the address with the instance id just fetched as the baseline: no probe
        # runs inside this request (MGR-21).
        self._watch(addr, next(iter(fresh.values())).instance_id if fresh else None)
        return fresh

    def register(self, addr: str, claim: Claim, fetched: Fetched) -> BootstrapError | None:
        """Register with every rank of ``fetched``; the typed error if a send failed (then the
        led flights fail with it)."""
        try:
            for generation in fetched.values():
                self._outbox.register(generation)
        except SendFailed as error:
            self._fanout.send_failed(error)  # the evidence, for the other requests there
            # Nothing of this request reached a prefill: retryable, as above (MGR-19).
            refused = unreachable(addr, error.endpoint, "registering with it failed")
            refused.__cause__ = error
            self.flights.fail(claim.led, refused)
            return refused
        return None

    def publish(self, addr: str, claim: Claim, fetched: Fetched) -> Published:
        """Publish ``fetched`` through the source; the led flights follow the result."""
        published: dict[PoolKey, Generation] = {}
        stale: BootstrapError | None = None
        for key, generation in fetched.items():
            # setdefault: a concurrent winner's generation replaces ours in our records.
            held = self._source.publish(self._pool, key, generation)
            if held is None:
                # The source's watermark (etcd: the watch applied a change this fetch
                # predates): the object is not published and this request fails (the model's
                # Publish with fresh = None, then PeerLost).
                stale = stale or self._source.refusal(addr, generation)
                continue
            if held is generation:
                self._retention.retain(generation)
            published[key] = held
        led = claim.led
        self.flights.resolve({k: f for k, f in led.items() if k in published}, published)
        if stale is not None:
            self.flights.fail({k: f for k, f in led.items() if k not in published}, stale)
        return Published(published, stale)

    def abandon(self, addr: str, claim: Claim, failure: BootstrapError | None) -> None:
        """The claim's flights nobody resolved fail (with ``failure``, the request's own
        reason, if it has one): no follower may wait for a flight nobody will resolve."""
        unresolved = {key: f for key, f in claim.led.items() if not f.done}
        if unresolved:
            self.flights.fail(
                unresolved,
                failure or PeerLost(f"{addr}: the fetch this request waited for was abandoned"),
            )

    def _fetch(
        self,
        addr: str,
        plan: RankPlan,
        keys: list[PoolKey],
        *,
        room: int,
        adopted: Mapping[PoolKey, Generation],
    ) -> Fetched:
        """Ask the source for every (tp, pp) rank of each key; one generation each.

        Runs outside the pool lock. When the answering instance differs from the instance of
        entries this request adopted before the fetch, that older instance was replaced:
        its entries of this address are retired (POOL-6) and ours are fetched again.
        """
        adopted = dict(adopted)
        fresh = self._fetch_keys(addr, plan, keys)
        instance_id = _one_instance(addr, fresh)
        if instance_id is not None:
            stale = [
                key
                for key, g in adopted.items()
                if g.instance_id is not None and g.instance_id != instance_id
            ]
            if stale:
                old_ids = {g.instance_id for k, g in adopted.items() if k in stale}
                self._fanout.instance_replaced(addr, old_ids, instance_id, finder=room)
                fresh.update(self._fetch_keys(addr, plan, stale))
                _one_instance(addr, fresh)
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


def _one_instance(addr: str, fresh: Mapping[PoolKey, Generation]) -> str | None:
    """The one instance id that answered every key of ``fresh`` (``None`` if the source sends
    none). Keys answered by two instances (the prefill restarted between two of them) are
    never accepted together: the request fails with :class:`PrefillRestarted`, retryable,
    and publishes nothing (``spec/manager.md`` MGR-23)."""
    answered: list[str] = []  # in the order the keys were answered: the first is the older
    for generation in fresh.values():
        if generation.instance_id is not None and generation.instance_id not in answered:
            answered.append(generation.instance_id)
    if len(answered) > 1:
        old_id, new_id = answered[0], answered[-1]
        raise PrefillRestarted(
            f"prefill {addr} restarted while this request fetched its ranks (keys answered by "
            f"instance {old_id} and by {new_id}); nothing was published: retry the request, "
            "it will fetch the new instance's ranks",
            addr=addr,
            old_id=old_id,
            new_id=new_id,
        )
    return answered[0] if answered else None


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
