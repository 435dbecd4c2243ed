"""``Fetcher`` (statemachine/decode/fetcher.py, spec/manager.md MGR-3, MGR-19, MGR-21, MGR-22,
MGR-23, POOL-6): the miss path's steps, each answering with a value (a claim, the fetched
generations, the typed error), over a fake source with canned ranks, a fake transport that
records sends, and the real pool, flights, fan-out and routes beside them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.exits import ExitProofs
from statemachine.decode.fanout import FanOut
from statemachine.decode.fetcher import Claim, Fetcher
from statemachine.decode.flight import Flights
from statemachine.decode.holds import AbortHolds
from statemachine.decode.plan import DEFAULT_PLAN, RankPlan
from statemachine.decode.ranks.outbox import Outbox
from statemachine.decode.retention import SocketRetention
from statemachine.decode.rooms import Rooms
from statemachine.decode.routes import Routes
from statemachine.decode.silent import SilentAddresses
from statemachine.errors import (
    BootstrapHTTPError,
    FetchWaitTimeout,
    PeerLost,
    PrefillRestarted,
    PrefillSilent,
    RanksUnreachable,
    SendFailed,
    TransportFailure,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey

from .fakes import (
    ADDR,
    FakeBackend,
    FakeHealth,
    FakeReceiver,
    FakeSource,
    FakeTransport,
    ManualBackground,
    ManualClock,
    generation,
    key,
)

K0, K1 = key(0), key(1)
DEADLINE_S = 5.0


@dataclass
class Setup:
    fetcher: Fetcher
    pool: BootstrapPool
    source: FakeSource
    transport: FakeTransport
    rooms: Rooms
    fanout: FanOut
    silent: SilentAddresses
    health: FakeHealth
    clock: ManualClock

    def deadline(self) -> float:
        return self.clock() + DEADLINE_S


def setup() -> Setup:
    clock = ManualClock()
    pool, rooms, transport, health = BootstrapPool(), Rooms(clock), FakeTransport(), FakeHealth()
    source = FakeSource()
    for dp_rank in range(2):
        for tp_rank in range(2):
            source.ports[(ADDR, dp_rank, tp_rank, 0)] = 5000 + 10 * dp_rank + tp_rank
    background = ManualBackground()
    routes = Routes(source, None, staging=False, background=background)  # type: ignore[arg-type]
    retention = SocketRetention(pool=pool, rooms=rooms, transport=transport)  # type: ignore[arg-type]
    fanout = FanOut(
        rooms=rooms,
        routes=routes,
        pool=pool,
        source=source,
        dead_keys=DeadKeys(clock=clock, recheck_s=1.0),
        hold_off_dead=True,
        clock=clock,
        retention=retention,
        exits=ExitProofs(pool=pool, rooms=rooms, holds=AbortHolds(30.0, clock)),
    )
    silent = SilentAddresses(clock=clock)
    fetcher = Fetcher(
        pool=pool,
        source=source,
        transport=transport,  # type: ignore[arg-type]
        outbox=Outbox(transport, FakeBackend()),  # type: ignore[arg-type]
        flights=Flights(),
        fanout=fanout,
        retention=retention,
        routes=routes,
        silent=silent,
        health=health,  # type: ignore[arg-type]
        clock=clock,
    )
    return Setup(fetcher, pool, source, transport, rooms, fanout, silent, health, clock)


def lead(s: Setup, *keys: PoolKey) -> Claim:
    claim = s.fetcher.claim(list(keys), {}, s.deadline())
    assert isinstance(claim, Claim) and not claim.followed
    return claim


def test_mgr_3_a_miss_claims_fetches_registers_and_publishes() -> None:
    s = setup()
    claim = lead(s, K0)
    assert claim.missing == [K0] and set(claim.led) == {K0}
    fetched = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
    assert isinstance(fetched, dict) and set(fetched) == {K0}
    (fresh,) = fetched.values()
    assert [(r.port, r.is_dummy) for r in fresh.ranks] == [(5000, False)]
    assert fresh.instance_id == "instance-a"
    assert s.fetcher.register(ADDR, claim, fetched) is None
    assert s.transport.sent_to() == [("127.0.0.1", 5000)]
    published = s.fetcher.publish(ADDR, claim, fetched)
    assert published.stale is None and published.entries == {K0: fresh}
    assert s.pool.get(K0) is fresh
    assert s.transport.retained == {("127.0.0.1", 5000): 1}  # ours: its sockets are kept
    assert claim.led[K0].wait(0.0) is fresh and len(s.fetcher.flights) == 0


def test_mgr_21_the_address_is_health_watched_once_with_the_fetched_instance_as_baseline() -> None:
    s = setup()
    for _ in range(2):
        claim = lead(s, K0)
        s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
        s.fetcher.abandon(ADDR, claim, None)
    assert s.health.watched == [(ADDR, "instance-a", False)]  # no probe inside the request


def test_plan_fetches_every_tp_rank_and_flags_dummy_ranks() -> None:
    s = setup()
    plan = RankPlan(tp_ranks=(0, 1), dummy_tp_ranks=frozenset({1}))
    fetched = s.fetcher.fetch(ADDR, plan, lead(s, K0), room=1, adopted={})
    assert isinstance(fetched, dict)
    assert [(r.port, r.is_dummy) for r in fetched[K0].ranks] == [(5000, False), (5001, True)]
    assert s.source.rank_calls == [(ADDR, 0, 0, 0), (ADDR, 0, 1, 0)]


def test_mgr_3_a_key_published_between_lookup_and_claim_is_taken_from_the_pool() -> None:
    s = setup()
    winner = generation(5000)
    s.pool.publish(K0, winner)
    entries: dict[PoolKey, Generation] = {}
    claim = s.fetcher.claim([K0, K1], entries, s.deadline())
    assert isinstance(claim, Claim)
    assert claim.missing == [K1] and set(claim.led) == {K1} and entries == {K0: winner}
    assert len(s.fetcher.flights) == 1


def test_mgr_3_a_follower_adopts_what_the_leader_published() -> None:
    s = setup()
    leader = lead(s, K0)
    flight = leader.led[K0]
    entries: dict[PoolKey, Generation] = {}
    answers: list[object] = []
    follower = threading.Thread(
        target=lambda: answers.append(s.fetcher.claim([K0, K1], entries, s.deadline()))
    )
    follower.start()
    give_up = time.monotonic() + 10.0
    while flight.followers == 0 and time.monotonic() < give_up:
        time.sleep(0)  # yield until the follower has joined the flight (no timed wait)
    assert flight.followers == 1
    fetched = s.fetcher.fetch(ADDR, DEFAULT_PLAN, leader, room=1, adopted={})
    assert isinstance(fetched, dict)
    s.fetcher.publish(ADDR, leader, fetched)
    follower.join(10.0)
    (claim,) = answers
    assert isinstance(claim, Claim) and claim.followed and claim.led == {}
    assert entries == {K0: fetched[K0]}  # recorded from the moment it adopted (MGR-1)
    assert claim.missing == [K1]  # not in flight then: the follower looks again
    assert s.source.rank_calls == [(ADDR, 0, 0, 0)]  # one fetch for both requests


def test_mgr_3_a_follower_past_its_deadline_answers_the_typed_error_without_waiting() -> None:
    s = setup()
    lead(s, K0)
    answer = s.fetcher.claim([K0], {}, s.clock())  # the deadline is now
    assert isinstance(answer, FetchWaitTimeout)


def test_mgr_23_keys_answered_by_two_instances_are_never_accepted_together() -> None:
    s = setup()
    s.source.instances = ["instance-a", "instance-b"]  # restarted between the two keys
    claim = lead(s, K0, K1)
    answer = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
    assert isinstance(answer, PrefillRestarted)
    assert (answer.old_id, answer.new_id) == ("instance-a", "instance-b")
    assert all(flight.error is answer for flight in claim.led.values())  # followers fail too
    assert len(s.pool) == 0 and s.health.watched == []


def test_one_keys_ranks_answered_by_two_instances_fail_the_fetch() -> None:
    s = setup()
    s.source.instances = ["instance-a", "instance-b"]
    answer = s.fetcher.fetch(ADDR, RankPlan(tp_ranks=(0, 1)), lead(s, K0), room=1, adopted={})
    assert isinstance(answer, BootstrapHTTPError) and "restarted" in str(answer)


def test_mgr_19_a_rank_the_transport_judged_dead_is_refused_and_the_key_held_off() -> None:
    s = setup()
    s.transport.down.add(("127.0.0.1", 5000))
    claim = lead(s, K0)
    answer = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
    assert isinstance(answer, RanksUnreachable) and answer.retryable
    assert answer.endpoint == "tcp://127.0.0.1:5000"
    assert claim.led[K0].error is answer
    assert len(s.fanout.dead_keys) == 1
    assert s.transport.sends == []  # nothing of this request was sent


def test_mgr_22_a_fetch_that_failed_while_its_server_was_judged_silent_says_so() -> None:
    s = setup()
    cause = TransportFailure("timed out", addr=ADDR)
    s.source.failing[ADDR] = cause
    plain = s.fetcher.fetch(ADDR, DEFAULT_PLAN, lead(s, K0), room=1, adopted={})
    assert plain is cause
    s.silent.judged_silent(ADDR, "probes unanswered")
    claim = lead(s, K0)
    answer = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
    assert isinstance(answer, PrefillSilent) and answer.__cause__ is cause
    assert claim.led[K0].error is answer


def test_mgr_19_a_failed_register_is_evidence_for_the_others_and_retryable_for_this_one() -> None:
    s = setup()
    s.transport.failing.add(("127.0.0.1", 5000))
    other = FakeReceiver(2, entries={K1: generation(5000)})
    s.rooms.by_room[2] = other
    claim = lead(s, K0)
    fetched = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
    assert isinstance(fetched, dict)
    answer = s.fetcher.register(ADDR, claim, fetched)
    assert isinstance(answer, RanksUnreachable) and isinstance(answer.__cause__, SendFailed)
    assert len(other.lost) == 1  # the other request on that endpoint is lost too
    assert claim.led[K0].error is answer


def test_a_publish_the_source_refuses_fails_the_flights_with_its_reason() -> None:
    s = setup()
    s.source.refuse_publish = True
    claim = lead(s, K0)
    fetched = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
    assert isinstance(fetched, dict)
    published = s.fetcher.publish(ADDR, claim, fetched)
    assert published.entries == {} and isinstance(published.stale, PeerLost)
    assert claim.led[K0].error is published.stale and len(s.pool) == 0
    assert s.transport.retained == {}


def test_mgr_3_a_concurrent_winner_is_adopted_and_its_sockets_not_retained_again() -> None:
    s = setup()
    claim = lead(s, K0)
    fetched = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={})
    assert isinstance(fetched, dict)
    winner = generation(5000)
    s.pool.publish(K0, winner)  # another process path published first
    published = s.fetcher.publish(ADDR, claim, fetched)
    assert published.entries == {K0: winner} and claim.led[K0].wait(0.0) is winner
    assert s.transport.retained == {}


def test_mgr_3_abandon_fails_the_flights_nobody_resolved() -> None:
    s = setup()
    claim = lead(s, K0, K1)
    s.fetcher.flights.resolve({K0: claim.led[K0]}, {K0: generation(5000)})
    s.fetcher.abandon(ADDR, claim, None)
    assert claim.led[K0].error is None
    with pytest.raises(PeerLost, match="abandoned"):
        claim.led[K1].wait(0.0)
    reason = PeerLost("the request's own reason")
    again = lead(s, K1)
    s.fetcher.abandon(ADDR, again, reason)
    assert again.led[K1].error is reason


def test_pool_6_an_answer_from_a_new_instance_retires_the_adopted_old_one() -> None:
    s = setup()
    old = generation(5000)  # instance-a
    s.pool.publish(K0, old)
    stale_user = FakeReceiver(2, entries={K0: old})
    s.rooms.by_room[2] = stale_user
    s.source.instance = "instance-b"
    claim = lead(s, K1)
    fetched = s.fetcher.fetch(ADDR, DEFAULT_PLAN, claim, room=1, adopted={K0: old})
    assert isinstance(fetched, dict)
    assert set(fetched) == {K0, K1}  # the stale key fetched again
    assert {g.instance_id for g in fetched.values()} == {"instance-b"}
    assert s.pool.get(K0) is None  # the old instance's entry retired
    assert isinstance(stale_user.lost[0], PrefillRestarted)
