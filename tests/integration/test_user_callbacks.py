"""A user's callback cannot break the manager (issue 17, "Callbacks and the fan-out"; MGR-18).

Real parts: a bootstrap server on 127.0.0.1, prefill rank processes killed with SIGKILL, real
ZMQ sockets and the transport's socket monitor. A receiver's ``on_change`` runs on whatever
thread brought the news - the fan-out on the monitor's thread, or another request's failed
send - so what it raises must stay there: counted, logged once, and the fan-out completes.
"""

from __future__ import annotations

import logging

import pytest

from statemachine import lifecycle as life
from statemachine.completion import KVPoll
from statemachine.demo.baselines import UnmonitoredTransport
from statemachine.errors import RankDead, SendFailed
from tests.support.manager_support import (
    FAIL_BOUND_S,
    WakeCounter,
    in_flight_waiting,
    manager_for,
)
from tests.support.receiver_support import PLAN, Prefill
from tests.support.zmq_support import VerdictRecorder


def _raise() -> None:
    raise RuntimeError("user callback broke")


def test_a_raising_on_change_does_not_stop_the_fan_out(
    slow_prefill: Prefill, caplog: pytest.LogCaptureFixture
) -> None:
    """Socket monitor on: the first receiver's on_change raises; the other nine waiting on
    the killed rank are still failed (RankDead) by the same fan-out, the error is counted
    once per raise and logged once. Before: 0 of the 9 others were failed by the fan-out."""
    with manager_for(waiting_timeout_s=300.0) as manager:
        receivers = in_flight_waiting(manager, slow_prefill, range(1, 11))
        broken, others = receivers[0], receivers[1:]
        woken = WakeCounter(others)
        broken.on_change = _raise
        verdicts = VerdictRecorder()
        manager.transport.subscribe(verdicts)
        dead = ("127.0.0.1", slow_prefill.ranks[1].port)
        with caplog.at_level(logging.ERROR, logger="statemachine.decode.manager"):
            slow_prefill.ranks[1].kill()
            verdicts.wait_for(dead, alive=False, timeout=FAIL_BOUND_S)
            assert woken.all_woken.wait(FAIL_BOUND_S), "the fan-out stopped at the callback"
        for receiver in receivers:
            assert receiver.poll() == KVPoll.Failed
            assert isinstance(receiver.failure, RankDead), receiver.failure
        assert manager.stats().fanout.get("RankDead") == len(receivers)
        assert manager.stats().callback_errors == 1
        logged = [r for r in caplog.records if "on_change raised" in r.getMessage()]
        assert len(logged) == 1 and "fix the callback" in logged[0].getMessage()


def test_another_requests_send_never_raises_the_callbacks_error(slow_prefill: Prefill) -> None:
    """Socket monitor off: a request's own failed send is the evidence, and its fan-out wakes
    the other requests on that rank from inside its ``send_metadata``. A raising on_change of
    one of them used to surface there: that call raised the RuntimeError and its request was
    left ``cached``, in flight, with no failure. Now the send fails its own request (typed)
    and every other one is failed; the raises are counted, logged once."""
    transport = UnmonitoredTransport(send_timeout_ms=300)
    try:
        with manager_for(transport=transport, waiting_timeout_s=300.0) as manager:
            victims = in_flight_waiting(manager, slow_prefill, range(1, 5))
            for victim in victims:
                victim.on_change = _raise
            slow_prefill.ranks[1].kill()
            for room in range(100, 100 + 100_000):
                probe = manager.receiver(slow_prefill.addr, room, PLAN, prefill_dp_rank=0)
                assert probe.init() == KVPoll.WaitingForInput
                probe.on_change = _raise
                state = probe.send_metadata((room,))  # raised RuntimeError before
                if state == KVPoll.Failed:
                    break
                victims.append(probe)
            else:  # pragma: no cover
                pytest.fail("no send to the killed rank ever failed")
            assert probe.state == life.INVALIDATED
            assert isinstance(probe.failure, SendFailed), probe.failure
            for victim in victims:
                assert victim.poll() == KVPoll.Failed
                assert isinstance(victim.failure, RankDead), victim.failure
            assert manager.stats().in_flight == 0
            assert manager.stats().callback_errors >= len(victims)
    finally:
        transport.close()
