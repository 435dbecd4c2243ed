"""Cache-hit path throughput at 1, 4 and 16 threads: the anchor's hit path vs ours.

* anchor: SGLang's hit path — build the string key, ``with lock: cache.get(key)``, record it;
* pool: the receiver's keys for (address, dp rank), ``BootstrapPool.lookup(key)`` and record
  it — what a receiver does per key;
* receiver: a whole ``BootstrapReceiver`` per request on a hit — create it, ``init()``
  (lookup + record + the ``Hit`` lifecycle step) — i.e. the per-request cost a decode pays.

Each figure is the median over rounds of (total hits / wall time) with all threads running.
Goal: >= 200,000 cache hits per second on one thread.

    .venv/bin/python -m benchmarks.bench_cache_hit
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable

from benchmarks.anchors import ADDR, sglang_cache, sglang_hits
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo

THREAD_COUNTS = (1, 4, 16)
ROUNDS = 5
OPS_PER_ROUND = 200_000  # split across the threads of a round


def _anchor_worker(ops: int) -> Callable[[], None]:
    lock, cache = sglang_cache()  # shared by every thread of the round, as in SGLang
    return lambda: sglang_hits(lock, cache, ops)


def _pool_worker(ops: int, pool: BootstrapPool) -> Callable[[], None]:
    from statemachine.decode.receiver import DEFAULT_PLAN

    def run() -> None:
        entries: dict[PoolKey, Generation] = {}
        lookup = pool.lookup
        for _ in range(ops):
            # The receiver's own way to get its keys: built once per (address, dp rank).
            for key in DEFAULT_PLAN.keys_for(ADDR, 0):
                generation = lookup(key)
                if generation is not None:
                    entries[key] = generation

    return run


def _receiver_worker(ops: int, pool: BootstrapPool) -> Callable[[], None]:
    from statemachine.backend import SimpleBackend
    from statemachine.decode.client import BootstrapClient
    from statemachine.decode.receiver import BootstrapReceiver, Decode
    from statemachine.decode.transport import ZmqTransport

    decode = Decode(
        pool=pool,
        client=BootstrapClient(),
        transport=ZmqTransport(),
        backend=SimpleBackend("127.0.0.1", 1, "bench"),
    )

    def run() -> None:
        for room in range(ops):
            BootstrapReceiver(decode, ADDR, room).init(0)

    return run


def _throughput(make: Callable[[int], Callable[[], None]], threads: int) -> float:
    per_thread = OPS_PER_ROUND // threads
    workers = [threading.Thread(target=make(per_thread)) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return per_thread * threads / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    del argv
    import logging

    logging.getLogger("transitions").setLevel(logging.WARNING)
    pool = BootstrapPool()
    pool.publish(PoolKey(ADDR, 0, 0, 0), Generation((RankInfo("10.0.0.5", 5000, 0),)))
    variants: dict[str, Callable[[int], Callable[[], None]]] = {
        "anchor (str key + lock + dict)": _anchor_worker,
        "ours: pool.lookup + record": lambda ops: _pool_worker(ops, pool),
        "ours: receiver per request (hit)": lambda ops: _receiver_worker(ops, pool),
    }
    print(f"Python {sys.version.split()[0]}; {ROUNDS} rounds of {OPS_PER_ROUND:,} hits; medians")
    print(f"{'variant':<36}" + "".join(f"{t:>11} thr" for t in THREAD_COUNTS) + "   vs anchor@1")
    results: dict[str, list[float]] = {}
    for name, make in variants.items():
        row = []
        for threads in THREAD_COUNTS:
            row.append(statistics.median(_throughput(make, threads) for _ in range(ROUNDS)))
        results[name] = row
    anchor_one = next(iter(results.values()))[0]
    for name, row in results.items():
        cells = "".join(f"{rate:>13,.0f}/s" for rate in row)
        print(f"{name:<36}{cells}   {row[0] / anchor_one:.2f}x")
    single = results["ours: receiver per request (hit)"][0]
    goal = "met" if single >= 200_000 else "NOT met"
    print(f"goal >= 200,000 receiver hits/s on one thread: {single:,.0f}/s ({goal})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
