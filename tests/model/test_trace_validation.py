"""Trace validation: hand-written traces, and real traces of the receiver and pool.

The real traces come from the real receiver against a real bootstrap server and real prefill
rank processes on 127.0.0.1 (the helpers of tests/integration/test_receiver.py), driven
single-threaded so
that the trace order is the pool's order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from statemachine import lifecycle as life
from statemachine import pool as pool_module
from statemachine import trace
from statemachine.demo.baselines import UnmonitoredTransport
from statemachine.errors import TraceFormatError
from statemachine.model.validate import Report, main, read_trace, validate
from statemachine.pool import Generation, PoolKey
from tests import pool_mutants as mutants
from tests.support import pool_stress_support as stress
from tests.support.receiver_support import (
    PLAN,
    DecodeSide,
    Prefill,
    make_decode,
    start_prefill,
    stop_prefill,
)

K = ["h:80", 0, 0, 0]
K2 = ["h:8000", 0, 0, 0]


def rx(action: str, receiver: int, state: str, entries: list[Any] | None = None) -> dict[str, Any]:
    return {"action": action, "receiver": receiver, "state": state, "entries": entries or []}


def publish(key: list[Any], held: int, fresh: int) -> dict[str, Any]:
    return {"action": "PoolPublish", "key": key, "generation": held, "fresh": fresh}


def invalidate(entries: list[Any], removed: int) -> dict[str, Any]:
    return {"action": "PoolInvalidate", "entries": entries, "removed": removed}


def miss_publish(r: int, token: int, held: int | None = None, key: list[Any] = K) -> list[Any]:
    held = token if held is None else held
    return [
        rx("Miss", r, "fetching"),
        rx("FetchOk", r, "fetched", [[key, token]]),
        rx("RegisterOk", r, "registered", [[key, token]]),
        publish(key, held, token),
        rx("Publish", r, "cached", [[key, held]]),
    ]


def fail_and_invalidate(r: int, event: str, entries: list[Any], removed: int) -> list[Any]:
    return [
        rx(event, r, "failed", entries),
        invalidate(entries, removed),
        rx("Invalidate", r, "invalidated", entries),
    ]


GOOD = [
    *miss_publish(1, 1),
    rx("SendOk", 1, "waiting", [[K, 1]]),
    rx("Complete", 1, "done", [[K, 1]]),
    rx("Hit", 2, "cached", [[K, 1]]),  # r2 adopts r1's generation
    *miss_publish(3, 2, held=1),  # r3 raced and lost: adopts 1 in place of its own 2
    # r2 fails on the (now stale) generation 1 and removes it by identity
    *fail_and_invalidate(2, "SendFail", [[K, 1]], 1),
    *miss_publish(4, 3),  # a fresh generation 3 is published
    # r3 still recorded 1: its late failure must not remove 3
    rx("SendOk", 3, "waiting", [[K, 1]]),
    *fail_and_invalidate(3, "Timeout", [[K, 1]], 0),
    rx("Abort", 4, "aborted", [[K, 3]]),  # no invalidation on abort
    *miss_publish(5, 4, key=K2),
    {"action": "PoolInvalidateAddress", "addr": "h:80", "removed": 1},  # only h:80's entry
    *fail_and_invalidate(6, "FetchFail", [], 0),  # dp-rank resolution failed: nothing recorded
]


def test_good_trace_is_allowed() -> None:
    report = validate(GOOD)
    assert report.ok, report.violation
    assert report.events == len(GOOD)


def mutated(index: int, **changes: Any) -> list[dict[str, Any]]:
    events = [dict(e) for e in GOOD]
    events[index].update(changes)
    return events


def _index(action: str, nth: int = 0, **match: Any) -> int:
    found = [
        i
        for i, e in enumerate(GOOD)
        if e["action"] == action and all(e.get(k) == v for k, v in match.items())
    ]
    return found[nth]


@pytest.mark.parametrize(
    "events, rule, at",
    [
        # IdentitySafe: r3's late failure deletes generation 3 (invalidate by key).
        (
            mutated(_index("PoolInvalidate", 1), removed=1),
            "IdentitySafe",
            _index("PoolInvalidate", 1),
        ),
        # A recorded, still pooled generation that is not removed.
        (mutated(_index("PoolInvalidate", 0), removed=0), "IdentitySafe", _index("PoolInvalidate")),
        # setdefault: the loser's publish replaced the winner.
        (mutated(_index("PoolPublish", 1), generation=2), "POOL-2", _index("PoolPublish", 1)),
        # Prefix node failure: h:80 also removed h:8000's entry.
        (
            mutated(_index("PoolInvalidateAddress"), removed=2),
            "ExactNodeFailure",
            _index("PoolInvalidateAddress"),
        ),
        # Lifecycle: a hit straight into waiting.
        (mutated(_index("Hit"), state="waiting"), "lifecycle", _index("Hit")),
        # Lifecycle: Complete from cached.
        (
            [e for e in GOOD if not (e["action"] == "SendOk" and e["receiver"] == 1)],
            "lifecycle",
            _index("Complete") - 1,
        ),
        # AdoptionCorrect: a hit on a generation never published under that key.
        (mutated(_index("Hit"), entries=[[K, 7]]), "AdoptionCorrect", _index("Hit")),
        # FetchOk must bring a new object.
        (mutated(_index("FetchOk", 1), entries=[[K, 1]]), "FetchOk", _index("FetchOk", 1)),
        # Invalidate without the pool invalidation of its recorded entries.
        (
            [e for i, e in enumerate(GOOD) if i != _index("PoolInvalidate")],
            "IdentitySafe",
            _index("Invalidate") - 1,
        ),
        # An action the model does not have.
        (mutated(0, action="Teleport"), "model", 0),
    ],
)
def test_bad_trace_reports_the_first_disallowed_step(
    events: list[dict[str, Any]], rule: str, at: int
) -> None:
    report = validate(events)
    assert report.violation is not None
    assert report.violation.rule.startswith(rule), report.violation
    assert report.violation.index == at
    # Everything before that step is allowed on its own.
    assert validate(events[:at]).ok


def test_single_entry_form_of_the_brief_is_accepted() -> None:
    events = [
        {"action": "Miss", "receiver": 1, "key": K, "generation": None, "state": "fetching"},
        {"action": "FetchOk", "receiver": 1, "key": K, "generation": 5, "state": "fetched"},
    ]
    assert validate(events).ok


@pytest.mark.parametrize(
    "event",
    [
        {"receiver": 1},
        {"action": "Hit", "state": "cached"},
        {"action": "PoolPublish", "key": "h:80", "generation": 1, "fresh": 1},
        {"action": "PoolInvalidate", "entries": [[K, 1]], "removed": -1},
        {"action": "PoolInvalidateAddress", "addr": 80, "removed": 0},
        {"action": "Hit", "receiver": 1, "entries": [[K, "one"]], "state": "cached"},
    ],
)
def test_malformed_events_raise_a_typed_error(event: Mapping[str, Any]) -> None:
    with pytest.raises(TraceFormatError):
        validate([event])


def test_cli_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.ndjson"
    good.write_text("\n".join(json.dumps(e) for e in GOOD) + "\n", encoding="utf-8")
    assert main([str(good)]) == 0
    bad = tmp_path / "bad.ndjson"
    bad.write_text(
        "\n".join(json.dumps(e) for e in mutated(_index("PoolInvalidate", 1), removed=1)),
        encoding="utf-8",
    )
    assert main([str(bad)]) == 1
    broken = tmp_path / "broken.ndjson"
    broken.write_text("{not json\n", encoding="utf-8")
    assert main([str(broken)]) == 2
    assert main([str(tmp_path / "missing.ndjson")]) == 2


# --- real traces ------------------------------------------------------------------------------


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    instance = start_prefill()
    yield instance
    stop_prefill(instance)


@pytest.fixture
def side() -> Iterator[DecodeSide]:
    """A decode side whose transport has no socket monitor: with one, the restart's dead
    ports are found and fanned out before the first send, and no receiver would ever hold
    the stale generation this scenario is about."""
    transport = UnmonitoredTransport()
    try:
        yield from make_decode(transport=transport)
    finally:
        transport.close()


def _stale_receiver_outlives_a_replacement(prefill: Prefill, side: DecodeSide) -> None:
    """Single-threaded: a receiver holding the stale generation fails only after another
    receiver has already replaced it with a fresh one."""
    assert side.run(prefill, room=1).state == life.DONE
    prefill.restart_ranks()  # every pooled port is dead now
    late = side.decode.receiver(prefill.addr, 2, PLAN)
    late.init(0)  # hit on the stale generation; it fails later
    early = side.run(prefill, room=3)  # hits it too, fails at once and invalidates it
    assert early.state == life.INVALIDATED
    fresh = side.run(prefill, room=4)  # misses, fetches the new ports, publishes
    assert fresh.state == life.DONE
    side.send(late)  # fails on the dead ports, then invalidates by identity
    assert late.state == life.INVALIDATED


def test_real_trace_of_restart_and_replacement_is_allowed(
    prefill: Prefill, side: DecodeSide, tmp_path: Path
) -> None:
    with trace.tracing(tmp_path / "trace.ndjson") as path:
        _stale_receiver_outlives_a_replacement(prefill, side)
        side.pool.invalidate_address(prefill.addr)
    events = read_trace(path)
    actions = [e["action"] for e in events]
    assert {"Hit", "Miss", "PoolPublish", "SendFail", "PoolInvalidate", "Complete"} <= set(actions)
    assert actions[-1] == "PoolInvalidateAddress"
    report = validate(events)
    assert report.ok, report.violation


def test_real_trace_of_a_by_key_invalidation_is_caught(
    prefill: Prefill, side: DecodeSide, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def by_key(
        entries_pool: dict[PoolKey, Generation], entries: Mapping[PoolKey, Generation]
    ) -> tuple[int, int]:
        removed = 0
        for key in entries:
            if entries_pool.pop(key, None) is not None:
                removed += 1
        return removed, 0

    monkeypatch.setattr(pool_module, "invalidate_entries", by_key)
    with trace.tracing(tmp_path / "trace.ndjson") as path:
        _stale_receiver_outlives_a_replacement(prefill, side)
    report = validate(read_trace(path))
    assert report.violation is not None
    assert report.violation.rule == "IdentitySafe"
    assert report.violation.event["action"] == "PoolInvalidate"
    assert report.violation.event["removed"] == 1


# --- many threads: the pool stress workload and concurrent receivers through a restart ---------


@dataclass
class StressTrace:
    result: dict[str, object]
    events: list[dict[str, Any]]
    report: Report


#: The real pool's stress run (seed 5: it retires instances) and each failing variant's (seed 3).
POOL_SEED, VARIANT_SEED = 5, 3


@pytest.fixture(scope="module")
def stress_trace(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], StressTrace]:
    """The traced stress run of the pool (``"pool"``) or of a pool variant, run once per module:
    the tests below judge the same run in different ways (each run costs 1-3 s)."""
    runs: dict[tuple[str, int], StressTrace] = {}

    def get(name: str, seed: int) -> StressTrace:
        if (name, seed) not in runs:
            where = tmp_path_factory.mktemp(f"stress_{name}_{seed}")
            if name == "pool":
                module: Any = pool_module
            else:
                mutants.write_mutant(mutants.BY_NAME[name], where)
                module = mutants.load_module(where / f"pool_{name}.py")
            with trace.tracing(where / "trace.ndjson") as path:
                result = stress.run_stress(module, seed=seed)
            events = read_trace(path)
            runs[name, seed] = StressTrace(result, events, validate(events))
        return runs[name, seed]

    return get


def test_trace_of_the_threaded_pool_stress_run_is_allowed(
    stress_trace: Callable[[str, int], StressTrace],
) -> None:
    """IdentitySafe / ExactNodeFailure on the 8-thread stress workload's trace: pool events are
    numbered under the pool lock, so replaying in seq order is the order the lock chose."""
    run = stress_trace("pool", POOL_SEED)
    stress.check_accounting(run.result)
    assert sum(e["action"] == "PoolInvalidate" for e in run.events) > 100
    assert run.report.ok, run.report.violation


def test_trace_of_concurrent_receivers_through_a_restart_is_allowed(
    prefill: Prefill, side: DecodeSide, tmp_path: Path
) -> None:
    """Four request threads share one pool while the prefill's ranks crash and restart on new
    ports; every lifecycle step and pool operation of the run replays against the model."""
    import threading

    stop = threading.Event()
    outcomes: list[str] = []
    rooms = iter(range(1000, 100_000))
    room_lock = threading.Lock()

    def loop() -> None:
        while not stop.is_set():
            with room_lock:
                room = next(rooms)
            outcomes.append(side.run(prefill, room).state)

    with trace.tracing(tmp_path / "threads.ndjson") as path:
        threads = [threading.Thread(target=loop) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            while outcomes.count(life.DONE) < 20:
                threading.Event().wait(0.01)
            prefill.restart_ranks()
            done_at_restart = outcomes.count(life.DONE)
            deadline = 200
            while outcomes.count(life.DONE) < done_at_restart + 20 and deadline:
                threading.Event().wait(0.05)
                deadline -= 1
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
    assert life.INVALIDATED in outcomes, "no request met the dead ports"
    assert outcomes.count(life.DONE) >= done_at_restart + 20, "no recovery after the restart"
    report = validate(read_trace(path))
    assert report.ok, report.violation


@pytest.mark.parametrize(
    "name, rule",
    [
        ("delete_by_key", "IdentitySafe"),
        ("overwrite_not_setdefault", "POOL-2 setdefault"),
        ("retire_all_but_observed", "ExactNodeFailure"),
    ],
)
def test_trace_of_the_stress_run_on_a_failing_pool_variant_is_caught(
    name: str, rule: str, stress_trace: Callable[[str, int], StressTrace]
) -> None:
    """The same threaded workload on each pool variant the stress accounting catches yields a
    trace the validator rejects, naming the rule: it has teeth on concurrent traces too."""
    report = stress_trace(name, VARIANT_SEED).report
    assert report.violation is not None
    assert report.violation.rule == rule


# --- the new steps: PeerLost, SendFail from idle, multi-key requests, retirement --------------

K_CP1 = ["h:80", 0, 1, 0]


def publish_with(key: list[Any], held: int, fresh: int, instance: str) -> dict[str, Any]:
    return {**publish(key, held, fresh), "instance": instance, "fresh_instance": instance}


def retire(addr: str, instance: str, keys: list[Any]) -> dict[str, Any]:
    return {
        "action": "PoolRetireInstance",
        "addr": addr,
        "instance_id": instance,
        "removed": len(keys),
        "keys": keys,
    }


MULTI_KEY = [
    # r1 sets up both cp ranks of h:80 from instance "a".
    rx("Miss", 1, "fetching"),
    rx("FetchOk", 1, "fetched", [[K, 1], [K_CP1, 2]]),
    rx("RegisterOk", 1, "registered", [[K, 1], [K_CP1, 2]]),
    publish_with(K, 1, 1, "a"),
    publish_with(K_CP1, 2, 2, "a"),
    rx("Publish", 1, "cached", [[K, 1], [K_CP1, 2]]),
    # cp rank 1's entry is dropped (a failure elsewhere); r2 hits cp0, misses cp1: a partial hit.
    invalidate([[K_CP1, 2]], 1),
    rx("Miss", 2, "fetching", [[K, 1]]),
    rx("FetchOk", 2, "fetched", [[K, 1], [K_CP1, 3]]),
    rx("RegisterOk", 2, "registered", [[K, 1], [K_CP1, 3]]),
    publish_with(K_CP1, 3, 3, "a"),  # one publish per fetched key only
    rx("Publish", 2, "cached", [[K, 1], [K_CP1, 3]]),
    # The fan-out fails r2 (its prefill restarted): one invalidation drops every recorded key,
    # the hit one included.
    rx("PeerLost", 2, "failed", [[K, 1], [K_CP1, 3]]),
    invalidate([[K, 1], [K_CP1, 3]], 2),
    rx("Invalidate", 2, "invalidated", [[K, 1], [K_CP1, 3]]),
    # The fan-out also reaches a receiver that had not looked anything up yet, and one waiting.
    rx("PeerLost", 3, "failed"),
    invalidate([], 0),
    rx("Invalidate", 3, "invalidated"),
    rx("SendOk", 1, "waiting", [[K, 1], [K_CP1, 2]]),
    rx("PeerLost", 1, "failed", [[K, 1], [K_CP1, 2]]),
    invalidate([[K, 1], [K_CP1, 2]], 0),
    rx("Invalidate", 1, "invalidated", [[K, 1], [K_CP1, 2]]),
    # send_metadata before init: SendFail from idle.
    *fail_and_invalidate(4, "SendFail", [], 0),
    # Instance "b" replaced "a"; an entry of "b" and one of "a" are pooled; "a" is retired.
    *miss_publish(5, 4, key=K),
    publish_with(K_CP1, 5, 5, "a"),
]
MULTI_KEY[-3] = publish_with(K, 4, 4, "b")  # r5's publish came from instance "b"


def test_multi_key_fan_out_and_idle_failures_are_allowed() -> None:
    events = [*MULTI_KEY, retire("h:80", "a", [K_CP1])]
    report = validate(events)
    assert report.ok, report.violation


def test_retiring_a_newer_instances_entry_is_caught() -> None:
    """The stale-observer bug: retiring "a" (or "everything but a") removes "b"'s entry."""
    events = [*MULTI_KEY, retire("h:80", "a", [K, K_CP1])]
    report = validate(events)
    assert report.violation is not None and report.violation.rule == "ExactNodeFailure"
    assert "another instance" in report.violation.reason


