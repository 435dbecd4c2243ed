"""Cache-hit path throughput at 1, 4 and 16 threads: the anchors' hit paths vs ours.

Per key:

* anchor: SGLang's hit path — build the string key, ``with lock: cache.get(key)``, record it;
* pool: the receiver's keys for (address, dp rank), ``BootstrapPool.lookup(key)`` and record
  it — what a receiver does per key.

Per request (what a decode pays per request on a hit, the room known to its manager):

* model of SGLang's receiver: the steps SGLang's receiver takes on a hit, written out in
  ``benchmarks/anchors.py`` (create with a status record, string key, lock + get, adopt and
  record, status update). It is a *model*, a second baseline: ``bench_vs_sglang`` measures
  SGLang 0.5.23's own receiver code, which costs about twice the model;
* ours through the manager: ``manager.receiver(addr, room, plan, prefill_dp_rank=0)``
  (admitted by room; the one-rank plan given), ``init()`` (lookup + record + the ``Hit`` step).

Both hold a window of 1,000 requests in flight, as a scheduler holds its requests, and end
them (``clear()``) between timed batches: a request's end is not its hit path, but a realistic
number of requests in flight is part of its cost.

Each figure is the median over rounds of (total hits / wall time) with all threads running;
rounds of the variants are interleaved so a slow moment of a shared machine hits all of them.
Goals: >= 500,000 requests/s through the manager on one thread, and >= 2x the model of SGLang's
receiver in the same run.

    .venv/bin/python -m benchmarks.bench_cache_hit [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable

from benchmarks.anchors import (
    ADDR,
    SGLangDecodeManagerAnchor,
    SGLangReceiverAnchor,
    sglang_cache,
    sglang_hits,
)
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.wire.reference import SimpleBackend

THREAD_COUNTS = (1, 4, 16)
ROUNDS = 5
OPS_PER_ROUND = 200_000  # split across the threads of a round


#: --smoke: one round of this many hits, goals not judged (it shows that the benchmark runs).
SMOKE_OPS = 4_000
#: Requests a decode holds in flight at once in the per-request variants.
WINDOW = 1_000


def _anchor_worker(ops: int) -> Callable[[], float]:
    lock, cache = sglang_cache()  # shared by every thread of the round, as in SGLang

    def run() -> float:
        start = time.perf_counter()
        sglang_hits(lock, cache, ops)
        return time.perf_counter() - start

    return run


def _pool_worker(ops: int, pool: BootstrapPool) -> Callable[[], float]:
    from statemachine.decode.receiver import DEFAULT_PLAN

    def run() -> float:
        entries: dict[PoolKey, Generation] = {}
        lookup = pool.lookup
        start = time.perf_counter()
        for _ in range(ops):
            # The receiver's own way to get its keys: built once per (address, dp rank).
            for key in DEFAULT_PLAN.keys_for(ADDR, 0):
                generation = lookup(key)
                if generation is not None:
                    entries[key] = generation
        return time.perf_counter() - start

    return run


# Per request, both sides hold a window of WINDOW requests in flight (a scheduler holds its
# requests, the manager knows them by room) and end them between timed batches: a request's
# end is not its hit path, but a realistic number in flight is part of its cost.


def _sglang_receiver_worker(ops: int, mgr: SGLangDecodeManagerAnchor) -> Callable[[], float]:
    first = next(_room_blocks) * OPS_PER_ROUND

    def run() -> float:
        timed = 0.0
        for batch in range(first, first + ops, WINDOW):
            start = time.perf_counter()
            held = [
                SGLangReceiverAnchor(mgr, ADDR, room, 0)
                for room in range(batch, min(batch + WINDOW, first + ops))
            ]
            timed += time.perf_counter() - start
            for receiver in held:
                receiver.clear()
        return timed

    return run


def _manager_worker(ops: int, manager: DecodeManager) -> Callable[[], float]:
    first = next(_room_blocks) * OPS_PER_ROUND  # distinct rooms per thread and round

    def run() -> float:
        make = manager.receiver
        timed = 0.0
        for batch in range(first, first + ops, WINDOW):
            held: list[BootstrapReceiver] = []
            keep = held.append
            start = time.perf_counter()
            for room in range(batch, min(batch + WINDOW, first + ops)):
                receiver = make(ADDR, room, ONE_RANK, prefill_dp_rank=0)
                receiver.init()
                keep(receiver)
            timed += time.perf_counter() - start
            for receiver in held:
                receiver.clear()
        return timed

    return run


_room_blocks = itertools.count()
#: The one-rank plan the published entry serves (no server to fetch a topology from).
ONE_RANK = RankPlan()


def _throughput(
    make: Callable[[int], Callable[[], float]], threads: int, ops: int
) -> tuple[float, float]:
    """(hits / wall time of the round, hits / timed seconds of the slowest thread).

    The first counts everything, a per-request variant's ends included; the second only the
    timed hit path (meaningful on one thread, where nothing else runs meanwhile).
    """
    per_thread = ops // threads
    timed: list[float] = []
    runs = [make(per_thread) for _ in range(threads)]
    workers = [threading.Thread(target=lambda r=run: timed.append(r())) for run in runs]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - start
    total = per_thread * threads
    return total / wall, total / max(timed)


def main(argv: list[str] | None = None) -> int:
    import logging

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cache_hit")
    parser.add_argument(
        "--smoke", action="store_true", help="one round of a few hits; goals not judged"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rounds, ops = (1, SMOKE_OPS) if args.smoke else (ROUNDS, OPS_PER_ROUND)

    logging.getLogger("transitions").setLevel(logging.WARNING)
    pool = BootstrapPool()
    pool.publish(PoolKey(ADDR, 0, 0, 0), Generation((RankInfo("10.0.0.5", 5000, 0),)))
    # No network is touched on a hit: an external-completion manager needs no ack listener.
    manager = DecodeManager(
        pool=pool,
        completion="external",
        backend=SimpleBackend("127.0.0.1", 1, "bench"),
        health_interval_s=None,
    )
    sglang_manager = SGLangDecodeManagerAnchor()
    variants: dict[str, Callable[[int], Callable[[], float]]] = {
        "anchor (str key + lock + dict)": _anchor_worker,
        "ours: pool.lookup + record": lambda ops: _pool_worker(ops, pool),
        "model of SGLang receiver (hit)": lambda ops: _sglang_receiver_worker(ops, sglang_manager),
        "ours: manager receiver per request": lambda ops: _manager_worker(ops, manager),
    }
    print(f"Python {sys.version.split()[0]}; {rounds} rounds of {ops:,} hits; medians")
    print("(a shared machine while developing: figures are indicative, ratios more so)")
    print(f"{'variant':<38}" + "".join(f"{t:>11} thr" for t in THREAD_COUNTS) + "   vs anchor@1")
    samples: dict[str, list[list[float]]] = {name: [[] for _ in THREAD_COUNTS] for name in variants}
    hit_only: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for i, threads in enumerate(THREAD_COUNTS):
            for name, make in variants.items():
                wall_rate, timed_rate = _throughput(make, threads, ops)
                samples[name][i].append(wall_rate)
                if threads == 1:
                    hit_only[name].append(timed_rate)
    results = {name: [statistics.median(s) for s in rows] for name, rows in samples.items()}
    anchor_one = results["anchor (str key + lock + dict)"][0]
    for name, row in results.items():
        cells = "".join(f"{rate:>13,.0f}/s" for rate in row)
        print(f"{name:<38}{cells}   {row[0] / anchor_one:.2f}x")
    print("(wall time; the per-request rows include ending each request between batches)")
    ours_name, sglang_name = (
        "ours: manager receiver per request",
        "model of SGLang receiver (hit)",
    )
    ours = statistics.median(hit_only[ours_name])
    sglang = statistics.median(hit_only[sglang_name])
    ratio = statistics.median(
        o / a for o, a in zip(hit_only[ours_name], hit_only[sglang_name], strict=True)
    )
    print(
        f"hit path only (create + init, {WINDOW} in flight, 1 thread): ours {ours:,.0f}/s, "
        f"model of SGLang {sglang:,.0f}/s"
    )
    ok_rate = ours >= 500_000
    ok_ratio = ratio >= 2.0
    print(
        f"goal >= 500,000 requests/s through the manager, 1 thread: {ours:,.0f}/s "
        f"({'met' if ok_rate else 'NOT met'})"
    )
    print(
        f"goal >= 2x the model of SGLang's receiver hit path, same run (median of per-round "
        f"ratios; SGLang's own code: bench_vs_sglang): "
        f"{ratio:.2f}x ({'met' if ok_ratio else 'NOT met'})"
    )
    if args.smoke:
        print("(--smoke: a few thousand hits show that the benchmark runs; goals not judged)")
    stats = manager.stats()
    manager.close()
    if stats.in_flight:
        raise SystemExit(f"bench_cache_hit: {stats.in_flight} receivers left in flight")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
