"""etcd as a DecodeManager's source, end to end: real etcd, real prefill rank processes
registering themselves with ``prefill.rank --discovery etcd``, real receivers (ZMQ, acks).

The manager stamps every fetch with the watch's revision; a watch event retires exactly the
generations fetched at an older revision, marks them, and fails the receivers in flight that
hold them with :class:`RankRetired`; the HTTP health monitor is off (there is no HTTP server at
the bootstrap address at all here: it is only the prefill's name in etcd).

The watch path is tested deliberately: an overlapping restart leaves the old ranks' ports alive
(only the watch can know they were replaced), and the crash test turns the transport's socket
monitor off (only the lease expiry can tell).
"""

from __future__ import annotations

import threading
import time

import pytest

from statemachine import lifecycle as life
from statemachine.completion import KVPoll
from statemachine.decode.manager import DecodeManager
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.decode_on_etcd import manager_on_etcd
from statemachine.demo.baselines import FetchPerMissManager, UnmonitoredTransport
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.errors import NotReady, PeerLost, RankRetired
from statemachine.pool import PoolKey
from tests.support.etcd_cluster_support import (
    BOUND,
    PLAN,
    Instance,
    finish,
    launch,
    manager_for,
    run,
    start,
    visible,
)
from tests.support.etcd_support import EtcdServer, free_port, wait_until
from tests.support.zmq_support import VerdictRecorder