def test_retirement_that_leaves_the_instance_behind_is_caught() -> None:
    events = [*MULTI_KEY, retire("h:80", "b", [])]
    report = validate(events)
    assert report.violation is not None and report.violation.rule == "ExactNodeFailure"
    assert "left" in report.violation.reason


def test_stress_trace_has_retirements_and_the_old_rule_is_rejected(
    stress_trace: Callable[[str, int], StressTrace],
) -> None:
    """The threaded stress run retires replaced instances while receivers publish the new one;
    its trace validates. The same workload on the pool with the old rule ("drop every instance
    but the one named") drops live entries, and its trace is rejected. (The runs are those of
    the two tests above: one stress run each, judged here for retirements.)"""
    run = stress_trace("pool", POOL_SEED)
    stress.check_accounting(run.result)
    assert sum(e["action"] == "PoolRetireInstance" for e in run.events) > 0
    assert run.report.ok, run.report.violation
    report = stress_trace("retire_all_but_observed", VARIANT_SEED).report
    assert report.violation is not None and report.violation.rule == "ExactNodeFailure"


def _multi_key_workload(pool_module: Any, seed: int) -> None:
    """Four threads run two-key requests (cp ranks 0 and 1 of one address) on one pool while a
    restarter moves the instance on: partial hits, one publish per missing key, and on a
    failure one invalidation of every recorded key, the hit ones included."""
    import random
    import threading

    pool = pool_module.BootstrapPool()
    keys = [pool_module.PoolKey("h:80", 0, cp, 0) for cp in (0, 1)]
    current = {"instance": "h:80#0"}
    done = threading.Event()

    def request_loop(rng: random.Random) -> None:
        for _ in range(3000):
            if done.is_set():
                return
            entries = {}
            for key in keys:
                held = pool.lookup(key)
                if held is None:
                    instance = current["instance"]
                    fresh = pool_module.Generation(
                        (pool_module.RankInfo("10.0.0.9", 17000, 0),), instance
                    )
                    held = pool.publish(key, fresh)
                entries[key] = held
            stale = any(g.instance_id != current["instance"] for g in entries.values())
            if stale or rng.random() < 0.05:
                pool.invalidate(entries)

    def restarter() -> None:
        for epoch in range(1, 200):
            if done.wait(0.002):
                return
            current["instance"] = f"h:80#{epoch}"

    threads = [
        threading.Thread(target=request_loop, args=(random.Random(seed * 10 + n),))
        for n in range(4)
    ]
    restart = threading.Thread(target=restarter)
    restart.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    done.set()
    restart.join(30)


