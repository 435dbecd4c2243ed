"""``DecodeManager``: one per decode process; the façade over the decode core's parts.

SGLang's counterpart is the decode-side KV manager. A decode worker makes one, asks it for a
receiver per request (:meth:`DecodeManager.receiver`), calls :meth:`step` once per scheduler
step, reports completions from its transfer engine (:meth:`complete`, :meth:`fail_room`),
asks :meth:`kv_release` before freeing an aborted room's pages, reads :meth:`stats`, and closes
it. Everything else is done by the parts it wires together, each with one job, each depending
only on the ones below it (``docs/design.md``, "The decode core"):

* :mod:`~statemachine.decode.rooms` - the receivers in flight by room, and how they ended;
* :mod:`~statemachine.decode.routes` - per prefill address: topology → rank plan → the
  address plan and checks the hit path reads (MGR-16/17/20);
* :mod:`~statemachine.decode.fanout` - evidence → invalidate by identity → fail every
  receiver that depends on it (MGR-1..6), the keys known dead;
  :mod:`~statemachine.decode.retention` the sockets of what this process published (ZMQ-20),
  :mod:`~statemachine.decode.exits` the transport's exit proofs for held KV (MGR-15);
* :mod:`~statemachine.decode.fetcher` - the miss path's steps, each answering a value:
  single-flight → fetch → register → publish (the receiver steps its lifecycle between them);
* :mod:`~statemachine.decode.completions` - prefill statuses → receivers (MGR-13/14/16), and
  the KV an ABORT holds (MGR-15); :mod:`~statemachine.decode.ranks.outbox` - everything sent
  to the ranks;
* :mod:`~statemachine.decode.dp_ranks` - rooms waiting for their dp rank, asked in one batch
  per address per step (MGR-8).

The receiver (:mod:`~statemachine.decode.receiver`) is handed them as one ``Parts`` value and
never calls the manager. **Any source** (:mod:`statemachine.decode.source`): the manager knows
its source only by the ``BootstrapSource`` protocol; it attaches the source to the pool and the
fan-out, and runs the HTTP health monitor only for a source that needs probes. The etcd source
is composed with a manager in ``statemachine/decode_on_etcd.py`` (docs/etcd.md), never here.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from statemachine.backend import KVBackend
from statemachine.decode import holds
from statemachine.decode.background import Background
from statemachine.decode.client import BootstrapClient
from statemachine.decode.completions import Completions
from statemachine.decode.config import DecodeConfig
from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.dp_ranks import DpRankQueries
from statemachine.decode.exits import ExitProofs
from statemachine.decode.fanout import FanOut
from statemachine.decode.fetcher import Fetcher
from statemachine.decode.flight import Flights
from statemachine.decode.health import HealthMonitor
from statemachine.decode.parts import Parts, check_parts
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.acks import AckListener
from statemachine.decode.ranks.outbox import Outbox
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.decode.retention import SocketRetention
from statemachine.decode.rooms import Rooms
from statemachine.decode.routes import AddressPlan, Routes
from statemachine.decode.silent import SilentAddresses
from statemachine.decode.source import BootstrapQueries, BootstrapSource, as_source
from statemachine.errors import BootstrapError, ConfigurationError, ManagerClosed
from statemachine.pool import BootstrapPool, Generation
from statemachine.validation import Topology
from statemachine.wire.reference import SimpleBackend

__all__ = [
    "DecodeConfig",
    "DecodeManager",
    "DetectionStats",
    "ManagerStats",
]

_session_ids = itertools.count(1)


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
    #: bootstrap addresses held off as silent, and requests failed at once on them (MGR-22)
    silent_addresses: int = 0
    refused_silent: int = 0


class DecodeManager:
    """One per decode process; see the module docstring.

    Settings come as one :class:`~statemachine.decode.config.DecodeConfig`
    (``DecodeManager(config)``), or as its field names (``DecodeManager(layout=...,
    liveness_timeout_s=1.0)``), not both. The parts - ``source`` (default: a
    :class:`~statemachine.decode.client.BootstrapClient`), ``pool``, ``transport``,
    ``backend`` or ``backend_factory(ack_ip, ack_port)`` - may be given (then the caller owns
    and closes them) or left to the manager (made here, closed by :meth:`close`).
    ``completion="acks"`` (default) listens for the reference prefill rank's acks (or, through
    the backend's ``decode_message``, SGLang's statuses); ``"external"`` is for a transfer
    engine that reports completion itself (call :meth:`complete` per prefill rank, or
    ``receiver.mark_transferred()``).

    The fan-out, the fetcher and (when none is passed) the transport are made from
    :attr:`fanout_class`, :attr:`fetcher_class` and :attr:`transport_class`: a comparison
    that needs other behaviour (the demo's and benchmarks' SGLang-like anchor,
    ``statemachine/demo/baselines.py``) subclasses those, never a flag here.
    """

    fanout_class: type[FanOut] = FanOut
    fetcher_class: type[Fetcher] = Fetcher
    #: the transport made when none is passed (a baseline subclass swaps SGLang's sockets in)
    transport_class: type[ZmqTransport] = ZmqTransport

    def __init__(
        self,
        config: DecodeConfig | None = None,
        *,
        source: BootstrapQueries | None = None,
        pool: BootstrapPool | None = None,
        transport: ZmqTransport | None = None,
        backend: KVBackend | None = None,
        backend_factory: Callable[[str, int], KVBackend] | None = None,
        **settings: Any,
    ) -> None:
        if config is None:
            config = _config_of(settings)
        elif settings:
            raise ConfigurationError(
                f"give a DecodeConfig or its settings ({', '.join(sorted(settings))}), not both"
            )
        if backend is not None and backend_factory is not None:
            raise ConfigurationError("give backend or backend_factory, not both")
        if config.completion == "external" and backend is None and backend_factory is None:
            raise ConfigurationError(
                "completion='external' needs your transfer engine's backend: pass backend="
            )
        #: The settings, as given (frozen).
        self.config = config
        self.clock = config.clock
        self._owned: list[Callable[[], None]] = []  # closers of the parts made here, in order
        self._closed = False
        self._rooms = Rooms(config.clock)
        self._background = Background()  # step()'s queries and prepare() (threads on first use)
        try:
            self._build(source, pool, transport, backend, backend_factory)
        except BaseException:
            self._close_owned()
            raise
        try:
            # The source retires from our pool, asks what our receivers hold, and reports
            # what it retired to our fan-out (a no-op for the HTTP client).
            self.source.attach(
                self.pool, held=self._rooms.held_by, retire=self._fanout.fail_generations
            )
        except BootstrapError as exc:
            self._close_owned()
            raise ConfigurationError(str(exc)) from exc
        self.transport.subscribe_exits(self._exits.process_exited)
        self.transport.subscribe_verdicts(self._fanout.on_verdict)

    def _build(
        self,
        source: BootstrapQueries | None,
        pool: BootstrapPool | None,
        transport: ZmqTransport | None,
        backend: KVBackend | None,
        backend_factory: Callable[[str, int], KVBackend] | None,
    ) -> None:
        config = self.config
        bound = config.liveness  # every timeout on silence, from liveness_timeout_s (ZMQ-25)
        if source is None:
            client = BootstrapClient(**bound.client_options())
            self._owned.append(client.close_all)  # every thread's sessions, not only ours
            source = client
        self.source: BootstrapSource = as_source(source)
        if pool is None:
            pool = self.source.shared_pool()  # the pool the source already retires from
        self.pool: BootstrapPool = BootstrapPool() if pool is None else pool
        if transport is None:
            # The bound's heartbeats and reconnects (ZMQ-25); a baseline without the monitor
            # (SGLang's queueing sockets) ignores them and keeps its own options.
            transport = self.transport_class(
                send_timeout_ms=config.send_timeout_ms, **bound.transport_options()
            )
            self._owned.append(transport.close)
        self.transport: ZmqTransport = transport
        kv_holds = holds.AbortHolds(config.kv_release_timeout_s, config.clock)
        self._completions = Completions(
            rooms=self._rooms,
            holds=kv_holds,
            prefill_complete=config.prefill_complete,
            clock=config.clock,
        )
        self.acks: AckListener | None = None
        if config.completion == "acks":
            self.acks = AckListener(
                config.ack_ip,
                on_event=self._completions.on_event,
            )
            self._owned.append(self.acks.close)
        if backend is None:
            assert self.acks is not None  # checked above for "external"
            session_id = config.session_id or f"decode-{os.getpid()}-{next(_session_ids)}"
            if backend_factory is not None:
                backend = backend_factory(self.acks.ip, self.acks.port)
            else:
                backend = SimpleBackend(self.acks.ip, self.acks.port, session_id)
        check_parts(
            pool=self.pool,
            source=self.source,
            transport=self.transport,
            backend=backend,
            waiting_timeout_s=config.waiting_timeout_s,
            clock=config.clock,
        )
        self.backend: KVBackend = backend
        if self.acks is not None:
            # The backend needed the listener's port; the listener reads the backend's wire
            # from now on (nothing was sent to that port before).
            self.acks.decode_with(backend.decode_message)
        outbox = Outbox(self.transport, backend)
        self._routes = Routes(
            self.source,
            config.layout,
            staging=config.staging,
            background=self._background,
            check_topology=getattr(backend, "check_topology", None),
        )
        self._dp_ranks = DpRankQueries(self.source, self._background)
        #: keys whose ranks are known dead: a miss on one fails at once (no refetch per
        #: request); held off only when dead_recheck_s is given
        self.dead_keys = DeadKeys(clock=config.clock, recheck_s=config.dead_recheck_s or 1.0)
        #: the sockets of the generations this process published (ZMQ-20)
        self._retention = SocketRetention(
            pool=self.pool, rooms=self._rooms, transport=self.transport
        )
        #: the transport's exit proofs, for the KV of failed rooms (MGR-15)
        self._exits = ExitProofs(pool=self.pool, rooms=self._rooms, holds=kv_holds)
        self._fanout = self.fanout_class(
            rooms=self._rooms,
            routes=self._routes,
            pool=self.pool,
            source=self.source,
            dead_keys=self.dead_keys,
            hold_off_dead=config.dead_recheck_s is not None,
            clock=config.clock,
            retention=self._retention,
            exits=self._exits,
        )
        self.health: HealthMonitor | None = None
        # A source that finds dead prefills itself (etcd: the watch and the leases) needs no
        # probes, and there may be no HTTP server at the address to probe.
        #: bootstrap addresses judged dead whose probes go unanswered, held off until one is
        #: answered or refused (MGR-22)
        self.silent = SilentAddresses(clock=config.clock)
        if config.health_probes and self.source.health_by_probes:
            monitor = HealthMonitor(
                self.pool,
                on_silent=self.silent.judged_silent,
                on_heard=self.silent.heard,
                on_dead=self._fanout.address_dead,
                on_restart=self._fanout.address_restarted,
                **bound.health_options(),
            )
            self.health = monitor
            monitor.start()

            def stop_health() -> None:
                monitor.stop()

            self._owned.append(stop_health)
        #: single-flight fetches per pool key (:mod:`statemachine.decode.flight`)
        self.flights = Flights()
        fetcher = self.fetcher_class(
            pool=self.pool,
            source=self.source,
            transport=self.transport,
            outbox=outbox,
            flights=self.flights,
            fanout=self._fanout,
            retention=self._retention,
            routes=self._routes,
            silent=self.silent,
            health=self.health,
            clock=config.clock,
        )
        self._parts = Parts(
            config=config,
            pool=self.pool,
            source=self.source,
            outbox=outbox,
            rooms=self._rooms,
            routes=self._routes,
            dp_ranks=self._dp_ranks,
            fanout=self._fanout,
            fetcher=fetcher,
            silent=self.silent,
            dead_keys=self.dead_keys,
            completions=self._completions,
            prefill_complete=config.prefill_complete,
            checks_stale_marks=bool(self.source.marks_generations),
        )

    def close_with(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` when this manager closes, after every part it made (a source made
        for it, say, whose thread must outlive the parts that call it)."""
        self._owned.insert(0, closer)

    # --- requests ---------------------------------------------------------------------------

    def receiver(
        self,
        addr: str,
        room: int,
        plan: RankPlan | None = None,
        *,
        prefill_dp_rank: int | None = None,
    ) -> BootstrapReceiver:
        """A receiver for ``room`` against the prefill at ``addr``, known to this manager.

        ``plan`` defaults to the one derived from the prefill's topology and the layout
        (:meth:`plan_for`); ``prefill_dp_rank`` is the router's, if any.
        """
        return BootstrapReceiver(self._parts, addr, room, plan, prefill_dp_rank)

    def in_flight(self) -> list[BootstrapReceiver]:
        """The receivers not yet ended (a snapshot)."""
        return self._rooms.snapshot()  # type: ignore[return-value]  # only receivers admit

    def get(self, room: int) -> BootstrapReceiver | None:
        """The receiver in flight for ``room``, if any."""
        return self._rooms.get(room)  # type: ignore[return-value]  # only receivers admit

    # --- the prefill's topology -------------------------------------------------------------

    def topology(self, addr: str) -> Topology:
        """The prefill's topology, fetched once per instance of the prefill (MGR-20)."""
        return self._routes.topology(addr)

    def plan_for(self, addr: str) -> RankPlan:
        """This decode rank's plan against ``addr``, from the prefill's topology (spec/plans.md):
        derived from the layout; without one, only a one-rank prefill is planned (PLAN-9)."""
        return self._routes.plan_for(addr)

    def prepare(self, addr: str) -> Future[AddressPlan]:
        """Start resolving ``addr`` (its topology fetch, plan and policy checks) on the
        background workers and return at once: a scheduler that learns of a new prefill calls
        this, and until the future is done every ``init()`` for ``addr`` returns
        ``Bootstrapping`` instead of fetching on the caller's thread (call it again later).
        The future's result is the :class:`~statemachine.decode.routes.AddressPlan` (or the
        ``BootstrapError`` that refused the address: the next ``init()`` meets it too). An
        address already resolved gives a finished future; one being resolved, the future in
        flight."""
        return self._routes.prepare(addr)

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
        return self._dp_ranks.step(wait=wait)

    # --- completion -------------------------------------------------------------------------

    def complete(self, room: int, *, prefill_rank: int = 0) -> bool:
        """A transfer engine reports that prefill rank ``prefill_rank`` sent ``room``'s KV.

        Counted as SGLang counts statuses (MGR-13): once per distinct prefill rank; the room
        is transferred when ``required_prefill_response_num`` ranks reported (one call with
        the default rank for a one-rank plan). False if no receiver is in flight or the rank
        already reported.
        """
        return self._completions.complete(room, prefill_rank)

    def fail_room(self, room: int, reason: str | None, *, prefill_rank: int | None = None) -> bool:
        """A prefill rank reported ``room``'s transfer failed; its receiver fails with it, and
        no later success can complete it (MGR-14)."""
        return self._completions.fail_room(room, reason, prefill_rank=prefill_rank)

    def kv_release(self, room: int) -> bool:
        """Whether ``room``'s KV pages may be freed (SGLang's deferred decode KV release).

        A room whose ABORT carried a generation (sent after its metadata: on the waiting
        timeout, on any failure, on abort) is *held*: the prefill may still be writing into its
        pages. It may be freed once every rank it was sent to acknowledged that generation
        (ABORT_ACK), once every one of them is proven gone (its port refused a connect: the
        process exited, ZMQ-26), or ``kv_release_timeout_s`` after the ABORT, whichever comes
        first; silence (a hang, a partition) is no proof. A room that was never held may be
        freed at once. Ask after a request fails, before reusing its pages; memory is bounded
        (MGR-15).
        """
        return self._completions.holds.released(room)

    def kv_holds(self) -> holds.HoldStats:
        """The deferred-release bookkeeping: rooms held now, released by acks or by timeout,
        holds evicted at the bound, stale acks (MGR-15)."""
        return self._completions.holds.stats()

    # --- evidence from outside --------------------------------------------------------------

    def fail_generations(self, generations: Iterable[Generation], error: BootstrapError) -> int:
        """Fail every receiver in flight that uses one of ``generations``; invalidate them by
        identity. Returns how many receivers were failed (evidence a caller has, e.g. its
        own transfer engine's verdict on a rank)."""
        return self._fanout.fail_generations(generations, error)

    def fail_address(self, addr: str, error: BootstrapError) -> int:
        """Fail every receiver in flight bound to ``addr``; invalidate their generations by
        identity and forget the address's topology. Returns how many receivers were failed."""
        return self._fanout.fail_address(addr, error)

    # --- metrics and shutdown --------------------------------------------------------------

    def stats(self) -> ManagerStats:
        pool = self.pool.stats()
        sockets = self.transport.stats().sockets_open
        completed, failures, in_flight = self._rooms.counts()
        pending, dp_in_flight, dp_started = self._dp_ranks.counts()
        rooms = self._rooms
        return ManagerStats(
            hits=pool.hits,
            misses=pool.misses,
            publishes=pool.publishes,
            adoptions=pool.adoptions,
            invalidations=dict(self._fanout.invalidations),
            failures=failures,
            completed=completed,
            in_flight=in_flight,
            pending_dp=pending,
            flights_led=self.flights.led,
            flights_followed=self.flights.followed,
            fanout=dict(self._fanout.failed),
            detection=DetectionStats(
                rooms.detections, rooms.detection_total_s, rooms.detection_max_s
            ),
            sockets_open=sockets,
            endpoints_retained=self._retention.endpoints_retained(),
            dp_queries=dp_started,
            dropped_events=self._completions.dropped,
            kv_held=self._completions.holds.stats().held,
            callback_errors=rooms.callback_errors,
            dp_queries_in_flight=dp_in_flight,
            known_dead_keys=len(self.dead_keys),
            refused_known_dead=self.dead_keys.refused,
            silent_addresses=len(self.silent),
            refused_silent=self.silent.refused,
        )

    def close(self) -> None:
        """Fail what is still in flight (ManagerClosed), then close every part made here:
        the health monitor's thread, the ack listener's thread and socket, the transport's
        sockets, the calling thread's HTTP sessions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._rooms.close(
            ManagerClosed("the decode manager was closed while this request was in flight")
        )
        self._retention.close()
        self._fanout.close()
        self.silent.clear()
        self._background.close()  # queries not started are cancelled; none is applied
        self._dp_ranks.close()
        self._routes.close()
        self.source.detach()  # a source the caller owns must not call a closed manager
        self._close_owned()

    def _close_owned(self) -> None:
        # Health first (its probes call back into the fan-out), the transport last.
        for closer in reversed(self._owned):
            closer()
        self._owned.clear()

    def __enter__(self) -> DecodeManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SETTINGS = frozenset(field.name for field in dataclasses.fields(DecodeConfig))


#: Settings that one bound replaced (ZMQ-25), and what to write instead.
_REPLACED = {
    "health_interval_s": (
        "health_interval_s is derived from liveness_timeout_s now (probes every bound/4): set "
        "liveness_timeout_s=SECONDS, or health_probes=False for no probes"
    ),
    "failures_to_dead": (
        "failures_to_dead is derived from liveness_timeout_s now (two failed probes within "
        "the bound): set liveness_timeout_s=SECONDS"
    ),
}


def _config_of(settings: Mapping[str, Any]) -> DecodeConfig:
    """A :class:`DecodeConfig` from keyword settings; ConfigurationError on an unknown name."""
    for name, instead in _REPLACED.items():
        if name in settings:
            raise ConfigurationError(f"DecodeManager got {name}: {instead}")
    unknown = sorted(set(settings) - _SETTINGS)
    if unknown:
        raise ConfigurationError(
            f"DecodeManager got unknown settings {', '.join(unknown)}: the settings are "
            f"DecodeConfig's fields ({', '.join(sorted(_SETTINGS))})"
        )
    return DecodeConfig(**settings)
