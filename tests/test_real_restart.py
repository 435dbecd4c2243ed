"""SGLang 0.5.23's prefill SIGKILLed under load and replaced behind the same bootstrap port, with
this library's decode and SGLang's own decode side by side (``tests/real_prefill/restart.py``).

A short warm run per engine: the replacement imported SGLang beforehand and starts at the kill.
The library's column is asserted: no wrong byte, nothing hung, nothing issued after the
replacement was READY failed, every failure was of a request in flight at the kill or issued
while the prefill was down, and it verified a request after READY. SGLang's column is printed,
not asserted (longer runs, cold replacements too: ``make demo-sglang``).

A request issued while the prefill is down reaches no prefill (a router's call to a dead
prefill is refused, not queued into its replacement), so the library ends it typed: at once
when its ranks are known dead, or by its waiting timeout when its metadata reached a rank of
the replacement before that served (the run sets it below the grace).
"""

from __future__ import annotations

import pytest
from real_prefill.engines import engine_unavailable
from real_prefill.restart import run_restart, table
from sglang_support import requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_library_recovers_from_a_prefill_restart_beside_sglangs_decode(backend: str) -> None:
    reason = engine_unavailable(backend)
    if reason is not None:
        pytest.skip(reason)
    reports, timeline = run_restart(backend, warm=True, kill_at_s=1.0, after_ready_s=1.5)
    print(table(f"{backend}, warm replacement ({timeline})", reports))
    library = reports[0]
    assert library.wrong_pages == 0
    assert library.hung == 0, library.hung_issued_from_kill
    assert library.failed_after_ready == 0
    assert library.failed == library.failed_in_flight_at_kill + library.failed_while_down
    assert library.ready_to_first_success is not None
    assert library.verified > 0 and library.kv_held_pages == 0