def test_threaded_multi_key_trace_is_allowed_and_by_key_deletion_is_caught(
    tmp_path: Path,
) -> None:
    partial = False
    for seed in range(1, 6):  # every trace must validate; one must show a partial removal
        with trace.tracing(tmp_path / f"multi{seed}.ndjson") as path:
            _multi_key_workload(pool_module, seed=seed)
        events = read_trace(path)
        report = validate(events)
        assert report.ok, report.violation
        invalidations = [e for e in events if e["action"] == "PoolInvalidate"]
        assert sum(len(e["entries"]) == 2 for e in invalidations) > 10
        # One key already dropped or replaced by another thread, the other still recorded.
        partial = partial or any(e["removed"] == 1 for e in invalidations)
        if partial:
            break
    assert partial, "no invalidation met one replaced and one recorded key"
    mutants.write_mutant(mutants.BY_NAME["delete_by_key"], tmp_path)
    mutant = mutants.load_module(tmp_path / "pool_delete_by_key.py")
    for seed in (1, 2, 3):
        with trace.tracing(tmp_path / f"mutant{seed}.ndjson") as path:
            _multi_key_workload(mutant, seed=seed)
        report = validate(read_trace(path))
        if report.violation is not None:
            assert report.violation.rule == "IdentitySafe"
            return
    pytest.fail("the by-key pool's multi-key traces were all accepted")


