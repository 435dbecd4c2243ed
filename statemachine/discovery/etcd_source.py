"""Decode side: a bootstrap source fed by an etcd watch, informer-style (docs/etcd.md).

:class:`EtcdBootstrapSource` answers ``get_rank`` / ``get_topology`` / ``query_dp_ranks``
(the ``BootstrapSource`` protocol the receiver fetches through) from a *local store* only: a
background thread lists ``<prefix>/`` once, then watches it from the list's revision + 1 and
applies every put and delete to the store, in revision order, as Kubernetes' reflector does.
A caller never waits on etcd: a miss in the pool costs a dictionary lookup here, and before the
first list completes every call raises :class:`~statemachine.errors.NotReady` at once.

**Retirement rule.** A generation (one pool entry) is *current* while every rank it holds is
still registered with the same endpoint *and* has held that exact value since a revision no
newer than the generation's own ``revision``: the store revision read before its fetch
(:class:`~statemachine.discovery.changes.StampedGeneration`; an unstamped generation is
current while its endpoints are registered). The store and this rule are
:mod:`statemachine.discovery.rank_store`'s; this module runs the watch that feeds the store
and retires what the rule finds stale. On every put or delete of a rank key at revision
``R`` the source drops, by identity (``BootstrapPool.invalidate``), each entry of that key's
``(addr, dp, cp)`` that is no longer current, and reports them to ``on_change``: exactly the
generations fetched before ``R`` that used the changed rank. A generation fetched at or after
``R`` survives, even when a restarted rank re-bound the same port with the same instance id -
the revision is the order that instance ids lack. A re-put of identical bytes (a registrar
that re-granted its lease) changes nothing.

**Failures.** A broken stream or an unreachable etcd keeps the store serving (the receiver's
failure-driven invalidation still works) and retries with jittered back-off (the loop that
lists and watches is :mod:`statemachine.discovery.watch_loop`); on reconnect the
watch resumes from revision + 1, so no change is missed and no list is needed. A resume whose
revision was compacted meanwhile re-lists and diffs the store against the list, emitting a
change for each key that differs. Another cluster answering (etcd replaced or restored) drops
the store and every stamped generation, then lists the new cluster. Every retry - reconnect,
re-list, a bad reply, a replaced cluster - waits its jittered back-off (50 ms doubling to 2 s),
reset only by a stream that stayed up for ``backoff_max``: a gateway that fails the same way
each time costs at most one attempt per back-off, never a busy loop.
``stats()`` says ``connected=False`` while etcd is unreachable.

**Defensive decoding** (docs/etcd.md, "Limits"). A key or event that does not decode, or whose
value fails the bootstrap server's rules, is counted (``malformed``) and skipped: the rest sync.
Revisions only move forward: an event not newer than the store is ignored (``stale_events``),
one beyond its own message's header revision is refused (``refused_revisions``). Replies and
watch messages have size caps and every exchange a total deadline (the gateway's); ``close()``
ends the exchange in progress, so the thread ends within ``connect_timeout + 1`` s.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from statemachine.discovery.changes import (
    ChangeListener,
    HeldGenerations,
    RankChange,
    generation_for,
    mark_retired,
    refused_publish,
    retired_at,
    retiring_listener,
    stale_start,
)
from statemachine.discovery.etcd_wire import WatchMessage
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.layout import (
    DEFAULT_PREFIX,
    RankKey,
    RankRecord,
    normalise_prefix,
    parse_key,
    parse_value,
    topology_of,
)
from statemachine.discovery.rank_store import AddressView, RankStore
from statemachine.discovery.watch_loop import WatchLoop
from statemachine.errors import (
    BootstrapError,
    InvalidArgument,
    MalformedValue,
    NotFound,
    NotReady,
    PeerLost,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.validation import (
    RouteReply,
    Topology,
    parse_addr,
    require_index,
    require_rank,
)

__all__ = ["EtcdBootstrapSource", "EtcdSourceStats"]


@dataclass(frozen=True, slots=True)
class EtcdSourceStats:
    #: a watch stream is open (False while etcd is unreachable: the store still serves)
    connected: bool
    #: the first list completed; before it every call raises NotReady
    synced: bool
    revision: int
    last_error: str | None
    lists: int
    relists: int
    compactions: int
    reconnects: int
    idle_reopens: int
    events_handled: int
    #: keys and events skipped: undecodable (bad base64, ...) or a value failing validation
    malformed: int
    #: events not newer than the store (a replay): ignored
    stale_events: int
    #: events whose revision lies beyond their message's header revision: refused
    refused_revisions: int
    #: replies etcd never sends (no header, not JSON, over a size cap): retried with back-off
    bad_replies: int
    changes: int
    retired: int
    #: pool entries compared against the store (only the changed key's (addr, dp, cp))
    entries_examined: int
    hook_errors: int
    #: fetches ``publish`` refused because a change overtook them (the watermark)
    publishes_refused: int


class EtcdBootstrapSource:
    """Rank infos from etcd, served from a watch-fed local store (see the module doc).

    ``pool``: the decode's pool, whose stale entries the source retires on each change.
    ``on_change``: called on the watch thread after each applied change (exceptions are
    counted, never propagated). ``start()`` returns at once; ``wait_synced()`` waits for the
    first list.
    """

    def __init__(
        self,
        gateway: EtcdGateway,
        *,
        prefix: str = DEFAULT_PREFIX,
        pool: BootstrapPool | None = None,
        on_change: ChangeListener | None = None,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        watch_idle_timeout: float = 10.0,
    ) -> None:
        if not 0 < backoff_initial <= backoff_max:
            raise InvalidArgument("need 0 < backoff_initial <= backoff_max")
        if not watch_idle_timeout > 0:
            raise InvalidArgument("watch_idle_timeout must be > 0")
        self.gateway = gateway
        self.prefix = normalise_prefix(prefix)
        self._prefix_bytes = (self.prefix + "/").encode()
        self.pool = pool
        self.on_change = on_change
        #: the local store every answer comes from, and its currency rule (watch thread only)
        self.store = RankStore()
        self._cluster_id = 0
        self._replaced = False
        #: Makes a watch event one step for publishers (``publish``): the history append, the
        #: fan-out mark and the pool retirement of a change happen under it, and so does the
        #: watermark check + ``pool.publish`` of a fetch (spec/model.md, WatchEvent/Publish).
        self._retire_lock = threading.Lock()
        #: The manager's in-flight holdings (``attach``): marked with the pool's entries.
        self._held: HeldGenerations | None = None
        self._bound_on_change: ChangeListener | None = None
        self._refused = 0
        self._synced = threading.Event()
        #: set once the first list is over, whether it succeeded (synced) or failed
        self._first_list_over = threading.Event()
        self._last_error: str | None = None
        self._lists = 0
        self._events = 0
        self._malformed = 0
        self._stale_events = 0
        self._refused_revisions = 0
        self._changes = 0
        self._retired = 0
        self._examined = 0
        self._hook_errors = 0
        self._watch = WatchLoop(
            gateway,
            self._prefix_bytes,
            list_and_diff=self._list_and_diff,
            revision=lambda: self.store.revision,
            same_cluster=self._same_cluster,
            apply=self._apply,
            first_list_failed=self._first_list_over.set,
            report_error=self._report_error,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            idle_timeout=watch_idle_timeout,
        )

    # --- the BootstrapSource protocol (local store only) -------------------------------------

    @property
    def revision(self) -> int:
        """The store's revision: every change up to it is applied. Read it *before* fetching
        and stamp the generation with it (``StampedGeneration(ranks, instance_id, revision)``)."""
        return self.store.revision

    def _view(self, addr: str) -> AddressView:
        if not self._synced.is_set():
            cause = self._last_error
            raise NotReady(
                f"{addr}: etcd source not synced yet (first list of {self.prefix!r} "
                + (f"failed: {cause}" if cause else "pending")
                + f"): check that etcd serves at {', '.join(self.gateway.endpoints)}; the "
                "source keeps retrying, so retry the request shortly",
                addr=addr,
            )
        view = self.store.addrs.get(addr)
        if view is None:
            parse_addr(addr)
            raise NotReady(
                f"{addr}: no prefill registered under {self.prefix!r} (not started yet, or its "
                "lease expired): retry, or route the request elsewhere",
                addr=addr,
            )
        if not view.ready:
            raise NotReady(
                f"{addr}: not every prefill rank registered in etcd by one instance yet "
                "(starting or restarting): retry shortly",
                addr=addr,
            )
        return view

    def get_rank(
        self, addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int
    ) -> RouteReply:
        require_rank(dp_rank=dp_rank, cp_rank=cp_rank, tp_rank=tp_rank, pp_rank=pp_rank)
        view = self._view(addr)
        record = view.records.get((dp_rank, cp_rank, tp_rank, pp_rank))
        reference = view.reference
        if record is None or reference is None or record.layout != reference.layout:
            raise NotFound(
                f"{addr}: no rank dp={dp_rank} cp={cp_rank} tp={tp_rank} pp={pp_rank} in the "
                "registered topology",
                addr=addr,
            )
        return RouteReply(record.rank_ip, record.rank_port, record.instance_id)

    def get_topology(self, addr: str) -> Topology:
        reference = self._view(addr).reference
        assert reference is not None  # a ready view has one
        # The optional layout keys (the rank-plan switches of spec/plans.md PLAN-1, the
        # allocation policy, DSpark) come from the reference rank's registration, as a bootstrap
        # server takes them from its first registration, and go through the same reply parser.
        registration = json.loads(reference.raw)  # a JSON object: parse_value checked it
        return topology_of(registration, reference, addr)

    def query_dp_ranks(self, addr: str, rooms: Sequence[int]) -> dict[int, int]:
        """dp rank per room, by the prefill's registered rule (docs/etcd.md, "dp ranks").

        One dp group: 0. ``follow_bootstrap_room`` (or unset, as in SGLang): ``room %
        dp_size``. Otherwise per-room dp ranks are not published in etcd (yet), so no room
        is known and the answer is empty, as a bootstrap server answers for unknown rooms.
        """
        if isinstance(rooms, (str, bytes)) or not isinstance(rooms, Sequence):
            raise InvalidArgument(f"rooms must be a sequence of ints, got {type(rooms).__name__}")
        checked = [require_index("room", room) for room in rooms]
        reference = self._view(addr).reference
        assert reference is not None
        if reference.dp_size == 1:
            return dict.fromkeys(checked, 0)
        if reference.follow_bootstrap_room is not False:
            return {room: room % reference.dp_size for room in checked}
        return {}

    # --- currency of a generation -------------------------------------------------------------

    def is_current(self, key: PoolKey, generation: Generation) -> bool:
        """No rank ``generation`` used has changed or gone since it was fetched (the store's
        rule, :meth:`~statemachine.discovery.rank_store.RankStore.is_current`)."""
        return self.store.is_current(key, generation)

    def attach(
        self,
        pool: BootstrapPool,
        *,
        held: HeldGenerations,
        retire: Callable[[Sequence[Generation], BootstrapError], object],
    ) -> None:
        """Serve a decode manager (the ``BootstrapSource`` protocol; docs/etcd.md): retire from
        ``pool``, mark what ``held`` says the receivers in flight hold, and hand each change's
        retired generations to ``retire`` (the manager's fan-out, with ``RankRetired``) after
        the listener given at construction. Replaces an earlier attachment."""
        if self.pool is not None and self.pool is not pool:
            raise InvalidArgument(
                "this etcd source already retires from another pool: give the manager the "
                "same pool (or none) as the source"
            )
        self.pool = pool
        self._held = held
        self._bound_on_change = retiring_listener(retire)

    def detach(self) -> None:
        """The manager closed: stop asking it (the pool stays, and so does ``on_change``)."""
        self._held = None
        self._bound_on_change = None

    # --- what the source reports to its manager (the BootstrapSource protocol) ---------------

    #: The watch and the leases find a dead or restarted prefill: no HTTP probes.
    health_by_probes = False
    #: A watch event marks the generations it retires (``changes.mark_retired``).
    marks_generations = True

    def shared_pool(self) -> BootstrapPool | None:
        return self.pool

    def stamp(self) -> int | None:
        """The store's revision, read before a fetch (``changes.revision_of``)."""
        return self.store.revision

    def generation(
        self, ranks: tuple[RankInfo, ...], instance_id: str | None, stamp: int | None
    ) -> Generation:
        """A :class:`~statemachine.discovery.changes.StampedGeneration` of revision ``stamp``."""
        return generation_for(ranks, instance_id, stamp)

    def refusal(self, addr: str, generation: Generation) -> BootstrapError:
        return refused_publish(addr, getattr(generation, "revision", None), self.store.revision)

    def stale_mark(self, addr: str, generations: Iterable[Generation]) -> PeerLost | None:
        """``RankRetired`` if a watch event marked one of ``generations`` (NoStaleStart)."""
        for generation in generations:
            revision = retired_at(generation)
            if revision is not None:
                return stale_start(addr, revision)
        return None

    def publish(
        self, pool: BootstrapPool, key: PoolKey, generation: Generation
    ) -> Generation | None:
        """``pool.publish(key, generation)`` unless a change overtook the fetch: the watermark.

        Atomic with the watch's retirement steps (one lock, never taken on a hit): a fetch
        older than a change the watch already applied to its ``(addr, dp, cp)`` is refused
        (``None``: the caller fails its request with ``RankRetired``); one published first is
        found by that change's pool scan. So no stale object enters the slot a retirement just
        emptied (the model's mutation ``NoWatermark``).

        A stale fetch whose key already holds a *current* entry (another request, or another
        manager on the pool, fetched after the change) adopts that entry, as ``setdefault``
        would have: the model's Publish lets a leader and its followers adopt the pool's entry,
        so only a fetch with nothing current to adopt is refused.
        """
        with self._retire_lock:
            if not self.is_current(key, generation):
                held = pool.get(key)
                if held is not None and self.is_current(key, held):
                    return pool.publish(key, generation)  # setdefault: returns ``held``
                self._refused += 1
                return None
            return pool.publish(key, generation)

    def check_published(self, key: PoolKey, generation: Generation) -> bool:
        """Call after publishing a fetched generation: retire it if a change overtook it.

        Closes the one race the watch cannot: a fetch that read a rank before a change and
        published after the watch thread had already scanned the pool. Returns ``True`` when
        the generation is current (and stays), ``False`` when it was invalidated (the caller
        fetches again).
        """
        if self.is_current(key, generation):
            return True
        if self.pool is not None:
            self.pool.invalidate({key: generation})
        return False

    # --- running ------------------------------------------------------------------------------

    def start(self) -> EtcdBootstrapSource:
        self._watch.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def wait_first_list(self, timeout: float) -> bool:
        """Wait until the first list is over (succeeded, or failed: etcd refused or did not
        answer within the gateway's timeouts), at most ``timeout`` s; whether it is synced.
        A failed first list is retried in the background either way."""
        self._first_list_over.wait(timeout)
        return self._synced.is_set()

    def close(self) -> None:
        """Stop the watch thread: within ``connect_timeout + 1`` s (the gateway's), whatever
        etcd or a proxy does - the exchange in progress is ended at once (its socket shut
        down); only a TCP connect in progress cannot be, and it has its own timeout."""
        self._watch.close()
        self.gateway.close()

    def __enter__(self) -> EtcdBootstrapSource:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> EtcdSourceStats:
        watch = self._watch
        return EtcdSourceStats(
            connected=watch.connected,
            synced=self._synced.is_set(),
            revision=self.store.revision,
            last_error=self._last_error,
            lists=self._lists,
            relists=max(0, self._lists - 1),
            compactions=watch.compactions,
            reconnects=watch.reconnects,
            idle_reopens=watch.idle_reopens,
            events_handled=self._events,
            malformed=self._malformed,
            stale_events=self._stale_events,
            refused_revisions=self._refused_revisions,
            bad_replies=watch.bad_replies,
            changes=self._changes,
            retired=self._retired,
            entries_examined=self._examined,
            hook_errors=self._hook_errors,
            publishes_refused=self._refused,
        )

    # --- applying changes (watch thread only) -------------------------------------------------

    def _report_error(self, text: str) -> None:
        self._last_error = text

    def _same_cluster(self, message: WatchMessage) -> bool:
        """A watch's first message comes from the cluster the store was listed from (not etcd
        replaced, or restored from a backup); when not, the next list starts over."""
        if message.cluster_id == self._cluster_id and message.revision >= self.store.revision:
            return True
        self._replaced = True
        return False

    def _record(self, key: RankKey, raw: bytes, mod_revision: int) -> RankRecord | None:
        try:
            return parse_value(key, raw, mod_revision=mod_revision)
        except MalformedValue:
            self._malformed += 1
            return None

    def _list_and_diff(self) -> None:
        revision, cluster_id, kvs, undecodable = self.gateway.get_prefix(
            self._prefix_bytes, on_exchange=self._watch.track
        )
        self._lists += 1
        self._malformed += undecodable
        replaced = self._synced.is_set() and (
            self._replaced or cluster_id != self._cluster_id or revision < self.store.revision
        )
        self._cluster_id = cluster_id
        self._replaced = False
        if replaced:
            self._clear()
        listed: dict[RankKey, RankRecord] = {}
        for kv in kvs:
            try:
                key = parse_key(self.prefix, kv.key)
            except MalformedValue:
                self._malformed += 1
                continue
            record = self._record(key, kv.value, kv.mod_revision)
            if record is not None:
                listed[key] = record
        store = self.store
        if not self._synced.is_set() or replaced:
            for key, record in listed.items():
                store.put(key, record)
            store.revision = store.floor = revision
            if self._synced.is_set():
                for key in listed:
                    self._emit(key, revision, False, {})
            self._synced.set()
            self._first_list_over.set()
            return
        # Re-list: a change for every key whose value differs, as the watch would have sent.
        changed = [
            key
            for key in store.records.keys() | listed.keys()
            if (store.records.get(key) is None) != (listed.get(key) is None)
            or (key in listed and store.records[key].raw != listed[key].raw)
        ]
        before = {key: store.records.get(key) for key in changed}
        for key in changed:
            store.put(key, listed.get(key))
        store.revision = max(store.revision, revision)
        for key in changed:
            self._changed(key, revision, before[key], deleted=key not in listed)

    def _clear(self) -> None:
        """Another cluster: every stamped generation and the change history belong to the old
        revision space. Drop them all, reporting each old key as deleted; the caller then
        loads the new cluster's list."""
        old = dict(self.store.records)
        addrs = self.store.addrs
        pool = self.pool
        stale: dict[PoolKey, Generation] = {}
        marked: list[Generation] = []
        with self._retire_lock:
            if pool is not None:
                stale = {
                    key: generation
                    for key, generation in pool.snapshot().items()
                    if key.addr in addrs and getattr(generation, "revision", None) is not None
                }
            held = self._held
            if held is not None:
                for addr in list(addrs):
                    marked.extend(
                        g for _, g in held(addr) if getattr(g, "revision", None) is not None
                    )
            marked.extend(stale.values())
            for generation in marked:
                mark_retired(generation, 0)
            if pool is not None:
                self._retired += pool.invalidate(stale)
            self.store.clear()
        in_pool = set(stale.values())
        only_held = [g for g in marked if g not in in_pool]
        reported: set[Generation] = set()
        for key in old:
            group = {
                pool_key: generation
                for pool_key, generation in stale.items()
                if (pool_key.addr, pool_key.dp_rank, pool_key.cp_rank)
                == (key.addr, key.dp_rank, key.cp_rank)
            }
            for pool_key in group:
                del stale[pool_key]  # each retired generation is reported once
            # Generations only receivers held (none of the pool's) go with the first change.
            mine = tuple(group.values()) + tuple(g for g in only_held if g not in reported)
            reported.update(mine)
            self._emit(key, 0, True, group, mine)

    def _apply(self, message: WatchMessage) -> None:
        # The store's revision moves once per message, after all its events: etcd sends every
        # event of one revision (a transaction, a lease revoke) in one message, so a reader
        # that sees revision R never sees R half applied.
        self._malformed += message.malformed
        applied = self.store.revision
        newest = applied
        for event in message.events:
            self._events += 1
            revision = event.kv.mod_revision
            if revision > message.revision:
                # etcd sends no event newer than its own header: taking one would move the
                # store past every later real event (which would then look like a replay).
                self._refused_revisions += 1
                continue
            if revision <= applied or revision < newest:
                self._stale_events += 1  # a replay: the store already holds what followed
                continue
            newest = revision
            try:
                key = parse_key(self.prefix, event.kv.key)
            except MalformedValue:
                self._malformed += 1
                continue
            old = self.store.records.get(key)
            record = None if event.deleted else self._record(key, event.kv.value, revision)
            if old is None and record is None:
                continue
            self.store.put(key, record)
            self._changed(key, revision, old, deleted=record is None)
        # Data first, then the revision: a reader that sees revision R sees the data of R.
        self.store.revision = newest

    def _changed(
        self, key: RankKey, revision: int, old: RankRecord | None, *, deleted: bool
    ) -> None:
        """Record what the change replaced or removed, then retire what it made stale.

        One step for publishers and for the receivers' start check (``_retire_lock``): the
        history append (the watermark moves), the fan-out mark on every stale generation of
        the key's ``(addr, dp, cp)`` - pool entries and those receivers in flight hold - and
        the pool retirement. The model's ``WatchEvent`` (spec/model.md)."""
        self._changes += 1
        retired: dict[PoolKey, Generation] = {}
        new = self.store.records.get(key)
        if old is None or (new is not None and new.raw == old.raw):
            # A new rank, or identical bytes put again: nothing fetched before used it.
            self._emit(key, revision, deleted, retired)
            return
        group = (key.addr, key.dp_rank, key.cp_rank)
        marked: list[Generation] = []
        with self._retire_lock:
            self.store.note_change(key, revision, old)
            pool = self.pool
            if pool is not None:
                for pool_key, generation in pool.snapshot().items():
                    if (pool_key.addr, pool_key.dp_rank, pool_key.cp_rank) != group:
                        continue
                    self._examined += 1
                    if not self.is_current(pool_key, generation):
                        retired[pool_key] = generation
            held = self._held
            if held is not None:
                seen = set(retired.values())
                for pool_key, generation in held(key.addr):
                    if (
                        generation not in seen
                        and (pool_key.addr, pool_key.dp_rank, pool_key.cp_rank) == group
                        and not self.is_current(pool_key, generation)
                    ):
                        seen.add(generation)
                        marked.append(generation)
            marked.extend(retired.values())
            # Mark first, then retire: a receiver that looks the entry up in between holds a
            # marked object and fails at its start (never starts a transfer on it).
            for generation in marked:
                mark_retired(generation, revision)
            if retired and pool is not None:
                self._retired += pool.invalidate(retired)
        self._emit(key, revision, deleted, retired, tuple(marked))

    def _emit(
        self,
        key: RankKey,
        revision: int,
        deleted: bool,
        retired: Mapping[PoolKey, Generation],
        marked: tuple[Generation, ...] = (),
    ) -> None:
        listener = self.on_change
        bound = self._bound_on_change
        if listener is None and bound is None:
            return
        change = RankChange(
            key.addr,
            key.dp_rank,
            key.cp_rank,
            key.tp_rank,
            key.pp_rank,
            revision,
            deleted,
            retired,
            marked or tuple(retired.values()),
        )
        for hook in (listener, bound):
            if hook is None:
                continue
            try:
                hook(change)
            except Exception as exc:  # a listener bug must not stop the watch
                self._hook_errors += 1
                self._last_error = f"on_change: {type(exc).__name__}: {exc}"
