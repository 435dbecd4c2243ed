"""BootstrapReceiver against real parts: an aiohttp bootstrap server on 127.0.0.1, prefill rank
*processes* with real ZMQ PULL sockets (killed and restarted for the restart tests), the real
pool, client, transport and ack listener, all owned by a real DecodeManager.

Requirement IDs: LIFE-n (spec/lifecycle.md), POOL-n (spec/pool.md).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from statemachine import lifecycle as life
from statemachine.completion import KVPoll
from statemachine.decode.receiver import BootstrapReceiver, RankPlan
from statemachine.errors import (
    Aborted,
    InvalidTransition,
    NotReady,
    PeerLost,
    SendFailed,
    WaitingTimeout,
)
from statemachine.pool import BootstrapPool, RankInfo
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.reference import SimpleBackend
from tests.support.bootstrap_support import TOKEN
from tests.support.http_support import ScriptedServer
from tests.support.receiver_support import (
    PLAN,
    POLL_LIMIT_S,
    TP,
    DecodeSide,
    Prefill,
    _TwoDpPlan,
    finish,
    key_of,
    make_decode,
    start_prefill,
    stop_prefill,
)


@pytest.fixture
def side() -> Iterator[DecodeSide]:
    yield from make_decode()


def rank_queries(prefill: Prefill) -> int:
    return prefill.server.stats().requests.get("GET /route", 0)


# --- happy path --------------------------------------------------------------------------------


def test_happy_path_miss_then_hit_makes_no_http_request(prefill: Prefill, side: DecodeSide) -> None:
    """LIFE-1/POOL-1/POOL-2: a miss fetches, registers and publishes; the next request hits
    the pool and makes no HTTP request at all."""
    first = side.run(prefill, room=1)
    assert first.state == life.DONE and first.poll() == KVPoll.Success
    generation = side.pool.get(key_of(prefill))
    assert generation is not None
    assert {rank.port for rank in generation.ranks} == prefill.ports()
    assert first.entries == {key_of(prefill): generation}
    queries = rank_queries(prefill)
    assert queries == TP  # one query per (tp, pp) rank

    second = side.run(prefill, room=2)
    assert second.state == life.DONE
    assert second.entries[key_of(prefill)] is generation
    assert rank_queries(prefill) == queries, "a cache hit must not query the bootstrap server"
    stats = side.pool.stats()
    assert (stats.hits, stats.misses, stats.publishes, stats.invalidations) == (1, 1, 1, 0)


# --- prefill restart (the SGLang #36029 bug) ---------------------------------------------------


def test_restart_on_new_ports_fails_fast_invalidates_and_next_request_refetches(
    prefill: Prefill, side: DecodeSide
) -> None:
    """LIFE-3/POOL-3: after a restart the request meeting the dead ports fails on its first send
    (IMMEDIATE), drops its generation; the next request refetches the new ports and succeeds."""
    assert side.run(prefill, room=1).state == life.DONE
    stale = side.pool.get(key_of(prefill))
    old_ports = prefill.ports()
    prefill.restart_ranks()
    assert prefill.ports().isdisjoint(old_ports)

    victim = side.receiver(prefill, room=2)
    assert victim.init(0) == KVPoll.WaitingForInput
    if victim.entries[key_of(prefill)] is stale:
        # A hit on the stale generation (no socket monitor noticed the deaths yet).
        started = time.monotonic()
        assert side.send(victim) == KVPoll.Failed
        assert time.monotonic() - started < POLL_LIMIT_S  # bounded; the benchmark measures it
        assert isinstance(victim.failure, (SendFailed, PeerLost))
        assert victim.state == life.INVALIDATED and victim.entries == {}
        assert side.pool.get(key_of(prefill)) is not stale
        with pytest.raises((SendFailed, PeerLost)):
            victim.failure_exception()
    else:
        # The transport's socket monitor saw the ranks die first: the manager had already
        # dropped the stale generation, so this request fetched the new ports.
        victim.clear()

    fresh = side.run(prefill, room=3)
    assert fresh.state == life.DONE
    generation = side.pool.get(key_of(prefill))
    assert generation is not None and generation is not stale
    assert {rank.port for rank in generation.ranks} == prefill.ports()


def test_server_restart_new_instance_id_retires_old_entries(side: DecodeSide) -> None:
    """POOL-6 (retire exactly the replaced instance, spec/pool.md): a receiver that adopted an
    entry of instance X by lookup and then fetched another key from a server answering as Y
    retires X's entries of that address, refetches the stale key, and so ends up with Y's
    generations only."""
    first = start_prefill(port=0)
    addr = first.addr
    port = int(addr.rsplit(":", 1)[1])
    plan_cp1 = RankPlan(tp_ranks=tuple(range(TP)))
    try:
        receiver = side.decode.receiver(addr, 1, plan_cp1)
        assert receiver.init(0) == KVPoll.WaitingForInput
        receiver.clear()
        old = side.pool.get(key_of(first))
        assert old is not None and old.instance_id == first.server.instance_id
    finally:
        stop_prefill(first)
    second = start_prefill(port=port)
    try:
        assert second.addr == addr and second.server.instance_id != old.instance_id
        # A request keyed by two dp ranks: dp 0 hits the old instance's entry, dp 1 misses.
        two_dp = _TwoDpPlan(tp_ranks=tuple(range(TP)))
        newcomer = side.decode.receiver(addr, 2, two_dp)
        assert newcomer.init(0) == KVPoll.WaitingForInput
        # The fetch answered as the new instance: the old entry was retired and refetched.
        assert side.pool.get(key_of(second)) is not old
        assert all(g.instance_id == second.server.instance_id for g in newcomer.entries.values())
        assert newcomer.entries[key_of(second)] is side.pool.get(key_of(second))
    finally:
        stop_prefill(second)


# --- concurrency -------------------------------------------------------------------------------


class BarrierBackend(SimpleBackend):
    """Holds each thread's first register until both racing receivers got there, so both
    have missed the pool and fetched before either publishes (a controlled interleaving)."""

    def __init__(self, barrier: threading.Barrier, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        object.__setattr__(self, "_barrier", barrier)

    __slots__ = ("_barrier",)
    _waited = threading.local()

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        if not getattr(self._waited, "done", False):
            self._waited.done = True
            self._barrier.wait(timeout=POLL_LIMIT_S)
        return super().register_frames(rank, instance_id=instance_id)


def test_racing_misses_publish_one_generation_and_the_loser_adopts(prefill: Prefill) -> None:
    """POOL-2 (AdoptionCorrect): two receivers miss the same key at once and both fetch and
    register - two managers sharing one pool, so single-flight (per manager) does not merge
    them; setdefault publishes one generation and the loser records the winner's object."""
    barrier = threading.Barrier(2)

    def backend_for(ack_port: int) -> SimpleBackend:
        return BarrierBackend(barrier, "127.0.0.1", ack_port, "decode-race")

    pool = BootstrapPool()
    for one in make_decode(backend_for=backend_for, pool=pool):
        for other in make_decode(backend_for=backend_for, pool=pool):
            receivers = [one.receiver(prefill, 1), other.receiver(prefill, 2)]
            threads = [threading.Thread(target=r.init, args=(0,)) for r in receivers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(POLL_LIMIT_S)
            winner = pool.get(key_of(prefill))
            assert winner is not None
            assert all(r.state == life.CACHED for r in receivers)
            assert all(r.entries[key_of(prefill)] is winner for r in receivers)
            stats = pool.stats()
            assert (stats.misses, stats.publishes, stats.adoptions) == (2, 1, 1)
            for receiver in receivers:
                assert receiver.send_metadata((1, 2, 3)) == KVPoll.Transferring
                assert finish(receiver) == KVPoll.Success


def test_stale_receiver_invalidation_never_deletes_a_newer_generation(
    prefill: Prefill, side: DecodeSide
) -> None:
    """POOL-3 (IdentitySafe), the seed race: receiver A holds generation g1 and stalls; the
    prefill restarts; C fails on g1 and drops it; B publishes g2; only then does A fail on g1
    and invalidate — g2 must survive. Threads with events fix the interleaving."""
    a_cached, a_go = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def receiver_a() -> None:
        a = side.receiver(prefill, room=1)
        a.init(0)
        outcome["g1"] = a.entries[key_of(prefill)]
        a_cached.set()
        a_go.wait(POLL_LIMIT_S)
        outcome["a_status"] = side.send(a)
        outcome["a"] = a

    thread_a = threading.Thread(target=receiver_a)
    thread_a.start()
    assert a_cached.wait(POLL_LIMIT_S)
    g1 = outcome["g1"]
    prefill.restart_ranks()

    c = side.receiver(prefill, room=2)
    assert c.init(0) == KVPoll.WaitingForInput
    if c.entries[key_of(prefill)] is g1:
        assert side.send(c) == KVPoll.Failed  # C detects the restart and drops g1
        assert side.pool.get(key_of(prefill)) is None
    else:
        c.clear()  # a socket monitor had already dropped g1 (and failed A: PeerLost)

    b_result: dict[str, BootstrapReceiver] = {}
    thread_b = threading.Thread(target=lambda: b_result.setdefault("b", side.run(prefill, 3)))
    thread_b.start()
    thread_b.join(POLL_LIMIT_S)
    g2 = side.pool.get(key_of(prefill))
    assert b_result["b"].state == life.DONE and g2 is not None and g2 is not g1

    kept_before = side.pool.stats().kept_newer
    a_go.set()
    thread_a.join(POLL_LIMIT_S)
    assert outcome["a_status"] == KVPoll.Failed
    assert side.pool.get(key_of(prefill)) is g2, "a stale invalidation deleted a newer generation"
    assert side.pool.stats().kept_newer == kept_before + 1
    last = side.run(prefill, room=4)
    assert last.state == life.DONE and last.entries[key_of(prefill)] is g2


def test_slow_prefill_costs_one_refetch_and_no_wrong_invalidation(side: DecodeSide) -> None:
    """A merely slow prefill (acks after the waiting timeout) makes the request time out and
    drop its own generation: one refetch later; another receiver's newer generation is kept."""
    slow = start_prefill(ack_delay_ms=1500)
    try:
        for fast_side in make_decode(waiting_timeout_s=0.5):
            receiver = fast_side.receiver(slow, room=1)
            assert receiver.init(0) == KVPoll.WaitingForInput
            own = receiver.entries[key_of(slow)]
            fast_side.send(receiver)
            # Another receiver republishes a newer generation meanwhile (a refetch elsewhere).
            fast_side.pool.invalidate({key_of(slow): own})
            newer = fast_side.decode.receiver(slow.addr, 2, PLAN)
            assert newer.init(0) == KVPoll.WaitingForInput
            newer_generation = fast_side.pool.get(key_of(slow))
            assert finish(receiver) == KVPoll.Failed
            assert isinstance(receiver.failure, WaitingTimeout)
            assert fast_side.pool.get(key_of(slow)) is newer_generation
            # Without the interference the timeout costs exactly one refetch.
            fast_side.pool.invalidate({key_of(slow): newer_generation})
            misses = fast_side.pool.stats().misses
            third = fast_side.decode.receiver(slow.addr, 3, PLAN)
            third.init(0)
            fast_side.send(third)
            assert finish(third) == KVPoll.Failed  # times out, drops its own generation
            assert fast_side.pool.get(key_of(slow)) is None
            fourth = fast_side.decode.receiver(slow.addr, 4, PLAN)
            fourth.init(0)
            assert fast_side.pool.stats().misses == misses + 2  # third's miss + one refetch
    finally:
        stop_prefill(slow)


# --- failures and API rules --------------------------------------------------------------------


def test_fetch_failure_not_ready_caches_nothing(side: DecodeSide) -> None:
    """A 503 (ranks not all registered) fails the request with NotReady; nothing is cached."""
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    try:
        receiver = side.decode.receiver(server.address, 1, PLAN)
        assert receiver.init(0) == KVPoll.Failed
        assert isinstance(receiver.failure, NotReady)
        assert receiver.state == life.INVALIDATED
        assert len(side.pool) == 0
    finally:
        server.stop()


def test_server_down_fails_request_and_caches_nothing(side: DecodeSide) -> None:
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    addr = server.address
    server.stop()
    receiver = side.decode.receiver(addr, 1, PLAN)
    assert receiver.init(0) == KVPoll.Failed
    assert receiver.state == life.INVALIDATED and len(side.pool) == 0


def test_dp_rank_of_a_single_dp_prefill_needs_no_query(prefill: Prefill, side: DecodeSide) -> None:
    """SGLang's order: with no router-given dp rank, a prefill with dp_size 1 serves every room
    from dp rank 0 - one topology query per address, no POST /query_dp_ranks."""
    first = side.receiver(prefill, room=77)
    assert first.init(None) == KVPoll.WaitingForInput
    second = side.receiver(prefill, room=78)
    assert second.init(None) == KVPoll.WaitingForInput
    assert set(second.entries) == {key_of(prefill)}
    requests = prefill.server.stats().requests
    assert requests.get("POST /query_dp_ranks", 0) == 0
    assert side.decode.stats().dp_queries == 0


def test_abort_does_not_invalidate_and_out_of_order_calls_raise(
    prefill: Prefill, side: DecodeSide
) -> None:
    """LIFE-4: API calls out of lifecycle order raise InvalidTransition; abort() ends the
    request without dropping pool entries (an abort says nothing about the prefill)."""
    early = side.receiver(prefill, room=9)
    # send_metadata before init fails the request (SGLang), with a reason naming the call.
    assert early.send_metadata((0,)) == KVPoll.Failed
    assert isinstance(early.failure, InvalidTransition)
    assert "send_metadata()" in str(early.failure) and "init()" in str(early.failure)
    assert early.state == life.INVALIDATED and len(side.pool) == 0
    receiver = side.receiver(prefill, room=1)
    receiver.init(0)
    with pytest.raises(InvalidTransition):
        receiver.init(0)
    with pytest.raises(InvalidTransition):
        receiver.invalidate_cached_bootstrap_infos()
    receiver.abort()
    assert receiver.poll() == KVPoll.Failed and receiver.state == life.ABORTED
    assert isinstance(receiver.failure, Aborted)
    assert side.pool.get(key_of(prefill)) is not None
    receiver.abort()  # idempotent once ended
    receiver.clear()
    assert receiver.entries == {} and receiver.state == life.ABORTED


# --- malformed bootstrap replies are never cached ----------------------------------------------

_good_or_bad_ip = st.sampled_from(["127.0.0.1", "", "not a host!", "127.0.0.1:80", 127, None])
_bad_port = st.sampled_from([0, -1, 65536, "5000", True, 5000.0, None])


@pytest.fixture(scope="module")
def scripted_rank() -> Iterator[tuple[ScriptedServer, int]]:
    """A scripted HTTP server (answers whatever the test sets) and a live PULL socket."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ScriptedServer() as scripted:
            yield scripted, port
    finally:
        pull.close()
        context.term()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_malformed_route_replies_are_never_cached(
    scripted_rank: tuple[ScriptedServer, int], data: st.DataObject
) -> None:
    """Whatever the bootstrap server answers (generated junk, wrong types, missing keys, bad
    ports), the pool only ever holds generations made of validated replies; a failed fetch
    caches nothing. Valid replies point at a live PULL socket on 127.0.0.1 (no other host)."""
    scripted, pull_port = scripted_rank
    reply = st.fixed_dictionaries(
        {},
        optional={
            "rank_ip": st.one_of(st.just("127.0.0.1"), _good_or_bad_ip),
            "rank_port": st.one_of(st.just(pull_port), _bad_port),
            "extra": st.integers(),
        },
    )
    valid = st.fixed_dictionaries(
        {"rank_ip": st.just("127.0.0.1"), "rank_port": st.just(pull_port)},
        optional={"extra": st.integers()},  # unknown keys are ignored, not fatal
    )
    body = data.draw(
        st.one_of(st.binary(max_size=40), reply, valid).map(
            lambda v: v if isinstance(v, bytes) else json.dumps(v).encode()
        )
    )
    scripted.set(data.draw(st.sampled_from([200, 200, 200, 404, 503, 500])), body)
    for side in make_decode():
        receiver = side.decode.receiver(scripted.address, 1, RankPlan())
        outcome = receiver.init(0)
        event(f"init -> {outcome.name}")  # --hypothesis-show-statistics: both branches occur
        held = side.pool.snapshot()
        if outcome == KVPoll.Failed:
            assert held == {}, f"a failed fetch cached {held}"
            assert receiver.state == life.INVALIDATED
        else:
            (generation,) = held.values()
            assert generation.ranks == (RankInfo("127.0.0.1", pull_port, 0, False),)