# --- the SGLang 0.5.23 rules: responses per rank, terminal Failed, ABORT notices ------------


def ack(room: int, tp_rank: int, instance: str = "a") -> dict[str, Any]:
    return {
        "action": "Ack",
        "room": room,
        "instance": instance,
        "target": instance,
        "tp_rank": tp_rank,
        "pp_rank": 0,
    }


def completed_room(required: int, acks: list[dict[str, Any]]) -> list[Any]:
    """One receiver completes room 7 on instance "a"'s generation, with the given acks."""
    done = rx("Complete", 1, "done", [[K, 1]])
    done.update(room=7, required=required)
    return [
        rx("Miss", 1, "fetching"),
        rx("FetchOk", 1, "fetched", [[K, 1]]),
        rx("RegisterOk", 1, "registered", [[K, 1]]),
        publish_with(K, 1, 1, "a"),
        rx("Publish", 1, "cached", [[K, 1]]),
        rx("SendOk", 1, "waiting", [[K, 1]]),
        done,
        *acks,
    ]


def test_completion_with_every_required_rank_is_allowed() -> None:
    report = validate(completed_room(2, [ack(7, 0), ack(7, 1)]))
    assert report.ok, report.violation


def test_completion_on_a_repeated_response_is_caught() -> None:
    """Two acks, both from tp rank 0: one distinct rank of the two the plan requires."""
    report = validate(completed_room(2, [ack(7, 0), ack(7, 0)]))
    assert report.violation is not None
    assert report.violation.rule == "CompleteNeedsAllResponses"
    assert "1 distinct prefill ranks" in report.violation.reason


