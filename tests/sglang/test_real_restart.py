"""SGLang 0.5.23's prefill SIGKILLed under load and replaced behind the same bootstrap port, with
this library's decode and SGLang's own decode side by side (``tests/real_prefill/restart.py``).

A short warm run per engine: the replacement imported SGLang beforehand and starts at the kill.
The library's column is asserted: no wrong byte, nothing hung, nothing issued after the
replacement was READY failed, every failure was of a request in flight at the kill or issued
while the prefill was down, and it verified a request after READY. SGLang's column is printed,
not asserted (longer runs: ``make demo-sglang``).

A short cold run on Mooncake: the replacement starts after the kill (it imports SGLang then,
seconds on this machine). Asserted the same way; a request issued after READY may fail only if
the replacement got its metadata and had not answered when the library's waiting timeout ended
it (the prefill's doing, reported as a warning). The replacement's bootstrap server listens
only a few hundred milliseconds before READY, answering slowly meanwhile: the library asks it
at once because a port that refused is not held off until a probe answers (HEALTH-7;
docs/sglang-interop.md, "A cold replacement").

A request issued while the prefill is down reaches no prefill (a router's call to a dead
prefill is refused, not queued into its replacement), so the library ends it typed: at once
when its ranks are known dead, or by its waiting timeout when its metadata reached a rank of
the replacement before that served (the run sets it below the grace).
"""

from __future__ import annotations

import warnings

import pytest

from statemachine.errors import WaitingTimeout
from tests.real_prefill.engines import engine_unavailable
from tests.real_prefill.prefill_process import RoomReport
from tests.real_prefill.restart import (
    ANSWER_IN_TRANSIT_S,
    DecodeReport,
    Request,
    prefill_was_late,
    run_restart,
    table,
)
from tests.support.sglang_support import requires_sglang


def assert_library_recovered(library: DecodeReport) -> None:
    assert library.wrong_pages == 0
    assert library.hung == 0, library.hung_issued_from_kill
    assert library.failed == (
        library.failed_in_flight_at_kill + library.failed_while_down + library.failed_after_ready
    )
    assert library.ready_to_first_success is not None
    assert library.verified > 0 and library.kv_held_pages == 0
    assert library.stale_pool_entries == 0


@requires_sglang
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_library_recovers_from_a_prefill_restart_beside_sglangs_decode(backend: str) -> None:
    reason = engine_unavailable(backend)
    if reason is not None:
        pytest.skip(reason)
    reports, timeline = run_restart(backend, warm=True, kill_at_s=1.0, after_ready_s=1.5)
    print(table(f"{backend}, warm replacement ({timeline})", reports))
    library = reports[0]
    assert_library_recovered(library)
    assert library.failed_after_ready == 0


@requires_sglang
@pytest.mark.slow
def test_library_recovers_from_a_cold_prefill_restart_beside_sglangs_decode() -> None:
    reason = engine_unavailable("mooncake")
    if reason is not None:
        pytest.skip(reason)
    reports, timeline = run_restart("mooncake", warm=False, kill_at_s=1.0, after_ready_s=1.5)
    print(table(f"mooncake, cold replacement ({timeline})", reports))
    library = reports[0]
    assert_library_recovered(library)
    # None issued after READY fails by the library's doing. One whose transfer the replacement
    # had not finished when the library's waiting timeout ended it is the prefill's (a cold
    # prefill under load): reported as a warning with its error (CI shows no passing test's
    # output), not asserted.
    details = [
        f"issued {seconds:.3f} s after READY: {failure}"
        for seconds, failure in library.failed_after_ready_detail
    ]
    assert library.failed_after_ready == library.failed_after_ready_prefill_late, details
    if details:
        warnings.warn(
            f"cold restart: {len(details)} failed after READY, each answered late by the "
            "prefill:\n" + "\n".join(details),
            stacklevel=1,
        )


def failed_request(room: int, failed_at: float) -> Request:
    request = Request(room, [0], 0, handle=None, issued_at=failed_at - 2.5)
    request.failed_at = failed_at
    return request


@pytest.mark.parametrize(
    ("metadata_at", "concluded_at", "late"),
    [
        # the replacement had it and answered after the library gave up, or never
        (9.0, 10.5, True),
        (9.0, None, True),
        # its metadata reached the replacement only after the library gave up (a slow reader)
        (10.2, 10.4, True),
        # an answer still crossing to the library when it gave up
        (9.0, 10.0 - ANSWER_IN_TRANSIT_S / 2, True),
        # the library's doing: metadata that never reached the replacement (a dead rank's port)
        (None, None, False),
        (None, 10.5, False),
        # ... or an answer it had in time and missed
        (9.0, 9.5, False),
    ],
    ids=[
        "answered-after",
        "never-answered",
        "metadata-read-after",
        "answer-in-transit",
        "no-metadata",
        "no-metadata-answered",
        "answer-missed",
    ],
)
def test_a_failure_after_ready_is_the_prefills_only_with_its_evidence(
    metadata_at: float | None, concluded_at: float | None, late: bool
) -> None:
    request = failed_request(7, failed_at=10.0)
    report = RoomReport(metadata_at=metadata_at, concluded_at=concluded_at)
    assert prefill_was_late(request, report) is late


class TimedOut:
    """A request handle whose failure is the library's waiting timeout."""

    failure = WaitingTimeout("room 7: no transfer within 2.5 s")


@pytest.mark.parametrize(
    ("concluded_at", "late"),
    [
        # after the deadline (sent 7.5 + 2.5 = 10.0), before the poll that noticed (10.3)
        (10.1, True),
        # in time for the deadline: the decode had it and missed it
        (9.8, False),
    ],
    ids=["answered-after-the-deadline", "answered-before-the-deadline"],
)
def test_a_waiting_timeout_is_judged_at_its_deadline_not_at_the_poll_that_noticed_it(
    concluded_at: float, late: bool
) -> None:
    request = Request(7, [0], 0, handle=TimedOut(), issued_at=7.5)
    request.sent_at, request.failed_at = 7.5, 10.3
    report = RoomReport(metadata_at=7.6, concluded_at=concluded_at)
    assert prefill_was_late(request, report, waiting_timeout_s=2.5) is late
    # Without the timeout (SGLang's decode), the failure's own time is the reference.
    assert prefill_was_late(request, report) is (concluded_at > 10.3 - ANSWER_IN_TRANSIT_S)


def test_a_request_that_did_not_fail_is_never_counted_late() -> None:
    request = Request(7, [0], 0, handle=None, issued_at=1.0)
    assert not prefill_was_late(request, RoomReport(metadata_at=1.0))
