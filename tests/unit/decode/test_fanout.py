"""``FanOut`` (statemachine/decode/fanout.py, spec/manager.md MGR-1, MGR-6, MGR-19, MGR-20,
POOL-6): evidence fails every receiver in flight that depends on what it names, by identity,
and nothing else; the real pool, rooms, routes, dead keys and retention beside fake receivers,
a fake source and a fake transport."""

from __future__ import annotations

from dataclasses import dataclass

from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.exits import ExitProofs
from statemachine.decode.fanout import FanOut
from statemachine.decode.holds import AbortHolds
from statemachine.decode.ranks.verdicts import Verdict
from statemachine.decode.retention import SocketRetention
from statemachine.decode.rooms import Rooms
from statemachine.decode.routes import Routes
from statemachine.errors import (
    PeerLost,
    PrefillDead,
    PrefillRestarted,
    RankDead,
    RanksUnreachable,
    SendFailed,
)
from statemachine.pool import BootstrapPool, Generation

from .fakes import (
    ADDR,
    OTHER_ADDR,
    FakeReceiver,
    FakeSource,
    FakeTransport,
    ManualBackground,
    ManualClock,
    generation,
    key,
    topology,
)

URL = "tcp://127.0.0.1:5001"


@dataclass
class Setup:
    fanout: FanOut
    pool: BootstrapPool
    rooms: Rooms
    routes: Routes
    source: FakeSource
    transport: FakeTransport
    retention: SocketRetention
    clock: ManualClock

    def receiver(self, room: int, *held: Generation, addr: str = ADDR) -> FakeReceiver:
        receiver = FakeReceiver(room, addr, {key(i, addr=addr): g for i, g in enumerate(held)})
        self.rooms.by_room[room] = receiver
        return receiver


def setup(*, hold_off_dead: bool = True, health_by_probes: bool = True) -> Setup:
    clock = ManualClock()
    pool, rooms, transport = BootstrapPool(), Rooms(clock), FakeTransport()
    source = FakeSource(health_by_probes=health_by_probes)
    routes = Routes(source, None, staging=False, background=ManualBackground())  # type: ignore[arg-type]
    retention = SocketRetention(pool=pool, rooms=rooms, transport=transport)  # type: ignore[arg-type]
    fanout = FanOut(
        rooms=rooms,
        routes=routes,
        pool=pool,
        source=source,
        dead_keys=DeadKeys(clock=clock, recheck_s=1.0),
        hold_off_dead=hold_off_dead,
        clock=clock,
        retention=retention,
        exits=ExitProofs(pool=pool, rooms=rooms, holds=AbortHolds(30.0, clock)),
    )
    return Setup(fanout, pool, rooms, routes, source, transport, retention, clock)


def test_mgr_1_every_receiver_using_a_doomed_generation_fails_and_only_those() -> None:
    s = setup()
    doomed, healthy = generation(5001), generation(5002)
    users = [s.receiver(1, doomed), s.receiver(2, healthy, doomed)]
    bystander = s.receiver(3, healthy)
    error = PeerLost("gone")
    assert s.fanout.fail_generations([doomed], error) == 2
    assert [r.lost for r in users] == [[error], [error]] and bystander.lost == []
    assert error.evidence_at == s.clock()  # the detection time starts here
    assert s.fanout.failed == {"PeerLost": 2}


def test_mgr_1_generations_are_invalidated_by_identity_a_newer_one_is_kept() -> None:
    s = setup()
    doomed = generation(5001)
    newer = generation(5001)  # the same ports, another fetch
    s.pool.publish(key(0), doomed)
    s.pool.publish(key(1), newer)
    s.fanout.fail_generations([doomed], PeerLost("gone"))
    assert s.pool.get(key(0)) is None and s.pool.get(key(1)) is newer
    assert s.fanout.invalidations == {"PeerLost": 1}


def test_pool_6_the_finder_is_spared() -> None:
    s = setup()
    doomed = generation(5001)
    finder, other = s.receiver(1, doomed), s.receiver(2, doomed)
    assert s.fanout.fail_generations([doomed], PeerLost("gone"), spare_room=1) == 1
    assert finder.lost == [] and len(other.lost) == 1


def test_mgr_10_sockets_of_dropped_generations_are_released() -> None:
    s = setup()
    doomed = generation(5001)
    s.pool.publish(key(0), doomed)
    s.retention.retain(doomed)
    s.fanout.fail_generations([doomed], PeerLost("gone"))
    assert s.transport.released == [("127.0.0.1", 5001)]


