"""One kill-window rule on every source (issue 32 item 3; ``spec/manager.md`` MGR-24).

The demo's real path, run short on each source: real prefill processes (a bootstrap server and
two rank processes; on etcd the ranks register under leases in a real etcd), SIGKILLed and
restarted midway, decode loops in this process. While the prefill is down a request's
bootstrap fails at once on both sources with a retryable error and sends nothing - on HTTP the
server refuses (``TransportFailure``) or is not ready (``NotReady``), on etcd the store still
lists the dead ranks, which the transport judged dead (``RanksUnreachable``) - and the caller's
one rule, retry a failed ``init()`` whose error is retryable within the request's deadline,
gets it served by the replacement. Before, the loops retried only HTTP's two errors: on etcd
every request started in the window failed (15 of 21 failures in one 20 s run were
``RanksUnreachable``).
"""

from __future__ import annotations

import dataclasses

import pytest

from statemachine import errors
from statemachine.demo.modes import OURS
from statemachine.demo.run import DemoConfig, RunResult, run_demo
from tests.support.etcd_support import running_etcd

#: Short: the restart at 3 s leaves 3 s after it, more than the request deadline (the 2 s
#: waiting timeout), on a loaded machine too.
SHORT = DemoConfig(mode=OURS, duration_s=6.0, loops=4, rate=200.0)


def _check_the_rule(result: RunResult) -> None:
    (restart,) = result.restarts
    assert restart.ready_at is not None and restart.new_instance != restart.old_instance
    deadline_s = result.config.waiting_timeout_s
    for outcome in result.outcomes:
        if outcome.ok or outcome.bootstrap_s is not None:
            continue  # served, or failed after its bootstrap (a send into the dying prefill)
        error = getattr(errors, outcome.error or "", None)
        assert isinstance(error, type), outcome
        # A bootstrap failed: only with an error that retrying cannot help, or once the
        # request's deadline had passed - never a retryable one inside it.
        assert not error.retryable or outcome.end - outcome.start >= deadline_s, outcome
    # The rule acted: requests started while the prefill was down retried their bootstrap,
    # and the replacement served requests started after the kill.
    assert result.retries >= 1
    served = [o for o in result.outcomes if o.ok and o.start >= restart.killed_at]
    assert served, "no request started after the kill was served"


@pytest.mark.parametrize("source", ["http", "etcd"])
def test_a_request_started_while_the_prefill_is_down_retries_on_every_source(
    source: str,
) -> None:
    if source == "http":
        _check_the_rule(run_demo(SHORT))
        return
    with running_etcd() as etcd:
        _check_the_rule(run_demo(dataclasses.replace(SHORT, etcd_endpoint=etcd.endpoint)))
