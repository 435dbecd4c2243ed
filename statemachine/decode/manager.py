"""``DecodeManager``: one per decode process; owns the shared parts and every request in flight.

SGLang's counterpart is the decode-side KV manager. This one owns the pool, the bootstrap
source (a :class:`~statemachine.decode.client.BootstrapClient` by default), the ZMQ transport,
the ack listener and the health monitor; makes the receivers (:meth:`DecodeManager.receiver`);
and knows every receiver in flight by room. From that it does what no single receiver can
(``spec/manager.md``):

* **Failure fan-out.** Evidence that a prefill rank or instance is gone - a failed send to an
  endpoint, the transport reporting an endpoint dead, the health monitor declaring an address
  dead or seeing a new instance id, a fetch answered by a new instance - fails *every* receiver
  in flight that depends on it, with a typed :class:`~statemachine.errors.PeerLost` reason, and
  invalidates the generations involved by identity. The fan-out never steps another thread's
  receiver: it stores the reason on it (one attribute store) and wakes it (``on_change``); the
  owner's next ``poll``/``send_metadata``/``init`` fires ``PeerLost``.
* **Single-flight fetches** per pool key (:mod:`statemachine.decode.flight`).
* **Completion** as SGLang 0.5.23's decode manager applies prefill statuses: every message on
  the decode's PULL endpoint becomes an event through the backend's ``decode_message``; a room
  completes when ``required_prefill_response_num`` *distinct* prefill ranks reported success; a
  Failed status fails it, terminally; ``complete(room, prefill_rank=...)`` counts the same way.
* **ABORT and deferred release**: each room's ranks are told once (legacy ABORT before the
  metadata, an ABORT with a generation after it, on the waiting timeout and on any failure);
  the KV of such a room may be freed when every rank acknowledged the generation or 30 s
  passed (:meth:`kv_release`). **Allocation policy**: ``prefill_complete`` checked against the
  prefill's and run as SGLang's BOOTSTRAP handshake.
* **dp-rank resolution** in SGLang's order, with one batched ``POST /query_dp_ranks`` per
  address per :meth:`step` for all pending rooms, and **rank plans** derived from the prefill's
  topology (:mod:`statemachine.decode.plan`).
* **Resources follow generations**: a generation published by this process retains its
  endpoints' sockets in the transport; when it leaves the pool and no receiver in flight uses
  it, they are released (closed at refcount zero).

**Any source** (:mod:`statemachine.decode.source`): the manager knows its source only by the
``BootstrapSource`` protocol. It attaches to it (the source retires stale entries from the
pool and reports them to :meth:`fail_generations`, asking :meth:`held_by` what the receivers
in flight hold), runs the HTTP health monitor only for a source that needs probes, and its
receivers fetch, stamp, build and publish through it. The HTTP client reports nothing; the
etcd source (``DecodeManager.with_etcd``, docs/etcd.md) stamps, watermarks and marks.
Receivers know the manager only as a :class:`~statemachine.decode.receiver_host.ReceiverHost`.

Why no index by generation or endpoint: keeping one would cost every cache hit a few dict
updates, and fan-out is rare. The receivers in flight (one dict by room, updated with one store
at creation and one pop at the end) are scanned when evidence arrives instead: a few
microseconds per thousand requests in flight, off the hit path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, cast

from statemachine.backend import KVBackend
from statemachine.completion import (
    AbortAck,
    KVPoll,
    PrefillEvent,
)
from statemachine.decode import holds
from statemachine.decode.background import Background
from statemachine.decode.client import BootstrapClient
from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.flight import Flights
from statemachine.decode.health import HealthMonitor
from statemachine.decode.plan import DecodeLayout, RankPlan, derive_plan, plan_without_layout
from statemachine.decode.ranks.acks import AckListener
from statemachine.decode.ranks.transport import Endpoint, Mode, ZmqTransport, endpoint_url
from statemachine.decode.receiver import (
    DEFAULT_WAITING_TIMEOUT_S,
    PREFILL_COMPLETE,
    BootstrapReceiver,
    Decode,
    transfer_failed,
)
from statemachine.decode.receiver_host import AddressPlan, HostedReceiver
from statemachine.decode.source import BootstrapQueries, BootstrapSource, as_source
from statemachine.errors import (
    BootstrapError,
    ConfigurationError,
    ManagerClosed,
    PeerLost,
    PrefillDead,
    PrefillRestarted,
    RankDead,
    RanksUnreachable,
    SendFailed,
    TopologyMismatch,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey
from statemachine.validation import Topology
from statemachine.wire.reference import SimpleBackend, decode_reply

#: SGLang's default bootstrap timeout (a room whose dp rank stays unknown fails after it).
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0
#: How long a request waits for another request's fetch of the same key.
DEFAULT_FLIGHT_TIMEOUT_S = 30.0
#: How long one ``init()`` may spend asking its source (the topology and every rank together);
#: the HTTP client's own per-exchange deadline (HTTP-35) is the same by default.
DEFAULT_FETCH_DEADLINE_S = 5.0
#: SGLang's ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``: an aborted room's KV
#: is freed after this even if some prefill rank never acknowledged the ABORT.
DEFAULT_KV_RELEASE_TIMEOUT_S = 30.0
Completion = Literal["acks", "external"]

_session_ids = itertools.count(1)
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DetectionStats:
    """Time from evidence (a death or restart) to a receiver in flight failing, in seconds."""

    count: int
    total_s: float
    max_s: float


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """What a fleet operator reads; a consistent snapshot (``DecodeManager.stats()``)."""

    hits: int
    misses: int
    publishes: int
    adoptions: int
    #: pool entries removed, by what removed them (the lifecycle event or the evidence type)
    invalidations: Mapping[str, int]
    #: requests that ended Failed, by the type of their reason
    failures: Mapping[str, int]
    completed: int
    in_flight: int
    pending_dp: int
    flights_led: int
    flights_followed: int
    #: receivers failed by fan-out, by evidence type
    fanout: Mapping[str, int]
    detection: DetectionStats
    sockets_open: int
    endpoints_retained: int
    dp_queries: int
    #: prefill messages for rooms not in flight, and stale ABORT_ACKs (dropped, MGR-13/15)
    dropped_events: int = 0
    #: rooms whose KV is held after an ABORT with a generation (MGR-15)
    kv_held: int = 0
    #: receivers' ``on_change`` calls that raised (contained; the first is logged, MGR-18)
    callback_errors: int = 0
    #: batched dp-rank queries started by step() and not yet collected (MGR-8)
    dp_queries_in_flight: int = 0
    #: pool keys whose ranks are known dead, and requests failed at once on them (MGR-1)
    known_dead_keys: int = 0
    refused_known_dead: int = 0


class DecodeManager:
    """One per decode process; see the module docstring.

    Every part may be given (then the caller owns and closes it) or left to the manager
    (created here, closed by :meth:`close`). ``completion="acks"`` (default) listens for the
    reference prefill rank's acks (or, through the backend's ``decode_message``, SGLang's
    statuses) on ``ack_ip``; ``"external"`` is for a transfer engine that reports completion
    itself (call :meth:`complete` per prefill rank, or ``receiver.mark_transferred()``).
    ``staging=True`` says the decode runs SGLang's staging buffer (attn-tp sizes may differ);
    this library does not implement it, so a prefill whose attn-tp differs from the layout's
    is refused (``TopologyMismatch``). ``kv_release_timeout_s``: see :meth:`kv_release`.
    ``dead_recheck_s`` (off by default): hold a key whose rank is known dead off for that long
    after each refetch that met it (``statemachine/decode/dead_keys.py``, MGR-1).
    """

    def __init__(
        self,
        *,
        source: BootstrapQueries | None = None,
        pool: BootstrapPool | None = None,
        transport: ZmqTransport | None = None,
        backend: KVBackend | None = None,
        backend_factory: Callable[[str, int], KVBackend] | None = None,
        completion: Completion = "acks",
        ack_ip: str = "127.0.0.1",
        session_id: str | None = None,
        layout: DecodeLayout | None = None,
        health_interval_s: float | None = 5.0,
        failures_to_dead: int = 2,
        waiting_timeout_s: float = DEFAULT_WAITING_TIMEOUT_S,
        bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S,
        flight_timeout_s: float = DEFAULT_FLIGHT_TIMEOUT_S,
        fetch_deadline_s: float = DEFAULT_FETCH_DEADLINE_S,
        transport_mode: Mode = "immediate",
        send_timeout_ms: int = 1000,
        clock: Callable[[], float] = time.monotonic,
        fanout: bool = True,
        single_flight: bool = True,
        staging: bool = False,
        kv_release_timeout_s: float = DEFAULT_KV_RELEASE_TIMEOUT_S,
        dead_recheck_s: float | None = None,
    ) -> None:
        if completion not in ("acks", "external"):
            raise ConfigurationError(f"completion must be 'acks' or 'external', not {completion!r}")
        if backend is not None and backend_factory is not None:
            raise ConfigurationError("give backend or backend_factory, not both")
        if completion == "external" and backend is None and backend_factory is None:
            raise ConfigurationError(
                "completion='external' needs your transfer engine's backend: pass backend="
            )
        if layout is not None and not isinstance(layout, DecodeLayout):
            raise ConfigurationError(f"layout must be a DecodeLayout, not {type(layout).__name__}")
        for name, value in (
            ("bootstrap_timeout_s", bootstrap_timeout_s),
            ("flight_timeout_s", flight_timeout_s),
            ("kv_release_timeout_s", kv_release_timeout_s),
            ("fetch_deadline_s", fetch_deadline_s),
            ("dead_recheck_s", 1.0 if dead_recheck_s is None else dead_recheck_s),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(f"{name} must be a positive number, not {value!r}")
        self._owned: list[Callable[[], None]] = []  # closers of the parts made here, in order
        # Set before the ack listener exists: its thread may deliver at once.
        self._decoder: Callable[[Sequence[bytes]], PrefillEvent | None] = decode_reply
        self._inflight: dict[int, BootstrapReceiver] = {}
        #: ReceiverHost.admit_room: the room table's setdefault until close() (the receivers
        #: admitted are those receiver() made, the type in_flight() and get() hand back).
        self.admit_room = cast(
            "Callable[[int, HostedReceiver], HostedReceiver]", self._inflight.setdefault
        )
        self.clock = clock
        self._holds = holds.AbortHolds(kv_release_timeout_s, clock)
        self._unknown_events = 0
        try:
            self._build(
                source, pool, transport, backend, backend_factory, completion, ack_ip,
                session_id, health_interval_s, failures_to_dead, transport_mode,
                send_timeout_ms,
            )  # fmt: skip
            #: The shared parts as one bundle, checked (ConfigurationError on a wrong part).
            self.decode = Decode(
                pool=self.pool,
                client=self.source,
                transport=self.transport,
                backend=self.backend,
                waiting_timeout_s=waiting_timeout_s,
                clock=clock,
            )
        except BaseException:
            self._close_owned()
            raise
        self.layout = layout
        policy = None if layout is None else layout.decode_allocation_policy
        #: SGLang's decode allocation policy is compared with each prefill's (MGR-16)
        self.policy_checked = layout is not None
        #: ``prefill_complete``: init() runs the BOOTSTRAP handshake (MGR-16)
        self.prefill_complete = policy == PREFILL_COMPLETE
        self.staging = bool(staging)
        self.waiting_timeout_s = float(waiting_timeout_s)
        self.bootstrap_timeout_s = float(bootstrap_timeout_s)
        self.flight_timeout_s = float(flight_timeout_s)
        #: init()'s questions to the source end by this many seconds after the first (MGR-21)
        self.fetch_deadline_s = float(fetch_deadline_s)
        self.clock = clock
        #: False: SGLang's behaviour for the benchmarks' anchor - no failure fan-out from
        #: evidence (a request fails on its own send or timeout only), no single-flight.
        self.fanout = fanout
        self.flights: Flights | None = Flights() if single_flight else None
        self._lock = threading.Lock()  # guards everything below (never taken on the hit path)
        self._pending: dict[str, dict[int, HostedReceiver]] = {}
        #: the batched dp-rank query in flight per address, and the rooms it asks about
        self._dp_inflight: dict[str, tuple[Future[dict[int, int]], dict[int, HostedReceiver]]] = {}
        #: addresses being resolved by prepare() on the background workers
        self._preparing: dict[str, Future[AddressPlan]] = {}
        #: the workers of step()'s queries and prepare() (threads start on first use)
        self._background = Background()
        #: keys whose ranks are known dead: a miss on one fails at once (no refetch per request)
        #: (off unless dead_recheck_s is given: holding a key off trades up to dead_recheck_s
        #: of failed requests after the rank registers again for microsecond stalls meanwhile)
        self.dead_keys = DeadKeys(clock=clock, recheck_s=dead_recheck_s or 1.0)
        self._hold_off_dead = dead_recheck_s is not None
        self._topologies: dict[str, Topology] = {}
        self._plans: dict[str, RankPlan] = {}
        #: ReceiverHost: what is known now, read without a call
        self.topologies: Mapping[str, Topology] = self._topologies
        self.plans: Mapping[str, RankPlan] = self._plans
        #: ReceiverHost.address_plans: per address, what init() needs before its lookup
        #: (written under the lock, read lock-free: one dict get per hit).
        self.address_plans: dict[str, AddressPlan] = {}
        self._retained: dict[Generation, tuple[Endpoint, ...]] = {}
        self._watched: set[str] = set()
        self._invalidations: dict[str, int] = {}
        self._failures: dict[str, itertools.count[int]] = {}
        self._fanout: dict[str, int] = {}
        self._completed = itertools.count()
        self._detections = 0
        self._detection_total = 0.0
        self._detection_max = 0.0
        self._dp_queries = 0
        self._callback_errors = 0
        self._closed = False
        #: True when the source marks stale generations (etcd): a receiver checks its
        #: generations' marks before it starts a transfer (one branch on the hit path otherwise).
        self.watermarked = bool(self.source.marks_generations)
        try:
            # The source retires from our pool, asks what our receivers hold, and reports
            # what it retired to our fan-out (a no-op for the HTTP client).
            self.source.attach(self.pool, held=self.held_by, retire=self.fail_generations)
        except BootstrapError as exc:
            self._close_owned()
            raise ConfigurationError(str(exc)) from exc
        self.transport.subscribe(self._on_endpoint)

    # --- the source ---------------------------------------------------------------------------

    @classmethod
    def with_etcd(cls, endpoints: object, **options: object) -> DecodeManager:
        """A manager whose bootstrap source is an etcd watch: see
        :func:`statemachine.decode_on_etcd.manager_on_etcd` for the options (docs/etcd.md).

        A convenience only: the manager knows its source by the ``BootstrapSource`` protocol,
        and the module that composes it with the etcd source is imported on first use."""
        compose = importlib.import_module("statemachine.decode_on_etcd")
        manager: DecodeManager = compose.manager_on_etcd(endpoints, manager_class=cls, **options)
        return manager

    def held_by(self, addr: str) -> list[tuple[PoolKey, Generation]]:
        """(key, generation) of every receiver in flight for ``addr`` (a source's question, on
        its own thread, answered from a snapshot)."""
        held: list[tuple[PoolKey, Generation]] = []
        for receiver in self.in_flight():
            if receiver.addr == addr:
                held.extend(_items_of(receiver))
        return held

    def close_with(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` when this manager closes, after every part it made (a source made
        for it, say, whose thread must outlive the parts that call it)."""
        self._owned.insert(0, closer)

    def _build(
        self,
        source: BootstrapQueries | None,
        pool: BootstrapPool | None,
        transport: ZmqTransport | None,
        backend: KVBackend | None,
        backend_factory: Callable[[str, int], KVBackend] | None,
        completion: Completion,
        ack_ip: str,
        session_id: str | None,
        health_interval_s: float | None,
        failures_to_dead: int,
        transport_mode: Mode,
        send_timeout_ms: int,
    ) -> None:
        if source is None:
            client = BootstrapClient()
            self._owned.append(client.close_all)  # every thread's sessions, not only ours
            source = client
        self.source: BootstrapSource = as_source(source)
        if pool is None:
            pool = self.source.shared_pool()  # the pool the source already retires from
        self.pool: BootstrapPool = BootstrapPool() if pool is None else pool
        if transport is None:
            transport = ZmqTransport(mode=transport_mode, send_timeout_ms=send_timeout_ms)
            self._owned.append(transport.close)
        self.transport: ZmqTransport = transport
        self.acks: AckListener | None = None
        if completion == "acks":
            self.acks = AckListener(ack_ip, decoder=self._decode, on_event=self._on_event)
            self._owned.append(self.acks.close)
        if backend is None:
            assert self.acks is not None  # checked above for "external"
            if session_id is None:
                session_id = f"decode-{os.getpid()}-{next(_session_ids)}"
            if backend_factory is not None:
                backend = backend_factory(self.acks.ip, self.acks.port)
            else:
                backend = SimpleBackend(self.acks.ip, self.acks.port, session_id)
        self.backend: KVBackend = backend
        decode_message = getattr(backend, "decode_message", None)  # checked by Decode below
        if callable(decode_message):
            self._decoder = decode_message
        self.health: HealthMonitor | None = None
        # A source that finds dead prefills itself (etcd: the watch and the leases) needs no
        # probes, and there may be no HTTP server at the address to probe.
        if health_interval_s is not None and self.source.health_by_probes:
            self.health = HealthMonitor(
                self.pool,
                interval_s=health_interval_s,
                failures_to_dead=failures_to_dead,
                on_dead=self._on_dead,
                on_restart=self._on_restart,
            )
            monitor = self.health
            monitor.start()

            def stop_health() -> None:
                monitor.stop()

            self._owned.append(stop_health)

    # --- making receivers -------------------------------------------------------------------

    def receiver(
        self,
        addr: str,
        room: int,
        plan: RankPlan | None = None,
        *,
        prefill_dp_rank: int | None = None,
    ) -> BootstrapReceiver:
        """A receiver for ``room`` against the prefill at ``addr``, known to this manager.

        ``plan`` defaults to the one derived from the prefill's topology and this manager's
        ``layout`` (:meth:`plan_for`); ``prefill_dp_rank`` is the router's, if any.
        """
        return BootstrapReceiver(self, addr, room, plan, prefill_dp_rank)  # by position: cheaper

    def in_flight(self) -> list[BootstrapReceiver]:
        """The receivers not yet ended (a snapshot)."""
        return list(self._inflight.copy().values())

    def get(self, room: int) -> BootstrapReceiver | None:
        """The receiver in flight for ``room``, if any."""
        return self._inflight.get(room)

    # --- topology, plans, dp ranks ----------------------------------------------------------

    def topology(self, addr: str) -> Topology:
        """The prefill's topology, fetched once per instance of the prefill (MGR-20): forgotten
        when the address dies or restarts, when a fetch is answered by another instance, and
        when it failed a request with ``TopologyMismatch``."""
        topology = self._topologies.get(addr)
        if topology is None:
            topology = self.source.get_topology(addr)
            self._topologies[addr] = topology
        return topology

    def plan_for(self, addr: str) -> RankPlan:
        """This decode rank's plan against ``addr``, from the prefill's topology (spec/plans.md):
        derived from ``layout``; without one, only a one-rank prefill is planned (PLAN-9)."""
        plan = self._plans.get(addr)
        if plan is None:
            topology = self.topology(addr)
            try:
                if self.layout is None:
                    plan = plan_without_layout(addr, topology)
                else:
                    plan = derive_plan(addr, topology, self.layout)
            except TopologyMismatch:
                self._forget_topology(addr, topology)
                raise
            self._plans[addr] = plan
        return plan

    def address_plan(self, addr: str) -> AddressPlan:
        """``addr``'s plan, response count, pool keys per dp rank, and the policy checks
        passed, resolved once (ReceiverHost.address_plans): the hit path reads it with one dict
        get instead of a plan, a topology, a policy check and a key lookup per request. Raises
        what :meth:`plan_for` or :meth:`check_prefill` raise (nothing is kept then)."""
        known = self.address_plans.get(addr)
        if known is not None:
            return known
        topology = self.topology(addr)
        plan = self.plan_for(addr)
        if self.policy_checked:
            self.check_prefill(addr)
        keys = {dp: plan.keys_for(addr, dp) for dp in range(topology.dp_size)}
        known = AddressPlan(plan, plan.required_prefill_response_num, keys)
        with self._lock:
            # Kept only while the topology it was derived from is the one known: a refresh or
            # a restart that dropped it while we resolved must not leave a stale plan behind.
            if self._topologies.get(addr) is topology:
                self.address_plans[addr] = known
        return known

    def _forget_topology(self, addr: str, topology: Topology | None = None) -> None:
        """Drop ``addr``'s topology (only ``topology``, if given: not a newer one another
        thread just fetched) and the plan and address plan derived from it: the next request
        asks again."""
        with self._lock:
            if topology is None or self._topologies.get(addr) is topology:
                self._topologies.pop(addr, None)
                self._plans.pop(addr, None)
                self.address_plans.pop(addr, None)

    def fetched_from(self, addr: str, instance_id: str | None) -> None:
        """A fetch from ``addr`` was answered by ``instance_id``: a cached topology of another
        instance is forgotten, and so is the plan derived from it (MGR-20). Off the hit path."""
        topology = self._topologies.get(addr)
        if (
            topology is not None
            and instance_id is not None
            and topology.instance_id is not None
            and topology.instance_id != instance_id
        ):
            self._forget_topology(addr, topology)

    def check_prefill(self, addr: str) -> None:
        """SGLang 0.5.23's ``init()`` checks (MGR-16, MGR-17): this decode's allocation policy
        equals the prefill's, ``prefill_complete`` needs a prefill of attn tp, cp and pp 1, and
        staging (not implemented here) is refused where it would be used."""
        assert self.layout is not None  # policy_checked implies a layout
        topology = self.topology(addr)
        try:
            self._check_policy(addr, topology, self.layout)
        except TopologyMismatch:
            self._forget_topology(addr, topology)  # not remembered past its deployment
            raise

    def _check_policy(self, addr: str, topology: Topology, layout: DecodeLayout) -> None:
        if self.staging and topology.attn_tp_size != layout.tp_size:
            raise TopologyMismatch(
                f"{addr}: prefill attn tp size {topology.attn_tp_size} differs from this "
                f"decode's {layout.tp_size} and staging is on: SGLang's staging buffer is "
                "not implemented here; run without staging (the plan maps the ranks), or with "
                "equal attn tp sizes"
            )
        mine = layout.decode_allocation_policy
        theirs = topology.decode_allocation_policy
        if theirs is None:
            return  # a prefill that does not report it (older than the policy): nothing to check
        if mine is None:
            if theirs != PREFILL_COMPLETE:
                return  # unset here: SGLang's default, early, which needs nothing
            # Such a prefill sends its statuses only to decodes that sent BOOTSTRAP: without
            # the handshake this request would wait out its timeout.
            mine = "early (DecodeLayout.decode_allocation_policy unset)"
        if theirs != mine:
            raise TopologyMismatch(
                f"{addr}: decode allocation policy mismatch: prefill={theirs}, decode={mine}; "
                "set --disaggregation-decode-allocation-policy identically on both roles "
                "(DecodeLayout.decode_allocation_policy here)"
            )
        if mine == PREFILL_COMPLETE and (
            topology.attn_tp_size,
            topology.attn_cp_size,
            topology.pp_size,
        ) != (1, 1, 1):
            raise TopologyMismatch(
                f"{addr}: the {PREFILL_COMPLETE} policy needs a prefill of attention tp 1, cp 1 "
                f"and pp 1, not tp {topology.attn_tp_size}, cp {topology.attn_cp_size}, pp "
                f"{topology.pp_size}: use the policy 'early' for this prefill"
            )

    def await_dp_rank(self, receiver: HostedReceiver) -> None:
        """The receiver's room waits for the next :meth:`step`'s batched query."""
        with self._lock:
            self._pending.setdefault(receiver.addr, {})[receiver.room] = receiver

    def step(self, *, wait: bool = False) -> int:
        """Once per scheduler step: collect the batched dp-rank queries that finished, and
        start one ``POST /query_dp_ranks`` per address for the rooms still pending (at most one
        query in flight per address, on the manager's background workers, as SGLang 0.5.23's
        scheduler prefetches them: ``decode.py:3130-3133``). Returns how many rooms were
        resolved. Never waits on the network: a room resolved by a query this step started is
        counted by a later step. ``wait=True`` is the synchronous form: it also waits for the
        queries in flight (each bounded by the source's deadline) and applies them.

        Unknown rooms stay pending (the prefill may register them later) until their
        bootstrap timeout; a failed query leaves them pending too. Call it from one thread
        (the scheduler's): the answers are applied on it.
        """
        resolved = self._collect_dp_queries()
        with self._lock:
            starts = {
                addr: dict(rooms)
                for addr, rooms in self._pending.items()
                if rooms and addr not in self._dp_inflight
            }
        for addr, rooms in starts.items():
            future = self._background.submit(self.source.query_dp_ranks, addr, list(rooms))
            with self._lock:
                self._dp_queries += 1
                self._dp_inflight[addr] = (future, rooms)
        if wait:
            with self._lock:
                futures = [future for future, _ in self._dp_inflight.values()]
            concurrent.futures.wait(futures)
            resolved += self._collect_dp_queries()
        return resolved

    def _collect_dp_queries(self) -> int:
        """Apply every finished dp-rank query (on the caller's thread); how many resolved."""
        with self._lock:
            finished = [
                (addr, query) for addr, query in self._dp_inflight.items() if query[0].done()
            ]
            for addr, _ in finished:
                del self._dp_inflight[addr]
        resolved = 0
        for addr, (future, rooms) in finished:
            if future.cancelled():
                continue
            error = future.exception()
            if isinstance(error, BootstrapError):
                continue  # the rooms stay pending: the next step asks again
            answer = future.result()  # raises what is not a BootstrapError: a source's bug
            with self._lock:
                waiting = self._pending.get(addr, {})
                for room, dp_rank in answer.items():
                    receiver = rooms.get(room)
                    if receiver is not None and waiting.get(room) is receiver:
                        del waiting[room]
                        receiver.resolved(dp_rank)
                        resolved += 1
        return resolved

    def prepare(self, addr: str) -> Future[AddressPlan]:
        """Start resolving ``addr`` (its topology fetch, plan and policy checks) on the
        background workers and return at once: a scheduler that learns of a new prefill calls
        this, and until the future is done every ``init()`` for ``addr`` returns
        ``Bootstrapping`` instead of fetching on the caller's thread (call it again later).
        The future's result is the :class:`AddressPlan` (or the ``BootstrapError`` that
        refused the address: the next ``init()`` meets it too). An address already resolved
        gives a finished future; one being resolved, the future in flight."""
        with self._lock:
            known = self.address_plans.get(addr)
            if known is None:
                future = self._preparing.get(addr)
                if future is None:
                    future = self._background.submit(self._prepared, addr)
                    self._preparing[addr] = future
                return future
        done: Future[AddressPlan] = Future()
        done.set_result(known)
        return done

    def _prepared(self, addr: str) -> AddressPlan:
        """A background worker resolves ``addr``; whatever happens, it is no longer being
        prepared (the next ``init()`` reads the result or resolves it again)."""
        try:
            return self.address_plan(addr)
        finally:
            with self._lock:
                self._preparing.pop(addr, None)

    def preparing(self, addr: str) -> bool:
        """Whether :meth:`prepare` is resolving ``addr`` in the background right now."""
        return addr in self._preparing

    # --- completion -------------------------------------------------------------------------

    def complete(self, room: int, *, prefill_rank: int = 0) -> bool:
        """A transfer engine reports that prefill rank ``prefill_rank`` sent ``room``'s KV.

        Counted as SGLang counts statuses (MGR-13): once per distinct prefill rank; the room
        is transferred when ``required_prefill_response_num`` ranks reported (one call with
        the default rank for a one-rank plan). False if no receiver is in flight or the rank
        already reported.
        """
        receiver = self._inflight.get(room)
        if receiver is None:
            return False
        return receiver.responded(prefill_rank)

    def fail_room(self, room: int, reason: str | None, *, prefill_rank: int | None = None) -> bool:
        """A prefill rank reported ``room``'s transfer failed; its receiver fails with it, and
        no later success can complete it (MGR-14)."""
        receiver = self._inflight.get(room)
        if receiver is None:
            return False
        error = transfer_failed(receiver, reason, prefill_rank)
        _note_evidence(error, self.clock())
        receiver.failed_by_prefill(error)
        return True

    def _decode(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        """The ack listener's decoder: the backend's (read when each message arrives)."""
        return self._decoder(frames)

    def _on_event(self, event: PrefillEvent) -> bool:
        """One message from a prefill rank (the ack listener's thread), applied as SGLang
        0.5.23's ``apply_prefill_status`` / ``handle_abort_ack_message`` do; False when it was
        dropped (no such room in flight, or a stale ABORT_ACK)."""
        if isinstance(event, AbortAck):
            if self._holds.acked(event):
                return True
            self._unknown_events += 1
            return False
        receiver = self._inflight.get(event.room)
        if receiver is None:  # cleared or never here: dropped, as SGLang drops it
            self._unknown_events += 1
            return False
        status = event.status
        if status == KVPoll.Success:
            receiver.responded(event.prefill_rank)
        elif status == KVPoll.Failed:
            self.fail_room(event.room, event.reason, prefill_rank=event.prefill_rank)
        elif status == KVPoll.WaitingForInput and self.prefill_complete:
            receiver.prefill_ready()
        # anything else: not a status the decode acts on (SGLang logs and ignores it)
        return True

    def kv_release(self, room: int) -> bool:
        """Whether ``room``'s KV pages may be freed (SGLang's deferred decode KV release).

        A room whose ABORT carried a generation (sent after its metadata: on the waiting
        timeout, on any failure, on abort) is *held*: the prefill may still be writing into its
        pages. It may be freed once every rank it was sent to acknowledged that generation
        (ABORT_ACK), or ``kv_release_timeout_s`` after the ABORT, whichever comes first; a room
        that was never held may be freed at once. Memory is bounded (MGR-15).
        """
        return self._holds.released(room)

    def kv_holds(self) -> holds.HoldStats:
        """The deferred-release bookkeeping: rooms held now, released by acks or by timeout,
        holds evicted at the bound, stale acks (MGR-15)."""
        return self._holds.stats()

    def receiver_ended(self, receiver: HostedReceiver, error: BootstrapError | None) -> None:
        """A receiver reached a final state: forget it and its pending room."""
        if self._inflight.get(receiver.room) is receiver:
            del self._inflight[receiver.room]
        if receiver.awaiting_dp_rank:
            with self._lock:
                rooms = self._pending.get(receiver.addr)
                if rooms is not None and rooms.get(receiver.room) is receiver:
                    del rooms[receiver.room]
        if error is None:
            next(self._completed)  # lock-free: one C call
            return
        kind = type(error).__name__
        counter = self._failures.get(kind)
        if counter is None:
            with self._lock:
                counter = self._failures.setdefault(kind, itertools.count())
        next(counter)
        if isinstance(error, PeerLost) and error.evidence_at is not None:
            with self._lock:
                latency = max(0.0, self.clock() - error.evidence_at)
                self._detections += 1
                self._detection_total += latency
                self._detection_max = max(self._detection_max, latency)

    def send_abort(self, receiver: HostedReceiver, *, armed: bool) -> bool:
        """Tell every rank of the room (MGR-15; the receiver asks once), best effort, skipping
        known-dead ones.

        ``armed``: the metadata went out, so the prefill may be writing our pages: the ABORT
        carries a new generation and the room's KV is held until every rank acknowledged it
        (:meth:`kv_release`). Otherwise SGLang's legacy ABORT (no generation), nothing held.
        Nothing is sent for a room that has no ranks yet (before ``init``): returns False.
        """
        ranks = receiver.ranks()
        if not ranks:
            return False
        generation_id = self._holds.hold(receiver.room, len(ranks)) if armed else None
        for generation, rank in ranks:
            endpoint = (rank.ip, rank.port)
            if self.transport.is_down(endpoint):
                continue
            # A failed send means the rank is gone: nothing left to free there.
            with contextlib.suppress(SendFailed):
                frames = self.backend.abort_frames(
                    rank,
                    receiver.room,
                    instance_id=generation.instance_id,
                    generation=generation_id,
                )
                self.transport.send(endpoint, frames)
        return True

    def send_bootstrap(self, receiver: HostedReceiver) -> None:
        """``prefill_complete``: BOOTSTRAP to every rank of the room (SendFailed propagates:
        a rank that cannot hear the handshake will never answer it)."""
        make = self.backend.bootstrap_frames
        for generation, rank in receiver.ranks():
            frames = make(rank, receiver.room, instance_id=generation.instance_id)
            self.transport.send((rank.ip, rank.port), frames)

    def callback_raised(self, receiver: HostedReceiver, error: Exception) -> None:
        """A receiver's ``on_change`` raised (on whatever thread woke it): contained there,
        counted here and logged once per manager, so a broken callback neither stops the
        fan-out nor fails another request's call, nor floods the log (MGR-18)."""
        with self._lock:
            self._callback_errors += 1
            first = self._callback_errors == 1
        if first:
            _log.error(
                "room %d: on_change raised %r; contained (the receiver still fails or "
                "completes at its owner's next call); later callback errors are only counted "
                "in stats().callback_errors: fix the callback",
                receiver.room,
                error,
                exc_info=error,
            )

    # --- generations and their sockets -----------------------------------------------------

    def retain_sockets(self, generation: Generation) -> None:
        endpoints = tuple((rank.ip, rank.port) for rank in generation.ranks)
        with self._lock:
            if generation in self._retained:
                return
            self._retained[generation] = endpoints
        self.transport.retain(endpoints)

    def entries_invalidated(
        self, entries: Mapping[PoolKey, Generation], removed: int, cause: str
    ) -> None:
        if removed:
            with self._lock:
                self._invalidations[cause] = self._invalidations.get(cause, 0) + removed
        if entries:
            self._reconcile()

    def _reconcile(self) -> int:
        """Release the sockets of retained generations nothing uses any more."""
        with self._lock:
            if not self._retained:
                return 0
        live = set(self.pool.snapshot().values())
        for receiver in self.in_flight():
            live.update(_entries_of(receiver))
        with self._lock:
            dead = [g for g in self._retained if g not in live]
            released = [self._retained.pop(g) for g in dead]
        for endpoints in released:
            self.transport.release(endpoints)
        return len(released)

    def instance_replaced(
        self,
        addr: str,
        old_ids: Iterable[str | None],
        new_id: str,
        finder: HostedReceiver,
    ) -> None:
        """``finder``'s fetch from ``addr`` answered as ``new_id`` while it held entries of
        ``old_ids``: retire those, and fail the other requests that use them (``finder``
        refetches its stale keys itself)."""
        # Retire exactly the replaced ids (POOL-6): ``finder`` adopted those entries before
        # its fetch began, so they answered before ``new_id`` did. Never "every id but
        # new_id": a newer instance may have published since this fetch was answered.
        for old in old_ids:
            if old is not None:
                self.pool.retire_instance(addr, old)
                self._restarted(addr, old, new_id, cause="fetch", exclude=finder)

    # --- failure fan-out --------------------------------------------------------------------

    def fail_generations(
        self,
        generations: Iterable[Generation],
        error: BootstrapError,
        *,
        exclude: HostedReceiver | None = None,
    ) -> int:
        """Fail every receiver in flight that uses one of ``generations``; invalidate them by
        identity. Returns how many receivers were failed."""
        doomed = set(generations)
        if not doomed:
            return 0
        _note_evidence(error, self.clock())
        held = {key: g for key, g in self.pool.snapshot().items() if g in doomed}
        if held:
            removed = self.pool.invalidate(held)
            self.entries_invalidated({}, removed, type(error).__name__)
        failed = 0
        for receiver in self.in_flight():
            if (
                receiver is not exclude
                and any(g in doomed for g in _entries_of(receiver))
                and receiver.lose(error)
            ):
                failed += 1
        self._count_fanout(error, failed)
        self._reconcile()
        return failed

    def fail_address(self, addr: str, error: BootstrapError) -> int:
        """Fail every receiver in flight bound to ``addr``; invalidate their generations by
        identity and forget the address's topology. Returns how many receivers were failed."""
        _note_evidence(error, self.clock())
        self._forget_topology(addr)
        used: dict[PoolKey, Generation] = {}
        failed = 0
        for receiver in self.in_flight():
            if receiver.addr == addr:
                used.update(receiver.entries.copy())
                if receiver.lose(error):
                    failed += 1
        if used:
            removed = self.pool.invalidate(used)
            self.entries_invalidated({}, removed, type(error).__name__)
        self._count_fanout(error, failed)
        self._reconcile()
        return failed

    def _count_fanout(self, error: BootstrapError, failed: int) -> None:
        kind = type(error).__name__
        with self._lock:
            self._fanout[kind] = self._fanout.get(kind, 0) + failed

    def _keys_holding(self, generations: set[Generation]) -> list[tuple[PoolKey, Generation]]:
        """The (key, generation) pairs of the pool and of the receivers in flight whose
        generation is one of ``generations``."""
        items = [(k, g) for k, g in self.pool.snapshot().items() if g in generations]
        for receiver in self.in_flight():
            items.extend((k, g) for k, g in _items_of(receiver) if g in generations)
        return items

    def still_named_dead(
        self, fresh: Mapping[PoolKey, Generation], error: RanksUnreachable
    ) -> None:
        """ReceiverHost: a fetch named again a rank judged dead (MGR-19): with the hold-off on,
        its keys are held off until the next recheck (``dead_keys``)."""
        if self._hold_off_dead and self.source.health_by_probes:
            self.dead_keys.record(fresh.items(), error.endpoint, "named again after it died")

    def known_dead(self, addr: str, keys: Sequence[PoolKey]) -> BootstrapError | None:
        """ReceiverHost: the error a request missing ``keys`` fails with at once because one of
        them is known dead (``statemachine/decode/dead_keys.py``), or ``None``."""
        return self.dead_keys.refusal(addr, keys)

    def _generations_using(self, url: str) -> set[Generation]:
        found: set[Generation] = set()
        candidates = list(self.pool.snapshot().values())
        for receiver in self.in_flight():
            candidates.extend(_entries_of(receiver))
        for generation in candidates:
            for rank in generation.ranks:
                if endpoint_url((rank.ip, rank.port)) == url:
                    found.add(generation)
                    break
        return found

    def _endpoint_dead(self, url: str, reason: str) -> int:
        if not self.fanout:
            return 0
        generations = self._generations_using(url)
        if not generations:
            return 0
        if self._hold_off_dead and self.source.health_by_probes:
            # A source asked over the network (HTTP) would be refetched per request; one that
            # answers from a watched local store (etcd) costs microseconds to ask and sees a
            # new registration at once, so its keys are never held as known dead.
            self.dead_keys.record(self._keys_holding(generations), url, reason)
        error = RankDead(
            f"prefill rank {url} is dead ({reason}); retry the request: it will fetch the "
            "prefill's current ranks",
            endpoint=url,
        )
        return self.fail_generations(generations, error)

    def send_failed(self, error: SendFailed) -> None:
        """A receiver's send failed: every other request using that endpoint is lost too."""
        self._endpoint_dead(error.endpoint, str(error))

    def _on_endpoint(self, endpoint: Endpoint, alive: bool, reason: str) -> None:
        """Transport listener: an endpoint was found dead (evidence for the fan-out) or back."""
        if not alive:
            self._endpoint_dead(endpoint_url(endpoint), reason)
        else:
            self.dead_keys.forget_endpoint(endpoint_url(endpoint))

    def _on_dead(self, addr: str, reason: str) -> None:
        """Health monitor: ``addr`` stopped answering (the pool entries are already gone)."""
        if not self.fanout:
            return
        self.fail_address(
            addr,
            PrefillDead(
                f"prefill {addr} stopped answering health probes ({reason}); retry the "
                "request once it is back",
                addr=addr,
            ),
        )

    def _on_restart(self, addr: str, old_id: str, new_id: str) -> None:
        """Health monitor: a new instance answers at ``addr``."""
        self._restarted(addr, old_id, new_id, cause="health")

    def _restarted(
        self,
        addr: str,
        old_id: str,
        new_id: str,
        *,
        cause: str,
        exclude: HostedReceiver | None = None,
    ) -> int:
        self._forget_topology(addr)
        self.dead_keys.forget_address(addr)  # a new instance: every registration is new
        if not self.fanout:
            return 0
        candidates = list(self.pool.snapshot().items())
        for receiver in self.in_flight():
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
        return self.fail_generations(stale, error, exclude=exclude)

    def watch_address(self, addr: str, instance_id: str | None) -> None:
        """Health-watch every address this manager fetched from (off the hit path), with the
        instance id the fetch saw as the baseline: no probe runs inside the request (MGR-21;
        a server that sends no id gets its baseline from the watch thread's first probe)."""
        if self.health is None or addr in self._watched:
            return
        with self._lock:
            if addr in self._watched:
                return
            self._watched.add(addr)
        self.health.watch(addr, instance_id=instance_id, baseline_now=False)

    # --- metrics and shutdown --------------------------------------------------------------

    def stats(self) -> ManagerStats:
        pool = self.pool.stats()
        sockets = self.transport.stats().sockets_open
        with self._lock:
            return ManagerStats(
                hits=pool.hits,
                misses=pool.misses,
                publishes=pool.publishes,
                adoptions=pool.adoptions,
                invalidations=dict(self._invalidations),
                failures={k: _count_value(c) for k, c in self._failures.items()},
                completed=_count_value(self._completed),
                in_flight=len(self._inflight),
                pending_dp=sum(len(rooms) for rooms in self._pending.values()),
                flights_led=0 if self.flights is None else self.flights.led,
                flights_followed=0 if self.flights is None else self.flights.followed,
                fanout=dict(self._fanout),
                detection=DetectionStats(
                    self._detections, self._detection_total, self._detection_max
                ),
                sockets_open=sockets,
                endpoints_retained=sum(len(e) for e in self._retained.values()),
                dp_queries=self._dp_queries,
                dropped_events=self._unknown_events,
                kv_held=self._holds.stats().held,
                callback_errors=self._callback_errors,
                dp_queries_in_flight=len(self._dp_inflight),
                known_dead_keys=len(self.dead_keys),
                refused_known_dead=self.dead_keys.refused,
            )

    def close(self) -> None:
        """Fail what is still in flight (ManagerClosed), then close every part made here:
        the health monitor's thread, the ack listener's thread and socket, the transport's
        sockets, the calling thread's HTTP sessions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.admit_room = _refuse_room
        error = ManagerClosed("the decode manager was closed while this request was in flight")
        for receiver in self.in_flight():
            receiver.lose(error)
        with self._lock:
            retained = list(self._retained.values())
            self._retained.clear()
        for endpoints in retained:
            self.transport.release(endpoints)
        self._background.close()  # queries not started are cancelled; none is applied
        self.dead_keys.clear()
        with self._lock:
            self._dp_inflight.clear()
            self._preparing.clear()
        self.source.detach()  # a source the caller owns must not call a closed manager
        self._close_owned()

    def _close_owned(self) -> None:
        # Health first (its probes call back into us), the transport before nothing else.
        for closer in reversed(self._owned):
            closer()
        self._owned.clear()

    def __enter__(self) -> DecodeManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _entries_of(receiver: HostedReceiver) -> tuple[Generation, ...]:
    """The generations a receiver (owned by another thread) holds right now."""
    for _ in range(3):
        try:
            return tuple(receiver.entries.values())
        except RuntimeError:  # pragma: no cover - resized while copied; look again
            continue
    return ()  # pragma: no cover


def _items_of(receiver: HostedReceiver) -> tuple[tuple[PoolKey, Generation], ...]:
    for _ in range(3):
        try:
            return tuple(receiver.entries.items())
        except RuntimeError:  # pragma: no cover - resized while copied; look again
            continue
    return ()  # pragma: no cover


def _refuse_room(room: int, receiver: HostedReceiver) -> HostedReceiver:
    """``admit_room`` of a closed manager."""
    raise ManagerClosed("the decode manager is closed: create a new one")


def _note_evidence(error: BootstrapError, now: float) -> None:
    """When the evidence arrived, on a PeerLost reason (for the detection-time stats)."""
    if isinstance(error, PeerLost) and error.evidence_at is None:
        error.evidence_at = now


def _count_value(counter: itertools.count[int]) -> int:
    """The next value of an ``itertools.count`` without advancing it (its repr is
    ``count(N)``); counters bumped lock-free on the request path are read this way."""
    return int(repr(counter)[6:-1])
