"""``Flights`` (statemachine/decode/flight.py, spec/manager.md MGR-3 single-flight): one fetch
per key, followers adopt the leader's generation or fail with its reason, all-or-none claims."""

from __future__ import annotations

import pytest

from statemachine.decode.flight import Flights
from statemachine.errors import FetchWaitTimeout, PeerLost

from .fakes import generation, key

K0, K1 = key(0), key(1)


def test_mgr_3_first_claim_leads_every_key() -> None:
    flights = Flights()
    led, followed = flights.claim([K0, K1])
    assert set(led) == {K0, K1} and followed == []
    assert len(flights) == 2 and flights.led == 2


def test_mgr_3_claim_is_all_or_none_a_key_in_flight_is_followed_and_nothing_claimed() -> None:
    flights = Flights()
    leader, _ = flights.claim([K0])
    led, followed = flights.claim([K1, K0])  # the key in flight need not come first
    assert led == {} and followed == [leader[K0]]
    assert len(flights) == 1  # K1 was not claimed: the follower looks again after the wait
    assert flights.followed == 1 and leader[K0].followers == 1


def test_mgr_3_followers_adopt_the_generation_the_leader_published() -> None:
    flights = Flights()
    led, _ = flights.claim([K0])
    _, followed = flights.claim([K0])
    published = generation(5001)
    flights.resolve(led, {K0: published})
    assert followed[0].wait(0.0) is published  # identity: the one generation the pool held
    assert len(flights) == 0


def test_mgr_3_followers_fail_with_the_leaders_reason() -> None:
    flights = Flights()
    led, _ = flights.claim([K0])
    _, followed = flights.claim([K0])
    reason = PeerLost("the leader's fetch failed")
    flights.fail(led, reason)
    with pytest.raises(PeerLost) as raised:
        followed[0].wait(0.0)
    assert raised.value is reason
    assert len(flights) == 0


@pytest.mark.parametrize("timeout", [0.0, -5.0])
def test_mgr_3_a_follower_waits_no_longer_than_its_deadline(timeout: float) -> None:
    flights = Flights()
    led, _ = flights.claim([K0])
    with pytest.raises(FetchWaitTimeout, match="retry the request"):
        led[K0].wait(timeout)  # nobody resolves it: the deadline ends the wait, never a hang
    assert not led[K0].done


def test_mgr_3_a_resolved_flight_is_not_failed_afterwards() -> None:
    flights = Flights()
    led, _ = flights.claim([K0])
    published = generation(5001)
    flights.resolve(led, {K0: published})
    flights.fail(led, PeerLost("too late"))
    assert led[K0].wait(0.0) is published and led[K0].error is None


def test_mgr_3_an_old_leader_never_ends_a_newer_flight_of_the_same_key() -> None:
    flights = Flights()
    first, _ = flights.claim([K0])
    flights.fail(first, PeerLost("first leader failed"))
    second, _ = flights.claim([K0])  # a new leader for the key
    flights.fail(first, PeerLost("the first leader again"))
    assert len(flights) == 1 and not second[K0].done
