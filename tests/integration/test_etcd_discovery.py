"""etcd discovery against a real etcd: key layout, registrar, and the watch-fed source.

Each test writes under its own prefix of one module-wide etcd server, so tests do not see each
other's keys. Fault tests (restart, SIGKILL, etcd killed, compaction) are in test_etcd_faults.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence

import pytest

from statemachine.decode.plan import DecodeLayout, derive_plan
from statemachine.discovery.changes import (
    RankChange,
    StampedGeneration,
    generation_for,
    retiring_listener,
    revision_of,
    still_current,
)
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway, prefix_range_end
from statemachine.discovery.layout import (
    RankKey,
    encode_value,
    parse_key,
    parse_value,
    rank_key,
)
from statemachine.discovery.registrar import EtcdRegistrar
from statemachine.errors import (
    BootstrapError,
    EtcdUnavailable,
    InvalidArgument,
    MalformedValue,
    NotFound,
    NotReady,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey
from tests.support.etcd_discovery_support import (
    ADDR,
    BOUND,
    fetch,
    payload,
)
from tests.support.etcd_support import EtcdServer, free_port, running_etcd, wait_until


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with running_etcd() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:12]}/ranks"


# --- layout (no etcd) ----------------------------------------------------------------------------


def test_key_layout_round_trips_and_rejects_foreign_keys() -> None:
    key = RankKey("[::1]:8998", 1, 0, 3, 2)
    raw = rank_key("/p/ranks", key)
    assert raw == b"/p/ranks/[::1]:8998/1/0/3/2"
    assert parse_key("/p/ranks", raw) == key
    for bad in (
        b"/p/ranks/127.0.0.1:8998/01/0/0/0",  # leading zero: not canonical
        b"/p/ranks/127.0.0.1:8998/0/0/0",  # a rank missing
        b"/p/other/127.0.0.1:8998/0/0/0/0",  # outside the prefix
        b"/p/ranks/not an addr/0/0/0/0",
        b"/p/ranks/127.0.0.1:8998/0/0/x/0",
        b"\xff",
    ):
        with pytest.raises(MalformedValue):
            parse_key("/p/ranks", bad)


def test_values_that_do_not_fit_their_key_are_never_served() -> None:
    key = RankKey(ADDR, 0, 0, 1, 0)
    good = encode_value(payload(5000, tp=1, tp_size=2), "inst", "reg")
    record = parse_value(key, good, mod_revision=7)
    assert (record.rank_ip, record.rank_port, record.instance_id) == ("127.0.0.1", 5000, "inst")
    assert (record.attn_tp_size, record.dp_size, record.world) == (2, 1, 2)
    bad_values = [
        b"not json",
        b"[]",
        encode_value(payload(5000, tp=0, tp_size=2), "inst", "reg"),  # ranks differ from key
        encode_value(payload(0, tp=1, tp_size=2), "inst", "reg"),  # port 0
        encode_value({**payload(5000, tp=1, tp_size=2), "rank_ip": "::bad::"}, "i", "r"),
        encode_value({**payload(5000, tp=1, tp_size=2), "attn_tp_size": True}, "i", "r"),
        encode_value({**payload(5000, tp=1, tp_size=2), "rank_ip": "prefill-0"}, "i", "r"),
        encode_value({**payload(5000, tp=1, tp_size=2), "attn_tp_size": 4097}, "i", "r"),
        encode_value({**payload(5000, tp=1, tp_size=2), "kv_cache_dtype": "x" * 65}, "i", "r"),
        encode_value(payload(5000, tp=1, tp_size=2), "", "reg"),  # empty instance id
        json.dumps(payload(5000, tp=1, tp_size=2)).encode(),  # no instance id at all
    ]
    for raw in bad_values:
        with pytest.raises(MalformedValue):
            parse_value(key, raw, mod_revision=1)


def test_prefix_range_end_covers_exactly_the_prefix() -> None:
    assert prefix_range_end(b"/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff") == b"\0"


def test_registrar_rejects_bad_payloads_before_any_etcd_call() -> None:
    gateway = EtcdGateway([f"http://127.0.0.1:{free_port()}"], connect_timeout=0.2, timeout=0.2)
    registrar = EtcdRegistrar(gateway, ADDR, ttl=2)
    with pytest.raises(InvalidArgument):
        registrar.register({**payload(5000), "rank_port": 70000})
    with pytest.raises(InvalidArgument):
        registrar.register({**payload(5000), "attn_tp_rank": 1})  # rank >= size
    assert registrar.stats().puts == 0
    with pytest.raises(InvalidArgument):
        EtcdRegistrar(gateway, "no-port", ttl=2)
    with pytest.raises(InvalidArgument):
        EtcdRegistrar(gateway, ADDR, ttl=0)


def test_registrar_gives_up_with_a_typed_error_when_etcd_is_unreachable() -> None:
    gateway = EtcdGateway([f"http://127.0.0.1:{free_port()}"], connect_timeout=0.2, timeout=0.2)
    registrar = EtcdRegistrar(gateway, ADDR, ttl=2, attempts=3, backoff=0.01)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable):
        registrar.register(payload(5000))
    assert time.monotonic() - started < BOUND
    assert registrar.stats().last_error is not None


# --- the source ---------------------------------------------------------------------------------


def test_source_never_blocks_before_its_first_list() -> None:
    """etcd unreachable from the start: every call raises NotReady at once; stats say why."""
    gateway = EtcdGateway([f"http://127.0.0.1:{free_port()}"], connect_timeout=0.2, timeout=0.2)
    with EtcdBootstrapSource(gateway, backoff_initial=0.01, backoff_max=0.05) as source:
        started = time.monotonic()
        with pytest.raises(NotReady, match="not synced"):
            source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
        with pytest.raises(NotReady):
            source.get_topology(ADDR)
        with pytest.raises(NotReady):
            source.query_dp_ranks(ADDR, [1])
        assert time.monotonic() - started < 1.0
        assert wait_until(lambda: source.stats().reconnects >= 2, BOUND)
        stats = source.stats()
        assert not stats.connected and not stats.synced
        assert stats.last_error is not None and "etcd" in stats.last_error


def test_source_serves_ranks_from_its_store(etcd: EtcdServer, prefix: str) -> None:
    changes: list[RankChange] = []
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint]), prefix=prefix, on_change=changes.append
    ).start()
    registrar = EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5)
    try:
        assert source.wait_synced(BOUND)
        with pytest.raises(NotReady, match="no prefill registered"):
            source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
        registrar.register(payload(5000, tp=0, tp_size=2))
        assert wait_until(lambda: len(changes) == 1, BOUND)
        # One of two ranks: not ready, like a bootstrap server's 503.
        with pytest.raises(NotReady, match="not every prefill rank"):
            source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
        revision = registrar.register(payload(5001, tp=1, tp_size=2))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert changes[-1][:7] == (ADDR, 0, 0, 1, 0, revision, False)
        reply = source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=1, pp_rank=0)
        assert (reply.rank_ip, reply.rank_port, reply.instance_id) == (
            "127.0.0.1",
            5001,
            registrar.instance_id,
        )
        topology = source.get_topology(ADDR)
        assert (topology.attn_tp_size, topology.dp_size, topology.pp_size) == (2, 1, 1)
        assert topology.instance_id == registrar.instance_id
        with pytest.raises(NotFound):
            source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=2, pp_rank=0)
        assert source.query_dp_ranks(ADDR, [7, 8]) == {7: 0, 8: 0}
        with pytest.raises(InvalidArgument):
            source.get_rank(ADDR, dp_rank=-1, cp_rank=0, tp_rank=0, pp_rank=0)
        stats = source.stats()
        assert stats.connected and stats.synced and stats.events_handled == 2
    finally:
        registrar.close()
        source.close()


def test_topology_carries_the_plan_switches_of_the_registration(
    etcd: EtcdServer, prefix: str
) -> None:
    """spec/plans.md PLAN-1: an etcd-discovered prefill's topology has the same optional keys
    as a bootstrap server's reply, so a decode on etcd plans as SGLang 0.5.23 does."""
    with (
        EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source,
        EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5) as registrar,
    ):
        assert source.wait_synced(BOUND)
        for tp in range(2):
            value = payload(5000 + tp, tp=tp, tp_size=2)
            value.update(kv_layout="paged", enable_kv_cache_sharding=True)
            value.update(decode_allocation_policy="prefill_complete")
            revision = registrar.register(value)
        assert wait_until(lambda: source.revision >= revision, BOUND)
        topology = source.get_topology(ADDR)
        assert topology.kv_layout == "paged" and topology.enable_kv_cache_sharding is True
        assert topology.decode_allocation_policy == "prefill_complete"
        assert topology.enable_dsa_cache_layer_split is False
        plan = derive_plan(ADDR, topology, DecodeLayout(1, 2, is_mla=True))
        assert plan.target_tp_rank is None and plan.required_dst_info_num == 2


