"""Hostile peers (issue 10's table): each figure against a baseline measured in the same run.

1. ``init()`` against a bootstrap server trickling its reply one byte per second. Ours:
   ``BootstrapReceiver.init`` with ``BootstrapClient(deadline=D)``; goal <= D + 50 ms.
   Baseline: SGLang's ``requests.get(url, timeout=5)``, whose timeout is per socket read, so
   the trickle holds it until the reply ends; stopped at ``--baseline-cap`` seconds.
2. ``/health`` latency (p50/p99, failures) from a keep-alive ``BootstrapClient`` while 600
   slowloris + 300 slow-body connections attack a server whose fd limit is 1024; baseline:
   the same probe against the same server without the attack. Goal: p99 <= 50 ms, 0 failures.
3. RSS of a process listening for acks after one message of 200,000 frames of 200 bytes:
   ours (``AckListener``) vs the previous design (a ``PULL`` socket with ``MAXMSGSIZE``).
   Goal: <= +1 MB.
4. The ack listener's process (fd limit 1024) under 1,100 libzmq senders that complete the
   ZMTP handshake and stay silent (issue 17): CPU share, whether it can still open a file,
   and the acks of a live sender delivered; baseline: the same process without the flood.

Loopback only. The attack and trickle tools are the test suite's
(``tests/support/attack_support.py``,
``tests/support/http_support.py``), imported from the tests directory so that the benchmark measures
exactly what the tests check.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.prefill.registration import register_rank
from statemachine.wire.http import route_payload
from statemachine.wire.reference import SimpleBackend
from tests.support.ack_flood_support import ListenerProcess, SilentHandshakes
from tests.support.attack_support import AttackProcess, ServerProcess, rss_after_one_message
from tests.support.http_support import TrickleServer

TOKEN = "bench-hostile-token"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_trickle(deadline: float, repeats: int, baseline_cap: float) -> None:
    print(f"\n-- init() against a server trickling 1 byte/s (deadline {deadline:g} s)")
    client = BootstrapClient(deadline=deadline)
    transport = ZmqTransport()
    manager = DecodeManager(
        source=client,
        transport=transport,
        backend=SimpleBackend("127.0.0.1", 9, "bench-hostile"),
        completion="external",
        health_probes=False,
    )
    overshoot: list[float] = []
    try:
        with TrickleServer(interval=1.0, phase="headers", max_seconds=baseline_cap) as srv:
            for room in range(repeats):
                receiver = manager.receiver(srv.address, room, RankPlan())
                start = time.monotonic()
                assert receiver.init(prefill_dp_rank=0) is KVPoll.Failed
                overshoot.append((time.monotonic() - start - deadline) * 1000.0)
            start = time.monotonic()
            with contextlib.suppress(requests.RequestException):
                requests.get(
                    f"http://{srv.address}/route?prefill_dp_rank=0&prefill_cp_rank=0"
                    "&target_tp_rank=0&target_pp_rank=0",
                    timeout=5,
                    stream=True,
                ).raw.read(decode_content=False, amt=1 << 20)
            baseline = time.monotonic() - start
    finally:
        manager.close()
        transport.close()
        client.close()
    ours = deadline + statistics.median(overshoot) / 1000.0
    print(
        f"baseline requests.get(timeout=5): {baseline:.2f} s, held until the trickling server "
        f"gave up at {baseline_cap:g} s (unbounded otherwise)"
    )
    print(
        f"ours: median {ours:.3f} s = deadline + {statistics.median(overshoot):.1f} ms "
        f"(max + {max(overshoot):.1f} ms over {repeats}); goal <= deadline + 50 ms"
    )
    print(f"ratio baseline/ours >= {baseline / ours:.1f}x")


def probe(address: str, seconds: float, interval: float) -> tuple[list[float], int, int]:
    """``/health`` latencies (ms) and failures from a keep-alive client, plus failures of the
    rank query and registration made every tenth round."""
    latencies: list[float] = []
    failures = other_failures = 0
    rounds = 0
    with BootstrapClient(deadline=5.0) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                client.health(address)
                latencies.append((time.monotonic() - start) * 1000.0)
            except Exception:
                failures += 1
            rounds += 1
            if rounds % 10 == 0:
                try:
                    client.get_rank(address, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
                    payload = route_payload(rank_ip="127.0.0.1", rank_port=5000 + rounds % 1000)
                    register_rank(address, TOKEN, payload, attempts=1)
                except Exception:
                    other_failures += 1
            time.sleep(interval)
    return latencies, failures, other_failures


def bench_attack(slowloris: int, slow_body: int, nofile: int, seconds: float) -> None:
    print(
        f"\n-- /health during {slowloris} slowloris + {slow_body} slow-body connections "
        f"(server fd limit {nofile})"
    )
    with ServerProcess(nofile=nofile, token=TOKEN) as srv:
        register_rank(srv.address, TOKEN, route_payload(rank_ip="127.0.0.1", rank_port=5000))
        quiet, quiet_failures, _ = probe(srv.address, min(seconds, 5.0), 0.01)
        attack = AttackProcess(
            srv.address, slowloris=slowloris, slow_body=slow_body, seconds=seconds + 2.0
        )
        time.sleep(2.0)
        loud, loud_failures, loud_other = probe(srv.address, seconds, 0.01)
        attacked = attack.stop()
        stats, log = srv.stop()
    print(
        f"baseline (no attack): p50 {percentile(quiet, 0.5):.2f} ms, "
        f"p99 {percentile(quiet, 0.99):.2f} ms, {quiet_failures} failures, n={len(quiet)}"
    )
    print(
        f"ours under attack (attack ready: {attack.ready}, opened {attacked.get('opened')}, "
        f"{attacked.get('open_now')} open at the end): p50 "
        f"{percentile(loud, 0.5):.2f} ms, p99 {percentile(loud, 0.99):.2f} ms, "
        f"{loud_failures} failures, n={len(loud)}; goal p99 <= 50 ms, 0 failures"
    )
    print(f"rank queries + registrations during the attack: {loud_other} failures")
    print(f"ratio p99 attack/quiet: {percentile(loud, 0.99) / percentile(quiet, 0.99):.2f}")
    print(
        f"server: timed out {stats.get('connections_timed_out')}, evicted "
        f"{stats.get('connections_evicted')}, accept failures {stats.get('accept_failures')}, "
        f"peak open {stats.get('connections_peak')}, log lines {len(log.splitlines())}"
    )


def bench_rss(frames: int) -> None:
    print(f"\n-- RSS after one ack message of {frames} frames of 200 bytes")
    base = rss_after_one_message(frames, "pull")
    ours = rss_after_one_message(frames, "ours")
    grow_base = base["peak"] - base["base"]
    grow_ours = ours["peak"] - ours["base"]
    print(f"baseline PULL + MAXMSGSIZE: +{grow_base:.2f} MB (peak {base['peak']:.1f} MB)")
    print(
        f"ours AckListener (ZMTP over STREAM): +{grow_ours:.2f} MB (peak {ours['peak']:.1f} MB); "
        "goal <= +1 MB"
    )
    print(f"ratio baseline/ours growth: {grow_base / max(grow_ours, 0.01):.0f}x")


def _listener_run(nofile: int, flood: int, seconds: float) -> dict[str, object]:
    """One listener process: CPU share over ``seconds`` with ``flood`` silent senders (0:
    none), a probe, and 20 acks from a live sender connecting during it."""
    import zmq

    from statemachine.wire.reference import ack_frames

    with ListenerProcess(nofile) as listener:
        listener.expect(0, 20)
        with contextlib.ExitStack() as stack:
            if flood:
                stack.enter_context(SilentHandshakes(listener.port, flood, mode="zmq"))
                time.sleep(1.0)
            listener.restart_cpu_clock()
            context = zmq.Context()
            sender = context.socket(zmq.PUSH)
            sender.setsockopt(zmq.LINGER, 0)
            sender.connect(f"tcp://127.0.0.1:{listener.port}")
            for room in range(20):
                sender.send_multipart(ack_frames(room, 0, 0))
                time.sleep(seconds / 20)
            stats = listener.stats()
            stats["probe"] = listener.probe()
            sender.close()
            context.term()
    return stats


def bench_ack_flood(nofile: int, flood: int, seconds: float) -> None:
    print(f"\n-- ack listener (fd limit {nofile}) under {flood} silent ZMTP senders")
    quiet = _listener_run(nofile, 0, seconds)
    loud = _listener_run(nofile, flood, seconds)
    for name, run in (("baseline (no flood)", quiet), ("ours under the flood", loud)):
        done = run["completed_rooms"]
        assert isinstance(done, list)
        print(
            f"{name}: CPU {100 * float(str(run['cpu_share'])):.1f} % of a core, probe "
            f"{run['probe']}, live acks {len(done)}/20, peers {run['peers']} (cap "
            f"{run['max_peers']}), cut at the cap {run['peers_evicted']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks bench_hostile")
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-cap", type=float, default=10.0)
    parser.add_argument("--slowloris", type=int, default=600)
    parser.add_argument("--slow-body", type=int, default=300)
    parser.add_argument("--nofile", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--ack-flood", type=int, default=1100)
    parser.add_argument(
        "--smoke", action="store_true", help="every figure once, at a tenth of the load"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.deadline, args.repeats, args.baseline_cap = 0.2, 1, 1.0
        args.slowloris, args.slow_body, args.nofile, args.seconds = 60, 30, 128, 1.0
        args.frames, args.ack_flood = 2_000, 110
    bench_trickle(args.deadline, args.repeats, args.baseline_cap)
    bench_attack(args.slowloris, args.slow_body, args.nofile, args.seconds)
    bench_rss(args.frames)
    bench_ack_flood(args.nofile, args.ack_flood, args.seconds / 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
