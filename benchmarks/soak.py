"""Load and soak: 20,000 requests over about 60 s through two prefill restarts (ours).

Checks, each printed with its figure; exit status 1 if any fails:

* zero lost live generations (the audited pool);
* zero dead-instance entries in the pool after the failure that detected each restart;
* if the trace validator (``statemachine.model.validate``) is present, the NDJSON trace of the
  whole run passes it (``main([trace]) == 0``);
* no leak: threads, open file descriptors (``/proc/self/fd``) and TCP sockets to the bootstrap
  port are back to their levels before the run (after a short settle time);
* resources follow generations: at the end of the run (before shutdown) the transport holds
  no more ZMQ sockets than the live generation has ranks, and no request is in flight or
  expected by the ack listener after the loops stopped.

``python -m benchmarks.soak [--requests N] [--duration S] [--no-trace] [--smoke]``
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from statemachine.demo.modes import OURS
from statemachine.demo.report import build_report
from statemachine.demo.run import DemoConfig, run_demo
from statemachine.demo.sampling import socket_counts

SETTLE_S = 3.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(baseline_threads: int, baseline_fds: int) -> tuple[int, int]:
    """Thread and fd counts once daemon threads and closed sockets had time to go."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        gc.collect()
        threads, fds = threading.active_count(), _fds()
        if (threads <= baseline_threads and fds <= baseline_fds) or time.monotonic() > deadline:
            return threads, fds
        time.sleep(0.1)


def _validate(trace_path: Path) -> tuple[str, bool]:
    try:
        validator = importlib.import_module("statemachine.model.validate")
    except ImportError:
        return "trace validator not available yet: skipped", True
    validate_main = getattr(validator, "main", None)
    if validate_main is None:
        return "trace validator has no main(argv): skipped", True
    code = validate_main([str(trace_path)])
    return f"trace validator exit status {code}", code == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="60 requests over 3 s, one restart; every check but the throughput-bound count",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.requests, args.duration, args.restarts = 60, 3.0, 1

    print(
        f"soak: {args.requests} requests over {args.duration:g} s through {args.restarts} prefill "
        f"restarts (about {args.duration + 5:.0f} s; a summary and checks follow)...",
        flush=True,
    )
    gc.collect()
    threads_before, fds_before = threading.active_count(), _fds()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        trace_path = Path(tmp) / "soak-trace.ndjson"
        config = DemoConfig(
            mode=OURS,
            duration_s=args.duration,
            rate=args.requests / args.duration,
            restarts=args.restarts,
            max_requests=args.requests,
            catch_up=True,
            trace_path=None if args.no_trace else str(trace_path),
        )
        started = time.monotonic()
        result = run_demo(config)
        wall = time.monotonic() - started
        report = build_report(result)
        trace_note, trace_ok = ("tracing off", True) if args.no_trace else _validate(trace_path)
        trace_size = 0 if args.no_trace else trace_path.stat().st_size
    threads_after, fds_after = _settled(threads_before, fds_before)
    sockets = socket_counts(result.bootstrap_port)

    total = report["requests_ok"] + report["requests_failed"]
    checks = [
        # How many complete in the time depends on the machine: not judged in a smoke run.
        (
            f"requests completed: {total} of {args.requests}"
            + (" (not judged: --smoke)" if args.smoke else ""),
            args.smoke or total >= 0.95 * args.requests,
        ),
        (
            f"restarts done: {len(result.restarts)} of {args.restarts}",
            len(result.restarts) == args.restarts,
        ),
        (
            f"lost live generations: {report['lost_live_generations']}",
            report["lost_live_generations"] == 0,
        ),
        (
            f"stale entries after detection: {report['stale_entries_after_detection']}",
            report["stale_entries_after_detection"] == 0,
        ),
        (f"{trace_note} ({trace_size} bytes of trace)", trace_ok),
        (
            f"threads before/after: {threads_before}/{threads_after}",
            threads_after <= threads_before,
        ),
        (f"open fds before/after: {fds_before}/{fds_after}", fds_after <= fds_before),
        (
            f"ZMQ sockets open at the end: {result.transport.sockets_open} "
            f"(live generation: {config.tp_size * config.pp_size} ranks)",
            result.transport.sockets_open <= config.tp_size * config.pp_size,
        ),
        (
            f"rooms still expected after the loops stopped: {result.manager.in_flight}",
            result.manager.in_flight == 0,
        ),
        (
            f"connections to the bootstrap port left open: {sockets.established}",
            sockets.established == 0,
        ),
    ]
    print(
        f"soak: {total} requests in {wall:.1f} s wall ({report['requests_per_s']} req/s), "
        f"{report['requests_failed']} failed "
        f"({report['failures_by_error']}), restarts at "
        f"{[r['killed_at_s'] for r in report['restarts']]} s, first success after each: "
        f"{[r['restart_to_first_success_s'] for r in report['restarts']]} s"
    )
    print(
        f"pool: {report['cache_hits']} hits, {report['cache_misses']} misses, "
        f"{report['refetches']} refetches, {report['invalidations']} invalidations, "
        f"{report['instance_retirements']} instance retirements; bootstrap p50/p99 "
        f"{report['bootstrap_latency_p50_ms']}/{report['bootstrap_latency_p99_ms']} ms; "
        f"TIME-WAIT peak {report['time_wait_sockets']}, connections peak "
        f"{report['peak_connections']}"
    )
    failed = False
    for text, ok in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {text}")
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
