"""The bootstrap server at fleet scale (issue 27): a decode's rank queries while N keep-alive
clients probe ``GET /health`` once a second.

Per setting (N clients, the server process's fd limit), each server runs in its own process:
ours (``BootstrapServer``) and, where its wheel is installed, SGLang 0.5.23's own
``CommonKVBootstrapServer`` after SGLang's launcher's ``set_ulimit()``, as its prefill runs it.
A fleet process (its fd limit raised to the hard limit) opens N raw keep-alive connections
from one selector thread, ramped in over a few seconds, and sends each one ``GET /health`` a
second, spread evenly; a connection the server closes is reopened for its next probe. Once
the fleet is up, this process times ``GET /route`` for ``--seconds``:

* keep-alive: one ``BootstrapClient`` made after the fleet is up, a query every 20 ms;
* new connection: a fresh ``BootstrapClient`` (a newcomer's first connection) every 100 ms.

Reported per server: p50/p99 in ms and failures of both (a failure is a typed error, e.g.
``TransportFailure`` at the client's 5 s deadline), probes answered and reconnects of the
fleet, and the server's counters (ours: connections evicted, peak open; RSS of the process;
its garbage collections by generation, count, total and longest pause, during the fleet's
ramp and during the measured window, timed with ``gc.callbacks``);
the CPU the server process and the fleet process each used while the fleet ran (in % of one
core; the fleet shares the machine's cores with the server it measures), and the server's CPU
microseconds per request answered (probes and queries).
Settings: the issue's (1,100 clients, fd limit 1,024 soft, the machine's hard limit), the
same with a hard limit of 1,024 (nothing to raise: the cap of 960 binds and eviction serves
the newcomers), and 10,000 clients at a soft limit of 1,024. Goal: p99 <= 50 ms. Loopback
only.

    .venv/bin/python -m benchmarks bench_fleet [--seconds 10] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import importlib
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from statemachine.decode.client import BootstrapClient
from statemachine.errors import BootstrapError
from statemachine.prefill.readiness import read_ready
from statemachine.prefill.registration import register_rank
from statemachine.wire.http import route_payload

_REPO = Path(__file__).resolve().parent.parent  # the repository: tests.support, tests.real_prefill
TOKEN = "bench-fleet"
HOST = "127.0.0.1"
RANK = {"dp_rank": 0, "cp_rank": 0, "tp_rank": 0, "pp_rank": 0}
#: Seconds between two probes of one fleet client, and fleet connections opened per second.
PROBE_INTERVAL = 1.0
CONNECTS_PER_S = 2_500
#: Seconds between two legit queries: keep-alive, and on a new connection.
KEEP_ALIVE_EVERY = 0.02
NEW_CONNECTION_EVERY = 0.1
GOAL_P99_MS = 50.0
_HEALTH = b"GET /health HTTP/1.1\r\nHost: bootstrap\r\n\r\n"


@dataclass(frozen=True)
class Setting:
    clients: int
    soft: int  # the server process's fd limit at start
    hard: int | None  # None: the machine's hard limit

    @property
    def judged(self) -> bool:
        """The goal (p99, no failure) is the server's where it can raise its fd limit past the
        fleet. At a hard limit of 1,024 the cap of 960 binds and each probe past it evicts
        another prober (HTTP-71): that setting shows newcomers still get in, not how fast."""
        return self.hard is None

    def describe(self) -> str:
        hard = "the machine's" if self.hard is None else f"{self.hard:,}"
        return f"{self.clients:,} clients, server fd limit {self.soft:,} soft / {hard} hard"


SETTINGS = (Setting(1_100, 1_024, None), Setting(1_100, 1_024, 1_024), Setting(10_000, 1_024, None))
#: --smoke: a cap of 36 (fd limit 100 less the reserve of 64) under 60 clients.
SMOKE = (Setting(60, 100, 100),)


# --- the server process ----------------------------------------------------------------------


class GcPauses:
    """Times every garbage collection of this process by generation (``gc.callbacks``), in
    two phases: the fleet's ramp, then the measured window (from :meth:`measuring` on)."""

    def __init__(self) -> None:
        self.pauses: dict[str, tuple[list[float], ...]] = {
            "ramp": ([], [], []),
            "window": ([], [], []),
        }
        self._phase = "ramp"
        self._began = 0.0
        gc.callbacks.append(self._on_gc)

    def measuring(self) -> None:
        self._phase = "window"

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            pause = time.perf_counter() - self._began
            self.pauses[self._phase][info["generation"]].append(pause)

    def summary(self) -> dict[str, float | None]:
        """Per phase and generation: collections, total and longest pause in ms."""
        out: dict[str, float | None] = {}
        for phase, by_gen in self.pauses.items():
            for gen, pauses in enumerate(by_gen):
                out[f"{phase}_gc{gen}_n"] = len(pauses)
                out[f"{phase}_gc{gen}_total_ms"] = 1e3 * sum(pauses)
                out[f"{phase}_gc{gen}_max_ms"] = 1e3 * max(pauses, default=0.0)
        return out


