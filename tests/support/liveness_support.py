"""Silence through a DecodeManager in a network namespace: the bound and the run the netns and
SGLang liveness tests share."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from statemachine.completion import KVPoll
from statemachine.decode.liveness_bound import LivenessBound
from statemachine.decode.manager import DecodeManager
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.errors import (
    PrefillDead,
    PrefillSilent,
    RankDead,
    RanksUnreachable,
)

BOUND = LivenessBound.from_timeout(1.0)


#: What a loaded machine may add to a deadline before the test calls it missed.
LOAD_MARGIN_S = 0.5


#: The first success after the path or the process returns (issue 27).
RECOVERY_S = 0.5


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def silence_through_manager(
    manager: DecodeManager,
    receiver_for: Callable[[int], BootstrapReceiver],
    start_fault: Callable[[], None],
    heal: Callable[[], None],
    server_silent: bool,
) -> None:
    """The scenario of MGR-22 / ZMQ-25 through a manager's public API (shared with the SGLang
    tests): 4 requests in flight, the fault, their typed failures within the bound, new
    requests failing at once and typed, the heal, the first success."""
    rooms = itertools.count(1)

    def served() -> bool:
        receiver = receiver_for(next(rooms))
        if receiver.init() != KVPoll.WaitingForInput:
            return False
        return receiver.send_metadata((1, 2, 3), aux_index=0) == KVPoll.Transferring

    assert wait_for(served, 10.0), "the prefill did not serve a request before the fault"
    waiting = []
    for _ in range(4):
        receiver = receiver_for(next(rooms))
        assert receiver.init() == KVPoll.WaitingForInput
        assert receiver.send_metadata((1, 2, 3), aux_index=0) == KVPoll.Transferring
        waiting.append(receiver)
    faulted = time.monotonic()
    start_fault()
    try:
        assert wait_for(lambda: all(r.poll() == KVPoll.Failed for r in waiting), 10.0)
        detection = time.monotonic() - faulted
        assert detection <= BOUND.liveness_timeout_s + LOAD_MARGIN_S, detection
        for receiver in waiting:
            assert isinstance(receiver.failure, (RankDead, PrefillDead)), receiver.failure
            assert "retry the request" in str(receiver.failure)
        if server_silent:
            assert wait_for(lambda: manager.stats().silent_addresses == 1, 5.0)
        # After the verdict: each new request fails at once and typed, and none is sent.
        for _ in range(5):
            receiver = receiver_for(next(rooms))
            began = time.monotonic()
            assert receiver.init() == KVPoll.Failed
            took = time.monotonic() - began
            failure = receiver.failure
            if server_silent:
                assert isinstance(failure, PrefillSilent), failure
                assert "is not answering" in str(failure) and "retry it shortly" in str(failure)
                assert took < LOAD_MARGIN_S, took  # no fetch: a fetch waits out a timeout
            else:
                # The server answers; its ranks are judged dead: refused before any send, or
                # the register send fails (nothing of the request reaches a prefill).
                assert isinstance(failure, (RanksUnreachable, RankDead)), failure
                assert took <= BOUND.liveness_timeout_s + LOAD_MARGIN_S, took
        if server_silent:
            assert manager.stats().refused_silent >= 5
    finally:
        heal()
    healed = time.monotonic()
    assert wait_for(served, 10.0), "no request was served within 10 s of the heal"
    recovery = time.monotonic() - healed
    assert recovery <= RECOVERY_S + LOAD_MARGIN_S, recovery
    assert manager.stats().silent_addresses == 0