def test_a_response_of_another_instance_does_not_count() -> None:
    report = validate(completed_room(2, [ack(7, 0), ack(7, 1, instance="b")]))
    assert report.violation is not None
    assert report.violation.rule in ("CompleteNeedsAllResponses", "NoStaleSuccess")


def test_a_late_completion_of_a_failed_request_is_caught() -> None:
    events = [
        *miss_publish(1, 1),
        rx("SendOk", 1, "waiting", [[K, 1]]),
        rx("Timeout", 1, "failed", [[K, 1]]),
        rx("Complete", 1, "done", [[K, 1]]),  # the late ack completed it
    ]
    report = validate(events)
    assert report.violation is not None and report.violation.rule == "FailedIsTerminal"


def notice(receiver: int) -> dict[str, Any]:
    return {"action": "AbortNotice", "receiver": receiver, "room": 7}


def gives_up(r: int, event: str, told: bool) -> list[Any]:
    """Receiver r's request gives up after init (timeout or abort), telling its ranks or not."""
    key = K if r == 1 else K2  # an aborted request leaves its entry pooled: one key each
    steps = [*miss_publish(r, r, key=key), rx("SendOk", r, "waiting", [[key, r]])]
    if event == "Abort":
        steps.append(rx("Abort", r, "aborted", [[key, r]]))
    else:
        steps += fail_and_invalidate(r, "Timeout", [[key, r]], 1)
    if told:
        steps.append(notice(r))
    return [*steps, rx("NewRequest", r, "idle")]


@pytest.mark.parametrize("event", ["Timeout", "Abort"])
def test_a_give_up_that_tells_the_ranks_is_allowed(event: str) -> None:
    report = validate(gives_up(1, event, told=True))
    assert report.ok, report.violation


@pytest.mark.parametrize("event", ["Timeout", "Abort"])
def test_a_give_up_that_tells_no_rank_is_caught(event: str) -> None:
    # Receiver 1 records its notices, so the trace is judged; receiver 2 gives up silently.
    report = validate([*gives_up(1, "Abort", told=True), *gives_up(2, event, told=False)])
    assert report.violation is not None and report.violation.rule == "AbortNotified"
    assert report.violation.event["receiver"] == 2


def test_an_abort_before_init_needs_no_notice() -> None:
    events = [
        *gives_up(1, "Abort", told=True),
        rx("Miss", 2, "fetching"),
        rx("Abort", 2, "aborted"),  # no target ranks known yet: nothing to tell
    ]
    report = validate(events)
    assert report.ok, report.violation


def test_a_decode_that_records_no_notices_is_not_judged_on_them() -> None:
    report = validate(gives_up(1, "Timeout", told=False))
    assert report.ok, report.violation
