"""Hypothesis stateful test of the pool against a reference model (spec/pool.md).

Several receivers look keys up, fetch fresh generations outside the pool, publish (racing each
other: two receivers that missed the same key both fetch, the first publish wins and the
second adopts), and invalidate what they recorded, possibly long after a prefill restart made
it stale. Prefill restarts bump an address's epoch: later fetches return new ports and a new
instance id, and earlier generations of that address are dead. Node failures drop an address.

The model is a plain dict updated with the reference semantics, compared by identity. Checks
named like the TLA+ model's invariants:

* ``IdentitySafe`` — an invalidation removes only generations the invalidating receiver
  recorded, each by identity (POOL-3);
* ``AdoptionCorrect`` — after ``publish`` the receiver holds exactly what the pool holds, and
  that is the first generation published since the key was last empty (POOL-2);
* ``ExactNodeFailure`` — a node failure removes every key of exactly that address and no other
  key (POOL-5, POOL-6).

:func:`pool_machine` builds the machine for any module with the pool's API, so
``test_pool_mutants.py`` can run the same test against seeded bugs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import statemachine.pool

#: ``host:80`` is a string prefix of ``host:8000``: the exact-match requirement is exercised.
#: The last server is "old" and sends no instance id.
ADDRESSES = ("10.0.0.1:80", "10.0.0.1:8000", "10.0.0.2:80")
OLD_SERVER = "10.0.0.2:80"
RECEIVERS = 3
#: Few keys, so receivers collide on them often.
TP_RANKS = (0, 1)

STATEFUL_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)


def pool_machine(pool_module: ModuleType) -> type[RuleBasedStateMachine]:
    """The stateful test of ``pool_module.BootstrapPool`` (the real pool or a mutant)."""
    pool_key = pool_module.PoolKey
    rank_info = pool_module.RankInfo
    generation_cls = pool_module.Generation
    keys = tuple(pool_key(addr, 0, 0, tp) for addr in ADDRESSES for tp in TP_RANKS)

    class PoolMachine(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.pool = pool_module.BootstrapPool()
            # The reference model: key -> generation, by the spec's semantics.
            self.model: dict[Any, Any] = {}
            self.counts = dict.fromkeys(
                (
                    "hits",
                    "misses",
                    "publishes",
                    "adoptions",
                    "invalidations",
                    "kept_newer",
                    "address_invalidations",
                ),
                0,
            )
            self.epoch = dict.fromkeys(ADDRESSES, 0)
            # What each receiver recorded (hits, wins, adoptions) and fetched but not published.
            self.entries: list[dict[Any, Any]] = [{} for _ in range(RECEIVERS)]
            self.pending: list[dict[Any, Any]] = [{} for _ in range(RECEIVERS)]

        def instance_id(self, addr: str) -> str | None:
            return None if addr == OLD_SERVER else f"{addr}#{self.epoch[addr]}"

        def fetch_generation(self, addr: str) -> Any:
            # Ports depend only on the epoch: two fetches in one epoch are value-equal but
            # distinct generations, which is what makes `==` differ from `is`.
            port = 17000 + self.epoch[addr]
            ranks = (rank_info("10.0.0.9", port, 0), rank_info("10.0.0.9", port + 1, 1))
            return generation_cls(ranks, self.instance_id(addr))

        # --- rules -----------------------------------------------------------------------

        @rule(r=st.integers(0, RECEIVERS - 1), key=st.sampled_from(keys))
        def lookup(self, r: int, key: Any) -> None:
            self.lookup_and_record(r, key)

        def lookup_and_record(self, r: int, key: Any) -> Any:
            got = self.pool.lookup(key)
            assert got is self.model.get(key)
            if got is None:
                self.counts["misses"] += 1
            else:
                self.counts["hits"] += 1
                self.entries[r][key] = got
            return got

        @rule(r=st.integers(0, RECEIVERS - 1), key=st.sampled_from(keys))
        def miss_path(self, r: int, key: Any) -> None:
            """Lookup, and on a miss fetch and publish at once (no other receiver between)."""
            if self.lookup_and_record(r, key) is None:
                self.pending[r][key] = self.fetch_generation(key.addr)
                self.publish_pending(r, key)

        @rule(r=st.integers(0, RECEIVERS - 1), key=st.sampled_from(keys))
        def fetch(self, r: int, key: Any) -> None:
            """A fetch outside the pool, from whichever prefill instance runs now."""
            self.pending[r][key] = self.fetch_generation(key.addr)

        @precondition(lambda self: any(self.pending))
        @rule(data=st.data())
        def publish(self, data: st.DataObject) -> None:
            waiting = [(r, key) for r, fetched in enumerate(self.pending) for key in fetched]
            r, key = data.draw(st.sampled_from(waiting))
            self.publish_pending(r, key)

        def publish_pending(self, r: int, key: Any) -> None:
            fresh = self.pending[r].pop(key)
            held = self.pool.publish(key, fresh)
            expected = self.model.setdefault(key, fresh)
            # AdoptionCorrect: the publisher gets the winner and the pool holds it.
            assert held is expected, "AdoptionCorrect: publish returned a non-winner"
            assert self.pool.get(key) is held, "AdoptionCorrect: pool does not hold the winner"
            self.counts["publishes" if expected is fresh else "adoptions"] += 1
            self.entries[r][key] = held

        @rule(r=st.integers(0, RECEIVERS - 1))
        def invalidate(self, r: int) -> None:
            """Receiver ``r`` failed: drop what it recorded, by identity, then forget it."""
            recorded = dict(self.entries[r])
            before = self.pool.snapshot()
            removed = self.pool.invalidate(recorded)
            after = self.pool.snapshot()
            for key in before.keys() - after.keys():
                assert before[key] is recorded.get(key), (
                    "IdentitySafe: removed a generation the receiver did not record"
                )
            for key, generation in after.items():
                assert generation is before.get(key), "invalidate published something"
            expected_removed = 0
            for key, generation in recorded.items():
                current = self.model.get(key)
                if current is generation:
                    del self.model[key]
                    expected_removed += 1
                elif current is not None:
                    self.counts["kept_newer"] += 1
            assert removed == expected_removed
            self.counts["invalidations"] += expected_removed
            self.entries[r].clear()

        @rule(addr=st.sampled_from(ADDRESSES))
        def restart_prefill(self, addr: str) -> None:
            """New epoch: new ports and instance id; the pool is not told."""
            self.epoch[addr] += 1

        @rule(addr=st.sampled_from(ADDRESSES))
        def node_failure(self, addr: str) -> None:
            before = self.pool.snapshot()
            removed = self.pool.invalidate_address(addr)
            self.check_exact_removal(before, lambda key, _g: key.addr == addr)
            assert removed == len(before) - len(self.pool)
            self.counts["address_invalidations"] += removed

        @rule(addr=st.sampled_from(ADDRESSES), back=st.integers(min_value=1, max_value=3))
        def retire_instance(self, addr: str, back: int) -> None:
            """An observer saw ``back`` restarts ago's instance replaced: retire exactly it."""
            if self.epoch[addr] < back:
                return
            instance = f"{addr}#{self.epoch[addr] - back}"
            before = self.pool.snapshot()
            removed = self.pool.retire_instance(addr, instance)
            self.check_exact_removal(
                before, lambda key, g: key.addr == addr and g.instance_id == instance
            )
            assert removed == len(before) - len(self.pool)
            self.counts["address_invalidations"] += removed

        def check_exact_removal(self, before: dict[Any, Any], doomed: Any) -> None:
            """ExactNodeFailure: exactly the doomed keys went, every other one is untouched."""
            after = self.pool.snapshot()
            for key, generation in before.items():
                if doomed(key, generation):
                    assert key not in after, f"ExactNodeFailure: {key} survived"
                    del self.model[key]
                else:
                    assert after.get(key) is generation, f"ExactNodeFailure: {key} was removed"

        # --- invariants ------------------------------------------------------------------

        @invariant()
        def pool_is_the_model(self) -> None:
            held = self.pool.snapshot()
            assert held.keys() == self.model.keys()
            for key, generation in held.items():
                assert generation is self.model[key]

        @invariant()
        def stats_are_exact(self) -> None:
            stats = self.pool.stats()
            assert stats.entries == len(self.model)
            for name, value in self.counts.items():
                assert getattr(stats, name) == value, name

    return PoolMachine


PoolStateMachine = pool_machine(statemachine.pool)
PoolStateMachine.TestCase.settings = STATEFUL_SETTINGS
TestPoolStateful = PoolStateMachine.TestCase
