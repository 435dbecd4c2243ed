"""One demo run: a prefill instance, the decode side in this process, restarts, measurements.

:func:`run_demo` owns every resource it creates and releases them all on the way out, Ctrl-C
included: the prefill processes are SIGKILLed and reaped, sockets closed, threads joined.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

from statemachine import trace
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import ManagerStats
from statemachine.decode.ranks.acks import AckStats
from statemachine.decode.ranks.transport import TransportStats
from statemachine.decode.receiver import RankPlan
from statemachine.decode.source import BootstrapSource
from statemachine.demo.baselines import manager_class, transport_class
from statemachine.demo.cluster import HOST, PrefillInstance
from statemachine.demo.loops import Outcome, RequestLoops
from statemachine.demo.modes import OURS, ModeConfig, make_pool
from statemachine.demo.sampling import socket_counts
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway
from statemachine.errors import BootstrapError, ClusterError
from statemachine.pool import PoolStats
from statemachine.wire.reference import SimpleBackend

SAMPLE_INTERVAL_S = 0.02


@dataclass(frozen=True)
class DemoConfig:
    mode: ModeConfig = OURS
    duration_s: float = 20.0
    loops: int = 8
    rate: float = 400.0  # requests per second, all loops together
    tp_size: int = 2
    pp_size: int = 1
    restarts: int = 1
    waiting_timeout_s: float = 2.0
    send_timeout_ms: int = 1000
    liveness_timeout_s: float = 4.0  # probes every second
    max_requests: int | None = None
    warm_restart: bool = True
    catch_up: bool = False  # loops keep their schedule after a stall (load runs)
    trace_path: str | None = None
    #: etcd client URL: the decode's source is an etcd watch and the prefill ranks register
    #: there (``--discovery etcd``); None: the prefill's HTTP bootstrap server (the default)
    etcd_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or self.loops < 1 or not self.rate > 0:
            raise ValueError("duration, loops and rate must be positive")
        if self.tp_size < 1 or self.pp_size < 1 or self.restarts < 0:
            raise ValueError("tp and pp must be >= 1, restarts >= 0")
        if not self.waiting_timeout_s > 0 or self.send_timeout_ms < 1:
            raise ValueError("waiting timeout and send timeout must be positive")
        if not self.liveness_timeout_s >= 0.5:
            raise ValueError("the liveness timeout must be at least 0.5 s")

    def restart_offsets(self) -> list[float]:
        """Seconds after the start at which the prefill restarts: evenly spaced."""
        n = self.restarts
        return [self.duration_s * (i + 1) / (n + 1) for i in range(n)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.name,
            "mode_description": self.mode.describe(),
            "zmq_mode": self.mode.zmq_mode,
            "invalidation": self.mode.invalidation,
            "instance_id": self.mode.instance_id,
            "duration_s": self.duration_s,
            "request_loops": self.loops,
            "rate_per_s": self.rate,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "restarts": self.restarts,
            "waiting_timeout_s": self.waiting_timeout_s,
            "send_timeout_ms": self.send_timeout_ms,
            "liveness_timeout_s": self.liveness_timeout_s,
            "max_requests": self.max_requests,
            "warm_restart": self.warm_restart,
            "catch_up": self.catch_up,
            "discovery": "http" if self.etcd_endpoint is None else "etcd",
        }


@dataclass
class Restart:
    """What happened around one prefill restart (monotonic seconds)."""

    killed_at: float
    in_flight: int  # requests in progress at the kill
    old_instance: str
    ready_at: float | None = None  # new server and every rank registered
    new_instance: str | None = None
    detected_at: float | None = None  # first request failure after the kill
    #: most dead-instance pool entries seen in one sample after detection
    stale_after_detection: int = 0


@dataclass
class RunResult:
    config: DemoConfig
    started_at: float
    ended_at: float
    outcomes: list[Outcome]
    restarts: list[Restart]
    pool: PoolStats
    lost_live_generations: int
    live_removed_by_heartbeat: int
    misses_before_first_restart: int
    retries: int
    peak_connections: int
    peak_time_wait: int
    end_time_wait: int
    transport: TransportStats
    acks: AckStats
    manager: ManagerStats
    health_restarts_seen: int
    health_deaths_seen: int
    bootstrap_port: int
    prefill_pids: list[int]
    samples: list[tuple[float, int]] = field(default_factory=list)  # (t, stale entries)


class _Tracker:
    """Restart bookkeeping shared by the controller, the loops and the sampler."""

    def __init__(self) -> None:
        self.live_instance: str | None = None
        self.dead_instances: set[str] = set()
        self.restarts: list[Restart] = []
        self.phase = "starting"

    def on_failure(self, at: float) -> None:
        if self.restarts:
            current = self.restarts[-1]
            if current.detected_at is None and at >= current.killed_at:
                current.detected_at = at


def run_demo(
    config: DemoConfig, status: Callable[[RequestLoops, _Tracker, float], None] | None = None
) -> RunResult:
    """Run once; ``status(loops, tracker, elapsed)`` is called a few times a second."""
    tracker = _Tracker()
    with ExitStack() as stack:
        if config.trace_path is not None:
            stack.enter_context(trace.tracing(config.trace_path))
        else:
            stack.enter_context(nullcontext())
        prefix = f"/pd-demo-{os.getpid()}-{uuid.uuid4().hex[:8]}/ranks"
        etcd = None if config.etcd_endpoint is None else (config.etcd_endpoint, prefix)
        instance = PrefillInstance(
            tp_size=config.tp_size, pp_size=config.pp_size, warm=config.warm_restart, etcd=etcd
        )
        stack.callback(instance.close)
        instance.start()
        tracker.live_instance = instance.instance_id
        addr = instance.addr

        transport = transport_class(config.mode.zmq_mode)(send_timeout_ms=config.send_timeout_ms)
        stack.callback(transport.close)
        client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
        stack.callback(client.close)
        pool = make_pool(config.mode, lambda: tracker.live_instance)
        session = f"demo-{os.getpid()}-{config.mode.name}"

        def backend(ip: str, port: int) -> SimpleBackend:
            return SimpleBackend(
                ip,
                port,
                session,
                kv_ptrs=(0x7F00_0000_0000,),
                aux_ptrs=(0x7F00_1000_0000,),
                kv_item_len=4096,
            )

        source: BootstrapSource = client
        if config.etcd_endpoint is not None:
            watch = EtcdBootstrapSource(EtcdGateway([config.etcd_endpoint]), prefix=prefix)
            stack.callback(watch.close)
            watch.start()
            _wait_ready(watch, addr, config.tp_size * config.pp_size)
            source = watch
        manager = manager_class(config.mode)(
            source=source,
            pool=pool,
            transport=transport,
            backend_factory=backend,
            ack_ip=HOST,
            waiting_timeout_s=config.waiting_timeout_s,
            liveness_timeout_s=config.liveness_timeout_s,
        )
        stack.callback(manager.close)
        monitor = manager.health  # None with etcd: the watch replaces it
        assert manager.acks is not None
        if monitor is not None:
            monitor.watch(addr)
        plan = RankPlan(
            tp_ranks=tuple(range(config.tp_size)), pp_ranks=tuple(range(config.pp_size))
        )

        loops = RequestLoops(
            manager,
            client if config.etcd_endpoint is None else None,
            addr,
            plan,
            n_loops=config.loops,
            rate=config.rate,
            on_failure=tracker.on_failure,
            max_requests=config.max_requests,
            catch_up=config.catch_up,
        )
        sampler = _Sampler(pool, tracker, instance.port)
        stack.callback(sampler.stop)
        sampler.start()

        started = time.monotonic()
        stack.callback(loops.stop)
        loops.start()
        tracker.phase = "running"
        misses_before = -1
        for offset in config.restart_offsets():
            if _wait_until(started + offset, loops, status, tracker, started):
                break
            if misses_before < 0:
                misses_before = pool.stats().misses
            restart = Restart(time.monotonic(), loops.in_flight(), instance.instance_id)
            tracker.restarts.append(restart)
            tracker.live_instance = None
            tracker.dead_instances.add(instance.instance_id)
            tracker.phase = "prefill down"
            instance.restart()
            restart.ready_at = time.monotonic()
            restart.new_instance = instance.instance_id
            tracker.live_instance = instance.instance_id
            tracker.phase = "recovering"
        _wait_until(started + config.duration_s, loops, status, tracker, started)
        tracker.phase = "stopping"
        loops.stop()
        ended = time.monotonic()
        if status is not None:
            status(loops, tracker, ended - started)
        sampler.stop()
        end_counts = socket_counts(instance.port)
        if monitor is not None:
            monitor.stop()
        acks = manager.acks
        stats = pool.stats()
        return RunResult(
            config=config,
            started_at=started,
            ended_at=ended,
            outcomes=list(loops.outcomes),
            restarts=tracker.restarts,
            pool=stats,
            lost_live_generations=pool.lost_live_generations,
            live_removed_by_heartbeat=pool.live_removed_by_heartbeat,
            misses_before_first_restart=stats.misses if misses_before < 0 else misses_before,
            retries=sum(loops.retries),
            peak_connections=sampler.peak_established,
            peak_time_wait=max(sampler.peak_time_wait, end_counts.time_wait),
            end_time_wait=end_counts.time_wait,
            transport=transport.stats(),
            acks=acks.stats(),
            manager=manager.stats(),
            health_restarts_seen=0 if monitor is None else monitor.restarts_seen,
            health_deaths_seen=0 if monitor is None else monitor.deaths_seen,
            bootstrap_port=instance.port,
            prefill_pids=instance.spawned_pids,
            samples=sampler.stale_samples,
        )
    raise AssertionError("unreachable")  # pragma: no cover (ExitStack does not swallow)


def _wait_ready(source: EtcdBootstrapSource, addr: str, ranks: int, timeout: float = 30.0) -> None:
    """Until the watch shows every rank of the prefill (bounded: ClusterError after it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            source.get_topology(addr)
            return
        except BootstrapError:
            time.sleep(0.02)
    raise ClusterError(
        f"the prefill's {ranks} ranks did not all appear in etcd within {timeout:g} s"
    )


def _wait_until(
    deadline: float,
    loops: RequestLoops,
    status: Callable[[RequestLoops, _Tracker, float], None] | None,
    tracker: _Tracker,
    started: float,
) -> bool:
    """Sleep until ``deadline``, reporting status; True if every loop ended early (budget)."""
    while True:
        now = time.monotonic()
        if status is not None:
            status(loops, tracker, now - started)
        if now >= deadline:
            return False
        if not loops.alive():
            return True
        time.sleep(min(0.25, deadline - now))


class _Sampler:
    """Samples sockets to the bootstrap port and dead-instance pool entries every 20 ms."""

    def __init__(self, pool: Any, tracker: _Tracker, port: int) -> None:
        self._pool = pool
        self._tracker = tracker
        self._port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-sampler", daemon=True)
        self.peak_established = 0
        self.peak_time_wait = 0
        self.stale_samples: list[tuple[float, int]] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            counts = socket_counts(self._port)
            self.peak_established = max(self.peak_established, counts.established)
            self.peak_time_wait = max(self.peak_time_wait, counts.time_wait)
            tracker = self._tracker
            if not tracker.restarts:
                continue
            current = tracker.restarts[-1]
            if current.detected_at is None:
                continue
            dead = tracker.dead_instances
            stale = sum(1 for g in self._pool.snapshot().values() if g.instance_id in dead)
            now = time.monotonic()
            self.stale_samples.append((now, stale))
            current.stale_after_detection = max(current.stale_after_detection, stale)
