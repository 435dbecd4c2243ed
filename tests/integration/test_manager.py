"""DecodeManager against real parts: a real bootstrap server on 127.0.0.1, prefill rank
*processes* killed and restarted, real ZMQ sockets, the real ack listener and health monitor.

Each failure path ends with every in-flight request Failed with a typed reason, within a
generous correctness bound (not a performance claim: ``benchmarks/bench_recovery.py`` measures),
and with nothing left behind: no ack expectation, no receiver in flight, no retained socket,
no thread after close. Requirement IDs: MGR-n (spec/manager.md), LIFE-n (spec/lifecycle.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from statemachine import lifecycle as life
from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import DecodeLayout, RankPlan, derive_plan
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.demo.baselines import UnmonitoredTransport
from statemachine.errors import (
    Aborted,
    BootstrapError,
    BootstrapTimeout,
    ConfigurationError,
    FetchWaitTimeout,
    InvalidRoom,
    InvalidTransition,
    NotReady,
    PeerLost,
    PrefillDead,
    PrefillRestarted,
    RankDead,
    RanksUnreachable,
    SendFailed,
    TopologyMismatch,
    WaitingTimeout,
)
from statemachine.pool import BootstrapPool, PoolKey, RankInfo
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.registration import register_rank
from statemachine.prefill.server import BootstrapServer
from statemachine.validation import Topology
from statemachine.wire.http import route_payload
from statemachine.wire.metadata import MetadataRequest
from statemachine.wire.reference import SimpleBackend, parse_metadata
from tests.support.http_support import FakeClock, HoldingProxy
from tests.support.manager_support import (
    FAIL_BOUND_S,
    SLOW_ACK_MS,
    WakeCounter,
    in_flight_waiting,
    manager_for,
    poll_all_failed,
    wait_until,
)
from tests.support.receiver_support import (
    PLAN,
    POLL_LIMIT_S,
    TOKEN,
    TP,
    Prefill,
    _TwoDpPlan,
    finish,
    key_of,
    start_prefill,
    stop_prefill,
)
from tests.support.zmq_support import VerdictRecorder


def assert_nothing_left(manager: DecodeManager) -> None:
    stats = manager.stats()
    assert manager.acks is not None and manager.acks.stats().expected == 0
    assert stats.in_flight == 0
    assert stats.endpoints_retained == 0
    assert stats.sockets_open == 0


# --- failure fan-out (MGR-1, MGR-2) -----------------------------------------------------------


def test_mgr_1_kill_one_rank_fails_every_request_in_flight_on_it(slow_prefill: Prefill) -> None:
    """A rank dies; the transport's verdict on its socket is the evidence: every request in
    flight on that generation fails with RankDead at once (not after the waiting timeout), and
    its generation, ack expectations and sockets are gone; a request started afterwards fails
    on its first send to the dead rank.

    Deterministic: it waits for the verdict and for every victim's wake-up, never for a time.
    (It used to race a probe's send against the verdict and failed 1 run in 2 under load.)
    Catches a fan-out that matches a generation by its first rank only (rank 1 dies here),
    sockets never released after the fan-out, and failures without their evidence time."""
    with manager_for(waiting_timeout_s=300.0) as manager:
        victims = in_flight_waiting(manager, slow_prefill, range(1, 9))
        woken = WakeCounter(victims)
        verdicts = VerdictRecorder()
        manager.transport.subscribe(verdicts)
        dead = ("127.0.0.1", slow_prefill.ranks[1].port)
        slow_prefill.ranks[1].kill()
        verdicts.wait_for(dead, alive=False, timeout=FAIL_BOUND_S)
        assert woken.all_woken.wait(FAIL_BOUND_S), "the fan-out did not reach every victim"
        assert poll_all_failed(victims)
        for victim in victims:
            assert isinstance(victim.failure, RankDead), victim.failure
            assert "retry" in str(victim.failure)
            assert victim.state == life.INVALIDATED
        assert manager.pool.get(key_of(slow_prefill)) is None
        stats = manager.stats()
        assert stats.failures.get("RankDead") == len(victims)
        assert stats.detection.count == len(victims)
        assert_nothing_left(manager)
        # The server still lists the dead rank: the next request refetches it and fails
        # retryable (MGR-19: the circuit is open, or registering there is refused).
        probe = manager.receiver(slow_prefill.addr, 100, PLAN, prefill_dp_rank=0)
        assert probe.init() == KVPoll.Failed
        assert isinstance(probe.failure, RanksUnreachable), probe.failure
        assert manager.stats().failures.get("RanksUnreachable") == 1


def test_mgr_1_requests_after_a_known_death_fail_at_once_without_a_refetch_each(
    slow_prefill: Prefill,
) -> None:
    """Issue 18: once a rank is known dead while its bootstrap server still names it, one
    request refetches (and meets the dead rank); every request after it fails at once with the
    one retry rule's typed, retryable RanksUnreachable (MGR-19) and asks the server nothing
    (counted at the server) until ``dead_recheck_s`` passed; then one request asks again."""
    clock = FakeClock()
    with manager_for(dead_recheck_s=5.0, clock=clock) as manager:
        first = in_flight_waiting(manager, slow_prefill, range(1, 2))[0]
        verdicts = VerdictRecorder()
        manager.transport.subscribe(verdicts)
        dead = ("127.0.0.1", slow_prefill.ranks[1].port)
        slow_prefill.ranks[1].kill()
        verdicts.wait_for(dead, alive=False, timeout=FAIL_BOUND_S)
        assert wait_until(lambda: first.poll() == KVPoll.Failed)
        routes = slow_prefill.server.stats().requests.get("GET /route", 0)
        recheck = manager.receiver(slow_prefill.addr, 10, PLAN, prefill_dp_rank=0)
        assert recheck.init() == KVPoll.Failed
        assert isinstance(recheck.failure, RanksUnreachable), recheck.failure  # MGR-19
        asked = slow_prefill.server.stats().requests.get("GET /route", 0)
        assert asked == routes + TP  # the one refetch: every rank of the key
        for room in range(11, 31):
            receiver = manager.receiver(slow_prefill.addr, room, PLAN, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Failed
            assert isinstance(receiver.failure, RanksUnreachable), receiver.failure
            assert "known dead" in str(receiver.failure) and "retry" in str(receiver.failure)
        assert slow_prefill.server.stats().requests.get("GET /route", 0) == asked
        assert manager.stats().refused_known_dead == 20
        clock.now += 5.0  # the recheck is due: one request asks the server again
        again = manager.receiver(slow_prefill.addr, 40, PLAN, prefill_dp_rank=0)
        assert again.init() == KVPoll.Failed
        assert isinstance(again.failure, RanksUnreachable), again.failure
        assert slow_prefill.server.stats().requests.get("GET /route", 0) == asked + TP
        assert manager.stats().in_flight == 0


def test_mgr_1_a_rank_known_dead_is_served_by_the_first_request_after_it_registers_again(
    slow_prefill: Prefill,
) -> None:
    """Issue 18: the memory of a dead rank never outlives its registration: the rank comes
    back on a new port and registers; the first request allowed to ask (the recheck is due)
    fetches the new port and is served, and so is every request after it."""
    clock = FakeClock()
    with manager_for(dead_recheck_s=5.0, clock=clock) as manager:
        first = in_flight_waiting(manager, slow_prefill, range(1, 2))[0]
        verdicts = VerdictRecorder()
        manager.transport.subscribe(verdicts)
        old_port = slow_prefill.ranks[1].port
        slow_prefill.ranks[1].kill()
        verdicts.wait_for(("127.0.0.1", old_port), alive=False, timeout=FAIL_BOUND_S)
        assert wait_until(lambda: first.poll() == KVPoll.Failed)
        recheck = manager.receiver(slow_prefill.addr, 2, PLAN, prefill_dp_rank=0)
        assert recheck.init() == KVPoll.Failed  # refetched, met the dead rank again
        refused = manager.receiver(slow_prefill.addr, 3, PLAN, prefill_dp_rank=0)
        assert refused.init() == KVPoll.Failed
        assert isinstance(refused.failure, RanksUnreachable)
        assert "known dead" in str(refused.failure)
        slow_prefill.ranks[1].start(avoid_port=old_port)  # registers its new port
        assert slow_prefill.ranks[1].port != old_port
        clock.now += 5.0
        for room in (4, 5):
            served = manager.receiver(slow_prefill.addr, room, PLAN, prefill_dp_rank=0)
            assert served.init() == KVPoll.WaitingForInput, served.failure
            ports = {rank.port for g in served.entries.values() for rank in g.ranks}
            assert slow_prefill.ranks[1].port in ports
            served.abort()
        assert manager.stats().known_dead_keys == 0


def test_mgr_1_a_failed_send_fails_every_request_in_flight_on_that_rank(
    slow_prefill: Prefill,
) -> None:
    """With the socket monitor off, a request's own failed send is the only evidence: it fails
    every other request in flight on that generation with RankDead, in the same call.

    Until libzmq has seen the dead rank's connection close, a send to it is still taken (and
    lost); so requests are started until one's send fails - the event, not a time - and every
    one started before it is a victim too. Catches a failed send that fans out nothing."""
    transport = UnmonitoredTransport(send_timeout_ms=300)
    try:
        with manager_for(transport=transport, waiting_timeout_s=300.0) as manager:
            victims = in_flight_waiting(manager, slow_prefill, range(1, 5))
            slow_prefill.ranks[1].kill()
            for room in range(100, 100 + 100_000):
                probe = manager.receiver(slow_prefill.addr, room, PLAN, prefill_dp_rank=0)
                assert probe.init() == KVPoll.WaitingForInput  # a hit on the generation
                if probe.send_metadata((room,)) == KVPoll.Failed:
                    break
                victims.append(probe)
                time.sleep(0.001)  # leave libzmq's I/O thread the core
            else:
                pytest.fail("every send to a killed rank was taken")
            assert isinstance(probe.failure, SendFailed), probe.failure
            assert poll_all_failed(victims)  # no wait: the fan-out ran inside that send
            assert all(isinstance(v.failure, RankDead) for v in victims)
            assert manager.pool.get(key_of(slow_prefill)) is None
            assert manager.stats().failures == {"RankDead": len(victims), "SendFailed": 1}
    finally:
        transport.close()


def test_mgr_1_kill_whole_prefill_health_fails_everything_bound_to_it(
    slow_prefill: Prefill,
) -> None:
    """The whole prefill dies (server and ranks): the first evidence - the health monitor's
    failed probe (PrefillDead), or the transport's verdict on a rank's socket (RankDead) where
    the transport monitors its sockets - fails every room bound to it, without any send."""
    with manager_for(liveness_timeout_s=0.5, health_probes=True) as manager:
        victims = in_flight_waiting(manager, slow_prefill, range(1, 6))
        stop_prefill(slow_prefill)
        killed = time.monotonic()
        assert wait_until(lambda: poll_all_failed(victims))
        assert time.monotonic() - killed < FAIL_BOUND_S
        assert all(isinstance(v.failure, (PrefillDead, RankDead)) for v in victims)
        failures = manager.stats().failures
        assert set(failures) <= {"PrefillDead", "RankDead"}
        assert sum(failures.values()) == len(victims)
        assert_nothing_left(manager)
    assert manager.health is not None and not any(
        t.name == "bootstrap-health" for t in threading.enumerate()
    )


def test_mgr_1_restart_behind_same_address_fails_old_rooms_and_serves_new_ones() -> None:
    """A new prefill instance answers behind the same address (its bootstrap server restarted;
    the rank processes stay up, so no socket says anything): the health monitor sees the new
    instance id and every room of the old instance fails with PrefillRestarted; once the ranks
    registered with the new instance, the next request succeeds on it; nothing is left."""
    first = start_prefill(ack_delay_ms=SLOW_ACK_MS)
    port = int(first.addr.rsplit(":", 1)[1])
    threads_before = threading.active_count()
    server: BootstrapServer | None = None
    try:
        with manager_for(liveness_timeout_s=1.0, health_probes=True) as manager:
            assert manager.health is not None
            victims = in_flight_waiting(manager, first, range(1, 6))
            old_id = first.server.instance_id
            assert wait_until(lambda: _probed(manager, first.addr))
            first.server.stop()
            server = BootstrapServer("127.0.0.1", port, token=TOKEN).start()
            restarted = time.monotonic()
            assert wait_until(lambda: poll_all_failed(victims), timeout=POLL_LIMIT_S)
            assert time.monotonic() - restarted < POLL_LIMIT_S
            for victim in victims:
                assert isinstance(victim.failure, PrefillRestarted), victim.failure
                assert (victim.failure.old_id, victim.failure.new_id) == (
                    old_id,
                    server.instance_id,
                )
            assert manager.pool.get(key_of(first)) is None
            for rank in first.ranks:
                payload = route_payload(
                    rank_ip="127.0.0.1", rank_port=rank.port, tp_rank=rank.tp_rank, tp_size=TP
                )
                register_rank(server.address, TOKEN, payload)
            fresh = manager.receiver(server.address, 50, PLAN, prefill_dp_rank=0)
            assert fresh.init() == KVPoll.WaitingForInput
            assert all(g.instance_id == server.instance_id for g in fresh.entries.values())
            fresh.abort()  # these ranks ack after a minute; abort tells them to forget it
            stats = manager.stats()
            assert stats.in_flight == 0 and manager.acks is not None
            assert manager.acks.stats().expected == 0
            assert stats.endpoints_retained == TP  # only the live (new) generation's ranks
    finally:
        for rank in first.ranks:
            rank.kill()
        first.server.stop()
        if server is not None:
            server.stop()
    assert wait_until(lambda: threading.active_count() <= threads_before)


def _restart_server(prefill: Prefill) -> BootstrapServer:
    """A new bootstrap server (a new instance id) behind ``prefill``'s address; the rank
    processes stay up on their ports and register with it, so no socket can tell."""
    port = int(prefill.addr.rsplit(":", 1)[1])
    prefill.server.stop()
    server = BootstrapServer("127.0.0.1", port, token=TOKEN).start()
    for rank in prefill.ranks:
        payload = route_payload(
            rank_ip="127.0.0.1", rank_port=rank.port, tp_rank=rank.tp_rank, tp_size=TP
        )
        register_rank(server.address, TOKEN, payload)
    return server


def test_mgr_1_a_fetch_answered_by_a_new_instance_retires_the_old_one() -> None:
    """POOL-6 on the fetch side, with nothing else to tell: no socket monitor, no health
    monitor, the ranks alive on their ports. A request that adopted an entry of instance A and
    fetched another key from a server now answering as B retires A's entries, fails the other
    requests in flight on them with PrefillRestarted ("seen by fetch"), refetches its stale
    key and goes on with B's generations only.

    Catches: the retirement not fanning out (the victims would wait out their timeout), the
    finder failing itself (its own exclusion dropped), and the stale key not refetched (the
    finder would start a transfer on A's ports)."""
    first = start_prefill(ack_delay_ms=SLOW_ACK_MS)
    transport = UnmonitoredTransport(send_timeout_ms=500)
    server: BootstrapServer | None = None
    try:
        with manager_for(transport=transport) as manager:
            victims = in_flight_waiting(manager, first, range(1, 4))
            old = manager.pool.get(key_of(first))
            assert old is not None
            old_id = first.server.instance_id
            server = _restart_server(first)
            finder = manager.receiver(
                server.address, 50, _TwoDpPlan(tp_ranks=PLAN.tp_ranks), prefill_dp_rank=0
            )
            # One key hits A's entry, the other misses and is fetched from B.
            assert finder.init() == KVPoll.WaitingForInput, finder.failure
            assert {g.instance_id for g in finder.entries.values()} == {server.instance_id}
            fresh = manager.pool.get(key_of(first))
            assert fresh is not None and fresh is not old
            assert finder.entries[key_of(first)] is fresh
            for victim in victims:
                assert victim.poll() == KVPoll.Failed  # no wait: failed inside the fetch
                assert isinstance(victim.failure, PrefillRestarted), victim.failure
                assert (victim.failure.old_id, victim.failure.new_id) == (
                    old_id,
                    server.instance_id,
                )
                assert "seen by fetch" in str(victim.failure)
            assert finder.send_metadata((50,)) == KVPoll.Transferring
            finder.abort()
            assert manager.stats().failures == {"PrefillRestarted": len(victims), "Aborted": 1}
    finally:
        stop_prefill(first)
        if server is not None:
            server.stop()
        transport.close()


class _RestartsAfterTheFirstKey(BootstrapClient):
    """A real client whose server is replaced between two keys of one fetch: once the first
    key's ranks were answered (``TP`` questions), a new bootstrap server (a new instance id,
    the same rank processes registered with it) takes the address before the next question.
    A stand-in for the timing only - a prefill restarting inside one request's fetch - which
    no real path can place between two questions on demand; the server, the ranks and the
    client are the real ones."""

    def __init__(self, prefill: Prefill) -> None:
        super().__init__(connect_timeout=1.0, read_timeout=2.0)
        self._prefill = prefill
        self._answered = 0
        self.replacement: BootstrapServer | None = None

    def get_rank(  # type: ignore[override]
        self, addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int
    ) -> object:
        reply = super().get_rank(
            addr, dp_rank=dp_rank, cp_rank=cp_rank, tp_rank=tp_rank, pp_rank=pp_rank
        )
        self._answered += 1
        if self._answered == TP and self.replacement is None:
            self.replacement = _restart_server(self._prefill)
        return reply


def test_mgr_23_a_fetch_whose_keys_two_instances_answered_is_never_accepted() -> None:
    """MGR-23: one request's two keys missed and were fetched together; the first key was
    answered by instance A, then the prefill's bootstrap server restarted (B) and answered the
    second. The request fails with PrefillRestarted (retryable, naming A then B), publishes
    nothing, and its retry fetches both keys from B.

    Catches a fetch that accepts keys of two instances (the request would go on with one
    generation of each, one of them the old instance's)."""
    first = start_prefill()
    client = _RestartsAfterTheFirstKey(first)
    old_id = first.server.instance_id
    try:
        with manager_for(source=client) as manager:
            plan = _TwoDpPlan(tp_ranks=PLAN.tp_ranks)
            keys = plan.keys_for(first.addr, 0)
            receiver = manager.receiver(first.addr, 60, plan, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Failed
            assert client.replacement is not None  # the restart came between the two keys
            error = receiver.failure
            assert isinstance(error, PrefillRestarted), error
            assert error.retryable
            assert (error.old_id, error.new_id) == (old_id, client.replacement.instance_id)
            assert all(manager.pool.get(key) is None for key in keys)  # nothing published
            retry = manager.receiver(first.addr, 61, plan, prefill_dp_rank=0)
            assert retry.init() == KVPoll.WaitingForInput, retry.failure
            assert {g.instance_id for g in retry.entries.values()} == {
                client.replacement.instance_id
            }
            assert set(retry.entries) == set(keys)
            retry.abort()
    finally:
        client.close()
        stop_prefill(first)
        if client.replacement is not None:
            client.replacement.stop()


def test_mgr_1_a_restart_notice_leaves_requests_on_the_new_instance_alone() -> None:
    """The health monitor's restart notice (A replaced by B) fails the requests in flight on
    A's generations and none already running on B's. Driven by ``probe_once`` (the monitor's
    thread probes once an hour here), so the notice comes exactly when the test says.
    Catches a restart fan-out that fails every request bound to the address."""
    first = start_prefill(ack_delay_ms=SLOW_ACK_MS)
    transport = UnmonitoredTransport(send_timeout_ms=500)
    server: BootstrapServer | None = None
    try:
        with manager_for(
            transport=transport,
            health_probes=True,
            liveness_timeout_s=14_400.0,  # probes once an hour
        ) as manager:
            assert manager.health is not None
            old_rooms = in_flight_waiting(manager, first, range(1, 4))  # baseline: A
            server = _restart_server(first)
            # A request keyed by tp rank 1 misses (A's entry is keyed by tp rank 0), so it
            # fetches from B and adopts nothing of A's.
            by_tp1 = RankPlan(tp_ranks=PLAN.tp_ranks, target_tp_rank=1)
            new_room = manager.receiver(server.address, 10, by_tp1, prefill_dp_rank=0)
            assert new_room.init() == KVPoll.WaitingForInput
            assert {g.instance_id for g in new_room.entries.values()} == {server.instance_id}
            assert new_room.send_metadata((10,)) == KVPoll.Transferring
            manager.health.probe_once()  # sees B where it saw A
            assert manager.health.restarts_seen == 1
            for receiver in old_rooms:
                assert receiver.poll() == KVPoll.Failed
                assert isinstance(receiver.failure, PrefillRestarted), receiver.failure
                assert "seen by health" in str(receiver.failure)
            assert new_room.poll() == KVPoll.Transferring and new_room.failure is None
            new_generation = new_room.entries[PoolKey(server.address, 0, 0, 1)]
            assert manager.pool.get(PoolKey(server.address, 0, 0, 1)) is new_generation
            new_room.abort()
    finally:
        stop_prefill(first)
        if server is not None:
            server.stop()
        transport.close()


def test_mgr_1_a_room_whose_acks_all_arrived_succeeds_despite_later_evidence() -> None:
    """MGR-14: evidence arriving after every response came in changes nothing - the fan-out
    skips the room (counts 0) and the next poll says Success. Waits for the acks' wake-up.
    Catches a fan-out that fails a room already fully acknowledged."""
    prefill = start_prefill(ack_delay_ms=0)
    try:
        with manager_for() as manager:
            receiver = manager.receiver(prefill.addr, 1, PLAN, prefill_dp_rank=0)
            acked = WakeCounter([receiver])  # the only news it can get: its acks
            assert receiver.init() == KVPoll.WaitingForInput
            assert receiver.send_metadata((1,)) == KVPoll.Transferring
            assert acked.all_woken.wait(FAIL_BOUND_S), "the prefill's acks never arrived"
            generation = receiver.entries[key_of(prefill)]
            evidence = RankDead("rank gone after the transfer", endpoint="tcp://127.0.0.1:1")
            assert manager.fail_generations([generation], evidence) == 0
            assert receiver.poll() == KVPoll.Success and receiver.failure is None
            stats = manager.stats()
            assert stats.fanout.get("RankDead") == 0 and stats.failures == {}
            assert stats.completed == 1
    finally:
        stop_prefill(prefill)


def _probed(manager: DecodeManager, addr: str) -> bool:
    """The health monitor has a baseline instance id for ``addr`` (it probed it once)."""
    assert manager.health is not None
    manager.health.watch(addr)
    time.sleep(0.2)  # a few probe intervals
    return True


def test_mgr_2_fail_address_and_fail_generations_entry_points(slow_prefill: Prefill) -> None:
    """The manager API other parts call: fail_generations fails exactly the users of those
    generation objects; fail_address every room bound to the address; both return counts."""
    with manager_for() as manager:
        victims = in_flight_waiting(manager, slow_prefill, range(1, 4))
        generation = manager.pool.get(key_of(slow_prefill))
        assert generation is not None
        other = manager.receiver("127.0.0.1:1", 99, PLAN, prefill_dp_rank=0)  # never started
        assert manager.fail_generations([generation], RankDead("test", endpoint="x")) == 3
        assert manager.fail_generations([generation], RankDead("again", endpoint="x")) == 0
        assert manager.pool.get(key_of(slow_prefill)) is None
        assert poll_all_failed(victims)
        with pytest.raises(InvalidTransition):  # never init()ed (MGR-7), untouched
            other.poll()
        assert manager.fail_address("127.0.0.1:1", PrefillDead("gone", addr="127.0.0.1:1")) == 1
        assert other.init() == KVPoll.Failed and isinstance(other.failure, PrefillDead)
        assert_nothing_left(manager)


# --- single flight (MGR-3) --------------------------------------------------------------------


def test_mgr_3_64_racing_misses_make_one_fetch(slow_prefill: Prefill) -> None:
    """64 receivers miss one key at once: one leads the fetch (GET /route = ranks, counted by
    the server) and one registration; the 63 others adopt the very generation it published."""
    queries_before = slow_prefill.server.stats().requests.get("GET /route", 0)
    with manager_for() as manager:
        receivers = [manager.receiver(slow_prefill.addr, room, PLAN) for room in range(64)]
        barrier = threading.Barrier(len(receivers))
        results: list[KVPoll] = []

        def run(receiver: BootstrapReceiver) -> None:
            barrier.wait(POLL_LIMIT_S)
            results.append(receiver.init(0))

        threads = [threading.Thread(target=run, args=(r,)) for r in receivers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(POLL_LIMIT_S)
        assert results == [KVPoll.WaitingForInput] * 64
        generation = manager.pool.get(key_of(slow_prefill))
        assert all(r.entries[key_of(slow_prefill)] is generation for r in receivers)
        queries = slow_prefill.server.stats().requests.get("GET /route", 0) - queries_before
        assert queries == TP
        stats = manager.stats()
        assert stats.publishes == 1 and stats.flights_led == 1
        for receiver in receivers:
            receiver.clear()
        assert manager.stats().in_flight == 0


def test_mgr_3_a_failed_fetch_fails_every_follower_with_its_reason() -> None:
    """The leader's fetch fails (503: no rank registered): every follower fails with the same
    typed reason from idle (FetchFail), after one query; nothing is cached."""
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    try:
        with manager_for() as manager:
            receivers = [manager.receiver(server.address, room, PLAN) for room in range(16)]
            barrier = threading.Barrier(len(receivers))

            def run(receiver: BootstrapReceiver) -> None:
                barrier.wait(POLL_LIMIT_S)
                receiver.init(0)

            threads = [threading.Thread(target=run, args=(r,)) for r in receivers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(POLL_LIMIT_S)
            assert all(isinstance(r.failure, NotReady) for r in receivers)
            assert all(r.state == life.INVALIDATED for r in receivers)
            assert (
                server.stats().requests.get("GET /route", 0) <= 2
            )  # one flight (maybe a late one)
            assert len(manager.pool) == 0 and manager.stats().in_flight == 0
    finally:
        server.stop()


# --- completion (MGR-4) -----------------------------------------------------------------------


def test_mgr_4_every_terminal_path_forgets_the_ack_expectation(slow_prefill: Prefill) -> None:
    """Abort, clear, timeout, a failed send and fan-out each leave no room expected.

    The expectation is the receiver in flight itself (its set of prefill responses, as SGLang's
    decode manager keeps one per room), so no room expected = no receiver in flight."""
    now = [0.0]
    with manager_for(clock=lambda: now[0], waiting_timeout_s=10.0) as manager:
        assert manager.acks is not None
        aborted, cleared, timed_out, lost = in_flight_waiting(manager, slow_prefill, range(1, 5))
        assert manager.stats().in_flight == 4
        aborted.abort()
        cleared.clear()
        assert cleared.poll() == KVPoll.Failed and isinstance(cleared.failure, Aborted)
        now[0] = 10.0  # elapsed == timeout: SGLang fires at >=
        assert timed_out.poll() == KVPoll.Failed and isinstance(timed_out.failure, WaitingTimeout)
        assert manager.fail_room(lost.room, "rank 0 reported a transfer error")
        assert lost.poll() == KVPoll.Failed and isinstance(lost.failure, PeerLost)
        assert manager.stats().in_flight == 0
        slow_prefill.ranks[0].kill()
        # The timeout dropped the generation: a refetch registers with the dead rank and fails.
        failing = manager.receiver(slow_prefill.addr, 9, PLAN, prefill_dp_rank=0)
        assert failing.init() == KVPoll.Failed
        assert isinstance(failing.failure, RanksUnreachable)  # retryable (MGR-19)
        assert manager.acks.stats().expected == 0  # the manager never uses the listener's table
        assert manager.stats().in_flight == 0


def test_mgr_13_a_repeated_report_counts_once_and_complete_says_so(slow_prefill: Prefill) -> None:
    """MGR-13: ``complete(room, prefill_rank=r)`` returns whether the report was new; a rank
    reporting twice counts once (the room of two ranks still waits for the other), and the
    second call says False. Catches a repeat taken as new (``complete`` would return True)."""
    with manager_for() as manager:
        (receiver,) = in_flight_waiting(manager, slow_prefill, range(1, 2))
        assert receiver.expected_acks() == TP
        assert manager.complete(1, prefill_rank=0) is True
        assert manager.complete(1, prefill_rank=0) is False
        assert receiver.poll() == KVPoll.Transferring
        assert manager.complete(1, prefill_rank=1) is True
        assert receiver.poll() == KVPoll.Success
        assert manager.complete(1, prefill_rank=1) is False  # no longer in flight


def test_mgr_4_external_completion_for_engines_that_report_it() -> None:
    """completion='external': no ack listener; the transfer engine calls complete(room)."""
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    prefill = Prefill(server)
    try:
        from statemachine.prefill.rank_process import PrefillRankProcess

        for tp_rank in range(TP):
            rank = PrefillRankProcess(server.address, TOKEN, tp_rank=tp_rank, tp_size=TP)
            prefill.ranks.append(rank)
            rank.start()
        backend = SimpleBackend("127.0.0.1", 1, "engine-session")
        with manager_for(completion="external", backend=backend) as manager:
            assert manager.acks is None
            receiver = manager.receiver(server.address, 7, PLAN, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.WaitingForInput
            assert receiver.send_metadata((1, 2)) == KVPoll.Transferring
            assert receiver.poll() == KVPoll.Transferring
            # SGLang 0.5.23 counts distinct prefill ranks: both of PLAN's ranks must report.
            assert manager.complete(7, prefill_rank=0)
            assert not manager.complete(7, prefill_rank=0)  # a repeat counts once
            assert receiver.poll() == KVPoll.Transferring
            assert manager.complete(7, prefill_rank=1)
            assert receiver.poll() == KVPoll.Success
            assert not manager.complete(7)  # no longer in flight
    finally:
        stop_prefill(prefill)


def test_mgr_4_kv_indices_numpy_and_sequences_pack_alike() -> None:
    """kv_indices: a tuple, a list, a range, an array.array or a numpy int array give the same
    wire bytes; floats, strings and out-of-range items are rejected at construction."""
    import array

    numpy = pytest.importorskip("numpy")
    expected = MetadataRequest(1, (3, 1, -1, 2**31 - 1), 0).kv_bytes
    for indices in (
        [3, 1, -1, 2**31 - 1],
        array.array("i", [3, 1, -1, 2**31 - 1]),
        numpy.array([3, 1, -1, 2**31 - 1], dtype=numpy.int32),
        numpy.array([3, 1, -1, 2**31 - 1], dtype=numpy.int64),
    ):
        assert MetadataRequest(1, indices, 0).kv_bytes == expected
    assert MetadataRequest(1, range(4), 0).kv_indices == (0, 1, 2, 3)
    big = numpy.arange(100_000, dtype=numpy.int32)
    frames = SimpleBackend("127.0.0.1", 1, "s").metadata_frames(
        PLAN_RANK, MetadataRequest(1, big, 0)
    )
    assert parse_metadata(frames).kv_indices[-1] == 99_999
    for bad in ("abc", [1.5], [2**31], numpy.array([0.5]), numpy.zeros((2, 2), dtype=int), 7):
        with pytest.raises((TypeError, ValueError)):
            MetadataRequest(1, bad, 0)


PLAN_RANK = RankInfo("127.0.0.1", 1, 0)


# --- SGLang semantics (MGR-5..MGR-9) ----------------------------------------------------------


def test_mgr_5_dummy_ranks_get_flagged_messages_and_no_transfer() -> None:
    """A decode rank that is a dummy peer for prefill tp rank 1 still registers with it and sends
    it the metadata (dummy flag set); that rank transfers nothing and sends no ack; the request
    completes on the non-dummy rank's ack."""
    prefill = start_prefill()
    try:
        plan = RankPlan(tp_ranks=(0, 1), dummy_tp_ranks=frozenset({1}))
        with manager_for() as manager:
            receiver = manager.receiver(prefill.addr, 3, plan, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.WaitingForInput
            assert receiver.expected_acks() == 1
            assert receiver.send_metadata((4, 5)) == KVPoll.Transferring
            assert finish(receiver) == KVPoll.Success
        stats = [rank.terminate() for rank in prefill.ranks]
    finally:
        stop_prefill(prefill)
    assert stats[0] is not None and stats[1] is not None
    assert (stats[0]["register"], stats[0]["metadata"], stats[0]["acks_sent"]) == (1, 1, 1)
    assert (stats[1]["register"], stats[1]["metadata"], stats[1]["acks_sent"]) == (1, 1, 0)


def test_mgr_6_abort_tells_every_rank_once_so_no_transfer_follows() -> None:
    """abort() in waiting sends one ABORT per rank: the prefill drops the room's pending
    transfer, so no ack ever arrives for it; a second abort() sends nothing."""
    prefill = start_prefill(ack_delay_ms=400)
    try:
        with manager_for() as manager:
            assert manager.acks is not None
            receiver = manager.receiver(prefill.addr, 11, PLAN, prefill_dp_rank=0)
            receiver.init()
            receiver.send_metadata((1,))
            sends = manager.transport.stats().sends
            receiver.abort()
            assert manager.transport.stats().sends == sends + TP
            receiver.abort()
            assert manager.transport.stats().sends == sends + TP
            assert receiver.poll() == KVPoll.Failed and isinstance(receiver.failure, Aborted)
            control = manager.receiver(prefill.addr, 12, PLAN, prefill_dp_rank=0)
            control.init()
            control.send_metadata((1,))
            assert finish(control) == KVPoll.Success  # acks still flow for other rooms
            time.sleep(0.2)
            assert manager.acks.stats().unknown == 0  # room 11's acks were never sent
    finally:
        stop_prefill(prefill)


def test_mgr_7_clear_keeps_results_and_failure_exception_fails_without_reason(
    slow_prefill: Prefill,
) -> None:
    """clear(): Success and Failed stay; an unfinished receiver becomes Failed (Abort) and a
    late completion cannot complete it. failure_exception() with no local reason raises a
    generic PeerLost and the receiver is Failed."""
    with manager_for() as manager:
        unfinished, generic = in_flight_waiting(manager, slow_prefill, range(1, 3))
        unfinished.clear()
        unfinished.mark_transferred()  # late
        assert unfinished.poll() == KVPoll.Failed and unfinished.state == life.ABORTED
        with pytest.raises(PeerLost, match="no local reason"):
            generic.failure_exception()
        assert generic.poll() == KVPoll.Failed
        with pytest.raises(PeerLost):
            generic.failure_exception()  # the recorded reason, again
        failed = manager.receiver(slow_prefill.addr, 3, PLAN)
        failed.send_metadata((1,))
        failed.clear()
        assert failed.poll() == KVPoll.Failed and isinstance(failed.failure, InvalidTransition)
        assert_nothing_left(manager)


def _register_ranks(
    server: BootstrapServer, ports: dict[tuple[int, int], int], **extra: object
) -> None:
    dp_size = 1 + max(dp for dp, _ in ports)
    tp_size = 1 + max(tp for _, tp in ports)
    for (dp, tp), port in ports.items():
        payload = route_payload(
            rank_ip="127.0.0.1",
            rank_port=port,
            tp_rank=tp,
            tp_size=tp_size,
            dp_rank=dp,
            dp_size=dp_size,
        )
        payload.update(extra)
        register_rank(server.address, TOKEN, payload)


@contextmanager
def dp_prefill(dp_size: int, **extra: object) -> Iterator[BootstrapServer]:
    """A bootstrap server with ``dp_size`` registered dp ranks (tp 1), each a bound ZMQ PULL
    socket on loopback; ``extra`` goes into every registration. Everything closes on exit."""
    import zmq

    context = zmq.Context()
    sockets = [context.socket(zmq.PULL) for _ in range(dp_size)]
    ports = {(dp, 0): s.bind_to_random_port("tcp://127.0.0.1") for dp, s in enumerate(sockets)}
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    try:
        _register_ranks(server, ports, **extra)
        yield server
    finally:
        server.stop()
        for sock in sockets:
            sock.close(linger=0)
        context.term()


def _register_dp_rooms(server: BootstrapServer, rooms: tuple[tuple[int, int], ...]) -> None:
    """The prefill's POST /register_dp_rank for each (room, dp rank)."""
    import requests

    for room, dp in rooms:
        requests.post(
            f"http://{server.address}/register_dp_rank",
            json={"bootstrap_room": room, "dp_rank": dp},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        ).raise_for_status()


def test_mgr_8_pending_rooms_batch_one_query_per_address_per_step() -> None:
    """dp_size 2 without follow_bootstrap_room: rooms wait (Bootstrapping) for the manager's
    step, which asks once for all pending rooms; an unknown room stays pending and fails with
    BootstrapTimeout after the bootstrap timeout - never at once."""
    # SGLang's prefill says so with a load-balance method other than follow_bootstrap_room
    # (older reference servers read the flag itself; both are sent).
    with dp_prefill(2, load_balance_method="round_robin", follow_bootstrap_room=False) as server:
        _register_dp_rooms(server, ((1, 1), (2, 0), (3, 1)))
        with manager_for(bootstrap_timeout_s=0.3) as manager:
            receivers = [manager.receiver(server.address, room) for room in (1, 2, 3, 4)]
            assert [r.init() for r in receivers] == [KVPoll.Bootstrapping] * 4
            assert manager.stats().pending_dp == 4
            assert manager.step(wait=True) == 3  # the synchronous form
            assert server.stats().requests.get("POST /query_dp_ranks", 0) == 1
            assert [r.init() for r in receivers[:3]] == [KVPoll.WaitingForInput] * 3
            assert [next(iter(r.entries)).dp_rank for r in receivers[:3]] == [1, 0, 1]
            assert receivers[3].init() == KVPoll.Bootstrapping  # unknown: still pending
            assert manager.step(wait=True) == 0
            time.sleep(0.3)
            assert receivers[0].poll() == KVPoll.WaitingForInput  # resolved: no timeout
            assert receivers[3].poll() == KVPoll.Failed
            assert isinstance(receivers[3].failure, BootstrapTimeout)
            for receiver in receivers[:3]:
                receiver.clear()
            assert manager.stats().pending_dp == 0


def test_mgr_8_step_returns_while_its_query_is_in_flight_and_applies_it_later() -> None:
    """step() never waits on the network (issue 18): the bootstrap server holds the batched
    POST /query_dp_ranks unanswered; step() returns with the query in flight, later steps
    start no second one for that address, the rooms stay pending (init() says Bootstrapping
    at once), and the step after the answer arrives resolves them."""
    with dp_prefill(2, load_balance_method="round_robin", follow_bootstrap_room=False) as server:
        _register_dp_rooms(server, ((1, 1), (2, 0)))
        with HoldingProxy(server.address) as proxy, manager_for() as manager:
            proxy.hold.clear()  # the topology comes back at once
            receivers = [manager.receiver(proxy.address, room) for room in (1, 2)]
            assert [r.init() for r in receivers] == [KVPoll.Bootstrapping] * 2
            proxy.hold.set()  # from now on the server answers nothing
            proxy.got_request.clear()
            assert manager.step() == 0
            assert proxy.got_request.wait(FAIL_BOUND_S)
            assert manager.stats().dp_queries_in_flight == 1  # returned with it in flight
            for _ in range(3):
                assert manager.step() == 0
            assert [r.init() for r in receivers] == [KVPoll.Bootstrapping] * 2
            assert manager.stats().dp_queries == 1  # one query in flight per address
            assert proxy.count("POST /query_dp_ranks") == 1
            proxy.hold.clear()  # the answer goes out
            resolved = 0
            deadline = time.monotonic() + FAIL_BOUND_S
            while resolved < 2 and time.monotonic() < deadline:
                resolved += manager.step()
                time.sleep(0.005)
            assert resolved == 2
            assert manager.stats().dp_queries_in_flight == 0
            assert [r.init() for r in receivers] == [KVPoll.WaitingForInput] * 2
            assert [next(iter(r.entries)).dp_rank for r in receivers] == [1, 0]
            for receiver in receivers:
                receiver.clear()


def test_mgr_8_prepare_fetches_the_topology_off_the_callers_thread() -> None:
    """prepare(addr) starts the topology fetch on the manager's background workers: while the
    bootstrap server holds it unanswered, init() for that address returns Bootstrapping at
    once instead of fetching on the caller's thread; once it is answered, init() goes on."""
    prefill = start_prefill()
    try:
        with (
            HoldingProxy(prefill.server.address) as proxy,
            manager_for(layout=DecodeLayout(0, 1)) as manager,
        ):
            future = manager.prepare(proxy.address)
            assert proxy.got_request.wait(FAIL_BOUND_S)
            assert manager.prepare(proxy.address) is future  # one fetch per address
            receiver = manager.receiver(proxy.address, 1, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Bootstrapping
            assert not future.done()  # the fetch is still held: init() did not wait for it
            assert receiver.poll() == KVPoll.Bootstrapping
            proxy.hold.clear()
            known = future.result(timeout=FAIL_BOUND_S)
            assert known.plan.tp_ranks == (0, 1)
            assert manager.prepare(proxy.address).result(timeout=0) is known
            assert receiver.init() == KVPoll.WaitingForInput
            assert proxy.count("GET /route?prefill_dp_rank=-1") == 1  # one topology fetch
            receiver.send_metadata((1,))
            assert finish(receiver) == KVPoll.Success
    finally:
        stop_prefill(prefill)


def test_mgr_8_follow_bootstrap_room_and_single_dp_need_no_query() -> None:
    """SGLang's order: router-given rank first; follow_bootstrap_room: room % dp_size."""
    topology = Topology(2, 1, 4, 1, 16, "bfloat16", None, None)
    assert topology.follow_bootstrap_room is None  # never set means True
    with dp_prefill(4) as server, manager_for() as manager:
        by_room = manager.receiver(server.address, 7)
        assert by_room.init() == KVPoll.WaitingForInput
        assert next(iter(by_room.entries)).dp_rank == 7 % 4
        routed = manager.receiver(server.address, 8, prefill_dp_rank=2)
        assert routed.init() == KVPoll.WaitingForInput
        assert next(iter(routed.entries)).dp_rank == 2
        assert server.stats().requests.get("POST /query_dp_ranks", 0) == 0
        by_room.clear()
        routed.clear()


def test_mgr_9_rank_plan_derived_from_topology_and_checked() -> None:
    """RankPlan from the prefill's topology and this decode's tp layout (every rule and
    SGLang's own mapping: tests/integration/test_plan.py, tests/sglang/test_sglang_plans.py); a
    page size or KV
    dtype mismatch is a typed TopologyMismatch, and a receiver meeting it fails (FetchFail)
    with that reason."""
    prefill_tp2 = Topology(2, 1, 1, 1, 16, "bfloat16", None, "i")
    assert derive_plan("a:1", prefill_tp2, DecodeLayout(0, 2)).tp_ranks == (0,)
    assert derive_plan("a:1", prefill_tp2, DecodeLayout(1, 2)).tp_ranks == (1,)
    assert derive_plan("a:1", prefill_tp2, DecodeLayout(0, 1)).tp_ranks == (0, 1)
    for rank in (2, 3):  # two decode ranks share prefill rank 1, both real peers of it
        shared = derive_plan("a:1", prefill_tp2, DecodeLayout(rank, 4))
        assert shared.tp_ranks == (1,) and shared.dummy_tp_ranks == frozenset()
        assert shared.required_dst_info_num == 2 and shared.required_prefill_response_num == 1
    for layout in (
        DecodeLayout(0, 3),
        DecodeLayout(page_size=32),
        DecodeLayout(kv_cache_dtype="fp8_e4m3"),
    ):
        with pytest.raises(TopologyMismatch, match="prefill"):
            derive_plan("a:1", prefill_tp2, layout)

    prefill = start_prefill()
    try:
        with manager_for(layout=DecodeLayout(0, 1, page_size=1, kv_cache_dtype="auto")) as manager:
            whole = manager.receiver(prefill.addr, 1, prefill_dp_rank=0)
            assert whole.init() == KVPoll.WaitingForInput
            assert whole.plan is not None and whole.plan.tp_ranks == (0, 1)
            whole.send_metadata((1,))
            assert finish(whole) == KVPoll.Success
        with manager_for(layout=DecodeLayout(page_size=64)) as manager:
            wrong = manager.receiver(prefill.addr, 2, prefill_dp_rank=0)
            assert wrong.init() == KVPoll.Failed
            assert isinstance(wrong.failure, TopologyMismatch)
            assert "page_size" in str(wrong.failure)
    finally:
        stop_prefill(prefill)


def test_mgr_9_a_restarted_prefill_is_planned_again_from_its_new_topology() -> None:
    """The plan an address resolved once (and the hit path reads, ``address_plans``) goes with
    the instance it was derived from: a prefill of tp 2 restarts behind the same address as tp
    1, the health monitor sees the new instance, and the next request is planned from the new
    topology (one rank) and succeeds; a plan kept from before would fetch a tp rank 1 that no
    longer exists."""
    first = start_prefill()
    port = int(first.addr.rsplit(":", 1)[1])
    second: Prefill | None = None
    try:
        with manager_for(
            layout=DecodeLayout(0, 1), health_probes=True, liveness_timeout_s=1.0
        ) as manager:
            before = manager.receiver(first.addr, 1, prefill_dp_rank=0)
            assert before.init() == KVPoll.WaitingForInput
            assert before.plan is not None and before.plan.tp_ranks == (0, 1)
            before.send_metadata((1,))
            assert finish(before) == KVPoll.Success
            assert _probed(manager, first.addr)
            stop_prefill(first)
            second = Prefill(BootstrapServer("127.0.0.1", port, token=TOKEN).start())
            rank = PrefillRankProcess(second.server.address, TOKEN, tp_rank=0, tp_size=1)
            second.ranks.append(rank)
            rank.start()
            rooms = iter(range(2, 10_000))

            def served_by_one_rank() -> bool:
                after = manager.receiver(first.addr, next(rooms), prefill_dp_rank=0)
                if after.init() != KVPoll.WaitingForInput:
                    return False
                assert after.plan is not None and after.plan.tp_ranks == (0,)
                after.send_metadata((2,))
                return finish(after) == KVPoll.Success

            assert wait_until(served_by_one_rank, timeout=POLL_LIMIT_S)
    finally:
        stop_prefill(first)
        if second is not None:
            stop_prefill(second)


# --- API errors (issue 12) --------------------------------------------------------------------


def test_bad_rooms_and_parts_are_rejected_at_construction_with_typed_errors() -> None:
    with manager_for() as manager:
        for room in (-1, "abc", 2**64, 1.0, True, None):
            with pytest.raises(InvalidRoom, match="room"):
                manager.receiver("127.0.0.1:1", room)  # type: ignore[arg-type]
        manager.receiver("127.0.0.1:1", 5)
        with pytest.raises(InvalidRoom, match="already in flight"):
            manager.receiver("127.0.0.1:1", 5)
    for bad in ({"pool": "pool"}, {"source": object()}, {"transport": 3}, {"backend": object()}):
        with pytest.raises(ConfigurationError):
            DecodeManager(health_probes=False, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="pool must be a BootstrapPool"):
        DecodeManager(pool=object(), health_probes=False)  # type: ignore[arg-type]
    assert issubclass(ConfigurationError, BootstrapError)


def test_invalid_transition_names_the_method_state_and_what_comes_first(
    slow_prefill: Prefill,
) -> None:
    with manager_for() as manager:
        receiver = manager.receiver(slow_prefill.addr, 1, PLAN, prefill_dp_rank=0)
        receiver.init()
        with pytest.raises(InvalidTransition) as caught:
            receiver.init()
        text = str(caught.value)
        assert text.startswith("init() called in state 'cached'") and "new receiver" in text
        assert caught.value.method == "init" and caught.value.state == "cached"
        receiver.send_metadata((1,))
        with pytest.raises(InvalidTransition, match=r"send_metadata\(\) called in state 'waiting'"):
            receiver.send_metadata((1,))
        receiver.abort()


def test_close_fails_what_is_in_flight_and_stops_threads(slow_prefill: Prefill) -> None:
    threads_before = threading.active_count()
    manager = DecodeManager(liveness_timeout_s=0.5)
    victims = in_flight_waiting(manager, slow_prefill, range(1, 3))
    manager.close()
    assert all(v.poll() == KVPoll.Failed for v in victims)
    assert wait_until(lambda: threading.active_count() <= threads_before)
    with pytest.raises(BootstrapError, match="closed"):
        manager.receiver(slow_prefill.addr, 9)


def test_pool_is_shared_not_owned() -> None:
    pool = BootstrapPool()
    with manager_for(pool=pool) as manager:
        assert manager.pool is pool


def test_stats_and_prometheus_export_read_the_same_figures(slow_prefill: Prefill) -> None:
    """stats() for code; the Prometheus collector renders the same figures at scrape time."""
    prometheus = pytest.importorskip("prometheus_client")
    from statemachine.decode.metrics import PrometheusCollector

    with manager_for() as manager:
        victims = in_flight_waiting(manager, slow_prefill, range(1, 3))
        generation = manager.pool.get(key_of(slow_prefill))
        assert generation is not None
        manager.fail_generations([generation], RankDead("test", endpoint="tcp://x:1"))
        assert poll_all_failed(victims)
        stats = manager.stats()
        assert stats.failures == {"RankDead": 2} and stats.fanout == {"RankDead": 2}
        assert stats.invalidations == {"RankDead": 1}
        assert stats.misses == 1 and stats.hits == 1 and stats.detection.count == 2
        registry = prometheus.CollectorRegistry()
        PrometheusCollector(manager).register(registry)
        text = prometheus.generate_latest(registry).decode()
        assert 'pd_bootstrap_requests_failed_total{reason="RankDead"} 2.0' in text
        assert 'pd_bootstrap_invalidations_total{cause="RankDead"} 1.0' in text
        assert "pd_bootstrap_cache_hits_total 1.0" in text
        assert "pd_bootstrap_failure_detection_seconds_count 2.0" in text
        assert "pd_bootstrap_zmq_sockets_open" in text
        assert "pd_bootstrap_callback_errors_total 0.0" in text
        assert "pd_bootstrap_dp_queries_in_flight 0.0" in text
        assert "pd_bootstrap_known_dead_keys 0.0" in text
        assert "pd_bootstrap_refused_known_dead_total 0.0" in text
        assert "pd_bootstrap_silent_addresses 0.0" in text
        assert "pd_bootstrap_refused_silent_total 0.0" in text


class SlowSource:
    """A real BootstrapClient whose rank queries take ``delay`` longer (a slow server)."""

    def __init__(self, delay: float) -> None:
        self.client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
        self.delay = delay

    def get_rank(self, addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int):  # type: ignore[no-untyped-def]
        time.sleep(self.delay)
        return self.client.get_rank(
            addr, dp_rank=dp_rank, cp_rank=cp_rank, tp_rank=tp_rank, pp_rank=pp_rank
        )

    def get_topology(self, addr: str) -> Topology:
        return self.client.get_topology(addr)

    def query_dp_ranks(self, addr: str, rooms: list[int]) -> dict[int, int]:
        return self.client.query_dp_ranks(addr, rooms)


def test_mgr_3_a_follower_past_its_deadline_fails_and_the_leader_goes_on(
    slow_prefill: Prefill,
) -> None:
    """A follower waits for the leader's fetch at most flight_timeout_s, then fails from idle
    with FetchWaitTimeout; the leader's fetch still publishes. Any BootstrapSource will do."""
    source = SlowSource(delay=0.3)
    with manager_for(source=source, flight_timeout_s=0.05) as manager:
        leader = manager.receiver(slow_prefill.addr, 1, PLAN, prefill_dp_rank=0)
        thread = threading.Thread(target=leader.init)
        thread.start()
        assert wait_until(lambda: manager.flights is not None and len(manager.flights) == 1)
        follower = manager.receiver(slow_prefill.addr, 2, PLAN, prefill_dp_rank=0)
        assert follower.init() == KVPoll.Failed
        assert isinstance(follower.failure, FetchWaitTimeout)
        assert "retry" in str(follower.failure)
        thread.join(POLL_LIMIT_S)
        assert leader.state == life.CACHED
        assert manager.pool.get(key_of(slow_prefill)) is leader.entries[key_of(slow_prefill)]
        leader.clear()
    source.client.close()


def test_mgr_1_a_transport_verdict_fails_the_requests_on_that_endpoint(
    slow_prefill: Prefill,
) -> None:
    """The transport's listener reporting an endpoint dead (here: the socket monitor saw the
    rank's connection refused) fails the requests in flight whose generation names it, with
    RankDead, and nothing else. Waits for the verdict and the victims' wake-ups (events)."""
    with manager_for() as manager:
        victims = in_flight_waiting(manager, slow_prefill, range(1, 4))
        woken = WakeCounter(victims)
        bystander = manager.receiver("127.0.0.1:1", 50, PLAN, prefill_dp_rank=0)
        verdicts = VerdictRecorder()
        manager.transport.subscribe(verdicts)
        dead = ("127.0.0.1", slow_prefill.ranks[0].port)
        slow_prefill.ranks[0].kill()
        verdicts.wait_for(dead, alive=False, timeout=FAIL_BOUND_S)
        assert woken.all_woken.wait(FAIL_BOUND_S)
        assert poll_all_failed(victims)
        assert all(isinstance(v.failure, RankDead) for v in victims)
        with pytest.raises(InvalidTransition):  # bound elsewhere: untouched (not lost), idle
            bystander.poll()
        bystander.clear()
        assert_nothing_left(manager)


def test_mgr_5_6_frames_carry_the_dummy_flag_and_abort_parses_strictly() -> None:
    """MGR-5/MGR-6 frame layouts: the dummy flag is the last frame of register and metadata
    (b"0"/b"1", nothing else); the abort message is [abort, room, session, pp rank]."""
    from statemachine.errors import MalformedFrames
    from statemachine.wire.reference import (
        ABORT_FRAMES,
        METADATA_FRAMES,
        REGISTER_FRAMES,
        parse_abort,
        parse_register,
    )

    backend = SimpleBackend("127.0.0.1", 5555, "session-d")
    dummy, real = RankInfo("127.0.0.1", 1, 0, True), RankInfo("127.0.0.1", 2, 1, False)
    request = MetadataRequest(9, (1, 2), 3)
    assert parse_register(backend.register_frames(dummy)).is_dummy
    assert not parse_register(backend.register_frames(real)).is_dummy
    assert parse_metadata(backend.metadata_frames(dummy, request)).is_dummy
    assert len(backend.register_frames(real)) == REGISTER_FRAMES
    assert len(backend.metadata_frames(real, request)) == METADATA_FRAMES
    abort = backend.abort_frames(real, 2**64 - 1)
    assert len(abort) == ABORT_FRAMES
    parsed = parse_abort(abort)
    assert (parsed.room, parsed.session_id, parsed.target_pp_rank) == (2**64 - 1, "session-d", 1)
    for bad_flag in (b"", b"2", b"true", b" 1"):
        frames = backend.metadata_frames(real, request)
        frames[-1] = bad_flag
        with pytest.raises(MalformedFrames):
            parse_metadata(frames)
    for bad in ([b"abort", b"1", b"s"], [b"abort", b"-1", b"s", b"0"], [b"abort", b"1", b"", b"0"]):
        with pytest.raises(MalformedFrames):
            parse_abort(bad)
    with pytest.raises(ValueError):
        backend.abort_frames(real, -1)
