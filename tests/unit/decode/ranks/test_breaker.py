"""``RememberedVerdicts`` (statemachine/decode/ranks/breaker.py, spec/zmq.md ZMQ-19/ZMQ-20): a
dead verdict outlives its closed socket for ``hold_s``, bounded in size."""

from __future__ import annotations

from statemachine.decode.ranks.breaker import RememberedVerdicts

A, B, C = ("127.0.0.1", 5001), ("127.0.0.1", 5002), ("127.0.0.1", 5003)


def test_zmq_19_a_remembered_verdict_refuses_while_held() -> None:
    verdicts = RememberedVerdicts(hold_s=3600.0, max_entries=8)
    assert verdicts.refusal(A) is None
    verdicts.remember(A, "reconnect refused")
    assert verdicts.refusal(A) == "reconnect refused"
    assert verdicts.refusal(B) is None and verdicts.held() == 1


def test_zmq_19_an_expired_verdict_refuses_nothing_but_is_still_forgettable() -> None:
    verdicts = RememberedVerdicts(hold_s=0.0, max_entries=8)  # expires the moment it is made
    verdicts.remember(A, "reconnect refused")
    assert verdicts.refusal(A) is None and verdicts.held() == 0
    assert verdicts.forget(A) is True  # a new socket there reports alive: the entry goes


def test_zmq_20_forget_drops_the_verdict_once() -> None:
    verdicts = RememberedVerdicts(hold_s=3600.0, max_entries=8)
    verdicts.remember(A, "dead")
    assert verdicts.forget(A) is True
    assert verdicts.refusal(A) is None and verdicts.forget(A) is False


def test_zmq_19_bounded_the_oldest_verdict_goes_first() -> None:
    verdicts = RememberedVerdicts(hold_s=3600.0, max_entries=2)
    verdicts.remember(A, "a")
    verdicts.remember(B, "b")
    verdicts.remember(C, "c")
    assert verdicts.refusal(A) is None
    assert (verdicts.refusal(B), verdicts.refusal(C)) == ("b", "c")
    assert verdicts.held() == 2
