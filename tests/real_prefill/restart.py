"""A prefill SIGKILLed under load and replaced behind the same bootstrap port, with this
library's decode and SGLang's own decode side by side in one run.

Each decode is driven by its own scheduler loop (a thread): a new request every ``interval_s``
from the start until ``after_ready_s`` after the replacement is READY,
every request in flight polled each iteration, every Success checked byte for byte. Both send to
the same SGLang prefill. At ``kill_at_s`` every prefill rank is SIGKILLed; the replacement is
either warm (imported beforehand, started at the kill: ready at once) or cold (started after
the kill). :func:`run_restart` returns one :class:`DecodeReport` per decode.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from real_prefill.harness import Layout, LibraryDecode, RealPrefill
from real_prefill.pattern import Geometry
from real_prefill.prefill_process import RoomReport

PAGES = 4
#: Room numbers: the two decodes never share one.
LIBRARY_ROOMS, SGLANG_ROOMS = 1 << 40, 2 << 40
RESTART_GEOMETRY = Geometry(slots=1024, aux_slots=256)


@dataclass
class DecodeReport:
    """What one decode saw (times in seconds; None: never)."""

    name: str
    issued: int = 0
    verified: int = 0
    failed: int = 0
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


class Request:
    __slots__ = ("aux", "dst", "failed_at", "handle", "issued_at", "room")

    def __init__(self, room: int, dst: list[int], aux: int, handle: Any, issued_at: float):
        self.room, self.dst, self.aux, self.handle, self.issued_at = (
            room,
            dst,
            aux,
            handle,
            issued_at,
        )
        self.failed_at: float | None = None


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
        self.in_flight.append(Request(room, dst, aux, handle, now))
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
        if ready is not None and request.issued_at >= ready:
            report.failed_after_ready += 1
            failure = str(getattr(request.handle, "failure", None))[:160]
            report.failed_after_ready_detail.append((round(request.issued_at - ready, 3), failure))
            request.failed_at = now
            self.failed_after_ready.append(request)
        elif kill is not None and request.issued_at >= kill:
            report.failed_while_down += 1
        elif kill is not None:
            report.failed_in_flight_at_kill += 1

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


def prefill_was_late(request: Request, report: RoomReport) -> bool:
    """Whether a request issued after READY failed because the replacement was slow, from the
    replacement's ``report`` of its room: the decode's metadata reached the replacement's rank
    (so it addressed the live incarnation, not a dead rank's port), and the rank had not
    answered by the time the decode gave up (it answered later, or not within the run). False
    is the decode's doing: metadata that never reached the replacement, or an answer the
    decode had in time and missed."""
    if request.failed_at is None or report.metadata_at is None:
        return False
    concluded_at = report.concluded_at
    return concluded_at is None or concluded_at > request.failed_at - ANSWER_IN_TRANSIT_S


def failure_kind(handle: Any) -> str:
    failure = getattr(handle, "failure", None)
    if failure is None:
        return "unknown"
    if isinstance(failure, str):
        return failure.split(":")[0][:60]
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
) -> tuple[list[DecodeReport], dict[str, float]]:
    """One run; returns the reports (the library's first) and the timeline (seconds from start)."""
    from real_prefill.sglang_decode import SGLangDecode

    layout = Layout(geometry=RESTART_GEOMETRY)
    prefill = RealPrefill(backend, layout=layout).start()
    replacement = RealPrefill(backend, layout=layout, bootstrap_port=prefill.port)
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
            report.failed_after_ready_prefill_late = sum(
                prefill_was_late(r, replacement.report(r.room)) for r in driver.failed_after_ready
            )
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
    ("  in flight at the kill", "failed_in_flight_at_kill"),
    ("  issued while down", "failed_while_down"),
    ("  issued after READY", "failed_after_ready"),
    ("    prefill answered late", "failed_after_ready_prefill_late"),
    ("hung (no answer at the end)", "hung"),
    ("wrong pages", "wrong_pages"),
    ("Success before its bytes", "late_bytes"),
    ("kill -> first verified (s)", "kill_to_first_success"),
    ("READY -> first verified (s)", "ready_to_first_success"),
    ("stale pool entries", "stale_pool_entries"),
    ("KV pages still held", "kv_held_pages"),
]


def table(title: str, reports: list[DecodeReport]) -> str:
    """The side-by-side table, one column per decode."""
    width = max(len(label) for label, _ in ROWS) + 2
    lines = [title, " " * width + "".join(f"{r.name:>14}" for r in reports)]
    for label, name in ROWS:
        cells = []
        for report in reports:
            value = getattr(report, name)
            text = (
                "never" if value is None else f"{value:.3f}" if isinstance(value, float) else value
            )
            cells.append(f"{text:>14}")
        lines.append(f"{label:<{width}}" + "".join(cells))
    return "\n".join(lines)