def test_mgr_1_a_dead_endpoint_fails_its_users_with_rank_dead_and_holds_the_key_off() -> None:
    s = setup()
    dead = generation(5001)
    s.pool.publish(key(0), dead)
    user = s.receiver(1, dead)
    assert s.fanout.endpoint_dead(URL, "reconnect refused") == 1
    (error,) = user.lost
    assert isinstance(error, RankDead) and error.endpoint == URL
    assert "retry the request" in str(error)
    assert len(s.fanout.dead_keys) == 1  # remembered (dead_keys.py has its own tests)
    assert s.pool.get(key(0)) is None


def test_mgr_1_an_endpoint_nothing_uses_fails_nothing() -> None:
    s = setup()
    s.receiver(1, generation(5002))
    assert s.fanout.endpoint_dead(URL, "dead") == 0
    assert s.fanout.failed == {}


def test_mgr_1_a_source_that_reports_deaths_itself_is_never_held_off() -> None:
    s = setup(health_by_probes=False)
    s.receiver(1, generation(5001))
    s.fanout.endpoint_dead(URL, "dead")
    assert len(s.fanout.dead_keys) == 0


def test_mgr_19_a_send_failure_and_a_dead_verdict_are_evidence_an_alive_one_forgets() -> None:
    s = setup()
    first = s.receiver(1, generation(5001))
    second = s.receiver(2, generation(5002), addr=OTHER_ADDR)  # another key
    s.fanout.send_failed(SendFailed("refused", endpoint=URL))
    s.fanout.on_verdict(Verdict(("127.0.0.1", 5002), False, "timed out"))
    assert len(first.lost) == 1 and len(second.lost) == 1
    assert len(s.fanout.dead_keys) == 2
    s.fanout.on_verdict(Verdict(("127.0.0.1", 5001), True, "connected"))
    assert len(s.fanout.dead_keys) == 1  # the endpoint answers again: its key is news again


def test_mgr_1_a_dead_address_fails_its_receivers_and_forgets_its_route() -> None:
    s = setup()
    s.source.topologies[ADDR] = topology()
    s.routes.address_plan(ADDR)
    used = generation(5001)
    s.pool.publish(key(0), used)
    mine, elsewhere = s.receiver(1, used), s.receiver(2, generation(5009), addr=OTHER_ADDR)
    assert s.fanout.fail_address(ADDR, PrefillDead("stopped answering", addr=ADDR)) == 1
    assert isinstance(mine.lost[0], PrefillDead) and elsewhere.lost == []
    assert ADDR not in s.routes.known and s.pool.get(key(0)) is None


def test_mgr_20_a_restart_fails_only_what_the_old_instance_served() -> None:
    s = setup()
    old, new = generation(5001), generation(5002, instance_id="instance-b")
    stale_user, fresh_user = s.receiver(1, old), s.receiver(2, new)
    s.fanout.dead_keys.record([(key(0), old)], URL, "dead")
    s.fanout.address_restarted(ADDR, "instance-a", "instance-b")
    (error,) = stale_user.lost
    assert isinstance(error, PrefillRestarted)
    assert (error.old_id, error.new_id) == ("instance-a", "instance-b")
    assert fresh_user.lost == []
    assert len(s.fanout.dead_keys) == 0  # a new instance: every registration is new


def test_pool_6_an_instance_replaced_mid_fetch_retires_the_old_id_and_spares_the_finder() -> None:
    s = setup()
    old = generation(5001)
    s.pool.publish(key(0), old)
    finder, other = s.receiver(1, old), s.receiver(2, old)
    s.fanout.instance_replaced(ADDR, ["instance-a", None], "instance-b", finder=1)
    assert s.pool.get(key(0)) is None
    assert finder.lost == [] and isinstance(other.lost[0], PrefillRestarted)


def test_mgr_19_ranks_named_dead_again_hold_the_key_off_only_with_the_hold_off_on() -> None:
    error = RanksUnreachable("named again", addr=ADDR, endpoint=URL)
    for hold_off, remembered in ((True, 1), (False, 0)):
        s = setup(hold_off_dead=hold_off)
        s.fanout.named_dead_again({key(0): generation(5001)}, error)
        assert len(s.fanout.dead_keys) == remembered


def test_close_forgets_the_keys_known_dead() -> None:
    s = setup()
    s.fanout.named_dead_again(
        {key(0): generation(5001)}, RanksUnreachable("x", addr=ADDR, endpoint=URL)
    )
    s.fanout.close()
    assert len(s.fanout.dead_keys) == 0


def test_invalidations_are_counted_by_cause_and_release_what_nothing_uses() -> None:
    s = setup()
    dropped = generation(5001)
    s.retention.retain(dropped)  # published by us, then dropped by a lifecycle event
    s.fanout.invalidated({key(0): dropped}, 1, "Clear")
    s.fanout.invalidated({}, 0, "Clear")
    assert s.fanout.invalidations == {"Clear": 1}
    assert s.transport.released == [("127.0.0.1", 5001)]
