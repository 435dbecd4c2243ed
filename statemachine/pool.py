"""The shared bootstrap-info pool: which prefill ranks serve a key, one *generation* at a time.

A decode process asks a prefill's bootstrap server where the ranks for
``(address, dp rank, cp rank, tp rank)`` listen, and caches the answer here so that later
requests skip the HTTP round trip. Rank ports are ephemeral: a prefill restart changes them
while the key stays the same. So every cached answer is a :class:`Generation` object whose
*identity* (not its value) names one fetch, and every removal is identity-checked:

* ``publish`` is ``dict.setdefault``: the first generation wins and every later publisher
  adopts the winner (POOL-2).
* ``invalidate(entries)`` removes ``pool[k]`` only while it *is* ``entries[k]``, so a fresh
  generation published concurrently by another receiver survives a stale receiver's failure
  (POOL-3, the ``IdentitySafe`` invariant of the TLA+ model).

The dictionary algorithms are module-level functions over plain dicts with PEP 316 contracts,
so CrossHair can check them symbolically; :class:`BootstrapPool` runs them under one lock and
keeps the statistics. See ``spec/pool.md``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from statemachine import trace

#: The tp part of a pool key that stands for every prefill tp rank at once (MLA KV-cache
#: sharding, spec/plans.md PLAN-6). An int, not None: a plain ``int`` field keeps the key's type
#: small enough for CrossHair's symbolic search of the pool's contracts (``make crosshair``);
#: with ``int | None`` it no longer found the seeded ``overwrite_not_setdefault`` bug.
EVERY_TP_RANK = -1


class PoolKey(NamedTuple):
    """What a pool entry is for. ``addr`` is compared exactly, never by prefix (POOL-5)."""

    addr: str
    dp_rank: int
    cp_rank: int
    #: A prefill tp rank (>= 0), or :data:`EVERY_TP_RANK`.
    tp_rank: int


class RankInfo(NamedTuple):
    """Where one prefill rank listens for ZMQ messages."""

    ip: str
    port: int
    pp_rank: int
    is_dummy: bool = False


@dataclass(frozen=True, eq=False, slots=True)
class Generation:
    """One fetch of the ranks behind a key. Compared by identity only (``eq=False``).

    Two fetches that return the same ports are still two generations: the pool cannot know
    whether the prefill restarted in between, so only the object a receiver actually used
    may be removed on that receiver's behalf.
    """

    ranks: tuple[RankInfo, ...]
    #: ``X-Bootstrap-Instance-Id`` of the server that answered, when it sent one.
    instance_id: str | None = None


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Counters since the pool was created (a consistent snapshot)."""

    entries: int
    hits: int
    misses: int
    publishes: int
    adoptions: int
    invalidations: int
    #: invalidations that found a *different* generation under the key and kept it
    kept_newer: int
    address_invalidations: int


# --- the algorithms, as pure functions over dicts (checked by CrossHair) ----------------------


def publish_entry(pool: dict[PoolKey, Generation], key: PoolKey, fresh: Generation) -> Generation:
    """Publish ``fresh`` unless ``key`` already holds a generation; return what the pool holds.

    post: pool[key] is __return__
    post: (__return__ is fresh) or (__old__.pool.get(key) is not None)
    post: (key in __old__.pool) == (__return__ is not fresh)
    """
    return pool.setdefault(key, fresh)


def invalidate_entries(
    pool: dict[PoolKey, Generation], entries: Mapping[PoolKey, Generation]
) -> tuple[int, int]:
    """Remove ``pool[k]`` for each ``k`` in ``entries`` only while it *is* ``entries[k]``.

    Returns ``(removed, kept_newer)``: how many entries were removed, and how many keys held a
    different generation that was left alone.

    post: all(pool.get(k) is not g for k, g in entries.items())
    post: all(k in pool for k in __old__.pool if __old__.pool[k] is not __old__.entries.get(k))
    post: all(k in pool for k in __old__.pool if k not in entries)
    post: all(pool[k] is __old__.pool[k] for k in pool)
    post: __return__[0] == len(__old__.pool) - len(pool)
    """
    removed = 0
    kept = 0
    for key, generation in entries.items():
        current = pool.get(key)
        if current is generation:
            del pool[key]
            removed += 1
        elif current is not None:
            kept += 1
    return removed, kept


def invalidate_address_entries(pool: dict[PoolKey, Generation], addr: str) -> int:
    """Remove every entry whose key's address is exactly ``addr``; return how many.

    post: all(k.addr != addr for k in pool)
    post: all(k in pool for k in __old__.pool if k.addr != addr)
    post: __return__ == len(__old__.pool) - len(pool)
    """
    doomed = [key for key in pool if key.addr == addr]
    for key in doomed:
        del pool[key]
    return len(doomed)


def retire_instance_entries(pool: dict[PoolKey, Generation], addr: str, instance_id: str) -> int:
    """Remove the entries of exactly ``addr`` fetched from instance ``instance_id``.

    The caller *knows* that instance was replaced: it saw ``instance_id`` answer at ``addr``
    before it saw another id answer there, and an instance id, once replaced, never answers
    again. Entries of any other instance (a newer one included: ids carry no order) and of
    servers that send no id survive, so a stale observer cannot remove a newer instance's
    entries (POOL-6).

    post: all(k.addr != addr or g.instance_id != instance_id for k, g in pool.items())
    post: all(k in pool for k in __old__.pool if k.addr != addr)
    post: all(k in pool for k in __old__.pool if __old__.pool[k].instance_id != instance_id)
    post: __return__ == len(__old__.pool) - len(pool)
    """
    doomed = [
        key
        for key, generation in pool.items()
        if key.addr == addr and generation.instance_id == instance_id
    ]
    for key in doomed:
        del pool[key]
    return len(doomed)