def serve(kind: str, soft: int, hard: int | None) -> int:
    """Child: lower the fd limit, start the server, print ``PORT n``, serve until stdin closes,
    then print ``STATS {json}``; ours also times its GC pauses, split at stdin's first line."""
    _, machine_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, machine_hard if hard is None else hard))
    stats: dict[str, float | None] = {}
    if kind == "ours":
        from statemachine.prefill.server import BootstrapServer

        server = BootstrapServer(HOST, 0, token=TOKEN).start()
        pauses = GcPauses()
        print(f"PORT {server.port} {server.limits()}", flush=True)
        sys.stdin.readline()  # the fleet is up: the measured window begins
        pauses.measuring()
        sys.stdin.read()
        snapshot = server.stats()
        stats.update(evicted=snapshot.connections_evicted, peak=snapshot.connections_peak)
        stats.update(pauses.summary())
        stats["rss_mb"] = _rss_mb()
        server.stop()
    else:
        sys.path.insert(0, str(_REPO))
        support = importlib.import_module("tests.support.sglang_support")
        conn = support.import_sglang()
        importlib.import_module("sglang.srt.utils.common").set_ulimit()  # as its launcher does
        port = support.free_port()
        sglang_server = conn.CommonKVBootstrapServer(HOST, port)
        support._wait_listening(HOST, port, timeout=10.0)
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        print(f"PORT {port} fd limit {limit:,} after SGLang's set_ulimit()", flush=True)
        sys.stdin.read()
        stats["rss_mb"] = _rss_mb()
        print("STATS", json.dumps(stats), flush=True)
        sglang_server.close()
        return 0
    print("STATS", json.dumps(stats), flush=True)
    return 0


