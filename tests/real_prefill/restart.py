"""A prefill SIGKILLed under load and replaced behind the same bootstrap port, with this
library's decode and SGLang's own decode side by side in one run.

Each decode is driven by its own scheduler loop (a thread): a new request every ``interval_s``
from the start until ``after_ready_s`` after the replacement is READY,
every request in flight polled each iteration, every Success checked byte for byte. Both send to
the same SGLang prefill. At ``kill_at_s`` every prefill rank is SIGKILLed; the replacement is
either warm (imported beforehand, started at the kill: ready at once) or cold (started after
the kill). :func:`run_restart` returns one :class:`DecodeReport` per decode, each failure in it
a :class:`Failure` saying when it was issued and ended (from the kill and from READY), its
error type and whose it was (:func:`whose`).
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.real_prefill.harness import Layout, LibraryDecode, RealPrefill
from tests.real_prefill.pattern import Geometry
from tests.real_prefill.prefill_process import RoomReport

PAGES = 4
#: Room numbers: the two decodes never share one.
LIBRARY_ROOMS, SGLANG_ROOMS = 1 << 40, 2 << 40
RESTART_GEOMETRY = Geometry(slots=1024, aux_slots=256)


#: The windows a failure falls in, by when its request was issued and ended (the table's rows).
BEFORE_KILL, IN_FLIGHT_AT_KILL, ISSUED_WHILE_DOWN, ISSUED_AFTER_READY = (
    "failed before the kill",
    "in flight at the kill",
    "issued while down",
    "issued after READY",
)
#: Whose a failure was (:func:`whose`): the kill's (its request met the dead prefill), the
#: replacement's (it had the request and answered after the decode gave up), or the decode's own.
KILLED_PREFILL, PREFILL_LATE = "killed prefill", "prefill answered late"


@dataclass
class Failure:
    """One failed request, as the JSON report of ``make demo-sglang`` lists it. Times are
    seconds from the kill and from the replacement's READY (negative: before it); the
    replacement's times of the room are from the decode's failure (None: it never reported
    them)."""

    room: int
    window: str
    error: str
    message: str
    whose: str
    issued_from_kill: float
    failed_from_kill: float
    issued_from_ready: float | None
    failed_from_ready: float | None
    #: the replacement's view of the room: its metadata arrived / it sent / it concluded, each
    #: in seconds from the decode's failure, and its verdict ("Success", "Failed", None)
    metadata_from_failure: float | None = None
    sent_from_failure: float | None = None
    concluded_from_failure: float | None = None
    prefill_status: str | None = None


@dataclass
class DecodeReport:
    """What one decode saw (times in seconds; None: never)."""

    name: str
    issued: int = 0
    verified: int = 0
    failed: int = 0
    #: against the first prefill, alive: no restart was involved
    failed_before_kill: int = 0
    failed_in_flight_at_kill: int = 0
    failed_while_down: int = 0
    failed_after_ready: int = 0
    #: of those, the replacement's doing: it got the request's metadata and had not answered
    #: when the decode gave up (a transfer slower than the decode's waiting timeout: load on
    #: the prefill, not a request the decode lost; :func:`prefill_was_late`)
    failed_after_ready_prefill_late: int = 0
    hung: int = 0
    wrong_pages: int = 0
    #: Successes whose bytes were wrong when polled and right 200 ms later
    late_bytes: int = 0
    kill_to_first_success: float | None = None
    ready_to_first_success: float | None = None
    stale_pool_entries: int = 0
    kv_held_pages: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)
    #: per failure after READY: seconds from READY to its issue, and its error (cut at 160)
    failed_after_ready_detail: list[tuple[float, str]] = field(default_factory=list)
    #: when each hung request was issued, in seconds from the kill (negative: before it)
    hung_issued_from_kill: list[float] = field(default_factory=list)
    #: per hung request: its poll() state and the prefill's verdict on its room (None: none)
    hung_detail: list[tuple[float, int, str | None]] = field(default_factory=list)
    wrong_issued_from_kill: list[float] = field(default_factory=list)
    #: every failure, in the order they ended (filled in at the end of the run)
    failures: list[Failure] = field(default_factory=list)

    @property
    def failed_after_ready_own(self) -> int:
        """Failures after READY the prefill did not cause: the decode's own."""
        return self.failed_after_ready - self.failed_after_ready_prefill_late

    def failures_by_type(self, window: str) -> dict[str, int]:
        """How many of the failures in ``window`` had each error type."""
        counts: dict[str, int] = {}
        for failure in self.failures:
            if failure.window == window:
                counts[failure.error] = counts.get(failure.error, 0) + 1
        return counts


