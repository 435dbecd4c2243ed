"""``DeadKeys`` (statemachine/decode/dead_keys.py, spec/manager.md MGR-1 "A key known dead"):
which request is held off and which one asks the source again, on a settable clock.

The manager-level behaviour (no refetch per request counted at a real server, a re-registered
rank served, etcd never held off) is in tests/integration/test_manager.py and
tests/integration/test_etcd_receiver.py;
this file pins the rules whose interleavings a real run only hits by chance: a straggler
that still held the dead generation, and the one recheck per ``recheck_s``."""

from __future__ import annotations

from statemachine.decode.dead_keys import DeadKeys
from statemachine.errors import RanksUnreachable
from statemachine.pool import Generation, PoolKey, RankInfo
from tests.support.http_support import FakeClock

KEY = PoolKey("127.0.0.1:8998", 0, 0, 0)
OTHER = PoolKey("127.0.0.1:8999", 0, 0, 0)
URL = "tcp://127.0.0.1:5001"


def generation() -> Generation:
    return Generation((RankInfo("127.0.0.1", 5001, 0),), "instance-a")


def test_one_request_per_recheck_asks_the_others_fail_at_once() -> None:
    clock = FakeClock()
    dead = DeadKeys(clock=clock, recheck_s=1.0)
    assert dead.refusal(KEY.addr, [KEY]) is None  # nothing known: fetch
    dead.record([(KEY, generation())], URL, "reconnect refused")
    assert dead.refusal(KEY.addr, [OTHER]) is None  # another key is not held off
    assert dead.refusal(KEY.addr, [KEY]) is None  # the first request after a death asks
    dead.record([(KEY, generation())], URL, "reconnect refused")  # its fresh fetch: dead again
    refused = dead.refusal(KEY.addr, [KEY])
    assert isinstance(refused, RanksUnreachable) and refused.endpoint == URL
    assert "known dead" in str(refused) and "retry" in str(refused)
    clock.now += 1.0
    assert dead.refusal(KEY.addr, [KEY]) is None  # the recheck is due: one asks again
    assert dead.refused == 1


def test_a_straggler_on_the_generation_already_let_through_holds_nothing_off() -> None:
    """A request that still held the dead generation and fails on it after the recheck was let
    through is old news: the next request is not held off by it (a whole-prefill restart with
    many request loops would otherwise fail requests for recheck_s after the prefill is back)."""
    clock = FakeClock()
    dead = DeadKeys(clock=clock, recheck_s=1.0)
    old = generation()
    dead.record([(KEY, old)], URL, "reconnect refused")
    assert dead.refusal(KEY.addr, [KEY]) is None  # let through
    dead.record([(KEY, old)], URL, "send failed")  # a straggler's send on the old generation
    assert dead.refusal(KEY.addr, [KEY]) is None
    assert len(dead) == 0


def test_alive_again_and_a_restart_forget_at_once() -> None:
    clock = FakeClock()
    dead = DeadKeys(clock=clock, recheck_s=1.0)
    for forget in (lambda: dead.forget_endpoint(URL), lambda: dead.forget_address(KEY.addr)):
        dead.record([(KEY, generation())], URL, "reconnect refused")
        assert dead.refusal(KEY.addr, [KEY]) is None
        dead.record([(KEY, generation())], URL, "reconnect refused")
        assert isinstance(dead.refusal(KEY.addr, [KEY]), RanksUnreachable)
        forget()
        assert dead.refusal(KEY.addr, [KEY]) is None