def test_overlapping_restart_is_found_by_the_watch_alone(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """The new instance re-registers every rank while the old one still runs (its ports stay
    alive, so neither a send nor the socket monitor can tell): the watch retires the old
    generation and fails the requests in flight on it with RankRetired."""
    prefix, addr, _ = cluster
    old = launch(etcd, cluster, ack_delay_ms=60_000)  # its transfers never finish in time
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    assert source is not None
    key = PoolKey(addr, 0, 0, 0)
    try:
        assert wait_until(lambda: visible(source, addr) == old.expected(), BOUND)
        waiting = [start(manager, addr, room) for room in range(1, 5)]
        assert all(r.state == life.WAITING for r in waiting)
        cached = manager.receiver(addr, 5, PLAN, prefill_dp_rank=0)
        assert cached.init() == KVPoll.WaitingForInput  # a hit, not started yet
        generation = manager.pool.get(key)
        assert generation is not None and getattr(generation, "revision", None) is not None

        new = launch(etcd, cluster)
        assert wait_until(lambda: manager.pool.get(key) is not generation, BOUND)
        for receiver in [*waiting, cached]:
            assert finish(receiver).state == life.INVALIDATED
            assert isinstance(receiver.failure, RankRetired), receiver.failure
        assert all(rank.alive() for rank in old.ranks)  # nothing but the watch knew
        assert source.stats().retired >= 1
        assert manager.stats().failures.get("RankRetired") == 5

        # Requests started once the new registration is visible: none fails.
        assert wait_until(lambda: visible(source, addr) == new.expected(), BOUND)
        for room in range(6, 11):
            receiver = run(manager, addr, room)
            assert receiver.state == life.DONE, receiver.failure
        fresh = manager.pool.get(key)
        assert fresh is not None and {r.port for r in fresh.ranks} == {r.port for r in new.ranks}
        assert manager.stats().in_flight == 0
    finally:
        manager.close()


def test_graceful_restart_fails_no_request_started_after_the_new_registration(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    prefix, addr, _ = cluster
    # Socket monitor off: a terminated rank's disconnect would otherwise race the lease
    # revocation to drop the entry, and the watch (what this test is about) could find it gone.
    transport = UnmonitoredTransport(send_timeout_ms=500)
    manager = manager_for(etcd, prefix, transport=transport)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    assert source is not None
    try:
        for cycle in range(2):
            instance = launch(etcd, cluster)
            expected = instance.expected()
            assert wait_until(lambda: visible(source, addr) == expected, BOUND)  # noqa: B023
            for room in range(10):
                receiver = run(manager, addr, 100 * cycle + room)
                assert receiver.state == life.DONE, receiver.failure
            instance.terminate()  # revokes its leases: the watch retires its generation
            assert wait_until(lambda: manager.pool.get(PoolKey(addr, 0, 0, 0)) is None, BOUND)
        assert manager.stats().failures == {}
        assert source.stats().retired >= 2
    finally:
        manager.close()
        transport.close()


def test_a_crashed_rank_that_registers_again_serves_the_next_request(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """Issue 18: with etcd the store still names a SIGKILLed rank until its lease expires, but
    asking the store costs microseconds and its watch shows a new registration at once, so a
    key whose rank died is never held off as known dead (only a source asked over the network
    is): requests on the dead rank fail, and the first request after the rank registered its
    new port is served, however soon (``dead_recheck_s`` is an hour here)."""
    prefix, addr, _ = cluster
    instance = launch(etcd, cluster)
    manager = manager_for(etcd, prefix, dead_recheck_s=3600.0)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    verdicts = VerdictRecorder()
    manager.transport.subscribe(verdicts)
    try:
        assert wait_until(lambda: visible(source, addr) == instance.expected(), BOUND)
        assert run(manager, addr, 1).state == life.DONE
        crashed = instance.ranks[1]
        old_port = crashed.port
        crashed.kill()  # the lease (10 s) outlives the test's wait: etcd still names the port
        verdicts.wait_for(("127.0.0.1", old_port), alive=False, timeout=BOUND)
        for room in (2, 3):
            assert run(manager, addr, room).state == life.INVALIDATED
        crashed.start(avoid_port=old_port)  # registers its new port under the same instance
        assert wait_until(lambda: visible(source, addr) == instance.expected(), BOUND)
        served = run(manager, addr, 4)
        assert served.state == life.DONE, served.failure
        assert manager.stats().known_dead_keys == 0
    finally:
        manager.close()


def test_sigkill_is_retired_by_lease_expiry(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """Socket monitor off: only the lease's expiry (etcd's delete) can retire the entry."""
    prefix, addr, _ = cluster
    ttl = 3  # keep-alive every 1.5 s: a loaded machine cannot starve it into an early expiry
    transport = UnmonitoredTransport(send_timeout_ms=500)
    manager = manager_for(etcd, prefix, transport=transport)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    assert source is not None
    key = PoolKey(addr, 0, 0, 0)
    try:
        instance = launch(etcd, cluster, ttl=ttl)
        assert wait_until(lambda: visible(source, addr) == instance.expected(), BOUND)
        assert run(manager, addr, 1).state == life.DONE
        generation = manager.pool.get(key)
        assert generation is not None
        in_flight = manager.receiver(addr, 2, PLAN, prefill_dp_rank=0)
        assert in_flight.init() == KVPoll.WaitingForInput
        killed = time.monotonic()
        instance.kill()
        time.sleep(0.2)
        assert manager.pool.get(key) is generation  # nothing else noticed the crash
        assert wait_until(lambda: manager.pool.get(key) is None, ttl + BOUND)
        retired_after = time.monotonic() - killed
        # etcd deletes the keys TTL after the last keep-alive it acknowledged (at most TTL
        # before the kill), rounded up to its 500 ms expiry check; loaded-machine slack.
        assert retired_after <= ttl + 5.0, retired_after
        assert finish(in_flight).state == life.INVALIDATED
        assert isinstance(in_flight.failure, RankRetired), in_flight.failure
        assert "deregistered" in str(in_flight.failure)
    finally:
        manager.close()
        transport.close()


def test_64_in_flight_at_a_restart(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """Failed requests per restart <= requests in flight at the kill; all end, typed; the
    requests started after the new registration is visible all succeed."""
    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    assert source is not None
    try:
        old = launch(etcd, cluster, ack_delay_ms=60_000)
        assert wait_until(lambda: visible(source, addr) == old.expected(), BOUND)
        in_flight = [start(manager, addr, room) for room in range(64)]
        assert sum(r.state == life.WAITING for r in in_flight) == 64
        old.kill()
        new = launch(etcd, cluster)
        for receiver in in_flight:
            finish(receiver)
        failed = [r for r in in_flight if r.state == life.INVALIDATED]
        assert len(failed) <= 64 and all(r.ended for r in in_flight)
        assert all(isinstance(r.failure, PeerLost) for r in failed), {
            type(r.failure).__name__ for r in failed
        }
        assert wait_until(lambda: visible(source, addr) == new.expected(), BOUND)
        after = [run(manager, addr, 1000 + room) for room in range(16)]
        assert [r.state for r in after] == [life.DONE] * 16, [r.failure for r in after]
        assert manager.stats().in_flight == 0
    finally:
        manager.close()


def test_etcd_killed_mid_run_keeps_serving_the_cache(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    assert source is not None
    try:
        instance = launch(etcd, cluster)
        assert wait_until(lambda: visible(source, addr) == instance.expected(), BOUND)
        assert run(manager, addr, 1).state == life.DONE
        etcd.kill()
        assert wait_until(lambda: not source.stats().connected, BOUND)
        slowest = 0.0
        for room in range(2, 22):
            began = time.monotonic()
            receiver = run(manager, addr, room)
            slowest = max(slowest, time.monotonic() - began)
            assert receiver.state == life.DONE, receiver.failure
        # Hits never touch etcd; a miss is answered from the store, never waits on etcd.
        assert slowest < 5.0, slowest
        began = time.monotonic()
        unknown = manager.receiver(f"127.0.0.1:{free_port()}", 99, PLAN, prefill_dp_rank=0)
        assert unknown.init() == KVPoll.Failed
        assert isinstance(unknown.failure, NotReady)
        assert time.monotonic() - began < 1.0
        assert source.stats().last_error is not None
        etcd.start()
        assert wait_until(lambda: source.stats().connected, BOUND)
        assert run(manager, addr, 30).state == life.DONE
    finally:
        manager.close()


def test_a_fetch_the_watch_overtook_is_not_published(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """The watermark (the model's NoWatermark mutation): a generation stamped before a change
    the watch applied is refused by ``publish``; the marked object fails at its start."""
    from statemachine.discovery.changes import StampedGeneration
    from statemachine.pool import RankInfo

    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    assert source is not None
    key = PoolKey(addr, 0, 0, 0)
    try:
        old = launch(etcd, cluster)
        assert wait_until(lambda: visible(source, addr) == old.expected(), BOUND)
        stamp = source.revision
        ranks = tuple(RankInfo("127.0.0.1", rank.port, 0, False) for rank in old.ranks)
        late = StampedGeneration(ranks, old.instance_id, stamp)
        new = launch(etcd, cluster)
        assert wait_until(lambda: visible(source, addr) == new.expected(), BOUND)
        assert source.publish(manager.pool, key, late) is None
        assert manager.pool.get(key) is None and source.stats().publishes_refused == 1
        ranks = tuple(RankInfo("127.0.0.1", rank.port, 0, False) for rank in new.ranks)
        current = StampedGeneration(ranks, new.instance_id, source.revision)
        assert source.publish(manager.pool, key, current) is current
    finally:
        manager.close()


def test_a_marked_generation_fails_its_holder_at_start(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """The fan-out mark is on the object: a receiver that adopted it before the watch event
    fails at ``send_metadata`` (never starts a transfer on it), even before the manager's
    fan-out reached it (the model's NoFanOutMark mutation)."""
    from statemachine.discovery.changes import mark_retired

    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    assert source is not None
    try:
        instance = launch(etcd, cluster)
        assert wait_until(lambda: visible(source, addr) == instance.expected(), BOUND)
        holder = manager.receiver(addr, 1, PLAN, prefill_dp_rank=0)
        assert holder.init() == KVPoll.WaitingForInput
        (generation,) = holder.entries.values()
        assert mark_retired(generation, source.revision + 1)
        assert holder.send_metadata((1,), aux_index=0) == KVPoll.Failed
        assert isinstance(holder.failure, RankRetired), holder.failure
        assert manager.stats().failures == {"RankRetired": 1}
    finally:
        manager.close()


def _held_outside_the_pool(manager: DecodeManager, addr: str, holder: BootstrapReceiver) -> None:
    """Drop ``holder``'s generation from the pool the way a real failure does: another request
    on the same generation fails (on another rank of its room) and invalidates it by identity.
    ``holder`` still holds the object; only ``held_by`` can tell the watch about it now."""
    (generation,) = holder.entries.values()
    other = manager.receiver(addr, 900, PLAN, prefill_dp_rank=0)
    assert other.init() == KVPoll.WaitingForInput
    assert other.entries[PoolKey(addr, 0, 0, 0)] is generation
    with pytest.raises(PeerLost):
        other.failure_exception()
    assert manager.pool.get(PoolKey(addr, 0, 0, 0)) is None


def test_a_watch_event_marks_a_held_generation_no_longer_in_the_pool(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """The watch's mark reaches generations only receivers in flight hold: a request that
    adopted a generation, which then left the pool, fails at ``send_metadata`` with
    RankRetired once the prefill re-registered - never starts a transfer on it. Waits for the
    mark itself. Catches a watch that examines the pool only (the held generation would be
    neither marked nor handed to the fan-out, and the request would start on the old ranks)."""
    from statemachine.discovery.changes import retired_at

    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    try:
        old = launch(etcd, cluster)
        assert wait_until(lambda: visible(source, addr) == old.expected(), BOUND)
        holder = manager.receiver(addr, 1, PLAN, prefill_dp_rank=0)
        assert holder.init() == KVPoll.WaitingForInput
        (generation,) = holder.entries.values()
        _held_outside_the_pool(manager, addr, holder)
        launch(etcd, cluster)  # re-registers every rank: the old registration is replaced
        assert wait_until(lambda: retired_at(generation) is not None, BOUND)
        assert holder.send_metadata((1,), aux_index=0) == KVPoll.Failed
        assert isinstance(holder.failure, RankRetired), holder.failure
        assert all(rank.alive() for rank in old.ranks)  # nothing but the watch knew
    finally:
        manager.close()


def test_a_watch_event_fails_a_transfer_on_a_generation_no_longer_in_the_pool(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """The watch's listener hands the held generations it marked to the manager's fan-out: a
    request already transferring on a generation that left the pool fails with RankRetired
    when the prefill re-registers. Waits for the request's wake-up. Catches a listener that
    fans out only the pool entries the change retired (none here: the request would wait out
    its timeout)."""
    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    try:
        old = launch(etcd, cluster, ack_delay_ms=60_000)  # its transfers never finish in time
        assert wait_until(lambda: visible(source, addr) == old.expected(), BOUND)
        holder = start(manager, addr, 1)
        assert holder.state == life.WAITING
        lost = threading.Event()
        holder.on_change = lost.set  # no ack can come: the only news is the fan-out
        _held_outside_the_pool(manager, addr, holder)
        launch(etcd, cluster)
        assert lost.wait(BOUND), "the watch event never failed the transfer"
        assert holder.poll() == KVPoll.Failed
        assert isinstance(holder.failure, RankRetired), holder.failure
        assert manager.stats().failures.get("RankRetired") == 1
    finally:
        manager.close()


def test_manager_on_etcd_leaves_no_thread_behind(etcd: EtcdServer) -> None:
    baseline = threading.active_count()
    for _ in range(3):
        manager = manager_on_etcd(etcd.endpoint, prefix="/test-threads/ranks")
        assert isinstance(manager.source, EtcdBootstrapSource) and manager.source.stats().synced
        manager.close()
    assert wait_until(lambda: threading.active_count() <= baseline, BOUND)


def test_the_manager_shares_the_sources_pool_and_refuses_another() -> None:
    from statemachine.discovery.gateway import EtcdGateway
    from statemachine.errors import ConfigurationError
    from statemachine.pool import BootstrapPool
    from statemachine.wire.reference import SimpleBackend

    pool = BootstrapPool()
    source = EtcdBootstrapSource(EtcdGateway([f"http://127.0.0.1:{free_port()}"]), pool=pool)
    backend = SimpleBackend("127.0.0.1", 1, "test")
    try:
        manager = DecodeManager(source=source, completion="external", backend=backend)
        try:
            assert manager.pool is pool and manager.source is source and manager.health is None
        finally:
            manager.close()
        with pytest.raises(ConfigurationError, match="same pool"):
            DecodeManager(
                source=source, pool=BootstrapPool(), completion="external", backend=backend
            )
    finally:
        source.close()


def test_prefill_rank_discovery_arguments() -> None:
    from statemachine.prefill.rank import parse_args

    args = parse_args(["--bootstrap", "10.0.0.7:8998", "--discovery", "etcd"])
    assert (args.discovery, args.etcd_endpoints, args.token) == (
        "etcd",
        "http://127.0.0.1:2379",
        None,
    )
    assert parse_args(["--bootstrap", "h:1", "--token", "t"]).discovery == "http"
    with pytest.raises(SystemExit):
        parse_args(["--bootstrap", "h:1"])  # http needs the server's token


def test_a_stale_fetch_adopts_a_current_entry_another_request_published(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    """Found by the model (docs/formal-model.md): a leader whose fetch a watch event overtook
    finds the pool already holding a *current* entry (another request fetched after the
    change and published first). The model's Publish adopts the pool's entry, as setdefault
    does; the source used to refuse the fetch first and fail the request with RankRetired."""
    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix, FetchPerMissManager)  # two leaders on one key
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    key = PoolKey(addr, 0, 0, 0)
    read_old = threading.Event()
    go_on = threading.Event()
    make = source.generation

    def generation(*args: object, **kwargs: object) -> object:
        # The first fetch (the stale leader) has read the old ranks: hold it there.
        if threading.current_thread().name == "stale-leader":
            read_old.set()
            assert go_on.wait(BOUND)
        return make(*args, **kwargs)  # type: ignore[arg-type]

    try:
        old = launch(etcd, cluster)  # keeps running: an overlapping restart
        assert wait_until(lambda: visible(source, addr) == old.expected(), BOUND)
        stale = manager.receiver(addr, 1, PLAN, prefill_dp_rank=0)
        outcome: list[KVPoll] = []
        source.generation = generation  # type: ignore[method-assign]
        leader = threading.Thread(target=lambda: outcome.append(stale.init()), name="stale-leader")
        leader.start()
        assert read_old.wait(BOUND)
        new = launch(etcd, cluster)
        assert wait_until(lambda: visible(source, addr) == new.expected(), BOUND)
        current = run(manager, addr, 2)  # fetched after the change: published
        assert current.state == life.DONE, current.failure
        published = manager.pool.get(key)
        assert published is not None
        go_on.set()
        leader.join(BOUND)
        assert outcome == [KVPoll.WaitingForInput], stale.failure
        assert stale.entries[key] is published  # adopted the current entry
        assert source.stats().publishes_refused == 0
        stale.send_metadata((1, 2, 3), aux_index=0)
        assert finish(stale).state == life.DONE, stale.failure
    finally:
        go_on.set()
        manager.close()
