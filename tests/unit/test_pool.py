"""Unit tests of the bootstrap pool, one operation at a time (spec/pool.md, POOL-1..POOL-7)."""

from __future__ import annotations

from typing import Any

import pytest

from statemachine import trace
from statemachine.pool import (
    BootstrapPool,
    Generation,
    PoolKey,
    PoolStats,
    RankInfo,
    invalidate_address_entries,
    invalidate_entries,
    publish_entry,
    retire_instance_entries,
)

K80 = PoolKey("10.0.0.1:80", 0, 0, 0)
K80_TP1 = PoolKey("10.0.0.1:80", 0, 0, 1)
K8000 = PoolKey("10.0.0.1:8000", 0, 0, 0)
K_OTHER = PoolKey("10.0.0.2:80", 0, 0, 0)


def gen(port: int = 17000, instance_id: str | None = None) -> Generation:
    """A fetch answer with one rank at ``port``; every call is a new generation."""
    return Generation((RankInfo("10.0.0.9", port, 0),), instance_id)


def counters(pool: BootstrapPool, **expected: int) -> None:
    """Assert the named counters and that every other counter is zero."""
    fields: dict[str, int] = dict.fromkeys(PoolStats.__dataclass_fields__, 0)
    fields["entries"] = len(pool)
    fields.update(expected)
    assert pool.stats() == PoolStats(**fields)


# --- Generation identity --------------------------------------------------------------------


def test_generation_equal_ports_are_two_generations() -> None:
    """Two fetches that return the same ports are two generations (eq=False)."""
    first, second = gen(17000), gen(17000)
    assert first.ranks == second.ranks
    assert first != second
    same = first
    assert first == same  # identity is the equality
    assert len({first, second}) == 2


def test_generation_is_frozen() -> None:
    g = gen()
    with pytest.raises(AttributeError):
        g.ranks = ()  # type: ignore[misc]


def test_pool_key_compares_by_value() -> None:
    """The key, unlike the generation, is a value: a refetch lands on the same key."""
    assert PoolKey("10.0.0.1:80", 0, 0, 0) == K80
    assert hash(PoolKey("10.0.0.1:80", 0, 0, 0)) == hash(K80)
    assert K80 != K8000


# --- POOL-1 lookup --------------------------------------------------------------------------


def test_pool1_lookup_miss_counts_a_miss_and_returns_none() -> None:
    pool = BootstrapPool()
    assert pool.lookup(K80) is None
    counters(pool, misses=1)


def test_pool1_lookup_hit_returns_the_published_object() -> None:
    pool = BootstrapPool()
    g = gen()
    pool.publish(K80, g)
    assert pool.lookup(K80) is g
    assert pool.lookup(K8000) is None
    counters(pool, entries=1, publishes=1, hits=1, misses=1)


def test_pool1_get_peeks_without_counting() -> None:
    pool = BootstrapPool()
    g = gen()
    pool.publish(K80, g)
    assert pool.get(K80) is g
    assert pool.get(K8000) is None
    counters(pool, entries=1, publishes=1)


# --- POOL-2 publish -------------------------------------------------------------------------


def test_pool2_first_publish_wins() -> None:
    pool = BootstrapPool()
    g = gen()
    assert pool.publish(K80, g) is g
    assert pool.get(K80) is g
    counters(pool, entries=1, publishes=1)


def test_pool2_later_publisher_adopts_the_winner() -> None:
    """Two receivers miss the same key and both fetch: the second adopts the first's answer."""
    pool = BootstrapPool()
    winner, loser = gen(17000), gen(17000)
    assert pool.lookup(K80) is None
    assert pool.lookup(K80) is None
    assert pool.publish(K80, winner) is winner
    assert pool.publish(K80, loser) is winner
    assert pool.get(K80) is winner
    counters(pool, entries=1, misses=2, publishes=1, adoptions=1)


def test_pool2_publish_entry_is_setdefault() -> None:
    entries: dict[PoolKey, Generation] = {}
    first, second = gen(), gen()
    assert publish_entry(entries, K80, first) is first
    assert publish_entry(entries, K80, second) is first
    assert entries == {K80: first}


# --- POOL-3 identity-safe invalidate --------------------------------------------------------


