"""Threaded stress test of the pool: receivers race a restarting prefill (spec/pool.md).

Eight receiver threads loop over a few shared keys: lookup; on a miss fetch a fresh generation
of the prefill instance running now and publish it (winning or adopting); then "send" to it,
which fails when the generation is stale (its prefill restarted) and, rarely, times out on a
live one; a failing receiver invalidates what it recorded. A restarter thread bumps the
prefill instance of each address, and for one address also retires the instance it replaced
(``retire_instance``), as the instance-id probe does. The GIL switch interval is set to
1 µs so threads interleave between almost every bytecode.

Every published generation is accounted for at the end: it is still in the pool, or exactly
one receiver's invalidation removed it (``invalidate`` returned 1 for an entry map holding only
it), or it was stale and retired by ``retire_instance``. So no live generation was ever lost
to another receiver's invalidation (``IdentitySafe``), and the counters match the operations.
"""

from __future__ import annotations

import sys

import statemachine.pool
from tests.support.pool_stress_support import (
    ReceiverLog,
    check_accounting,
    run_stress,
)


def test_pool_under_threads_loses_no_live_generation() -> None:
    result = run_stress(statemachine.pool)
    logs: list[ReceiverLog] = result["logs"]  # type: ignore[assignment]
    check_accounting(result)
    # The workload really raced: adoptions (lost publish races) and stale failures happened.
    stats = result["pool"].stats()  # type: ignore[attr-defined]
    assert stats.adoptions > 0
    assert stats.invalidations > 0
    assert sum(log.invalidations_without_effect for log in logs) > 0
    assert sys.getswitchinterval() != 1e-6