def test_dp_ranks_follow_the_room_when_the_prefill_says_so(etcd: EtcdServer, prefix: str) -> None:
    with (
        EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source,
        EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5) as registrar,
    ):
        assert source.wait_synced(BOUND)
        for dp in range(2):
            revision = registrar.register(payload(5000 + dp, dp=dp, dp_size=2))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert source.get_topology(ADDR).dp_size == 2
        assert source.query_dp_ranks(ADDR, [4, 5]) == {4: 0, 5: 1}
        reply = source.get_rank(ADDR, dp_rank=1, cp_rank=0, tp_rank=0, pp_rank=0)
        assert reply.rank_port == 5001


def test_malformed_values_are_counted_and_never_served(etcd: EtcdServer, prefix: str) -> None:
    gateway = EtcdGateway([etcd.endpoint])
    with EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source:
        assert source.wait_synced(BOUND)
        gateway.put(rank_key(prefix, RankKey(ADDR, 0, 0, 0, 0)), b"{not json")
        gateway.put(f"{prefix}/junk".encode(), b"x")
        assert wait_until(lambda: source.stats().malformed == 2, BOUND)
        with pytest.raises(NotReady):
            source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
    gateway.delete_prefix(prefix.encode())


def test_a_listener_that_raises_does_not_stop_the_watch(etcd: EtcdServer, prefix: str) -> None:
    def broken(change: RankChange) -> None:
        raise RuntimeError("listener bug")

    with (
        EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix, on_change=broken) as src,
        EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5) as registrar,
    ):
        assert src.wait_synced(BOUND)
        registrar.register(payload(5000))
        revision = registrar.register(payload(5001))  # same key again: a second change
        assert wait_until(lambda: src.revision >= revision, BOUND)
        stats = src.stats()
        assert stats.hook_errors == 2 and "listener bug" in (stats.last_error or "")
        assert src.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0).rank_port == 5001


