"""Rank queries: a fresh connection per query (SGLang before the fix) vs the pooled client.

One run = ``--queries`` ``GET /route`` rank queries from ``--threads`` threads against a real
``BootstrapServer`` in its own process on 127.0.0.1 (a separate process, so the server does not
compete with the client threads for this interpreter's GIL). Each run gets a fresh server on a
fresh port, so TIME-WAIT sockets towards that port belong to that run alone.

Modes:
  fresh  ``requests.get(url, timeout=5)`` per query, then ``.json()`` (the baseline)
  ours   ``BootstrapClient.get_rank`` (keep-alive session per thread, validated reply)

Reported per mode, as medians over ``--repeats`` runs: median and p99 latency, queries/s,
TIME-WAIT sockets towards the server port that the run left (counted after the run minus
before it), and the kernel's ``TWRecycled``
delta. Goals (spec/protocol.md, HTTP-30): ours leaves <= 10 TIME-WAIT sockets and its median
latency is <= 0.7x fresh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import requests

from statemachine.decode.client import BootstrapClient
from statemachine.demo.sampling import socket_counts
from statemachine.prefill.registration import register_rank
from statemachine.wire.http import route_payload

TP_SIZE = 4


@dataclass
class RunResult:
    median_ms: float
    p99_ms: float
    qps: float
    time_wait: int
    tw_recycled: int
    failures: int


class ServerProcess:
    """``python -m statemachine serve --port 0 --insecure`` in a child process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "statemachine", "serve", "--port", "0", "--insecure"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "listening on HOST:PORT instance ID"
        if not line.startswith("listening on "):
            self.close()
            raise RuntimeError(f"server did not start: {line!r}")
        self.address = line.split()[2]
        self.port = int(self.address.rsplit(":", 1)[1])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def time_wait_towards(port: int) -> int:
    """TIME-WAIT sockets with the server's ``port`` at either end, from /proc/net/tcp{,6}."""
    return socket_counts(port).time_wait


def tw_recycled() -> int:
    """``TcpExt: TWRecycled`` from /proc/net/netstat (0 when unavailable)."""
    try:
        with open("/proc/net/netstat") as netstat:
            lines = netstat.read().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(table.get("TWRecycled", 0))
    return 0


def run_once(mode: str, queries: int, threads: int) -> RunResult:
    server = ServerProcess()
    try:
        for tp in range(TP_SIZE):
            register_rank(server.address, None, _payload(tp, 20000 + tp), backoff_scale=0.01)
        per_thread = queries // threads
        latencies: list[list[float]] = [[] for _ in range(threads)]
        failures = [0] * threads
        client = BootstrapClient()
        base = f"http://{server.address}/route?prefill_dp_rank=0&prefill_cp_rank=0"

        def fresh(tp: int) -> None:
            reply = requests.get(f"{base}&target_tp_rank={tp}&target_pp_rank=0", timeout=5)
            reply.raise_for_status()
            reply.json()

        def ours(tp: int) -> None:
            client.get_rank(server.address, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0)

        query: Callable[[int], None] = fresh if mode == "fresh" else ours
        barrier = threading.Barrier(threads + 1)

        def worker(index: int) -> None:
            timings = latencies[index]
            clock = time.perf_counter
            barrier.wait()
            for i in range(per_thread):
                start = clock()
                try:
                    query(i % TP_SIZE)
                except Exception:
                    failures[index] += 1
                timings.append(clock() - start)
            client.close()  # release this thread's session (a no-op in fresh mode)

        # Registration's own short sessions may have left a few; count only the run's.
        before_time_wait = time_wait_towards(server.port)
        before_recycled = tw_recycled()
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for thread in workers:
            thread.start()
        barrier.wait()
        started = time.perf_counter()
        for thread in workers:
            thread.join()
        elapsed = time.perf_counter() - started
        samples = sorted(t for timings in latencies for t in timings)
        return RunResult(
            median_ms=statistics.median(samples) * 1e3,
            p99_ms=samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3,
            qps=len(samples) / elapsed,
            time_wait=time_wait_towards(server.port) - before_time_wait,
            tw_recycled=tw_recycled() - before_recycled,
            failures=sum(failures),
        )
    finally:
        server.close()


def _payload(tp: int, port: int) -> dict[str, object]:
    return route_payload(
        rank_ip="127.0.0.1", rank_port=port, tp_rank=tp, tp_size=TP_SIZE, page_size=16
    )


def _median(results: list[RunResult], attr: str) -> float:
    return float(statistics.median(getattr(r, attr) for r in results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_http", description=__doc__)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one run of 200 queries per mode")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.queries, args.threads, args.repeats = 200, 2, 1
    results: dict[str, list[RunResult]] = {"fresh": [], "ours": []}
    for repeat in range(args.repeats):
        for mode in ("fresh", "ours"):  # interleaved, so drift hits both modes alike
            result = run_once(mode, args.queries, args.threads)
            results[mode].append(result)
            print(
                f"  run {repeat + 1} {mode:<5}: median {result.median_ms:.3f} ms, "
                f"p99 {result.p99_ms:.3f} ms, {result.qps:,.0f} q/s, "
                f"TIME-WAIT {result.time_wait}, TWRecycled +{result.tw_recycled}, "
                f"failures {result.failures}",
                flush=True,
            )
    print(
        f"\n{args.queries} GET /route from {args.threads} threads, medians of {args.repeats} runs:"
    )
    header = ("mode", "median ms", "p99 ms", "q/s", "TIME-WAIT", "TWRecycled")
    print("{:<6} {:>10} {:>9} {:>9} {:>10} {:>11}".format(*header))
    for mode, runs in results.items():
        print(
            f"{mode:<6} {_median(runs, 'median_ms'):>10.3f} {_median(runs, 'p99_ms'):>9.3f} "
            f"{_median(runs, 'qps'):>9,.0f} {_median(runs, 'time_wait'):>10.0f} "
            f"{_median(runs, 'tw_recycled'):>11.0f}"
        )
    ratio = _median(results["ours"], "median_ms") / _median(results["fresh"], "median_ms")
    ours_tw = max(r.time_wait for r in results["ours"])
    print(f"median latency ratio ours/fresh: {ratio:.2f} (goal <= 0.70)")
    print(f"TIME-WAIT left by ours, worst run: {ours_tw} (goal <= 10)")
    verdict = "met" if ratio <= 0.7 and ours_tw <= 10 else "NOT met"
    if args.smoke:
        verdict = "not judged (--smoke)"
    print(f"goals {verdict}")
    failed = sum(r.failures for runs in results.values() for r in runs)
    if failed:
        print(f"{failed} queries failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
