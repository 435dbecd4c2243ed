"""``FanOut``: evidence that a prefill rank or instance is gone → every request that depends on it.

Evidence - a failed send to an endpoint, the transport reporting an endpoint dead, the health
monitor declaring an address dead or seeing a new instance id, a fetch answered by a new
instance, a source retiring generations - fails *every* receiver in flight that uses what it
names, with a typed :class:`~statemachine.errors.PeerLost` reason, and invalidates the
generations involved by identity (``spec/manager.md`` MGR-1..6). The fan-out never steps
another thread's receiver: it stores the reason on it (``mark_lost``: one attribute store) and the
owner's next call fires ``PeerLost``.

The transport's verdicts are also evidence about a failed room's KV (MGR-15): a proven exit
(ZMQ-26: the port refused a connect) is recorded with the deferred release
(:meth:`FanOut.process_exited`), so a room whose every writer exited is released at once; any
other dead verdict is silence and releases nothing (traced as ``SilenceSeen``).

Also here, because they follow the same generations: the keys known dead (a miss on one fails
at once, :mod:`statemachine.decode.dead_keys`, off unless a recheck time is given), and the
sockets of the generations this process published, retained in the transport until no pool
entry and no receiver uses them (ZMQ-20).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

from statemachine import trace
from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.holds import RESET_SEEN, AbortHolds, instance_label
from statemachine.decode.ranks.exit_probe import connect_refused
from statemachine.decode.ranks.transport import Endpoint, Verdict, ZmqTransport, endpoint_url
from statemachine.decode.rooms import Rooms, entries_of, items_of
from statemachine.decode.routes import Routes
from statemachine.decode.source import BootstrapSource
from statemachine.errors import (
    BootstrapError,
    PeerLost,
    PrefillDead,
    PrefillRestarted,
    RankDead,
    RanksUnreachable,
    SendFailed,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey

__all__ = ["FanOut", "note_evidence"]


class FanOut:
    """The failure fan-out of one decode process (see the module docstring)."""

    def __init__(
        self,
        *,
        rooms: Rooms,
        routes: Routes,
        pool: BootstrapPool,
        transport: ZmqTransport,
        source: BootstrapSource,
        dead_keys: DeadKeys,
        hold_off_dead: bool,
        clock: Callable[[], float],
        holds: AbortHolds | None = None,
    ) -> None:
        self._rooms = rooms
        self._routes = routes
        self._pool = pool
        self._transport = transport
        self._source = source
        self.dead_keys = dead_keys
        #: hold keys known dead off (a network source only: one that answers from a watched
        #: local store costs microseconds to ask and sees a new registration at once)
        self._hold_off_dead = hold_off_dead and source.health_by_probes
        self._clock = clock
        #: the deferred KV release the transport's exit proofs go to (MGR-15)
        self._holds = holds
        self._lock = threading.Lock()
        self._retained: dict[Generation, tuple[Endpoint, ...]] = {}
        #: pool entries removed, by what removed them (the lifecycle event or the evidence)
        self.invalidations: dict[str, int] = {}
        #: receivers failed, by evidence type
        self.failed: dict[str, int] = {}

    # --- evidence -------------------------------------------------------------------------

    def fail_generations(
        self,
        generations: Iterable[Generation],
        error: BootstrapError,
        *,
        spare_room: int | None = None,
    ) -> int:
        """Fail every receiver in flight that uses one of ``generations`` (but the one of
        ``spare_room``); invalidate them by identity. Returns how many receivers were failed."""
        doomed = set(generations)
        if not doomed:
            return 0
        note_evidence(error, self._clock())
        held = {key: g for key, g in self._pool.snapshot().items() if g in doomed}
        if held:
            self.invalidated({}, self._pool.invalidate(held), type(error).__name__)
        failed = 0
        for receiver in self._rooms.snapshot():
            if (
                receiver.room != spare_room
                and any(g in doomed for g in entries_of(receiver))
                and receiver.mark_lost(error)
            ):
                failed += 1
        self._count(error, failed)
        self.reconcile()
        return failed

    def fail_address(self, addr: str, error: BootstrapError) -> int:
        """Fail every receiver in flight bound to ``addr``; invalidate their generations by
        identity and forget the address's topology. Returns how many receivers were failed."""
        note_evidence(error, self._clock())
        self._routes.forget(addr)
        used: dict[PoolKey, Generation] = {}
        failed = 0
        for receiver in self._rooms.snapshot():
            if receiver.addr == addr:
                used.update(receiver.entries.copy())
                if receiver.mark_lost(error):
                    failed += 1
        if used:
            self.invalidated({}, self._pool.invalidate(used), type(error).__name__)
        self._count(error, failed)
        self.reconcile()
        return failed

    def send_failed(self, error: SendFailed) -> None:
        """A request's send failed: every other request using that endpoint is lost too."""
        self.endpoint_dead(error.endpoint, str(error))

    def on_verdict(self, verdict: Verdict) -> None:
        """Transport listener: an endpoint was found dead (evidence) or back."""
        if not verdict.alive:
            self.endpoint_dead(
                endpoint_url(verdict.endpoint), verdict.reason, exit_proven=verdict.exit_proven
            )
        else:
            self.dead_keys.forget_endpoint(endpoint_url(verdict.endpoint))

    def process_exited(self, endpoint: Endpoint, reason: str) -> None:
        """Transport exit listener (ZMQ-26, before the dead verdict): the rank's process at
        ``endpoint`` is gone, proof for the KV of every room its generations told.

        The other ranks of those generations are asked at once too: ranks that die together
        (a whole prefill killed) would otherwise race their own verdicts, and the first one
        ends the requests and closes the others' sockets before theirs arrive, leaving those
        rooms held until the timeout. A refused connect is the proof either way."""
        if self._holds is None:
            return
        url = endpoint_url(endpoint)
        generations = self._generations_using(url) | self._holds.generations_at(url)
        self._holds.proven_gone(url, generations, RESET_SEEN)
        others = {
            (rank.ip, rank.port)
            for generation in generations
            for rank in generation.ranks
            if (rank.ip, rank.port) != endpoint
        }
        for other in others:
            if connect_refused(other):
                other_url = endpoint_url(other)
                named = self._generations_using(other_url) | self._holds.generations_at(other_url)
                self._holds.proven_gone(other_url, named, RESET_SEEN)

    def _trace_silence(self, url: str) -> None:
        """A dead verdict that is not an exit: silence about every process told at ``url``."""
        named = self._generations_using(url)
        if self._holds is not None:
            named |= self._holds.generations_at(url)
        for generation in named:
            trace.emit("SilenceSeen", endpoint=url, instance=instance_label(generation))

    def endpoint_dead(self, url: str, reason: str, *, exit_proven: bool = False) -> int:
        """``url`` is dead (a verdict, or a failed send: never an exit): fail every request
        using it."""
        if trace.ENABLED and not exit_proven:
            self._trace_silence(url)  # a verdict or a failed send that proves no exit
        generations = self._generations_using(url)
        if not generations:
            return 0
        if self._hold_off_dead:
            self.dead_keys.record(self._keys_holding(generations), url, reason)
        error = RankDead(
            f"prefill rank {url} is dead ({reason}); retry the request: it will fetch the "
            "prefill's current ranks",
            endpoint=url,
        )
        return self.fail_generations(generations, error)

    def address_dead(self, addr: str, reason: str) -> None:
        """Health monitor: ``addr`` stopped answering (the pool entries are already gone)."""
        self.fail_address(
            addr,
            PrefillDead(
                f"prefill {addr} stopped answering health probes ({reason}); retry the "
                "request once it is back",
                addr=addr,
            ),
        )

    def address_restarted(self, addr: str, old_id: str, new_id: str) -> None:
        """Health monitor: a new instance answers at ``addr``."""
        self.restarted(addr, old_id, new_id, cause="health")

    def restarted(
        self,
        addr: str,
        old_id: str,
        new_id: str,
        *,
        cause: str,
        spare_room: int | None = None,
    ) -> int:
        self._routes.forget(addr)
        self.dead_keys.forget_address(addr)  # a new instance: every registration is new
        candidates = list(self._pool.snapshot().items())
        for receiver in self._rooms.snapshot():
            if receiver.addr == addr:
                candidates.extend(receiver.entries.copy().items())
        stale = {g for key, g in candidates if key.addr == addr and g.instance_id == old_id}
        error = PrefillRestarted(
            f"prefill {addr} restarted (instance {old_id} replaced by {new_id}, seen by "
            f"{cause}); retry the request: it will fetch the new instance's ranks",
            addr=addr,
            old_id=old_id,
            new_id=new_id,
        )
        return self.fail_generations(stale, error, spare_room=spare_room)

    def instance_replaced(
        self, addr: str, old_ids: Iterable[str | None], new_id: str, *, finder: int
    ) -> None:
        """The fetch of room ``finder`` from ``addr`` answered as ``new_id`` while it held
        entries of ``old_ids``: retire those, and fail the other requests that use them (the
        finder refetches its stale keys itself)."""
        # Retire exactly the replaced ids (POOL-6): ``finder`` adopted those entries before
        # its fetch began, so they answered before ``new_id`` did. Never "every id but
        # new_id": a newer instance may have published since this fetch was answered.
        for old in old_ids:
            if old is not None:
                self._pool.retire_instance(addr, old)
                self.restarted(addr, old, new_id, cause="fetch", spare_room=finder)

    def named_dead_again(
        self, fresh: Mapping[PoolKey, Generation], error: RanksUnreachable
    ) -> None:
        """A fetch named again a rank judged dead (MGR-19): with the hold-off on, its keys are
        held off until the next recheck (``dead_keys``)."""
        if self._hold_off_dead:
            self.dead_keys.record(fresh.items(), error.endpoint, "named again after it died")

    # --- generations and their sockets ------------------------------------------------------

    def retain_sockets(self, generation: Generation) -> None:
        """``generation`` was published by this process: keep its endpoints' sockets."""
        endpoints = tuple((rank.ip, rank.port) for rank in generation.ranks)
        with self._lock:
            if generation in self._retained:
                return
            self._retained[generation] = endpoints
        self._transport.retain(endpoints)

    def invalidated(self, entries: Mapping[PoolKey, Generation], removed: int, cause: str) -> None:
        """``entries`` were dropped from the pool (``removed`` of them were there)."""
        if removed:
            with self._lock:
                self.invalidations[cause] = self.invalidations.get(cause, 0) + removed
        if entries:
            self.reconcile()

    def reconcile(self) -> int:
        """Release the sockets of retained generations nothing uses any more."""
        with self._lock:
            if not self._retained:
                return 0
        live = set(self._pool.snapshot().values())
        for receiver in self._rooms.snapshot():
            live.update(entries_of(receiver))
        with self._lock:
            dead = [g for g in self._retained if g not in live]
            released = [self._retained.pop(g) for g in dead]
        for endpoints in released:
            self._transport.release(endpoints)
        return len(released)

    def endpoints_retained(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._retained.values())

    def close(self) -> None:
        """Release every retained socket and forget the keys known dead."""
        with self._lock:
            retained = list(self._retained.values())
            self._retained.clear()
        for endpoints in retained:
            self._transport.release(endpoints)
        self.dead_keys.clear()

    # --- lookups over the pool and the receivers in flight ----------------------------------

    def _count(self, error: BootstrapError, failed: int) -> None:
        kind = type(error).__name__
        with self._lock:
            self.failed[kind] = self.failed.get(kind, 0) + failed

    def _keys_holding(self, generations: set[Generation]) -> list[tuple[PoolKey, Generation]]:
        """The (key, generation) pairs of the pool and of the receivers in flight whose
        generation is one of ``generations``."""
        items = [(k, g) for k, g in self._pool.snapshot().items() if g in generations]
        for receiver in self._rooms.snapshot():
            items.extend((k, g) for k, g in items_of(receiver) if g in generations)
        return items

    def _generations_using(self, url: str) -> set[Generation]:
        found: set[Generation] = set()
        candidates = list(self._pool.snapshot().values())
        for receiver in self._rooms.snapshot():
            candidates.extend(entries_of(receiver))
        for generation in candidates:
            for rank in generation.ranks:
                if endpoint_url((rank.ip, rank.port)) == url:
                    found.add(generation)
                    break
        return found


def note_evidence(error: BootstrapError, now: float) -> None:
    """When the evidence arrived, on a PeerLost reason (for the detection-time stats)."""
    if isinstance(error, PeerLost) and error.evidence_at is None:
        error.evidence_at = now