def test_a_cache_hit_costs_no_etcd_operation(etcd: EtcdServer, prefix: str) -> None:
    """The pool answers hits; the source is not even called. A miss reads only the store."""
    pool = BootstrapPool()
    with (
        EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix, pool=pool) as source,
        EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5) as registrar,
    ):
        assert source.wait_synced(BOUND)
        revision = registrar.register(payload(5000))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        before = source.stats()
        generation = fetch(source, pool, ADDR, 1)
        for _ in range(100):
            assert pool.lookup(PoolKey(ADDR, 0, 0, 0)) is generation
        after = source.stats()
        # No list, no watch re-open, no event: the miss and the hits touched no etcd call.
        assert (after.lists, after.reconnects, after.idle_reopens, after.events_handled) == (
            before.lists,
            before.reconnects,
            before.idle_reopens,
            before.events_handled,
        )


def test_identity_safe_retirement_by_revision(etcd: EtcdServer, prefix: str) -> None:
    """A rank re-registered on the *same* port under the same instance id (a process restart)
    retires the generation fetched before, and not the one fetched after."""
    pool = BootstrapPool()
    changes: list[RankChange] = []
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint]), prefix=prefix, pool=pool, on_change=changes.append
    ).start()
    first = EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, instance_id="X")
    second = EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, instance_id="X")
    try:
        assert source.wait_synced(BOUND)
        revision = first.register(payload(5000))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        old = fetch(source, pool, ADDR, 1)
        # The same registrar re-putting identical bytes changes nothing.
        revision = first.register(payload(5000))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert pool.get(PoolKey(ADDR, 0, 0, 0)) is old
        assert changes[-1].retired == {}
        # A new life of the rank: same ip, port and instance id, new registration.
        revision = second.register(payload(5000))
        assert wait_until(lambda: pool.get(PoolKey(ADDR, 0, 0, 0)) is None, BOUND)
        assert changes[-1].revision == revision
        assert changes[-1].retired == {PoolKey(ADDR, 0, 0, 0): old}
        new = fetch(source, pool, ADDR, 1)
        assert new is not old and new.revision is not None and new.revision >= revision
        # A generation published late, from a read before the change, is caught on publish.
        late = StampedGeneration(old.ranks, old.instance_id, old.revision)
        key = PoolKey(ADDR, 0, 0, 0)
        pool.invalidate({key: new})
        assert pool.publish(key, late) is late
        assert not source.check_published(key, late)
        assert pool.get(key) is None
    finally:
        first.close(revoke=False)
        second.close()
        source.close()


def test_keepalive_keeps_the_keys_past_the_ttl(etcd: EtcdServer, prefix: str) -> None:
    with (
        EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source,
        EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=2) as registrar,
    ):
        assert source.wait_synced(BOUND)
        registrar.register(payload(5000))
        time.sleep(3.5)  # well past the TTL: only the keep-alives hold the key
        assert source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0).rank_port == 5000
        stats = registrar.stats()
        assert stats.keepalives >= 2 and stats.keepalive_failures == 0
        assert source.stats().changes == 1