# --- the thread-safe pool ---------------------------------------------------------------------


class BootstrapPool:
    """Thread-safe map from :class:`PoolKey` to the current :class:`Generation`.

    Every operation takes the one lock for a few dictionary operations and never does I/O
    under it: fetching and registering happen outside, between ``lookup`` and ``publish``.
    """

    __slots__ = (
        "_address_invalidations",
        "_adoptions",
        "_entries",
        "_hits",
        "_invalidations",
        "_kept_newer",
        "_lock",
        "_misses",
        "_publishes",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[PoolKey, Generation] = {}
        self._hits = itertools.count()
        self._misses = itertools.count()
        self._publishes = 0
        self._adoptions = 0
        self._invalidations = 0
        self._kept_newer = 0
        self._address_invalidations = 0

    def lookup(self, key: PoolKey) -> Generation | None:
        """The generation cached for ``key``, or ``None`` (POOL-1). Counts a hit or a miss.

        Lock-free: ``dict.get`` is atomic, and so is ``next()`` on an ``itertools.count``
        (one C call), so the counters stay exact without the lock. Holding the lock here made
        every hit a point where a descheduled thread could stall all others: with 16 threads
        hits/s fell to a third of the single-thread rate (``benchmarks/bench_cache_hit.py``).
        """
        generation = self._entries.get(key)
        next(self._misses if generation is None else self._hits)
        return generation

    def publish(self, key: PoolKey, fresh: Generation) -> Generation:
        """Publish ``fresh`` with setdefault semantics (POOL-2).

        Returns the generation the pool holds afterwards: ``fresh`` itself, or a concurrent
        winner's generation that the caller must adopt (and record in place of its own).
        """
        with self._lock:
            held = publish_entry(self._entries, key, fresh)
            if held is fresh:
                self._publishes += 1
            else:
                self._adoptions += 1
            seq = trace.reserve() if trace.ENABLED else None
        if seq is not None:
            trace.emit(
                "PoolPublish",
                seq=seq,
                key=key,
                generation=held,
                fresh=fresh,
                instance=held.instance_id,
                fresh_instance=fresh.instance_id,
            )
        return held

    def invalidate(self, entries: Mapping[PoolKey, Generation]) -> int:
        """Drop each ``entries[k]`` still in the pool by identity (POOL-3); return the count."""
        with self._lock:
            removed, kept = invalidate_entries(self._entries, entries)
            self._invalidations += removed
            self._kept_newer += kept
            seq = trace.reserve() if trace.ENABLED else None
        if seq is not None:
            trace.emit("PoolInvalidate", seq=seq, entries=entries, removed=removed)
        return removed

    def invalidate_address(self, addr: str) -> int:
        """Node failure: drop every entry of exactly ``addr`` (POOL-5); return the count."""
        with self._lock:
            removed = invalidate_address_entries(self._entries, addr)
            self._address_invalidations += removed
            seq = trace.reserve() if trace.ENABLED else None
        if seq is not None:
            trace.emit("PoolInvalidateAddress", seq=seq, addr=addr, removed=removed)
        return removed

    def retire_instance(self, addr: str, instance_id: str) -> int:
        """Instance ``instance_id`` at ``addr`` was replaced: drop its entries (POOL-6).

        Call only with an id the caller saw answer at ``addr`` *before* it saw a different id
        answer there (the health monitor's previous probe; the ids of entries a receiver had
        adopted before its fetch answered with another). Never "everything but the id I just
        saw": that id may already be stale, and the entries of a newer instance would go.
        """
        gone: list[PoolKey] = []
        seq = None
        with self._lock:
            before = list(self._entries) if trace.ENABLED else None
            removed = retire_instance_entries(self._entries, addr, instance_id)
            self._address_invalidations += removed
            if before is not None and removed:
                gone = [key for key in before if key not in self._entries]
                seq = trace.reserve()
        if seq is not None:
            trace.emit(
                "PoolRetireInstance",
                seq=seq,
                addr=addr,
                instance_id=instance_id,
                removed=removed,
                keys=gone,
            )
        return removed

    def get(self, key: PoolKey) -> Generation | None:
        """Peek without counting (for tests, reports and tracing)."""
        return self._entries.get(key)

    def snapshot(self) -> dict[PoolKey, Generation]:
        """A copy of the current entries."""
        with self._lock:
            return dict(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                entries=len(self._entries),
                hits=_count_value(self._hits),
                misses=_count_value(self._misses),
                publishes=self._publishes,
                adoptions=self._adoptions,
                invalidations=self._invalidations,
                kept_newer=self._kept_newer,
                address_invalidations=self._address_invalidations,
            )


def _count_value(counter: itertools.count[int]) -> int:
    """How many times ``next()`` was called on ``counter``: the pool's hit or miss count.

    The two counters are ``itertools.count`` objects so that ``lookup`` can bump them without
    the lock: one ``next()`` is one C call, so concurrent bumps never lose a count (``+= 1`` on
    an int attribute would). ``itertools.count`` has no method that reads its value without
    advancing it; its repr, ``count(N)``, names the next value, which is the number of bumps so
    far. That repr is the one way left to read it (pickling, the other, was removed in 3.14).
    """
    return int(repr(counter).removeprefix("count(").removesuffix(")"))
