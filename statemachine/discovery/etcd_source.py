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
current while its endpoints are registered). On every put or delete of a rank key at revision
``R`` the source drops, by identity (``BootstrapPool.invalidate``), each entry of that key's
``(addr, dp, cp)`` that is no longer current, and reports them to ``on_change``: exactly the
generations fetched before ``R`` that used the changed rank. A generation fetched at or after
``R`` survives, even when a restarted rank re-bound the same port with the same instance id -
the revision is the order that instance ids lack. A re-put of identical bytes (a registrar
that re-granted its lease) changes nothing.

**Failures.** A broken stream or an unreachable etcd keeps the store serving (the receiver's
failure-driven invalidation still works) and retries with jittered back-off; on reconnect the
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
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from statemachine.call_deadline import Exchange
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
from statemachine.discovery.gateway import (
    EtcdBadReply,
    EtcdGateway,
    WatchIdle,
    WatchMessage,
    WatchStream,
)
from statemachine.discovery.layout import (
    DEFAULT_PREFIX,
    RankKey,
    RankRecord,
    normalise_prefix,
    parse_key,
    parse_value,
    topology_of,
)
from statemachine.errors import (
    BootstrapError,
    DiscoveryError,
    InvalidArgument,
    MalformedValue,
    NotFound,
    NotReady,
    PeerLost,
    WatchCompacted,
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

_Ranks = tuple[int, int, int, int]  # (dp, cp, tp, pp)
_Endpoint = tuple[str, int, int]  # (ip, port, pp)

#: Changes remembered per (addr, dp, cp) for the currency check: far more than one prefill
#: restart makes (two per rank); a generation older than what is kept counts as stale.
HISTORY_PER_GROUP = 256
#: Floors kept for the groups of prefills that vanished, before they fold into one.
MAX_FORGOTTEN = 100_000


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


@dataclass(frozen=True, slots=True)
class _AddressView:
    """One prefill's registrations, rebuilt (copy-on-write) on each change of its keys."""

    records: Mapping[_Ranks, RankRecord]
    #: (ip, port, dp, cp, pp) -> how many ranks registered it, for unstamped generations
    endpoints: Mapping[tuple[str, int, int, int, int], int]
    reference: RankRecord | None
    ready: bool

    @staticmethod
    def build(records: Mapping[_Ranks, RankRecord]) -> _AddressView:
        reference = max(records.values(), key=lambda r: r.mod_revision, default=None)
        ready = False
        if reference is not None:
            layout, instance = reference.layout, reference.instance_id
            # Ready when every rank of the newest registration's topology is registered by the
            # same instance: while a restart is half re-registered the prefill is NotReady
            # (retryable), never a mix of two instances' ranks.
            complete = sum(
                1
                for (dp, cp, tp, pp), record in records.items()
                if record.layout == layout
                and record.instance_id == instance
                and dp < reference.dp_size
                and cp < reference.attn_cp_size
                and tp < reference.attn_tp_size
                and pp < reference.pp_size
            )
            ready = complete == reference.world
        endpoints = Counter(
            (record.rank_ip, record.rank_port, dp, cp, pp)
            for (dp, cp, _tp, pp), record in records.items()
        )
        return _AddressView(dict(records), endpoints, reference, ready)


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
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._idle_timeout = watch_idle_timeout
        # Written by the watch thread only; read lock-free (single dict/attribute loads).
        self._records: dict[RankKey, RankRecord] = {}
        self._addrs: dict[str, _AddressView] = {}
        self._revision = 0
        #: per (addr, dp, cp): (revision, replaced or removed endpoint) of the latest changes
        self._history: dict[tuple[str, int, int], deque[tuple[int, _Endpoint]]] = {}
        #: per group: the newest revision dropped from its history; and the revision before
        #: which this source knows nothing (its first list, or a replaced cluster's)
        self._history_floor: dict[tuple[str, int, int], int] = {}
        self._floor = 0
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
        self._stop = threading.Event()
        self._stream_lock = threading.Lock()
        self._stream: WatchStream | None = None
        #: the exchange with etcd in progress (a list, a watch open), for close() to end
        self._exchange: Exchange | None = None
        self._thread: threading.Thread | None = None
        self._connected = False
        self._last_error: str | None = None
        self._lists = 0
        self._compactions = 0
        self._reconnects = 0
        self._idle_reopens = 0
        self._events = 0
        self._malformed = 0
        self._stale_events = 0
        self._refused_revisions = 0
        self._bad_replies = 0
        self._changes = 0
        self._retired = 0
        self._examined = 0
        self._hook_errors = 0

    # --- the BootstrapSource protocol (local store only) -------------------------------------

    @property
    def revision(self) -> int:
        """The store's revision: every change up to it is applied. Read it *before* fetching
        and stamp the generation with it (``StampedGeneration(ranks, instance_id, revision)``)."""
        return self._revision

    def _view(self, addr: str) -> _AddressView:
        if not self._synced.is_set():
            cause = self._last_error
            raise NotReady(
                f"{addr}: etcd source not synced yet (first list of {self.prefix!r} "
                + (f"failed: {cause}" if cause else "pending")
                + f"): check that etcd serves at {', '.join(self.gateway.endpoints)}; the "
                "source keeps retrying, so retry the request shortly",
                addr=addr,
            )
        view = self._addrs.get(addr)
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
        """No rank ``generation`` used has changed or gone since it was fetched.

        Stamped (:class:`~statemachine.discovery.changes.StampedGeneration`): no change of its
        ``(addr, dp, cp)`` after its revision replaced or removed an endpoint it holds (the
        per-group change history; a stamp older than the history reaches is not current).
        Unstamped: every endpoint it holds is registered now.
        """
        view = self._addrs.get(key.addr)
        if view is None:
            return False
        stamp: int | None = getattr(generation, "revision", None)
        if stamp is None:
            needed = Counter((rank.ip, rank.port, rank.pp_rank) for rank in generation.ranks)
            registered = view.endpoints
            return all(
                registered.get((ip, port, key.dp_rank, key.cp_rank, pp), 0) >= count
                for (ip, port, pp), count in needed.items()
            )
        group = (key.addr, key.dp_rank, key.cp_rank)
        if not max(self._floor, self._history_floor.get(group, 0)) <= stamp <= self._revision:
            return False  # from another cluster, or older than the history we keep
        history = self._history.get(group)
        if history:
            used = {(rank.ip, rank.port, rank.pp_rank) for rank in generation.ranks}
            for revision, endpoint in reversed(history):
                if revision <= stamp:
                    break
                if endpoint in used:
                    return False
        return True

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
        return self._revision

    def generation(
        self, ranks: tuple[RankInfo, ...], instance_id: str | None, stamp: int | None
    ) -> Generation:
        """A :class:`~statemachine.discovery.changes.StampedGeneration` of revision ``stamp``."""
        return generation_for(ranks, instance_id, stamp)

    def refusal(self, addr: str, generation: Generation) -> BootstrapError:
        return refused_publish(addr, getattr(generation, "revision", None), self._revision)

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
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="etcd-source", daemon=True)
            self._thread.start()
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
        self._stop.set()
        with self._stream_lock:
            stream, exchange = self._stream, self._exchange
        if exchange is not None:
            exchange.end("closed")
        if stream is not None:
            stream.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.gateway.timeout[0] + 1.0)
        self.gateway.close()

    def _track(self, exchange: Exchange) -> None:
        """The gateway's ``on_exchange``: remember the exchange for ``close()``."""
        with self._stream_lock:
            self._exchange = exchange
        if self._stop.is_set():  # close() ran before the exchange was visible to it
            exchange.end("closed")

    def __enter__(self) -> EtcdBootstrapSource:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> EtcdSourceStats:
        return EtcdSourceStats(
            connected=self._connected,
            synced=self._synced.is_set(),
            revision=self._revision,
            last_error=self._last_error,
            lists=self._lists,
            relists=max(0, self._lists - 1),
            compactions=self._compactions,
            reconnects=self._reconnects,
            idle_reopens=self._idle_reopens,
            events_handled=self._events,
            malformed=self._malformed,
            stale_events=self._stale_events,
            refused_revisions=self._refused_revisions,
            bad_replies=self._bad_replies,
            changes=self._changes,
            retired=self._retired,
            entries_examined=self._examined,
            hook_errors=self._hook_errors,
            publishes_refused=self._refused,
        )

    def _run(self) -> None:
        backoff = self._backoff_initial
        need_list = True
        while not self._stop.is_set():
            opened: float | None = None  # when the current watch stream was accepted
            pause = True  # every way out of a stream but a healthy idle re-open waits
            try:
                if need_list:
                    self._list_and_diff()
                    need_list = False
                stream = self.gateway.watch_prefix(
                    self._prefix_bytes,
                    start_revision=self._revision + 1,
                    read_timeout=self._idle_timeout,
                    on_exchange=self._track,
                )
                with self._stream_lock:
                    self._stream = stream
                if self._stop.is_set():  # close() ran before the stream was visible to it
                    stream.close()
                    break
                opened = time.monotonic()
                with stream:
                    for message in stream:
                        if message.created:
                            self._connected = True
                            if (
                                message.cluster_id != self._cluster_id
                                or message.revision < self._revision
                            ):
                                # Another cluster (etcd replaced, or restored from a backup):
                                # our revisions mean nothing there. Start over.
                                self._last_error = "etcd cluster replaced: re-listing"
                                self._replaced = True
                                need_list = True
                                break
                        self._apply(message)
            except WatchIdle:
                # Quiet prefix: re-open from revision + 1, no re-list, no wait.
                self._idle_reopens += 1
                pause = False
            except WatchCompacted as exc:
                self._compactions += 1
                self._last_error = str(exc)
                need_list = True
            except EtcdBadReply as exc:
                # Not etcd's reply: a broken gateway or proxy. Resume as after a broken
                # stream (revision + 1); the back-off keeps a repeat from becoming a loop.
                self._connected = False
                self._bad_replies += 1
                self._last_error = str(exc)
            except Exception as exc:  # DiscoveryError, or a bug: the store must keep serving
                if self._stop.is_set():
                    break
                self._connected = False
                self._reconnects += 1
                self._last_error = (
                    str(exc) if isinstance(exc, DiscoveryError) else f"{type(exc).__name__}: {exc}"
                )
                if need_list:
                    self._first_list_over.set()  # a caller waiting for it hears the cause now
                # Resume from revision + 1 (etcd keeps the history until compaction, so no
                # change is missed); only a compacted resume costs a re-list.
                need_list = need_list or not isinstance(exc, DiscoveryError)
            finally:
                with self._stream_lock:
                    self._stream = None
                    self._exchange = None
            if opened is not None and time.monotonic() - opened >= self._backoff_max:
                # The stream served for a while: whatever ended it is news, not a repeat.
                backoff = self._backoff_initial
            if pause and not self._stop.is_set():
                self._stop.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2.0, self._backoff_max)
        self._connected = False

    # --- applying changes (watch thread only) -------------------------------------------------

    def _record(self, key: RankKey, raw: bytes, mod_revision: int) -> RankRecord | None:
        try:
            return parse_value(key, raw, mod_revision=mod_revision)
        except MalformedValue:
            self._malformed += 1
            return None

    def _list_and_diff(self) -> None:
        revision, cluster_id, kvs, undecodable = self.gateway.get_prefix(
            self._prefix_bytes, on_exchange=self._track
        )
        self._lists += 1
        self._malformed += undecodable
        replaced = self._synced.is_set() and (
            self._replaced or cluster_id != self._cluster_id or revision < self._revision
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
        if not self._synced.is_set() or replaced:
            for key, record in listed.items():
                self._store(key, record)
            self._revision = self._floor = revision
            if self._synced.is_set():
                for key in listed:
                    self._emit(key, revision, False, {})
            self._synced.set()
            self._first_list_over.set()
            return
        # Re-list: a change for every key whose value differs, as the watch would have sent.
        changed = [
            key
            for key in self._records.keys() | listed.keys()
            if (self._records.get(key) is None) != (listed.get(key) is None)
            or (key in listed and self._records[key].raw != listed[key].raw)
        ]
        before = {key: self._records.get(key) for key in changed}
        for key in changed:
            self._store(key, listed.get(key))
        self._revision = max(self._revision, revision)
        for key in changed:
            self._changed(key, revision, before[key], deleted=key not in listed)

    def _clear(self) -> None:
        """Another cluster: every stamped generation and the change history belong to the old
        revision space. Drop them all, reporting each old key as deleted; the caller then
        loads the new cluster's list."""
        old = dict(self._records)
        pool = self.pool
        stale: dict[PoolKey, Generation] = {}
        marked: list[Generation] = []
        with self._retire_lock:
            if pool is not None:
                stale = {
                    key: generation
                    for key, generation in pool.snapshot().items()
                    if key.addr in self._addrs and getattr(generation, "revision", None) is not None
                }
            held = self._held
            if held is not None:
                for addr in list(self._addrs):
                    marked.extend(
                        g for _, g in held(addr) if getattr(g, "revision", None) is not None
                    )
            marked.extend(stale.values())
            for generation in marked:
                mark_retired(generation, 0)
            if pool is not None:
                self._retired += pool.invalidate(stale)
            self._records.clear()
            self._addrs.clear()
            self._history.clear()
            self._history_floor.clear()
            self._revision = 0
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
        applied = self._revision
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
            old = self._records.get(key)
            record = None if event.deleted else self._record(key, event.kv.value, revision)
            if old is None and record is None:
                continue
            self._store(key, record)
            self._changed(key, revision, old, deleted=record is None)
        # Data first, then the revision: a reader that sees revision R sees the data of R.
        self._revision = newest

    def _store(self, key: RankKey, record: RankRecord | None) -> None:
        if record is None:
            self._records.pop(key, None)
        else:
            self._records[key] = record
        view = self._addrs.get(key.addr)
        records = dict(view.records) if view is not None else {}
        ranks = (key.dp_rank, key.cp_rank, key.tp_rank, key.pp_rank)
        if record is None:
            records.pop(ranks, None)
        else:
            records[ranks] = record
        if records:
            self._addrs[key.addr] = _AddressView.build(records)
        else:
            self._addrs.pop(key.addr, None)

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
        new = self._records.get(key)
        if old is None or (new is not None and new.raw == old.raw):
            # A new rank, or identical bytes put again: nothing fetched before used it.
            self._emit(key, revision, deleted, retired)
            return
        group = (key.addr, key.dp_rank, key.cp_rank)
        marked: list[Generation] = []
        with self._retire_lock:
            history = self._history.get(group)
            if history is None:
                history = self._history[group] = deque()
            if len(history) == HISTORY_PER_GROUP:
                self._history_floor[group] = history.popleft()[0]
            history.append((revision, (old.rank_ip, old.rank_port, key.pp_rank)))
            if key.addr not in self._addrs:
                self._forget(key.addr, revision)
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

    def _forget(self, addr: str, revision: int) -> None:
        """``addr`` has no key left: drop its history (prefills come and go), keeping only a
        floor per group - a generation stamped before ``revision`` is stale - so memory stays
        bounded by the live prefills plus one integer per vanished group. Past
        ``MAX_FORGOTTEN`` floors they fold into the source-wide floor (a generation stamped
        before it then counts as stale: one spurious retirement, never a missed one)."""
        for group in [group for group in self._history if group[0] == addr]:
            del self._history[group]
            self._history_floor[group] = revision
        if len(self._history_floor) > MAX_FORGOTTEN:
            self._floor = max(self._floor, *self._history_floor.values())
            self._history_floor.clear()

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