def test_an_expired_lease_is_regranted_and_the_ranks_re_put(etcd: EtcdServer, prefix: str) -> None:
    """The lease vanishes behind the registrar's back (as after an outage longer than the TTL):
    the next keep-alive finds it gone, grants a new one and puts the same bytes again."""
    gateway = EtcdGateway([etcd.endpoint])
    with (
        EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source,
        EtcdRegistrar(
            EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=2, keepalive_interval=0.2
        ) as registrar,
    ):
        assert source.wait_synced(BOUND)
        registrar.register(payload(5000))
        lease = registrar.stats().lease_id
        assert lease is not None
        gateway.lease_revoke(lease)
        assert wait_until(lambda: registrar.stats().lease_regrants == 1, BOUND)
        assert wait_until(lambda: source.stats().changes == 3, BOUND)  # put, delete, put
        assert registrar.stats().lease_id != lease
        assert source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0).rank_port == 5000


# --- the gateway ---------------------------------------------------------------------------------


def test_gateway_fails_over_to_the_next_endpoint(etcd: EtcdServer, prefix: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gateway = EtcdGateway([dead, etcd.endpoint], connect_timeout=0.3, timeout=1.0)
    key = f"{prefix}/failover".encode()
    revision = gateway.put(key, b"v")
    kv = gateway.get(key)
    assert kv is not None and kv.value == b"v" and kv.mod_revision == revision
    # Sources and registrars ride on the same failover.
    with (
        EtcdBootstrapSource(
            EtcdGateway([dead, etcd.endpoint], connect_timeout=0.3), prefix=prefix
        ) as source,
        EtcdRegistrar(
            EtcdGateway([dead, etcd.endpoint], connect_timeout=0.3), ADDR, prefix=prefix, ttl=5
        ) as registrar,
    ):
        assert source.wait_synced(BOUND)
        revision = registrar.register(payload(5000))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0).rank_port == 5000
    gateway.delete_prefix(prefix.encode())


def test_gateway_refusals_are_typed(etcd: EtcdServer) -> None:
    from statemachine.errors import EtcdRequestFailed

    gateway = EtcdGateway([etcd.endpoint])
    assert gateway.lease_keepalive(123456789) == 0  # unknown lease: gone, not an error
    with pytest.raises(EtcdRequestFailed) as refused:
        gateway.lease_revoke(123456789)
    assert refused.value.status == 404
    with pytest.raises(InvalidArgument):
        EtcdGateway(["127.0.0.1:2379"])  # not a URL
    with pytest.raises(InvalidArgument):
        EtcdGateway("http://127.0.0.1:2379")  # a str, not a sequence of URLs


def test_retiring_listener_fails_exactly_the_retired_generations(
    etcd: EtcdServer, prefix: str
) -> None:
    """The glue to the manager's fan-out: each retirement arrives once, with a typed error."""
    from statemachine.errors import RankRetired

    failed: list[tuple[list[Generation], BootstrapError]] = []

    def fail_generations(generations: Sequence[Generation], error: BootstrapError) -> int:
        failed.append((list(generations), error))
        return len(generations)

    pool = BootstrapPool()
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint]),
        prefix=prefix,
        pool=pool,
        on_change=retiring_listener(fail_generations),
    ).start()
    registrar = EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5)
    try:
        assert source.wait_synced(BOUND)
        revision = registrar.register(payload(5000))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert failed == []  # a new registration retires nothing
        generation = fetch(source, pool, ADDR, 1)
        registrar.close()
        assert wait_until(lambda: len(failed) == 1, BOUND)
        ((generations, error),) = failed
        assert generations == [generation] and isinstance(error, RankRetired)
        assert ADDR in str(error) and "deregistered" in str(error) and "retry" in str(error)
        assert still_current(object(), PoolKey(ADDR, 0, 0, 0), generation)  # other sources
        assert revision_of(object()) is None
        assert type(generation_for((), None, None)) is Generation
    finally:
        registrar.close()
        source.close()


def test_a_registration_after_the_lease_expired_replaces_the_lease(
    etcd: EtcdServer, prefix: str
) -> None:
    """The lease vanished and the keep-alive thread has not noticed yet: the next register
    replaces it, and the ranks registered before come back under the new lease."""
    gateway = EtcdGateway([etcd.endpoint])
    with (
        EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source,
        EtcdRegistrar(
            EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5, keepalive_interval=2.0
        ) as registrar,
    ):
        assert source.wait_synced(BOUND)
        registrar.register(payload(5000, tp=0, tp_size=2))
        lease = registrar.stats().lease_id
        assert lease is not None
        gateway.lease_revoke(lease)
        registrar.register(payload(5001, tp=1, tp_size=2))
        assert registrar.stats().lease_id != lease and registrar.stats().lease_regrants == 1
        # The keep-alive thread's next round re-puts rank 0 under the new lease.
        assert wait_until(lambda: ports_or_none(source) == [5000, 5001], BOUND)


def ports_or_none(source: EtcdBootstrapSource) -> list[int] | None:
    try:
        return [
            source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0).rank_port
            for tp in range(2)
        ]
    except NotReady:
        return None
