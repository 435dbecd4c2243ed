"""``pd-bootstrap demo --prefill sglang`` (``make demo-sglang``) as its user meets it: the demo's
own lines on the terminal, the peers' logging in the file it names, failures by type per row of
its table, and a JSON report giving every failure its times and whose it was.

The restart itself (the harness, ``tests/real_prefill/restart.py``) is
``tests/sglang/test_real_restart.py``'s; here the command runs end to end once, shortened (one
engine,
a warm replacement), and the pieces it is built of are checked on their own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from statemachine.demo import sglang_report
from statemachine.demo.cli import parse_args
from statemachine.errors import RankDead, WaitingTimeout
from tests.real_prefill.engines import engine_unavailable
from tests.real_prefill.prefill_process import RoomReport
from tests.real_prefill.restart import (
    BEFORE_KILL,
    IN_FLIGHT_AT_KILL,
    ISSUED_AFTER_READY,
    ISSUED_WHILE_DOWN,
    KILLED_PREFILL,
    PREFILL_LATE,
    DecodeReport,
    Request,
    describe_failure,
    table,
)
from tests.support.sglang_support import requires_sglang

ROOT = Path(__file__).resolve().parents[2]
#: A line of Mooncake's C++ logging (glog) or NIXL's Python logging: never on the terminal.
PEER_LINE = re.compile(r"^([IWE]\d{4} \d\d:\d\d|.* NIXL INFO )")


class Handle:
    def __init__(self, failure: Exception | str) -> None:
        self.failure = failure


def failed(room: int, failure: Exception | str, issued_at: float, failed_at: float, window: str
           ) -> Request:  # fmt: skip
    request = Request(room, [0], 0, Handle(failure), issued_at)
    request.sent_at, request.failed_at, request.window = issued_at, failed_at, window
    return request


def sample_reports() -> tuple[list[DecodeReport], dict[str, float]]:
    """Two decodes' reports as a run would leave them: kill at 10 s, READY at 12 s."""
    timeline = {"kill": 10.0, "ready": 12.0}
    library, sglang = DecodeReport("library"), DecodeReport("sglang")
    dead = RankDead("prefill rank tcp://127.0.0.1:1 is dead", endpoint="127.0.0.1:1")
    late = WaitingTimeout("room 3: no transfer within 2.5 s")
    cases = [
        (library, failed(1, dead, 9.9, 10.01, IN_FLIGHT_AT_KILL), RoomReport()),
        (library, failed(2, late, 10.5, 13.0, ISSUED_WHILE_DOWN), RoomReport()),
        # answered 0.4 s after the library's 2.5 s deadline: the prefill's
        (library, failed(3, late, 12.5, 15.1, ISSUED_AFTER_READY),
         RoomReport(metadata_at=12.51, concluded_at=15.4)),
        # its metadata never reached the replacement: the library's own
        (library, failed(4, late, 12.6, 15.2, ISSUED_AFTER_READY), RoomReport()),
        (sglang, failed(5, "KVTransferError(bootstrap_room=5): Lost connection with prefill "
                        "instance (bootstrap_addr: 127.0.0.1:2)", 8.0, 9.0, BEFORE_KILL),
         RoomReport(metadata_at=8.1, concluded_at=8.5)),
    ]  # fmt: skip
    for report, request, room in cases:
        timeout = 2.5 if report is library else None
        report.failures.append(describe_failure(report.name, request, room, timeline, timeout))
        report.failed += 1
    library.failed_in_flight_at_kill, library.failed_while_down = 1, 1
    library.failed_after_ready, library.failed_after_ready_prefill_late = 2, 1
    sglang.failed_before_kill = 1
    return [library, sglang], timeline


def test_every_failure_has_its_type_its_times_and_whose_it_was() -> None:
    (library, sglang), _ = sample_reports()
    assert [(f.window, f.error, f.whose) for f in library.failures] == [
        (IN_FLIGHT_AT_KILL, "RankDead", KILLED_PREFILL),
        (ISSUED_WHILE_DOWN, "WaitingTimeout", KILLED_PREFILL),
        (ISSUED_AFTER_READY, "WaitingTimeout", PREFILL_LATE),
        (ISSUED_AFTER_READY, "WaitingTimeout", "library"),
    ]
    third = library.failures[2]
    assert (third.issued_from_kill, third.failed_from_kill) == (2.5, 5.1)
    assert (third.issued_from_ready, third.failed_from_ready) == (0.5, 3.1)
    assert (third.metadata_from_failure, third.concluded_from_failure) == (-2.59, 0.3)
    (theirs,) = sglang.failures
    # SGLang's decode reports a message: its type is the message without room and address.
    assert theirs.error == "KVTransferError: Lost connection with prefill instance"
    # Against a live prefill that answered in time: SGLang's decode's own.
    assert (theirs.window, theirs.whose) == (BEFORE_KILL, "sglang")


