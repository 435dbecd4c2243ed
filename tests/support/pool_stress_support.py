"""The pool's threaded stress run and its accounting check (tests/unit/test_pool_stress.py, the
pool mutants and the trace validation run it)."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType

RECEIVER_THREADS = 8


ITERATIONS_PER_THREAD = 20_000


#: A bound on wall time only (the test asserts nothing about speed): a loop stops here.
DEADLINE_S = 20.0


#: The address whose restarts are observed; the other one's are only noticed by failed sends.
OBSERVED = "10.0.0.1:80"


ADDRESSES = (OBSERVED, "10.0.0.1:8000")


TIMEOUT_PROBABILITY = 0.02


@dataclass
class ReceiverLog:
    lookups: int = 0
    adoptions: int = 0
    #: generations this receiver published and won with (kept alive, so ids stay unique)
    won: list[object] = field(default_factory=list)
    #: id(generation) -> how many of this receiver's invalidations removed it
    removed: Counter[int] = field(default_factory=Counter)
    invalidations_without_effect: int = 0


def run_stress(pool_module: ModuleType, seed: int = 0) -> dict[str, object]:
    """Run the workload against ``pool_module``; return the pool, logs and restarter counts."""
    pool = pool_module.BootstrapPool()
    keys = [pool_module.PoolKey(addr, 0, 0, tp) for addr in ADDRESSES for tp in (0, 1)]
    # The running instance per address; a receiver's fetch reads it (one atomic dict load).
    current = {addr: f"{addr}#0" for addr in ADDRESSES}
    logs = [ReceiverLog() for _ in range(RECEIVER_THREADS)]
    retired: list[int] = []
    done = threading.Event()
    start = threading.Barrier(RECEIVER_THREADS)
    deadline = time.monotonic() + DEADLINE_S

    def receiver(log: ReceiverLog, rng: random.Random) -> None:
        start.wait(timeout=30)
        for _ in range(ITERATIONS_PER_THREAD):
            if time.monotonic() > deadline:
                return
            key = rng.choice(keys)
            log.lookups += 1
            held = pool.lookup(key)
            if held is None:
                # The fetch is HTTP outside the lock: let other receivers run meanwhile, so
                # they miss the same key too and race this publish.
                time.sleep(0)
                instance = current[key.addr]
                port = 17000 + int(instance.rsplit("#", 1)[1])
                fresh = pool_module.Generation(
                    (pool_module.RankInfo("10.0.0.9", port, 0),), instance
                )
                held = pool.publish(key, fresh)
                if held is fresh:
                    log.won.append(fresh)
                else:
                    log.adoptions += 1
            stale = held.instance_id != current[key.addr]
            # At the observed address half the stale sends go unnoticed (queued, as ZMQ does
            # without IMMEDIATE), so stale entries linger there until the retirement.
            noticed = stale and (key.addr != OBSERVED or rng.random() < 0.5)
            if noticed or rng.random() < TIMEOUT_PROBABILITY:
                if pool.invalidate({key: held}) == 1:
                    log.removed[id(held)] += 1
                else:
                    log.invalidations_without_effect += 1

    def restarter(rng: random.Random) -> None:
        for epoch in range(1, 5000):
            if done.wait(0.0005):
                return
            addr = rng.choice(ADDRESSES)
            replaced = current[addr]
            current[addr] = f"{addr}#{epoch}"
            if addr == OBSERVED:
                # Like a probe thread, retire a moment after noticing: receivers may publish
                # the new instance's entries meanwhile, and those must survive.
                done.wait(0.0002)
                retired.append(pool.retire_instance(addr, replaced))

    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [
            threading.Thread(target=receiver, args=(log, random.Random(seed * 100 + n)))
            for n, log in enumerate(logs)
        ]
        restart = threading.Thread(target=restarter, args=(random.Random(seed),))
        restart.start()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=DEADLINE_S + 30)
        done.set()
        restart.join(timeout=30)
    finally:
        sys.setswitchinterval(previous_interval)
    assert not any(t.is_alive() for t in (*workers, restart)), "a stress thread hung"
    # However the threads were scheduled (a loaded machine may starve the restarter), end with
    # one restart of the observed address that has an entry to retire, so every run retires.
    closing = ReceiverLog()
    logs.append(closing)
    key = keys[0]
    closing.lookups += 1
    if pool.lookup(key) is None:
        fresh = pool_module.Generation(
            (pool_module.RankInfo("10.0.0.9", 16999, 0),), current[OBSERVED]
        )
        if pool.publish(key, fresh) is fresh:
            closing.won.append(fresh)
        else:
            closing.adoptions += 1
    # The restart is not written into ``current``: the accounting below judges the threaded
    # run by the instances current at its end, and excuses exactly what this retirement takes.
    replaced = current[OBSERVED]
    closing_ids = {
        id(g)
        for k, g in pool.snapshot().items()
        if k.addr == OBSERVED and g.instance_id == replaced
    }
    retired.append(pool.retire_instance(OBSERVED, replaced))
    return {
        "pool": pool,
        "logs": logs,
        "retired": sum(retired),
        "current": current,
        "closing_ids": closing_ids,
    }


def check_accounting(result: dict[str, object]) -> None:
    pool = result["pool"]
    logs: list[ReceiverLog] = result["logs"]  # type: ignore[assignment]
    retired: int = result["retired"]  # type: ignore[assignment]
    current: dict[str, str] = result["current"]  # type: ignore[assignment]
    held = pool.snapshot()  # type: ignore[attr-defined]
    held_ids = {id(g) for g in held.values()}
    removed: Counter[int] = sum((log.removed for log in logs), Counter())
    won = [g for log in logs for g in log.won]
    won_ids = {id(g) for g in won}

    # Only winners are ever in the pool, and each one is held or removed, never twice.
    assert held_ids <= won_ids
    assert all(count == 1 for count in removed.values()), "a generation was removed twice"
    assert not (held_ids & removed.keys()), "a removed generation is still held"
    # What neither a receiver nor the pool accounts for was retired by retire_instance,
    # and only a stale generation of the observed address may be retired.
    lost = [g for g in won if id(g) not in held_ids and id(g) not in removed]
    assert len(lost) == retired
    closing_ids: set[int] = result["closing_ids"]  # type: ignore[assignment]
    for generation in lost:
        if id(generation) in closing_ids:
            continue  # taken by run_stress's closing restart, after the threads ended
        instance = generation.instance_id  # type: ignore[attr-defined]
        assert instance.startswith(OBSERVED + "#") and instance != current[OBSERVED], (
            f"IdentitySafe: live generation {instance} was lost"
        )

    stats = pool.stats()  # type: ignore[attr-defined]
    assert stats.entries == len(held)
    assert stats.hits + stats.misses == sum(log.lookups for log in logs)
    assert stats.publishes == len(won)
    assert stats.adoptions == sum(log.adoptions for log in logs)
    assert stats.invalidations == sum(removed.values())
    assert stats.kept_newer <= sum(log.invalidations_without_effect for log in logs)
    assert stats.address_invalidations == retired