def test_pool3_invalidate_removes_the_recorded_generation() -> None:
    pool = BootstrapPool()
    g = pool.publish(K80, gen())
    recorded = {K80: g}
    assert pool.invalidate(recorded) == 1
    assert pool.get(K80) is None
    assert recorded == {K80: g}  # the caller's record is not touched
    counters(pool, publishes=1, invalidations=1)


def test_pool3_stale_receiver_keeps_a_newer_generation() -> None:
    """IdentitySafe: a receiver that recorded g1 cannot remove g2 published after a restart."""
    pool = BootstrapPool()
    stale = pool.publish(K80, gen(17000))
    assert pool.invalidate({K80: stale}) == 1  # the first failing receiver
    fresh = pool.publish(K80, gen(17000))  # same ports, new generation
    assert pool.invalidate({K80: stale}) == 0  # a second receiver that recorded g1
    assert pool.get(K80) is fresh
    counters(pool, entries=1, publishes=2, invalidations=1, kept_newer=1)


def test_pool3_invalidate_absent_key_changes_nothing() -> None:
    pool = BootstrapPool()
    keep = pool.publish(K8000, gen())
    assert pool.invalidate({K80: gen()}) == 0
    assert pool.snapshot() == {K8000: keep}
    counters(pool, entries=1, publishes=1)


def test_pool3_invalidate_many_entries_each_by_identity() -> None:
    pool = BootstrapPool()
    a = pool.publish(K80, gen())
    b = pool.publish(K80_TP1, gen())
    other = pool.publish(K_OTHER, gen())
    newer = gen()
    pool.invalidate({K80_TP1: b})
    pool.publish(K80_TP1, newer)
    assert pool.invalidate({K80: a, K80_TP1: b, K8000: gen()}) == 1
    assert pool.snapshot() == {K80_TP1: newer, K_OTHER: other}
    counters(pool, entries=2, publishes=4, invalidations=2, kept_newer=1)


def test_pool3_invalidate_entries_returns_removed_and_kept() -> None:
    a, b, c = gen(), gen(), gen()
    entries = {K80: a, K8000: b}
    assert invalidate_entries(entries, {K80: a, K8000: c, K_OTHER: c}) == (1, 1)
    assert entries == {K8000: b}


# --- POOL-4 stats ---------------------------------------------------------------------------


def test_pool4_stats_counts_every_operation_exactly() -> None:
    pool = BootstrapPool()
    g1 = gen(instance_id="a")
    pool.lookup(K80)  # miss
    pool.publish(K80, g1)  # publish
    pool.publish(K80, gen())  # adoption
    pool.lookup(K80)  # hit
    pool.lookup(K80)  # hit
    pool.publish(K8000, gen(instance_id="a"))
    pool.publish(K_OTHER, gen())
    pool.invalidate({K80: g1})  # invalidation
    pool.publish(K80, gen(instance_id="b"))
    pool.invalidate({K80: g1})  # kept_newer
    pool.invalidate_address("10.0.0.2:80")  # 1 address invalidation
    pool.retire_instance("10.0.0.1:8000", "a")  # retires K8000's "a": 1 more
    assert pool.stats() == PoolStats(
        entries=1,
        hits=2,
        misses=1,
        publishes=4,
        adoptions=1,
        invalidations=1,
        kept_newer=1,
        address_invalidations=2,
    )


def test_pool4_stats_is_a_snapshot() -> None:
    pool = BootstrapPool()
    before = pool.stats()
    pool.lookup(K80)
    assert before.misses == 0
    assert pool.stats().misses == 1
    with pytest.raises(AttributeError):
        before.hits = 3  # type: ignore[misc]


def test_snapshot_is_a_copy_and_len_counts_entries() -> None:
    pool = BootstrapPool()
    g = pool.publish(K80, gen())
    snap = pool.snapshot()
    snap.clear()
    assert pool.get(K80) is g
    assert len(pool) == 1


# --- POOL-5 exact-address node failure ------------------------------------------------------