def test_the_table_shows_failures_by_type_under_each_row() -> None:
    reports, _ = sample_reports()
    lines = table("title", reports).splitlines()
    rows = [line.split() for line in lines]
    start = lines.index(next(line for line in lines if line.startswith("  issued after READY")))
    assert rows[start][-2:] == ["2", "0"]
    assert rows[start + 1] == ["-", "WaitingTimeout", "2", "0"]
    assert rows[start + 2][-2:] == ["1", "0"] and "prefill answered late" in lines[start + 2]
    assert rows[start + 3][-2:] == ["1", "0"] and "the decode's own" in lines[start + 3]
    before = lines.index(next(line for line in lines if line.startswith("  before the kill")))
    assert lines[before + 1].split()[-2:] == ["0", "1"]
    assert "KVTransferError: Lost connection" in lines[before + 1]


def test_the_json_report_holds_the_table_and_every_failure(tmp_path: Path) -> None:
    reports, timeline = sample_reports()
    restart = sys.modules["tests.real_prefill.restart"]
    entry = sglang_report.run_report(
        restart, "mooncake", "cold", reports, timeline, ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]),
        table("title", reports),
    )  # fmt: skip
    path = tmp_path / "report.json"
    path.write_text(json.dumps(entry))  # JSON as written, nothing else
    back: dict[str, Any] = json.loads(path.read_text())
    assert (back["engine"], back["replacement"], back["down_s"]) == ("mooncake", "cold", 2.0)
    library = back["decodes"]["library"]
    assert library["failed"] == len(library["failures"]) == 4
    assert library["failures_by_whose"] == {KILLED_PREFILL: 2, PREFILL_LATE: 1, "library": 1}
    assert library["failures_by_type"][ISSUED_AFTER_READY] == {"WaitingTimeout": 2}
    assert library["failures"][3]["message"].startswith("room 3")
    assert back["table"][0] == "title"


def test_peer_logging_goes_to_the_log_file_and_the_demos_lines_to_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """At the file-descriptor level, where C++ logging writes (Python's logging writes to
    ``sys.stderr``, descriptor 2 in the demo's process: the end-to-end run below shows it)."""
    log = tmp_path / "peers.log"
    with sglang_report.peer_output_to(log) as out:
        os.write(1, b"I1207 18:35:03.754 engine on stdout\n")  # as C++ writes, below Python
        os.write(2, b"E1207 18:35:03.755 engine on stderr\n")
        print("the demo's line", file=out)
    print("after the demo")
    captured = capfd.readouterr()
    assert captured.out == "the demo's line\nafter the demo\n"
    assert captured.err == ""
    assert log.read_text().splitlines() == [
        "I1207 18:35:03.754 engine on stdout",
        "E1207 18:35:03.755 engine on stderr",
    ]


def test_the_sglang_demos_files_have_their_own_defaults() -> None:
    args = parse_args(["--prefill", "sglang"])
    assert (args.report, args.peer_log) == ("demo-sglang-report.json", "demo-sglang.log")
    assert parse_args([]).report == "demo-report.json"


@requires_sglang
@pytest.mark.slow
def test_demo_sglang_runs_end_to_end_with_a_quiet_terminal(tmp_path: Path) -> None:
    """The documented command, shortened to one engine and a warm replacement."""
    if engine_unavailable("mooncake") is not None:
        pytest.skip(engine_unavailable("mooncake"))
    report, log = tmp_path / "report.json", tmp_path / "peers.log"
    run = subprocess.run(
        [sys.executable, "-m", "statemachine", "demo", "--prefill", "sglang",
         "--engine", "mooncake", "--replacement", "warm", "--kill-at", "1", "--after-ready", "1",
         "--report", str(report), "--peer-log", str(log)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    noise = [line for line in (run.stdout + run.stderr).splitlines() if PEER_LINE.match(line)]
    assert noise == []
    assert "mooncake, warm replacement (READY" in run.stdout
    assert f"report: {report}" in run.stdout and f"peer logs: {log}" in run.stdout
    peers = log.read_text()
    assert "===== mooncake, warm: prefill killed/rank0-start1.log =====" in peers
    assert "transfer_engine" in peers  # Mooncake's own logging, from this process and the ranks
    (entry,) = json.loads(report.read_text())["runs"]
    for name, decode in entry["decodes"].items():
        assert decode["failed"] == len(decode["failures"]), name
        for failure in decode["failures"]:
            assert failure["whose"] in (KILLED_PREFILL, PREFILL_LATE, name), failure
            assert failure["failed_from_kill"] is not None and failure["error"], failure
    assert "\n".join(entry["table"]) in run.stdout
