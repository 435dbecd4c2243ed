"""Recovery after a prefill restart or a rank's death, per design, measured in the same run.

Three designs, ``--reps`` times each (interleaved, so a slow moment of the machine hits all of
them), medians and ratios against ours:

1. ``before-36029``: no invalidation (the cache before SGLang PR #36029);
2. ``sglang``: invalidation with SGLang's queueing ZMQ sockets, no instance id, no fan-out, no
   single-flight (SGLang today);
3. ``ours``: immediate sends, instance-id retirement, the decode manager's fan-out and
   single-flight.

Part 1, a whole-prefill restart: the demo (real bootstrap server and rank processes, 8 request
loops at 400 req/s) with one SIGKILL restart of the whole prefill at its midpoint. Figures:
kill -> first success, and for the requests in flight at the kill, kill -> Failed.

Part 2, requests in flight when the prefill dies: eight requests wait for a transfer (the
prefill acks after a minute), the whole prefill (server and ranks) is SIGKILLed, and the time
from the kill until every one of them is Failed is measured (the run's waiting timeout bounds it
for designs without fan-out).

Part 3, a one-rank outage: one of two tp ranks is SIGKILLed while the bootstrap server still
lists its port; requests are then issued one after another from one thread (a single-threaded
scheduler), and each one's *caller stall* (time blocked in ``init`` + ``send_metadata``) and
outcome are recorded. The first request pays for discovering the death; the figure is the
median stall of the requests after it (ours: one of them refetches, the others fail at once on
the key known dead, ``statemachine/decode/dead_keys.py``).

Figures come from a machine shared with other work while developing: indicative only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.dead_keys import DEFAULT_RECHECK_S
from statemachine.decode.manager import DecodeManager
from statemachine.demo.baselines import manager_class
from statemachine.demo.modes import OURS, PRESETS, SGLANG, ModeConfig
from statemachine.demo.report import build_report
from statemachine.demo.run import DemoConfig, RunResult, run_demo
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer

_TOKEN = "bench-recovery"


def _median(values: list[float | None]) -> float | None:
    """Median, where None (never recovered) counts as larger than any number."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: (v is None, v or 0.0))
    middle = ordered[len(ordered) // 2]
    if len(ordered) % 2 or middle is None:
        return middle
    low = ordered[len(ordered) // 2 - 1]
    return None if low is None else statistics.median([low, middle])


def _fmt(value: float | None, unit: str = "") -> str:
    return "never" if value is None else f"{value:.3f}{unit}"


def in_flight_to_failed(result: RunResult) -> float | None:
    """Kill -> Failed for the slowest request in flight at the first kill that failed
    (None: no request in flight at the kill failed - there was nothing to detect)."""
    if not result.restarts:
        return None
    killed = result.restarts[0].killed_at
    ends = [o.end - killed for o in result.outcomes if not o.ok and o.start < killed <= o.end]
    return max(ends) if ends else None


def in_flight_at_kill(
    mode: ModeConfig, waiting: int, send_timeout_ms: int, waiting_timeout_s: float
) -> tuple[float | None, list[str]]:
    """Kill -> every waiting request Failed (None: not within 2 waiting timeouts)."""
    from statemachine.decode.plan import RankPlan

    server = BootstrapServer("127.0.0.1", 0, token=_TOKEN).start()
    ranks = [
        PrefillRankProcess(server.address, _TOKEN, tp_rank=tp, tp_size=2, ack_delay_ms=60_000)
        for tp in range(2)
    ]
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    manager: DecodeManager | None = None
    try:
        for rank in ranks:
            rank.start()
        manager = manager_class(mode)(
            source=client,
            send_timeout_ms=send_timeout_ms,
            waiting_timeout_s=waiting_timeout_s,
            liveness_timeout_s=4.0,  # probes every second, as the demo's
        )
        plan = RankPlan(tp_ranks=(0, 1))
        receivers = []
        for room in range(1, waiting + 1):
            receiver = manager.receiver(server.address, room, plan, prefill_dp_rank=0)
            receiver.init()
            receiver.send_metadata((room,))
            receivers.append(receiver)
        for rank in ranks:
            rank.kill()
        server.stop()
        killed = time.monotonic()
        deadline = killed + 2 * waiting_timeout_s
        while time.monotonic() < deadline:
            if all(r.poll() == KVPoll.Failed for r in receivers):
                reasons = sorted({type(r.failure).__name__ for r in receivers})
                return time.monotonic() - killed, reasons
            time.sleep(0.001)
        return None, []
    finally:
        if manager is not None:
            manager.close()
        client.close()
        for rank in ranks:
            rank.kill()
        server.stop()


def rank_outage(
    mode: ModeConfig, requests: int, send_timeout_ms: int, waiting_timeout_s: float
) -> tuple[list[float], list[str]]:
    """Caller stall (s) and outcome of ``requests`` sequential requests after one rank died."""
    server = BootstrapServer("127.0.0.1", 0, token=_TOKEN).start()
    ranks = [PrefillRankProcess(server.address, _TOKEN, tp_rank=tp, tp_size=2) for tp in range(2)]
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    manager: DecodeManager | None = None
    try:
        for rank in ranks:
            rank.start()
        manager = manager_class(mode)(
            source=client,
            send_timeout_ms=send_timeout_ms,
            waiting_timeout_s=waiting_timeout_s,
            health_probes=False,
            # issue 18: hold a key known dead off (one refetch per 50 ms, the rest fail at once)
            dead_recheck_s=DEFAULT_RECHECK_S if mode.manager_fanout else None,
        )
        from statemachine.decode.plan import RankPlan

        plan = RankPlan(tp_ranks=(0, 1))
        warm = manager.receiver(server.address, 1, plan, prefill_dp_rank=0)
        warm.init()
        warm.send_metadata((1,))
        deadline = time.monotonic() + 10
        while warm.poll() == KVPoll.Transferring and time.monotonic() < deadline:
            time.sleep(0.002)
        ranks[1].kill()
        stalls: list[float] = []
        outcomes: list[str] = []
        for room in range(2, 2 + requests):
            receiver = manager.receiver(server.address, room, plan, prefill_dp_rank=0)
            started = time.perf_counter()
            if receiver.init() == KVPoll.WaitingForInput:
                receiver.send_metadata((room,))
            stalls.append(time.perf_counter() - started)
            receiver.poll()
            if receiver.state == "waiting":
                # Sent into a queue (SGLang's sockets): it can only end on the waiting timeout.
                receiver.abort()
                outcomes.append("queued (ends on the waiting timeout)")
            else:
                failure = receiver.failure
                outcomes.append("ok" if failure is None else type(failure).__name__)
        return stalls, outcomes
    finally:
        if manager is not None:
            manager.close()
        client.close()
        for rank in ranks:
            rank.kill()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_recovery")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--waiting-timeout", type=float, default=2.0)
    parser.add_argument("--send-timeout-ms", type=int, default=1000)
    parser.add_argument("--outage-requests", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="one 1-second run per design")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.reps, args.duration, args.outage_requests = 1, 1.0, 2

    rows: dict[str, list[dict[str, object]]] = {mode.name: [] for mode in PRESETS}
    to_failed: dict[str, list[float | None]] = {mode.name: [] for mode in PRESETS}
    for rep in range(args.reps):
        for mode in PRESETS:
            config = DemoConfig(
                mode=mode,
                duration_s=args.duration,
                waiting_timeout_s=args.waiting_timeout,
                send_timeout_ms=args.send_timeout_ms,
            )
            result = run_demo(config)
            report = build_report(result)
            to_failed[mode.name].append(in_flight_to_failed(result))
            rows[mode.name].append(report)
            print(
                f"rep {rep + 1} {mode.name:>13}: failed {report['failed_by_restart']:>3}, "
                f"in flight {report['in_flight_at_restart']} + started while down "
                f"{report['started_while_down']}, first success after "
                f"{_fmt(report['restart_to_first_success_s'], ' s')} "
                f"(prefill down {_fmt(report['downtime_s'], ' s')})",
                flush=True,
            )

    summary: dict[str, tuple[float | None, float | None, float | None, float | None]] = {}
    for name, reports in rows.items():
        summary[name] = (
            _median([float(r["failed_by_restart"]) for r in reports]),  # type: ignore[arg-type]
            _median([r["restart_to_first_success_s"] for r in reports]),  # type: ignore[misc]
            _median([r["ready_to_first_success_s"] for r in reports]),  # type: ignore[misc]
            _median(
                [
                    float(r["in_flight_at_restart"] + r["started_while_down"])  # type: ignore[operator]
                    for r in reports
                ]
            ),
        )
    ours_failed, ours_time, _, _ = summary["ours"]
    print(f"\nmedians of {args.reps} runs (restart = SIGKILL of server and ranks, same port)")
    print(
        f"{'design':>13}  {'failed':>7}  {'kill->ok s':>10}  {'back->ok s':>10}  "
        f"{'failed/ours':>11}  {'time/ours':>9}"
    )
    for name, (failed, to_ok, back_ok, _) in summary.items():
        ratio_failed = "-" if failed is None or not ours_failed else f"{failed / ours_failed:.2f}x"
        ratio_time = (
            "never" if to_ok is None else ("-" if not ours_time else f"{to_ok / ours_time:.2f}x")
        )
        print(
            f"{name:>13}  {_fmt(failed):>7}  {_fmt(to_ok):>10}  {_fmt(back_ok):>10}  "
            f"{ratio_failed:>11}  {ratio_time:>9}"
        )

    # The goals, checked against the medians of this run.
    budget_s = args.send_timeout_ms / 1000.0
    exposed = summary["ours"][3]
    ok_time = ours_time is not None and ours_time <= budget_s + 0.25
    ok_failed = ours_failed is not None and exposed is not None and ours_failed <= exposed
    print(
        f"\ngoal: ours recovers within one send timeout ({budget_s:g} s) plus one refetch: "
        f"{_fmt(ours_time, ' s')} -> {'met' if ok_time else 'NOT met'}"
    )
    print(
        "goal: ours fails no more requests than were exposed to the dead prefill "
        f"(in flight at the kill + started while it was down): {_fmt(ours_failed)} <= "
        f"{_fmt(exposed)} -> {'met' if ok_failed else 'NOT met'}"
    )
    print(
        "\nrequests in flight at the kill -> Failed (slowest of them, median over the runs "
        "that had such requests):"
    )
    for name, values in to_failed.items():
        seen: list[float | None] = [v for v in values if v is not None]
        print(f"{name:>13}  {_fmt(_median(seen), ' s') if seen else 'n/a'} ({len(seen)} runs)")

    print(
        "\n8 requests waiting for a transfer when the whole prefill is SIGKILLed: "
        "kill -> all Failed"
    )
    in_flight_summary: dict[str, float | None] = {}
    for mode in (SGLANG, OURS):
        times: list[float | None] = []
        for _ in range(args.reps):
            elapsed, reasons = in_flight_at_kill(
                mode, 8, args.send_timeout_ms, args.waiting_timeout
            )
            times.append(elapsed)
            print(f"{mode.name:>13}: {_fmt(elapsed, ' s')} ({', '.join(reasons) or '-'})")
        in_flight_summary[mode.name] = _median(times)
    ours_kill = in_flight_summary["ours"]
    sglang_kill = in_flight_summary["sglang"]
    ratio = (
        "-"
        if ours_kill is None or sglang_kill is None or not ours_kill
        else f"{sglang_kill / ours_kill:.1f}x faster than sglang"
    )
    print(
        f"goal: ours fails them all within 50 ms of the kill: {_fmt(ours_kill, ' s')} ({ratio}) "
        f"-> {'met' if ours_kill is not None and ours_kill <= 0.05 else 'NOT met'}"
    )

    print(f"\none-rank outage: {args.outage_requests} requests in a row after the kill, 1 thread")
    stall_summary: dict[str, float] = {}
    for mode in (SGLANG, OURS):
        per_rep: list[float] = []
        for _ in range(args.reps):
            stalls, outcomes = rank_outage(
                mode, args.outage_requests, args.send_timeout_ms, args.waiting_timeout
            )
            after_first = stalls[1:] or stalls
            per_rep.append(statistics.median(after_first))
            print(
                f"{mode.name:>13}: first {stalls[0] * 1000:8.2f} ms, then median "
                f"{per_rep[-1] * 1000:8.2f} ms per request; outcomes {sorted(set(outcomes))}"
            )
        stall_summary[mode.name] = statistics.median(per_rep)
    ours_stall = stall_summary["ours"]
    print(
        f"goal: ours stalls <= 1 ms per request after the first failure: "
        f"{ours_stall * 1000:.2f} ms -> {'met' if ours_stall <= 0.001 else 'NOT met'}"
    )
    # Issue 18: a key known dead fails at once (no refetch per request) through the manager.
    print(
        f"goal (issue 18): <= 50 us through the manager once the rank is known dead: "
        f"{ours_stall * 1e6:.1f} us -> {'met' if ours_stall <= 50e-6 else 'NOT met'}"
    )
    # Goals are reported, not gated: on a loaded machine the refetch itself slows down.
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