def _rss_mb() -> float | None:
    """This process's RSS; None when it cannot even open a file (its fds are exhausted)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class ServerChild:
    def __init__(self, kind: str, setting: Setting) -> None:
        argv = ["--serve", kind, "--soft", str(setting.soft)]
        if setting.hard is not None:
            argv += ["--hard", str(setting.hard)]
        self.proc = _child(argv)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise RuntimeError(f"{kind} server did not start: {line!r} {err[-2000:]!r}")
        _, port, self.limits = line.rstrip("\n").split(" ", 2)
        self.address = f"{HOST}:{port}"

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def mark_measuring(self) -> None:
        """Tell the server process the measured window begins."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("measuring\n")
        self.proc.stdin.flush()

    def stop(self) -> dict[str, float]:
        try:
            out, _ = self.proc.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=10)
        for line in out.splitlines():
            if line.startswith("STATS "):
                stats: dict[str, float] = json.loads(line[len("STATS ") :])
                return stats
        return {}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process used so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            # Fields after the command name (which may hold spaces): utime, stime are 14, 15.
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _child(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_fleet", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# --- the fleet process ---------------------------------------------------------------------


@dataclass
class _Client:
    sock: socket.socket | None = None
    connected: bool = False
    waiting: bool = False  # a probe was sent, its reply not read yet
    owed: bool = False  # a probe fell due before the connection was up: sent once it is
    buf: bytes = b""


@dataclass
class FleetStats:
    answered: int = 0
    reconnects: int = 0
    late: int = 0  # a probe due while the previous one was unanswered (skipped)
    connected: int = 0
    counts: dict[str, int] = field(default_factory=dict)


def fleet(address: str, clients: int, seconds: float) -> int:
    """Child: ``clients`` keep-alive connections probing /health once a second for ``seconds``
    after the ramp; prints ``READY n`` once all are connected (or the ramp timed out), then
    ``STATS {json}``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, _, port = address.rpartition(":")
    assert host == HOST, "the fleet stays on loopback"
    target = (host, int(port))
    selector = selectors.DefaultSelector()
    fleet_clients = [_Client() for _ in range(clients)]
    stats = FleetStats()

    def open_one(index: int) -> None:
        client = fleet_clients[index]
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(target)
        except BlockingIOError:
            pass
        except OSError:
            sock.close()
            return
        client.sock, client.connected, client.waiting, client.buf = sock, False, False, b""
        client.owed = True  # as an HTTP client does, it connects to send a request
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, index)

    def send(index: int) -> None:
        client = fleet_clients[index]
        assert client.sock is not None
        client.owed = False
        try:
            client.sock.send(_HEALTH)
            client.waiting = True
        except OSError:
            drop(index)

    def drop(index: int) -> None:
        """Closed by the server: reconnected when its next probe falls due."""
        client = fleet_clients[index]
        if client.sock is not None:
            selector.unregister(client.sock)
            client.sock.close()
        client.sock, client.connected, client.waiting = None, False, False
        stats.reconnects += 1

    # Each client's next probe, a heap by due time: a probe is due PROBE_INTERVAL after the
    # last. (A FIFO is in due order only while the ramp is shorter than PROBE_INTERVAL: past
    # that, three quarters of 10,000 clients fell due together at each whole second.)
    due: list[tuple[float, int]] = []
    start = time.monotonic()
    ramp = clients / CONNECTS_PER_S
    for index in range(clients):
        due.append((start + ramp * index / clients, index))  # sorted: a heap already
    opened = 0
    ready_by = start + ramp + 10.0
    ready = False
    end = float("inf")
    while time.monotonic() < end:
        now = time.monotonic()
        while opened < clients and start + opened / CONNECTS_PER_S <= now:
            open_one(opened)
            opened += 1
        while due and due[0][0] <= now:
            when, index = heapq.heappop(due)
            heapq.heappush(due, (when + PROBE_INTERVAL, index))
            client = fleet_clients[index]
            if client.sock is None:
                if index < opened:
                    open_one(index)  # closed by the server: reconnect for this probe
                continue
            if not client.connected:
                client.owed = True
            elif client.waiting:
                stats.late += 1
            else:
                send(index)
        for key, events in selector.select(0.005):
            index = key.data
            client = fleet_clients[index]
            if client.sock is None:
                continue
            if events & selectors.EVENT_WRITE and not client.connected:
                if client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    drop(index)
                    continue
                client.connected = True
                selector.modify(client.sock, selectors.EVENT_READ, index)
                if client.owed:
                    send(index)
                    continue
            if events & selectors.EVENT_READ:
                try:
                    data = client.sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    drop(index)
                    continue
                client.buf += data
                while b"\r\n\r\nOK" in client.buf:  # one whole /health reply
                    _, _, client.buf = client.buf.partition(b"\r\n\r\nOK")
                    client.waiting = False
                    stats.answered += 1
        if not ready:
            stats.connected = sum(c.connected for c in fleet_clients)
            if stats.connected == clients or now >= ready_by:
                print(f"READY {stats.connected}", flush=True)
                ready = True
                stats.answered = stats.reconnects = stats.late = 0
                end = now + seconds
    stats.connected = sum(c.connected for c in fleet_clients)
    print(f"STATS {json.dumps(stats.__dict__)}", flush=True)
    return 0


class FleetChild:
    def __init__(self, address: str, clients: int, seconds: float) -> None:
        self.proc = _child(["--fleet", address, str(clients), str(seconds)])
        assert self.proc.stdout is not None
        try:  # the ramp, then up to 10 s for the last connections
            words = read_ready(self.proc.stdout.fileno(), time.monotonic() + 120)
        except TimeoutError:
            words = None
        if not words:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise RuntimeError(f"the fleet did not start: {err[-2000:]!r}")
        self.connected = int(words[0])

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def wait(self) -> dict[str, int]:
        try:
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=10)
        for line in out.splitlines():
            if line.startswith("STATS "):
                stats: dict[str, int] = json.loads(line[len("STATS ") :])
                return stats
        return {}


# --- the legit decode ----------------------------------------------------------------------


@dataclass
class Timings:
    latencies_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def cell(self) -> str:
        if not self.latencies_ms:
            return f"{'-':>8} {'-':>8} {len(self.failures):>4}/{len(self.failures):<4}"
        ordered = sorted(self.latencies_ms)
        p50 = statistics.median(ordered)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        total = len(ordered) + len(self.failures)
        return f"{p50:>8.2f} {p99:>8.2f} {len(self.failures):>4}/{total:<4}"

    def p99(self) -> float:
        ordered = sorted(self.latencies_ms) or [float("inf")]
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _timed(timings: Timings, client: BootstrapClient, address: str) -> None:
    start = time.perf_counter()
    try:
        client.get_rank(address, **RANK)
    except BootstrapError as exc:
        timings.failures.append(type(exc).__name__)
        return
    timings.latencies_ms.append((time.perf_counter() - start) * 1000)


def measure(address: str, seconds: float, deadline: float) -> tuple[Timings, Timings]:
    """(keep-alive, new connection) timings of GET /route over ``seconds``."""
    keep_alive, fresh = Timings(), Timings()
    end = time.monotonic() + seconds
    next_fresh = time.monotonic()
    with BootstrapClient(deadline=deadline) as client:
        while time.monotonic() < end:
            _timed(keep_alive, client, address)
            if time.monotonic() >= next_fresh:
                with BootstrapClient(deadline=deadline) as newcomer:
                    _timed(fresh, newcomer, address)
                next_fresh = time.monotonic() + NEW_CONNECTION_EVERY
            time.sleep(KEEP_ALIVE_EVERY)
    return keep_alive, fresh


# --- the run -------------------------------------------------------------------------------


def run_one(kind: str, setting: Setting, seconds: float, deadline: float) -> tuple[str, bool]:
    server = ServerChild(kind, setting)
    try:
        payload = route_payload(rank_ip=HOST, rank_port=5000)
        register_rank(server.address, TOKEN, payload, attempts=3)
        fleet_child = FleetChild(server.address, setting.clients, seconds + 1.0)
        # CPU used while the fleet runs: the server's per request, and the fleet's own (it
        # shares the machine's cores with the server it measures).
        began = time.monotonic()
        server_cpu, fleet_cpu = server.cpu_seconds(), fleet_child.cpu_seconds()
        server.mark_measuring()
        keep_alive, fresh = measure(server.address, seconds, deadline)
        fleet_cpu = fleet_child.cpu_seconds() - fleet_cpu
        probes = fleet_child.wait()
        server_cpu = server.cpu_seconds() - server_cpu
        window = time.monotonic() - began
    finally:
        stats = server.stop()
    evicted = stats.get("evicted")
    peak = stats.get("peak")
    row = (
        f"{kind:<7}{keep_alive.cell()}  {fresh.cell()}  "
        f"{probes.get('connected', 0):>6,} {probes.get('answered', 0):>8,} "
        f"{probes.get('reconnects', 0):>6,} "
        f"{_count(evicted):>8} {_count(peak):>6} "
        f"{_count(stats.get('rss_mb')):>7} "
        f"{100 * server_cpu / window:>5.0f}% {100 * fleet_cpu / seconds:>5.0f}% "
        f"{_per_request_us(server_cpu, probes, keep_alive, fresh):>6}   {server.limits}"
    )
    if kind == "ours":
        for phase in ("ramp", "window"):
            row += f"\n       GC pauses, {phase:<6} (ms): " + ", ".join(
                f"gen {gen} {_count(stats.get(f'{phase}_gc{gen}_n'))} collections "
                f"total {_count(stats.get(f'{phase}_gc{gen}_total_ms'))} "
                f"longest {_ms(stats.get(f'{phase}_gc{gen}_max_ms'))}"
                for gen in range(3)
            )
    met = max(keep_alive.p99(), fresh.p99()) <= GOAL_P99_MS and not (
        keep_alive.failures or fresh.failures
    )
    return row, met


def _per_request_us(cpu: float, probes: dict[str, int], *legit: Timings) -> str:
    """The server's CPU microseconds per request it answered (fleet probes and legit queries)."""
    answered = probes.get("answered", 0) + sum(len(t.latencies_ms) for t in legit)
    return f"{1e6 * cpu / answered:,.0f}" if answered else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"  # "-": not counted, or not readable


HEADER = (
    f"{'server':<7}{'keep-alive p50':>14} {'p99':>8} {'fail':>9}  "
    f"{'new-conn p50':>12} {'p99':>8} {'fail':>9}  "
    f"{'fleet':>6} {'probes':>8} {'reconn':>6} {'evicted':>8} {'peak':>6} {'RSS MB':>7} "
    f"{'srvCPU':>6} {'fltCPU':>6} {'us/req':>6}   limits"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks bench_fleet")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument(
        "--clients", type=int, nargs="*", help="fleet sizes (default: 1,100 and 10,000)"
    )
    parser.add_argument("--smoke", action="store_true", help="60 clients against a cap of 36")
    parser.add_argument("--serve", choices=("ours", "sglang"), help=argparse.SUPPRESS)
    parser.add_argument("--soft", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hard", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fleet", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve:
        return serve(args.serve, args.soft, args.hard)
    if args.fleet:
        address, clients, seconds = args.fleet
        return fleet(address, int(clients), float(seconds))
    settings = SMOKE if args.smoke else SETTINGS
    if args.clients:
        settings = tuple(s for s in settings if s.clients in args.clients)
    seconds, deadline = (1.5, 1.0) if args.smoke else (args.seconds, 5.0)
    kinds = ["ours"]
    sys.path.insert(0, str(_REPO))
    reason = importlib.import_module("tests.support.sglang_support").sglang_unavailable()
    sys.path.remove(str(_REPO))
    if reason is None:
        kinds.append("sglang")
    else:
        print(f"SGLang's bootstrap server: skipped ({reason})")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(
        f"GET /route from a decode while a fleet probes GET /health once a second; "
        f"{seconds:g} s per run; ms; goal p99 <= {GOAL_P99_MS:g} ms, no failure; "
        f"machine's hard fd limit {hard:,}; nproc {os.cpu_count()}"
    )
    verdicts: list[str] = []
    for setting in settings:
        print(f"\n-- {setting.describe()}")
        if setting.clients + 64 > hard:
            print(
                f"skipped: the fleet needs {setting.clients + 64:,} fds, the hard limit is {hard:,}"
            )
            continue
        print(HEADER)
        for kind in kinds:
            row, met = run_one(kind, setting, seconds, deadline)
            print(row, flush=True)
            if kind == "ours":
                verdict = ("met" if met else "NOT met") if setting.judged else "not judged"
                verdicts.append(f"goal (ours), {setting.describe()}: {verdict}")
    if args.smoke:
        print("goal: not judged (--smoke)")
    else:
        print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
