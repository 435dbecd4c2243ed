"""``FanOut``: evidence that a prefill rank or instance is gone → every request that depends on it.

Evidence - a failed send to an endpoint, the transport reporting an endpoint dead, the health
monitor declaring an address dead or seeing a new instance id, a fetch answered by a new
instance, a source retiring generations - fails *every* receiver in flight that uses what it
names, with a typed :class:`~statemachine.errors.PeerLost` reason, and invalidates the
generations involved by identity (``spec/manager.md`` MGR-1..6). The fan-out never steps
another thread's receiver: it stores the reason on it (``mark_lost``: one attribute store) and the
owner's next call fires ``PeerLost``.

A key whose endpoint was found dead is remembered (a miss on one fails at once,
:mod:`statemachine.decode.dead_keys`, off unless a recheck time is given). What the evidence
means for a failed room's KV is :mod:`statemachine.decode.exits`'s; the sockets released as the
fan-out drops generations are :mod:`statemachine.decode.retention`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

from statemachine import trace
from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.exits import ExitProofs
from statemachine.decode.ranks.transport import Verdict, endpoint_url
from statemachine.decode.retention import SocketRetention
from statemachine.decode.rooms import Rooms, entries_of, generations_at, items_of
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
        source: BootstrapSource,
        dead_keys: DeadKeys,
        hold_off_dead: bool,
        clock: Callable[[], float],
        retention: SocketRetention,
        exits: ExitProofs,
    ) -> None:
        self._rooms = rooms
        self._routes = routes
        self._pool = pool
        self._source = source
        self.dead_keys = dead_keys
        #: hold keys known dead off (a network source only: one that answers from a watched
        #: local store costs microseconds to ask and sees a new registration at once)
        self._hold_off_dead = hold_off_dead and source.health_by_probes
        self._clock = clock
        #: the sockets of what this process published: released as the fan-out drops it
        self._retention = retention
        #: a dead verdict that proves no exit is traced as silence there (MGR-15)
        self._exits = exits
        self._lock = threading.Lock()
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
        self._retention.reconcile()
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
        self._retention.reconcile()
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

    def endpoint_dead(self, url: str, reason: str, *, exit_proven: bool = False) -> int:
        """``url`` is dead (a verdict, or a failed send: never an exit): fail every request
        using it."""
        if trace.ENABLED and not exit_proven:
            self._exits.trace_silence(url)  # a verdict or a failed send that proves no exit
        generations = generations_at(url, self._pool, self._rooms)
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

    def invalidated(self, entries: Mapping[PoolKey, Generation], removed: int, cause: str) -> None:
        """``entries`` were dropped from the pool (``removed`` of them were there)."""
        if removed:
            with self._lock:
                self.invalidations[cause] = self.invalidations.get(cause, 0) + removed
        if entries:
            self._retention.reconcile()

    def close(self) -> None:
        """Forget the keys known dead."""
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


def note_evidence(error: BootstrapError, now: float) -> None:
    """When the evidence arrived, on a PeerLost reason (for the detection-time stats)."""
    if isinstance(error, PeerLost) and error.evidence_at is None:
        error.evidence_at = now