class Request:
    __slots__ = ("aux", "dst", "failed_at", "handle", "issued_at", "room", "sent_at", "window")

    def __init__(self, room: int, dst: list[int], aux: int, handle: Any, issued_at: float):
        self.room, self.dst, self.aux, self.handle, self.issued_at = (
            room,
            dst,
            aux,
            handle,
            issued_at,
        )
        self.failed_at: float | None = None
        self.window: str | None = None
        #: when the decode's request() returned: its metadata was sent by then, so its waiting
        #: timeout runs out no later than this plus the timeout
        self.sent_at: float | None = None


class Driver(threading.Thread):
    """One decode's scheduler loop."""

    def __init__(self, name: str, decode: Any, prefill: RealPrefill, rooms: int,
                 interval_s: float, timeline: dict[str, float]) -> None:  # fmt: skip
        super().__init__(name=f"driver-{name}", daemon=True)
        self.decode, self.prefill, self.interval_s = decode, prefill, interval_s
        self.timeline = timeline
        self.rooms = itertools.count(rooms)
        self.report = DecodeReport(name)
        self.in_flight: list[Request] = []
        self.failed: list[Request] = []
        self.failed_after_ready: list[Request] = []
        self.issuing = threading.Event()
        self.issuing.set()
        self.stopping = threading.Event()
        self.done = decode.kv_poll_done if hasattr(decode, "kv_poll_done") else None

    def issue(self, now: float) -> None:
        slots = RESTART_GEOMETRY.slots
        room = next(self.rooms)
        n = room % (slots // PAGES)
        dst = [(slots - 1 - (n * PAGES + i) * 5) % slots for i in range(PAGES)]
        aux = room % RESTART_GEOMETRY.aux_slots
        self.prefill.transfer(room, PAGES)  # the prefill allocates its own pages
        handle = self.decode.request(self.prefill.address, room, dst, aux)
        request = Request(room, dst, aux, handle, now)
        request.sent_at = time.monotonic()
        self.in_flight.append(request)
        self.report.issued += 1

    def settle(self, request: Request, success: bool, now: float) -> None:
        report, timeline = self.report, self.timeline
        if success:
            wrong = self.decode.wrong_pages(request.room, request.dst, request.aux)
            if wrong:
                time.sleep(0.2)  # bytes still landing after the Success (reported apart)?
                if not self.decode.wrong_pages(request.room, request.dst, request.aux):
                    report.late_bytes += 1
                    wrong = []
            report.wrong_pages += len(wrong)
            if wrong:
                kill = self.timeline.get("kill")
                report.wrong_issued_from_kill.append(
                    round(request.issued_at - kill, 3) if kill is not None else float("-inf")
                )
                return
            report.verified += 1
            kill, ready = timeline.get("kill"), timeline.get("ready")
            if (
                kill is not None
                and request.issued_at >= kill
                and report.kill_to_first_success is None
            ):
                report.kill_to_first_success = now - kill
            if (
                ready is not None
                and request.issued_at >= ready
                and report.ready_to_first_success is None
            ):
                report.ready_to_first_success = now - ready
            return
        report.failed += 1
        kind = failure_kind(request.handle)
        report.failure_kinds[kind] = report.failure_kinds.get(kind, 0) + 1
        kill, ready = timeline.get("kill"), timeline.get("ready")
        request.failed_at = now
        self.failed.append(request)
        if ready is not None and request.issued_at >= ready:
            report.failed_after_ready += 1
            request.window = ISSUED_AFTER_READY
            failure = str(getattr(request.handle, "failure", None))[:160]
            report.failed_after_ready_detail.append((round(request.issued_at - ready, 3), failure))
            self.failed_after_ready.append(request)
        elif kill is not None and request.issued_at >= kill:
            report.failed_while_down += 1
            request.window = ISSUED_WHILE_DOWN
        elif kill is not None:
            report.failed_in_flight_at_kill += 1
            request.window = IN_FLIGHT_AT_KILL
        else:
            report.failed_before_kill += 1
            request.window = BEFORE_KILL

    def run(self) -> None:
        next_issue = time.monotonic()
        while not self.stopping.is_set():
            now = time.monotonic()
            if self.issuing.is_set() and now >= next_issue:
                self.issue(now)
                next_issue += self.interval_s
            for request in list(self.in_flight):
                state = int(request.handle.poll())
                if state in (SUCCESS, FAILED):
                    self.in_flight.remove(request)
                    self.settle(request, state == SUCCESS, time.monotonic())
            time.sleep(0.001)


SUCCESS, FAILED = 4, 0  # KVPoll values, the same in SGLang and this library


#: How long before a decode gave up the prefill's answer may have left and still count as not
#: arrived: its status message crosses loopback and the decode's listener thread in about a
#: millisecond, tens of them on this loaded 2-core machine. An answer sent earlier than this
#: was lost or ignored by the decode.
ANSWER_IN_TRANSIT_S = 0.05


def prefill_was_late(
    request: Request, report: RoomReport, waiting_timeout_s: float | None = None
) -> bool:
    """Whether a request failed because the prefill was slow, from the prefill's ``report`` of
    its room: the decode's metadata reached the prefill's rank (so it addressed the live
    incarnation, not a dead rank's port), and the rank had not answered by the time the decode
    gave up (it answered later, or not within the run). For a ``WaitingTimeout`` the decode
    gave up when its waiting timeout ran out (``waiting_timeout_s`` after it sent the
    metadata), however late its poll noticed: an answer after that deadline is late even if
    it came before the decode's poll. False is the decode's doing: metadata that never reached
    the prefill, or an answer the decode had in time and missed."""
    if request.failed_at is None or report.metadata_at is None:
        return False
    gave_up = request.failed_at
    if (
        waiting_timeout_s is not None
        and request.sent_at is not None
        and failure_kind(request.handle) == "WaitingTimeout"
    ):
        gave_up = min(gave_up, request.sent_at + waiting_timeout_s)
    concluded_at = report.concluded_at
    return concluded_at is None or concluded_at > gave_up - ANSWER_IN_TRANSIT_S


def whose(decode: str, window: str, late: bool) -> str:
    """Whose a failure was: the killed prefill's for a request in flight at the kill or issued
    while it was down (it met the dead prefill, or reached no live one); against a live prefill
    (before the kill, after READY) the prefill's when it answered late
    (:func:`prefill_was_late`), else the decode's own (``decode``: "library" or "sglang")."""
    if window in (IN_FLIGHT_AT_KILL, ISSUED_WHILE_DOWN):
        return KILLED_PREFILL
    return PREFILL_LATE if late else decode


def describe_failure(
    decode: str,
    request: Request,
    report: RoomReport,
    timeline: dict[str, float],
    waiting_timeout_s: float | None,
) -> Failure:
    """A failed request as the JSON report lists it (``timeline``: monotonic kill and READY;
    ``waiting_timeout_s``: the decode's, None where it is not the run's to know)."""
    assert request.failed_at is not None and request.window is not None
    kill, ready = timeline["kill"], timeline.get("ready")
    late = prefill_was_late(request, report, waiting_timeout_s)

    def since(moment: float | None, origin: float | None) -> float | None:
        return None if moment is None or origin is None else round(moment - origin, 3)

    failure = getattr(request.handle, "failure", None)
    return Failure(
        room=request.room,
        window=request.window,
        error=failure_kind(request.handle),
        message=str(failure)[:300],
        whose=whose(decode, request.window, late),
        issued_from_kill=round(request.issued_at - kill, 3),
        failed_from_kill=round(request.failed_at - kill, 3),
        issued_from_ready=since(request.issued_at, ready),
        failed_from_ready=since(request.failed_at, ready),
        metadata_from_failure=since(report.metadata_at, request.failed_at),
        sent_from_failure=since(report.sent_at, request.failed_at),
        concluded_from_failure=since(report.concluded_at, request.failed_at),
        prefill_status=report.status,
    )


def failure_kind(handle: Any) -> str:
    """The library's error type; for SGLang's decode (a message), the message without its room
    and addresses ("KVTransferError: Lost connection with prefill instance")."""
    failure = getattr(handle, "failure", None)
    if failure is None:
        return "unknown"
    if isinstance(failure, str):
        text = re.sub(r"\(bootstrap_room=\d+\)", "", failure)
        text = re.sub(r"\s*\(bootstrap_addr: [^)]*\)", "", text)
        text = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+", "<address>", text)
        return " ".join(text.split())[:60]
    return type(failure).__name__


def run_restart(
    backend: str,
    *,
    warm: bool,
    kill_at_s: float = 1.5,
    after_ready_s: float = 2.0,
    interval_s: float = 0.02,
    grace_s: float = 4.0,
    waiting_timeout_s: float = 2.5,
    with_sglang: bool = True,
    log: Any = print,
    log_dir: Path | None = None,
) -> tuple[list[DecodeReport], dict[str, float]]:
    """One run; returns the reports (the library's first) and the timeline (seconds from start).
    ``log_dir``: where the prefill's rank processes write their logs (``killed/`` and
    ``replacement/`` in it; default: a new temporary directory each)."""
    from tests.real_prefill.sglang_decode import SGLangDecode

    layout = Layout(geometry=RESTART_GEOMETRY)
    killed_logs = replacement_logs = None
    if log_dir is not None:
        killed_logs, replacement_logs = log_dir / "killed", log_dir / "replacement"
        killed_logs.mkdir(parents=True, exist_ok=True)
        replacement_logs.mkdir(parents=True, exist_ok=True)
    prefill = RealPrefill(backend, layout=layout, log_dir=killed_logs).start()
    replacement = RealPrefill(
        backend, layout=layout, bootstrap_port=prefill.port, log_dir=replacement_logs
    )
    # The library's waiting timeout below the grace: a request issued while the replacement
    # registered but before it served (its metadata reached the new rank, the prefill never
    # got the request) ends typed (WaitingTimeout) within the run instead of outliving it.
    library = LibraryDecode(
        backend, layout=layout, liveness_timeout_s=2.0, waiting_timeout_s=waiting_timeout_s
    )
    decodes: list[tuple[str, Any, int]] = [("library", library, LIBRARY_ROOMS)]
    if with_sglang:
        decodes.append(("sglang", SGLangDecode(backend, layout=layout), SGLANG_ROOMS))
    timeline: dict[str, float] = {}
    drivers = [Driver(n, d, prefill, rooms, interval_s, timeline) for n, d, rooms in decodes]
    try:
        if warm:
            replacement.spawn(warm=True)
            replacement.wait_warm()
        start = time.monotonic()
        for driver in drivers:
            driver.start()
        time.sleep(kill_at_s)
        # Stamped before the SIGKILL: a decode may see the ranks die before kill() has reaped
        # them, and a failure settled then is one in flight at the kill.
        timeline["kill"] = time.monotonic()
        prefill.kill()
        log(f"{backend}: prefill SIGKILLed at {timeline['kill'] - start:.2f} s")
        if warm:
            replacement.go()
        else:
            replacement.spawn()
        replacement.wait_ready()
        # Requests reach the replacement once it serves, as a router's do: one routed while the
        # prefill is down is refused there (connection refused), never queued into the
        # replacement's start (a flood of rooms whose decodes gave up long ago, each a sender
        # the replacement's scheduler polls until its bootstrap timeout, slowing every live
        # request behind them by seconds). The decodes' requests meanwhile fail on their own.
        # READY is stamped after the swap: a request counted as issued after READY was routed
        # to the replacement.
        prefill.swap_in(replacement)
        timeline["ready"] = time.monotonic()
        down = timeline["ready"] - timeline["kill"]
        log(f"{backend}: replacement READY {down:.2f} s after the kill")
        time.sleep(after_ready_s)
        for driver in drivers:
            driver.issuing.clear()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(d.in_flight for d in drivers):
            time.sleep(0.01)
        for driver in drivers:
            driver.stopping.set()
            driver.join()
        live_ports = {int(r["rank_port"]) for r in replacement.ready}
        for driver, (name, decode, _) in zip(drivers, decodes, strict=True):
            report = driver.report
            report.hung = len(driver.in_flight)
            report.hung_issued_from_kill = [
                round(r.issued_at - timeline["kill"], 3) for r in driver.in_flight
            ]
            report.kv_held_pages = PAGES * len(driver.in_flight)
            # The library's waiting timeout is the run's; SGLang's decode waits 300 s, longer
            # than any run, so its failures are never its waiting timeout.
            timeout = waiting_timeout_s if name == "library" else None
            report.failed_after_ready_prefill_late = sum(
                prefill_was_late(r, replacement.report(r.room), timeout)
                for r in driver.failed_after_ready
            )
            # The replacement's report for requests routed to it (issued after READY), the
            # killed prefill's for the others.
            report.failures = [
                describe_failure(
                    name,
                    r,
                    (replacement if r.window == ISSUED_AFTER_READY else prefill).report(r.room),
                    timeline,
                    timeout,
                )
                for r in driver.failed
            ]
            report.hung_detail = [
                (round(r.issued_at - timeline["kill"], 3), int(r.handle.poll()),
                 replacement.report(r.room).status or prefill.report(r.room).status)
                for r in driver.in_flight
            ]  # fmt: skip
            if name == "library":
                snapshot = decode.manager.pool.snapshot()
                report.stale_pool_entries = sum(
                    1 for gen in snapshot.values() if {r.port for r in gen.ranks} - live_ports
                )
            else:
                report.stale_pool_entries = len(decode.cached_rank_ports() - live_ports)
        timeline = {k: v - start for k, v in timeline.items()}
        return [d.report for d in drivers], timeline
    finally:
        for driver in drivers:
            driver.stopping.set()
        for _, decode, _ in decodes:
            decode.close()
        replacement.close()
        prefill.close()


ROWS = [
    ("requests issued", "issued"),
    ("verified byte for byte", "verified"),
    ("failed", "failed"),
    ("  before the kill", "failed_before_kill"),
    ("  in flight at the kill", "failed_in_flight_at_kill"),
    ("  issued while down", "failed_while_down"),
    ("  issued after READY", "failed_after_ready"),
    ("    prefill answered late", "failed_after_ready_prefill_late"),
    ("    the decode's own", "failed_after_ready_own"),
    ("hung (no answer at the end)", "hung"),
    ("wrong pages", "wrong_pages"),
    ("Success before its bytes", "late_bytes"),
    ("kill -> first verified (s)", "kill_to_first_success"),
    ("READY -> first verified (s)", "ready_to_first_success"),
    ("stale pool entries", "stale_pool_entries"),
    ("KV pages still held", "kv_held_pages"),
]
#: The failure rows followed by one row per error type (``failures_by_type``).
WINDOW_OF_ROW = {
    "failed_before_kill": BEFORE_KILL,
    "failed_in_flight_at_kill": IN_FLIGHT_AT_KILL,
    "failed_while_down": ISSUED_WHILE_DOWN,
    "failed_after_ready": ISSUED_AFTER_READY,
}
CELL = 14
#: An error type is cut to this in the table (the JSON report has it whole).
TYPE_WIDTH = 36


def _cell(value: Any) -> str:
    text = "never" if value is None else f"{value:.3f}" if isinstance(value, float) else value
    return f"{text:>{CELL}}"


def table(title: str, reports: list[DecodeReport]) -> str:
    """The side-by-side table, one column per decode. Under each failure row, one row per
    error type any decode failed with there (a long type is cut to ``TYPE_WIDTH``; the JSON
    report has it whole)."""
    kinds = {failure.error[:TYPE_WIDTH] for r in reports for failure in r.failures}
    width = max(len(label) for label, _ in ROWS) + 2
    width = max([width, *(len(kind) + 8 for kind in kinds)])
    lines = [title, " " * width + "".join(f"{r.name:>{CELL}}" for r in reports)]
    for label, name in ROWS:
        lines.append(f"{label:<{width}}" + "".join(_cell(getattr(r, name)) for r in reports))
        window = WINDOW_OF_ROW.get(name)
        if window is None:
            continue
        by_type = [
            {kind[:TYPE_WIDTH]: n for kind, n in r.failures_by_type(window).items()}
            for r in reports
        ]
        indent = " " * (len(label) - len(label.lstrip()) + 2)
        for kind in sorted({kind for counts in by_type for kind in counts}):
            type_label = f"{indent}- {kind}"
            cells = "".join(_cell(counts.get(kind, 0)) for counts in by_type)
            lines.append(f"{type_label:<{width}}" + cells)
    return "\n".join(lines)
