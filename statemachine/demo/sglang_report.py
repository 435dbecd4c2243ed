"""What ``pd-bootstrap demo --prefill sglang`` writes besides its tables: the peers' logging,
moved off the terminal into one file, and the JSON report of its runs.

The harness's objects (``tests/real_prefill/restart.py``'s ``DecodeReport`` and ``Failure``)
come in as they are: this module reads their fields and never imports the harness, which
lives in a source checkout's ``tests/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


@contextlib.contextmanager
def peer_output_to(path: Path, *, restore: bool = True) -> Iterator[TextIO]:
    """Send this process's stdout and stderr (file descriptors 1 and 2: the engines' C++
    logging writes there as well as Python's) to ``path``, appended; yield a stream on the
    terminal's stdout for the demo's own lines. An error ending the block restores both, so it
    shows on the terminal; so does a normal end unless ``restore`` is False: the engines' threads
    go on logging until the process exits (Mooncake's segment teardown), and with ``restore``
    False that too stays in the file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    own = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8")
    ended_well = False
    try:
        for fd in saved:
            os.dup2(log, fd)
        yield own
        ended_well = True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if restore or not ended_well:
            for fd, original in saved.items():
                os.dup2(original, fd)
        for original in saved.values():
            os.close(original)
        os.close(log)
        own.close()


def append_rank_logs(peer_log: Path, log_dir: Path, run: str) -> None:
    """Append the prefill rank processes' logs of one run to the peer log, each under a header."""
    with peer_log.open("a", encoding="utf-8") as out:
        for path in sorted(log_dir.rglob("*.log")):
            out.write(f"\n===== {run}: prefill {path.relative_to(log_dir)} =====\n")
            out.write(path.read_text(encoding="utf-8", errors="replace"))


def load_average() -> list[float]:
    return [round(load, 2) for load in os.getloadavg()]


def run_report(
    restart: Any,
    backend: str,
    kind: str,
    reports: list[Any],
    timeline: dict[str, float],
    loads: tuple[list[float], list[float]],
    table: str,
) -> dict[str, Any]:
    """One run's entry in the JSON report: per decode the table's rows, its failures by window
    and error type and by whose they were, and every failure (``restart.Failure``)."""
    windows = (
        restart.BEFORE_KILL,
        restart.IN_FLIGHT_AT_KILL,
        restart.ISSUED_WHILE_DOWN,
        restart.ISSUED_AFTER_READY,
    )
    decodes: dict[str, Any] = {}
    for report in reports:
        whose: dict[str, int] = {}
        for failure in report.failures:
            whose[failure.whose] = whose.get(failure.whose, 0) + 1
        decodes[report.name] = {
            **{name: getattr(report, name) for _, name in restart.ROWS},
            "failures_by_type": {w: report.failures_by_type(w) for w in windows},
            "failures_by_whose": whose,
            "hung_issued_from_kill_s": report.hung_issued_from_kill,
            "failures": [dataclasses.asdict(f) for f in report.failures],
        }
    return {
        "engine": backend,
        "replacement": kind,
        "kill_s": round(timeline["kill"], 3),
        "ready_s": round(timeline["ready"], 3),
        "down_s": round(timeline["ready"] - timeline["kill"], 3),
        "load_average_before": loads[0],
        "load_average_after": loads[1],
        "decodes": decodes,
        "table": table.strip("\n").splitlines(),
    }
