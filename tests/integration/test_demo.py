"""End-to-end: the demo in each mode, as a subprocess with real server and rank processes.

Checks the report's keys and the relations each mode must show, and that no prefill process
survives the demo - neither a normal exit nor a Ctrl-C (SIGINT) midway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REQUIRED_KEYS = {
    "requests_ok",
    "requests_failed",
    "failed_by_restart",
    "restart_to_first_success_s",
    "cache_hits",
    "cache_misses",
    "refetches",
    "invalidations",
    "stale_entries_after_detection",
    "lost_live_generations",
    "bootstrap_latency_p50_ms",
    "bootstrap_latency_p99_ms",
    "time_wait_sockets",
    "peak_connections",
    "config",
}
# Short runs: restart at 3 s leaves 3 s after it, more than the 2 s waiting timeout.
SHORT = ["--duration", "6", "--loops", "4", "--rate", "200", "--quiet"]
RUN_TIMEOUT_S = 60


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run_demo(tmp_path: Path, *flags: str) -> dict[str, Any]:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "statemachine", "demo", *SHORT, *flags, "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "requests ok" in proc.stdout  # the table
    data: dict[str, Any] = json.loads(report.read_text())
    assert data.keys() >= REQUIRED_KEYS
    pids = data["prefill_pids"]
    assert len(pids) >= 6  # server + 2 ranks, and their replacements
    assert not [pid for pid in pids if _alive(pid)]
    return data


def test_ours_recovers_without_losing_live_generations(tmp_path: Path) -> None:
    data = _run_demo(tmp_path)
    assert data["mode"] == "ours"
    assert data["config"]["tp_size"] == 2
    (restart,) = data["restarts"]
    assert restart["new_instance"] != restart["old_instance"]
    # Requests succeed after the restart, on the new instance.
    assert data["restart_to_first_success_s"] is not None
    assert data["lost_live_generations"] == 0
    assert data["stale_entries_after_detection"] == 0
    assert data["failed_after_ready"] == 0
    assert data["requests_ok"] > data["requests_failed"]
    assert data["cache_hits"] > data["cache_misses"] > 0
    assert data["refetches"] >= 1
    assert data["invalidations"] + data["instance_retirements"] >= 1
    assert data["bootstrap_latency_p50_ms"] <= data["bootstrap_latency_p99_ms"]
    # One pooled HTTP connection per loop thread plus the heartbeat's, not one per request.
    assert 0 < data["peak_connections"] <= data["config"]["request_loops"] + 1


def test_sglang_anchor_recovers_through_waiting_timeout(tmp_path: Path) -> None:
    # Recovery waits out the 2 s waiting timeout: 8 s leave it margin on a loaded machine.
    data = _run_demo(tmp_path, "--zmq-mode=queueing", "--duration", "8")
    assert data["mode"] == "sglang"
    assert data["config"]["instance_id"] is False
    assert data["restart_to_first_success_s"] is not None
    assert data["lost_live_generations"] == 0
    # Queued sends never fail: the dead prefill is noticed by the waiting timeout only.
    assert set(data["failures_by_error"]) == {"WaitingTimeout"}


def test_no_invalidation_keeps_failing_after_restart(tmp_path: Path) -> None:
    data = _run_demo(tmp_path, "--no-invalidation")
    assert data["mode"] == "before-36029"
    assert data["restart_to_first_success_s"] is None  # no request succeeded after it
    assert data["failed_by_restart"] > 0
    assert data["stale_entries_after_detection"] >= 1
    assert data["invalidations"] == 0
    assert data["refetches"] == 0


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry))
    return found


def test_sigint_midway_leaves_no_child_process(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "statemachine",
            "demo",
            "--duration",
            "30",
            "--loops",
            "2",
            "--report",
            str(tmp_path / "r.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        # Status lines start once the prefill is up and the loops run.
        line = proc.stderr.readline()
        assert "ok=" in line
        children = _children(proc.pid)
        assert len(children) >= 3  # server and ranks (and warm spares)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 5
    while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if _alive(pid)]
    assert not (tmp_path / "r.json").exists()


def test_bad_flags_are_rejected_before_anything_starts() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "statemachine", "demo", "--loops", "0"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 2
    assert "--loops" in proc.stderr


@pytest.mark.parametrize("flags", [["--compare"], ["--instance-id"]])
def test_conflicting_modes_are_rejected(flags: list[str], tmp_path: Path) -> None:
    # Instance-id retirement is itself an invalidation; --compare sets the modes itself.
    report = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "statemachine",
            "demo",
            "--no-invalidation",
            *flags,
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode != 0
    assert not report.exists()
