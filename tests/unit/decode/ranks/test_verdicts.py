"""``Verdict`` and ``Listeners`` (statemachine/decode/ranks/verdicts.py, spec/zmq.md ZMQ-16,
ZMQ-26): every listener hears each verdict, a raising one is contained and counted."""

from __future__ import annotations

import pytest

from statemachine.decode.ranks.verdicts import Listeners, Verdict

A = ("127.0.0.1", 5001)


def test_zmq_16_both_listener_forms_hear_each_verdict() -> None:
    listeners = Listeners()
    plain: list[tuple[object, bool, str]] = []
    whole: list[Verdict] = []
    listeners.subscribe(lambda endpoint, alive, reason: plain.append((endpoint, alive, reason)))
    listeners.subscribe_verdicts(whole.append)
    verdict = Verdict(A, False, "refused", exit_proven=True)
    listeners.tell(verdict)
    assert plain == [(A, False, "refused")]
    assert whole == [verdict] and whole[0].exit_proven  # the typed flag, not a phrase


def test_zmq_26_exit_listeners_hear_proven_exits() -> None:
    listeners = Listeners()
    exits: list[tuple[object, str]] = []
    listeners.subscribe_exits(lambda endpoint, reason: exits.append((endpoint, reason)))
    listeners.tell_exit(A, "the port refuses connections")
    assert exits == [(A, "the port refuses connections")]


def test_a_raising_listener_is_contained_and_the_others_still_run() -> None:
    listeners = Listeners()
    heard: list[Verdict] = []

    def broken(verdict: Verdict) -> None:
        raise RuntimeError("listener bug")

    def broken_exit(endpoint: object, reason: str) -> None:
        raise RuntimeError("listener bug")

    listeners.subscribe_verdicts(broken)
    listeners.subscribe_verdicts(heard.append)
    listeners.subscribe_exits(broken_exit)
    listeners.tell(Verdict(A, True, "connected"))
    listeners.tell_exit(A, "refused")
    assert len(heard) == 1 and listeners.errors == 2


@pytest.mark.parametrize("method", ["subscribe", "subscribe_verdicts", "subscribe_exits"])
def test_a_listener_that_is_not_callable_is_refused(method: str) -> None:
    listeners = Listeners()
    with pytest.raises(TypeError, match="callable"):
        getattr(listeners, method)("not a function")
