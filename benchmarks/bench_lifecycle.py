"""Cost of one receiver lifecycle, and of one cache-hit lookup + record.

A lifecycle is: create the receiver's lifecycle, take the whole successful miss path
(Miss, FetchOk, RegisterOk, Publish, SendOk, Complete), drop it. Three implementations:

* table — ``statemachine.lifecycle.Lifecycle`` (the table derived from the Machine);
* machine — a ``transitions.Machine`` per receiver, the receiver as its model, built from
  ``lifecycle.STATES`` / ``TABLE`` / ``INITIAL`` like ``build_machine`` does;
* floor — a hand-written ``IntEnum`` + dict table with ``__slots__`` (checked equal to TABLE).

And the hit path: ``BootstrapPool.lookup`` + store into the receiver's entries dict, against
SGLang's (string key, ``with lock: cache.get``, store).

Each figure is the median over rounds of one timed batch; ratios are medians of the per-round
ratios. The cyclic GC stays on: freeing a Machine's model cycles is part of its cost.
Goals: table <= 2x floor, and table >= 50x faster than machine.

    .venv/bin/python -m benchmarks.bench_lifecycle [--rounds 7] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from enum import IntEnum

from transitions import Machine

from benchmarks.anchors import ADDR, sglang_cache, sglang_hits
from statemachine.errors import InvalidTransition
from statemachine.lifecycle import (
    COMPLETE,
    FETCH_OK,
    INITIAL,
    MISS,
    PUBLISH,
    REGISTER_OK,
    SEND_OK,
    STATES,
    TABLE,
    Lifecycle,
)
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo

MISS_PATH = (MISS, FETCH_OK, REGISTER_OK, PUBLISH, SEND_OK, COMPLETE)
#: Goals from the task: table <= 2x floor; table >= 50x faster than a Machine per receiver.
MAX_TABLE_OVER_FLOOR = 2.0
MIN_MACHINE_OVER_TABLE = 50.0

# --- (c) the hand-written floor -------------------------------------------------------------


class S(IntEnum):
    IDLE = 0
    FETCHING = 1
    FETCHED = 2
    REGISTERED = 3
    CACHED = 4
    HANDSHAKING = 5
    READY = 6
    WAITING = 7
    DONE = 8
    FAILED = 9
    INVALIDATED = 10
    ABORTED = 11


_ACTIVE = (
    S.IDLE,
    S.FETCHING,
    S.FETCHED,
    S.REGISTERED,
    S.CACHED,
    S.HANDSHAKING,
    S.READY,
    S.WAITING,
)
FLOOR_TABLE: dict[str, dict[S, S]] = {
    "Hit": {S.IDLE: S.CACHED},
    "Miss": {S.IDLE: S.FETCHING},
    "FetchOk": {S.FETCHING: S.FETCHED},
    "FetchFail": {S.IDLE: S.FAILED, S.FETCHING: S.FAILED},
    "RegisterOk": {S.FETCHED: S.REGISTERED},
    "RegisterFail": {S.FETCHED: S.FAILED},
    "Publish": {S.REGISTERED: S.CACHED},
    "Handshake": {S.CACHED: S.HANDSHAKING},
    "PrefillReady": {S.HANDSHAKING: S.READY},
    "SendOk": {S.CACHED: S.WAITING, S.READY: S.WAITING},
    "SendFail": dict.fromkeys((S.IDLE, S.CACHED, S.HANDSHAKING, S.READY), S.FAILED),
    "Complete": {S.WAITING: S.DONE},
    "Timeout": {S.HANDSHAKING: S.FAILED, S.WAITING: S.FAILED},
    "PeerLost": dict.fromkeys(
        (S.IDLE, S.CACHED, S.HANDSHAKING, S.READY, S.WAITING, S.DONE), S.FAILED
    ),
    "Invalidate": {S.FAILED: S.INVALIDATED},
    "Abort": dict.fromkeys((*_ACTIVE, S.DONE), S.ABORTED),
    "NewRequest": {S.DONE: S.IDLE, S.INVALIDATED: S.IDLE, S.ABORTED: S.IDLE},
}


class FloorReceiver:
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = S.IDLE

    def fire(self, event: str) -> S:
        try:
            self.state = dest = FLOOR_TABLE[event][self.state]
        except KeyError:
            raise InvalidTransition(self.state.name.lower(), event) from None
        return dest


def check_floor_is_the_table() -> None:
    """The floor must implement the same lifecycle, or comparing with it means nothing."""
    as_names = {
        event: {src.name.lower(): dst.name.lower() for src, dst in row.items()}
        for event, row in FLOOR_TABLE.items()
    }
    derived = {event: dict(row) for event, row in TABLE.items()}
    if as_names != derived:
        raise SystemExit("bench_lifecycle: FLOOR_TABLE differs from lifecycle.TABLE")


# --- (b) a transitions.Machine per receiver -------------------------------------------------

MACHINE_TRANSITIONS = [
    {"trigger": event, "source": source, "dest": dest}
    for event, row in TABLE.items()
    for source, dest in row.items()
]


class MachineReceiver:
    """A receiver object that a Machine decorates with its triggers and ``state``."""


# --- timed batches: each returns seconds for n iterations -----------------------------------


def time_table(n: int) -> float:
    miss, fetch_ok, register_ok, publish, send_ok, complete = MISS_PATH
    start = time.perf_counter()
    for _ in range(n):
        receiver = Lifecycle()
        receiver.fire(miss)
        receiver.fire(fetch_ok)
        receiver.fire(register_ok)
        receiver.fire(publish)
        receiver.fire(send_ok)
        receiver.fire(complete)
    return time.perf_counter() - start


def time_floor(n: int) -> float:
    miss, fetch_ok, register_ok, publish, send_ok, complete = MISS_PATH
    start = time.perf_counter()
    for _ in range(n):
        receiver = FloorReceiver()
        receiver.fire(miss)
        receiver.fire(fetch_ok)
        receiver.fire(register_ok)
        receiver.fire(publish)
        receiver.fire(send_ok)
        receiver.fire(complete)
    return time.perf_counter() - start


def time_machine(n: int) -> float:
    states = list(STATES)
    start = time.perf_counter()
    for _ in range(n):
        receiver = MachineReceiver()
        Machine(
            model=receiver,
            states=states,
            transitions=MACHINE_TRANSITIONS,
            initial=INITIAL,
            auto_transitions=False,
        )
        receiver.Miss()  # type: ignore[attr-defined]
        receiver.FetchOk()  # type: ignore[attr-defined]
        receiver.RegisterOk()  # type: ignore[attr-defined]
        receiver.Publish()  # type: ignore[attr-defined]
        receiver.SendOk()  # type: ignore[attr-defined]
        receiver.Complete()  # type: ignore[attr-defined]
    return time.perf_counter() - start


def time_pool_hit(n: int) -> float:
    pool = BootstrapPool()
    key = PoolKey(ADDR, 0, 0, 0)
    pool.publish(key, Generation((RankInfo("10.0.0.5", 5000, 0),)))
    entries: dict[PoolKey, Generation] = {}
    lookup = pool.lookup
    start = time.perf_counter()
    for _ in range(n):
        generation = lookup(key)
        if generation is not None:
            entries[key] = generation
    return time.perf_counter() - start


def time_sglang_hit(n: int) -> float:
    """SGLang's hit path: string key built per request, lock, get, record."""
    lock, cache = sglang_cache()
    start = time.perf_counter()
    sglang_hits(lock, cache, n)
    return time.perf_counter() - start


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"nproc={os.cpu_count()}, {cpu}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_lifecycle")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--smoke", action="store_true", help="one round of tiny batches; goals not judged"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    scale = 100 if args.smoke else 1
    if args.smoke:
        args.rounds = 1
    # At INFO each trigger formats log records (~3.5x slower): measure the library, not logging.
    logging.getLogger("transitions").setLevel(logging.WARNING)
    check_floor_is_the_table()

    # (name, batch, iterations per batch, unit scale): batches of ~50-150 ms here.
    cases: list[tuple[str, Callable[[int], float], int, float]] = [
        ("table", time_table, 50_000, 1e6),
        ("floor", time_floor, 50_000, 1e6),
        ("machine", time_machine, 400, 1e6),
        ("pool_hit", time_pool_hit, 500_000, 1e9),
        ("sglang_hit", time_sglang_hit, 500_000, 1e9),
    ]
    cases = [(name, batch, max(n // scale, 1), unit) for name, batch, n, unit in cases]
    for _, batch, n, _ in cases:  # warm up
        batch(max(n // 10, 1))
    per_op: dict[str, list[float]] = {name: [] for name, _, _, _ in cases}
    for _ in range(args.rounds):
        for name, batch, n, unit in cases:
            per_op[name].append(batch(n) / n * unit)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(per_op[a], per_op[b], strict=True))

    med = {name: statistics.median(values) for name, values in per_op.items()}
    table_over_floor = ratio("table", "floor")
    machine_over_table = ratio("machine", "table")
    hit_over_sglang = ratio("pool_hit", "sglang_hit")
    print(f"machine: {machine_description()}; rounds={args.rounds} (medians)")
    print("receiver lifecycle (create, Miss..Complete, drop), µs per lifecycle:")
    print(f"  (a) derived table  Lifecycle        {med['table']:9.2f}")
    print(f"  (b) Machine per receiver            {med['machine']:9.2f}")
    print(f"  (c) IntEnum+dict floor, __slots__   {med['floor']:9.2f}")
    print(f"  table / floor     = {table_over_floor:6.2f}x  (goal <= {MAX_TABLE_OVER_FLOOR}x)")
    print(f"  machine / table   = {machine_over_table:6.1f}x  (goal >= {MIN_MACHINE_OVER_TABLE}x)")
    print("cache hit (lookup + record), ns per hit:")
    print(f"  BootstrapPool.lookup + record       {med['pool_hit']:9.1f}")
    print(f"  SGLang str key + lock + get + record{med['sglang_hit']:9.1f}")
    print(f"  pool / sglang     = {hit_over_sglang:6.2f}x")
    ok = table_over_floor <= MAX_TABLE_OVER_FLOOR and machine_over_table >= MIN_MACHINE_OVER_TABLE
    if args.smoke:
        print("goals: not judged (--smoke: it only shows that the benchmark runs)")
        return 0
    print("goals:", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
