"""The liveness rule (ZMQ-16), event by event: no sockets, no clock (``now`` is given)."""

from __future__ import annotations

import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from statemachine.decode.ranks.liveness import ALIVE, ATTEMPT_FAILED, DEAD, EVENTS, Liveness

HANDSHAKE = zmq.EVENT_HANDSHAKE_SUCCEEDED
DISCONNECTED = zmq.EVENT_DISCONNECTED
CLOSED = zmq.EVENT_CLOSED


def test_zmq16_a_disconnect_alone_is_evidence_not_proof() -> None:
    live = Liveness(grace_s=0.1)
    assert live.on_event(HANDSHAKE, 0.0) is ALIVE
    assert live.on_event(DISCONNECTED, 1.0) is None
    assert live.tick(1.05) is None and live.dead_reason is None
    assert live.deadline() == 1.1
    # ZMQ reconnected by itself within the grace: never judged dead.
    assert live.on_event(HANDSHAKE, 1.06) is ALIVE
    assert live.tick(5.0) is None and live.deadline() is None


def test_zmq16_disconnect_then_refused_reconnect_is_dead_once() -> None:
    live = Liveness(grace_s=0.1)
    live.on_event(HANDSHAKE, 0.0)
    live.on_event(DISCONNECTED, 1.0)
    assert live.on_event(CLOSED, 1.005) is DEAD
    assert live.dead_reason == "disconnected, reconnect refused"
    # More refused attempts, the grace timer, a failed send: no second verdict.
    assert live.on_event(CLOSED, 1.015) is None
    assert live.tick(2.0) is None
    assert live.send_failed("timeout") is None
    assert live.on_event(HANDSHAKE, 3.0) is ALIVE and live.dead_reason is None


def test_zmq16_never_connected_refused_and_silent_after_disconnect() -> None:
    refused = Liveness(grace_s=0.1)
    assert refused.on_event(CLOSED, 0.0) is DEAD
    assert refused.dead_reason == "connect refused"
    silent = Liveness(grace_s=0.1)
    silent.on_event(HANDSHAKE, 0.0)
    silent.on_event(DISCONNECTED, 1.0)
    silent.on_event(DISCONNECTED, 1.05)  # the grace runs from the first disconnect
    assert silent.tick(1.0999) is None
    assert silent.tick(1.1) is DEAD
    assert silent.dead_reason == "disconnected, not reconnected within 100 ms"


def test_zmq16_handshake_failure_and_send_failures() -> None:
    stranger = Liveness(grace_s=0.1)
    assert stranger.on_event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0.0) is DEAD
    assert stranger.dead_reason is not None and "handshake failed" in stranger.dead_reason
    connected = Liveness(grace_s=0.1)
    connected.on_event(HANDSHAKE, 0.0)
    # Connected now: the send that timed out met a slow peer, not a dead one.
    assert connected.send_failed("no live peer within SNDTIMEO") is ALIVE
    assert connected.dead_reason is None
    never = Liveness(grace_s=0.1)
    assert never.send_failed("no live peer within SNDTIMEO") is DEAD
    assert never.dead_reason == "no live peer within SNDTIMEO"


def test_zmq16_closed_while_connected_is_not_a_verdict() -> None:
    """EVENT_CLOSED belongs to a connect attempt; while a connection is up it says nothing."""
    live = Liveness(grace_s=0.1)
    live.on_event(HANDSHAKE, 0.0)
    assert live.on_event(CLOSED, 0.5) is None and live.dead_reason is None


def test_zmq16_the_monitor_subscribes_to_what_the_rule_reads() -> None:
    for event in (HANDSHAKE, DISCONNECTED, CLOSED, zmq.EVENT_MONITOR_STOPPED):
        assert EVENTS & event
    assert not EVENTS & zmq.EVENT_CONNECT_RETRIED  # one per attempt: not needed, not read


EVENT = st.sampled_from(
    [HANDSHAKE, DISCONNECTED, CLOSED, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "tick", "send_failed"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(EVENT, st.floats(0, 0.2)), max_size=40))
def test_zmq16_verdicts_alternate_and_follow_the_rule(steps: list[tuple[object, float]]) -> None:
    """Property over any event sequence: DEAD is reported once until the next handshake, or
    twice when a silent verdict is followed by a failed connect attempt (ZMQ-26: the transport
    then asks whether the process exited); every handshake reports ALIVE and clears the
    verdict; DEAD never comes while a connection is up; a disconnect alone never gives DEAD
    before the grace has passed."""
    live = Liveness(grace_s=0.1)
    now = 0.0
    dead_reported = False
    upgraded = False
    for event, delay in steps:
        now += delay
        was_connected = live.connected
        reason_before = live.dead_reason
        if event == "tick":
            verdict = live.tick(now)
        elif event == "send_failed":
            verdict = live.send_failed("timeout")
        else:
            assert isinstance(event, int)
            verdict = live.on_event(event, now)
        if event == HANDSHAKE:
            assert verdict is ALIVE and live.dead_reason is None
            dead_reported = upgraded = False
        elif verdict is DEAD:
            if dead_reported:
                assert not upgraded, "DEAD three times without a handshake in between"
                assert reason_before not in ATTEMPT_FAILED and live.dead_reason in ATTEMPT_FAILED
                upgraded = True
            assert not was_connected or event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            if event == "tick":
                assert live.disconnected_at is not None
                # As the rule is stated (deadline = disconnected_at + grace_s): subtracting
                # the floats instead can round just below the grace.
                assert now >= live.disconnected_at + live.grace_s
            dead_reported = True
        elif verdict is ALIVE:
            assert event == "send_failed" and live.connected
        assert (live.dead_reason is not None) == dead_reported