def test_pool5_node_failure_matches_the_address_exactly() -> None:
    """ExactNodeFailure: ``host:80`` failing never wipes ``host:8000`` (SGLang's prefix bug)."""
    pool = BootstrapPool()
    pool.publish(K80, gen())
    pool.publish(K80_TP1, gen())
    keep = pool.publish(K8000, gen())
    keep_other = pool.publish(K_OTHER, gen())
    assert pool.invalidate_address("10.0.0.1:80") == 2
    assert pool.snapshot() == {K8000: keep, K_OTHER: keep_other}
    counters(pool, entries=2, publishes=4, address_invalidations=2)


def test_pool5_node_failure_of_a_prefix_or_unknown_address_removes_nothing() -> None:
    pool = BootstrapPool()
    g = pool.publish(K8000, gen())
    assert pool.invalidate_address("10.0.0.1:800") == 0
    assert pool.invalidate_address("10.0.0.1") == 0
    assert pool.invalidate_address("") == 0
    assert pool.snapshot() == {K8000: g}
    counters(pool, entries=1, publishes=1)


def test_pool5_invalidate_address_entries_function() -> None:
    a, b = gen(), gen()
    entries = {K80: a, K8000: b}
    assert invalidate_address_entries(entries, "10.0.0.1:80") == 1
    assert entries == {K8000: b}


# --- POOL-6 instance-id retirement ----------------------------------------------------------


def test_pool6_retire_instance_drops_exactly_that_instance_of_that_address() -> None:
    pool = BootstrapPool()
    pool.publish(K80, gen(instance_id="old"))
    current = pool.publish(K80_TP1, gen(instance_id="new"))
    anonymous = pool.publish(PoolKey("10.0.0.1:80", 1, 0, 0), gen(instance_id=None))
    neighbour = pool.publish(K8000, gen(instance_id="old"))
    assert pool.retire_instance("10.0.0.1:80", "old") == 1
    assert pool.snapshot() == {
        K80_TP1: current,
        PoolKey("10.0.0.1:80", 1, 0, 0): anonymous,
        K8000: neighbour,
    }
    counters(pool, entries=3, publishes=4, address_invalidations=1)


def test_pool6_a_stale_observer_cannot_remove_a_newer_instance() -> None:
    """The observer saw "b" replace "a", but by now "c" has replaced "b" and published: the
    retirement of "a" (the only id it knows was replaced) leaves "c" alone. The rule this
    replaced ("drop everything but b") would have dropped the newest entries."""
    pool = BootstrapPool()
    newest = pool.publish(K80, gen(instance_id="c"))
    assert pool.retire_instance("10.0.0.1:80", "a") == 0
    assert pool.retire_instance("10.0.0.1:80", "b") == 0
    assert pool.snapshot() == {K80: newest}


def test_pool6_retire_an_unknown_instance_or_a_prefix_removes_nothing() -> None:
    pool = BootstrapPool()
    g = pool.publish(K80, gen(instance_id="i1"))
    assert pool.retire_instance("10.0.0.1:80", "i2") == 0
    assert pool.retire_instance("10.0.0.1:8", "i1") == 0  # prefix of the address
    assert pool.snapshot() == {K80: g}
    counters(pool, entries=1, publishes=1)


def test_pool6_retire_instance_entries_function() -> None:
    old, new = gen(instance_id="1"), gen(instance_id="2")
    entries = {K80: old, K80_TP1: new}
    assert retire_instance_entries(entries, "10.0.0.1:80", "1") == 1
    assert entries == {K80_TP1: new}


# --- POOL-7 no I/O under the lock -----------------------------------------------------------


def test_pool7_trace_output_happens_outside_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every traced pool operation emits after releasing the lock (the sink may block)."""
    pool = BootstrapPool()
    emitted: list[tuple[str, bool]] = []

    def emit(action: str, **fields: Any) -> None:
        emitted.append((action, pool._lock.locked()))

    monkeypatch.setattr(trace, "ENABLED", True)
    monkeypatch.setattr(trace, "emit", emit)
    g = pool.publish(K80, gen(instance_id="a"))
    pool.invalidate({K80: g})
    pool.publish(K80, gen(instance_id="a"))
    pool.retire_instance("10.0.0.1:80", "a")
    pool.invalidate_address("10.0.0.1:80")
    assert emitted == [
        ("PoolPublish", False),
        ("PoolInvalidate", False),
        ("PoolPublish", False),
        ("PoolRetireInstance", False),
        ("PoolInvalidateAddress", False),
    ]
