"""``manager.step()`` with 1,000 pending rooms: off the scheduler's critical path (issue 18).

A prefill of dp size 2 that does not follow the bootstrap room (so every room's dp rank is
asked with the batched ``POST /query_dp_ranks``) behind a real bootstrap server on 127.0.0.1;
1,000 receivers whose ``init()`` left them pending. Measured in one run, wall time of the
calling thread (the question is how long the scheduler is blocked, not what it computes):

* **synchronous** - ``step(wait=True)``, the form a simple caller may keep: the query is asked
  and answered before it returns (what ``step()`` was before issue 18: the baseline);
* **start** - ``step()`` that starts the query on the manager's background workers and returns;
* **in flight** - ``step()`` while that query is in flight (the goal: <= 100 us);
* **collect** - the ``step()`` that applies the answer to the 1,000 rooms.

Each round uses fresh rooms; medians over rounds. Goals are reported, never asserted.

    .venv/bin/python -m benchmarks bench_step
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import requests
import zmq

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.prefill.registration import register_rank
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.http import route_payload

TOKEN = "bench-step"
ROOMS = 1000
ROUNDS = 9
GOAL_US = 100.0

_rooms = itertools.count(1)


def _pending(manager: DecodeManager, addr: str, count: int) -> list[object]:
    receivers = []
    for _ in range(count):
        receiver = manager.receiver(addr, next(_rooms))
        if receiver.init() != KVPoll.Bootstrapping:
            raise RuntimeError(f"room {receiver.room} did not wait for its dp rank")
        receivers.append(receiver)
    return receivers


def one_round(
    manager: DecodeManager, addr: str, figures: dict[str, list[float]], rooms: int
) -> None:
    held = _pending(manager, addr, rooms)
    started = time.perf_counter()
    resolved = manager.step(wait=True)
    figures["synchronous"].append(time.perf_counter() - started)
    if resolved != rooms:
        raise RuntimeError(f"the synchronous step resolved {resolved} of {rooms}")
    for receiver in held:
        receiver.clear()  # type: ignore[attr-defined]

    held = _pending(manager, addr, rooms)
    started = time.perf_counter()
    resolved = manager.step()
    figures["start"].append(time.perf_counter() - started)
    in_flight: list[float] = []
    deadline = time.monotonic() + 10
    while resolved < rooms and time.monotonic() < deadline:
        busy = manager.stats().dp_queries_in_flight > 0
        started = time.perf_counter()
        got = manager.step()
        elapsed = time.perf_counter() - started
        if got:
            figures["collect"].append(elapsed)
        elif busy:
            in_flight.append(elapsed)
        resolved += got
    if resolved != rooms:
        raise RuntimeError(f"the background steps resolved {resolved} of {rooms}")
    if in_flight:
        figures["in flight"].append(statistics.median(in_flight))
        figures["in flight (max)"].append(max(in_flight))
    for receiver in held:
        receiver.clear()  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_step")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument(
        "--smoke", action="store_true", help="one round of 50 rooms; goal not judged"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rooms = ROOMS
    if args.smoke:
        args.rounds, rooms = 1, 50
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets = [context.socket(zmq.PULL) for _ in range(2)]
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    client = BootstrapClient()
    try:
        for dp, sock in enumerate(sockets):
            payload = route_payload(
                rank_ip="127.0.0.1",
                rank_port=sock.bind_to_random_port("tcp://127.0.0.1"),
                tp_rank=0,
                tp_size=1,
                dp_rank=dp,
                dp_size=2,
            )
            payload.update(load_balance_method="round_robin", follow_bootstrap_room=False)
            register_rank(server.address, TOKEN, payload)
        rooms_needed = (2 * args.rounds + 1) * rooms
        with requests.Session() as session:  # the prefill registers each room's dp rank
            for room in range(1, rooms_needed + 1):
                session.post(
                    f"http://{server.address}/register_dp_rank",
                    json={"bootstrap_room": room, "dp_rank": room % 2},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    timeout=5,
                ).raise_for_status()
        with DecodeManager(source=client, health_interval_s=None) as manager:
            figures: dict[str, list[float]] = {
                name: [] for name in ("synchronous", "start", "in flight", "in flight (max)")
            }
            figures["collect"] = []
            warm = _pending(manager, server.address, 10)  # the topology, the workers
            manager.step(wait=True)
            for receiver in warm:
                receiver.clear()  # type: ignore[attr-defined]
            for _ in range(args.rounds):
                one_round(manager, server.address, figures, rooms)
        print(
            f"step() with {rooms:,} pending rooms, one address, wall time, medians of "
            f"{args.rounds} rounds"
        )
        for name, values in figures.items():
            if values:
                print(f"  {name:<22}{statistics.median(values) * 1e6:>12.1f} us")

        def verdict(met: bool) -> str:
            return "not judged: --smoke" if args.smoke else "met" if met else "NOT met"

        sync = statistics.median(figures["synchronous"]) * 1e6
        flight = statistics.median(figures["in flight"]) * 1e6 if figures["in flight"] else 0.0
        start = statistics.median(figures["start"]) * 1e6
        worst = max(start, flight)
        print(
            f"goal step() <= {GOAL_US:.0f} us while the query is in flight: start {start:.1f} us, "
            f"in flight {flight:.1f} us ({verdict(worst <= GOAL_US)}); the "
            f"synchronous form {sync:.0f} us ({sync / max(worst, 1e-9):.0f}x)"
        )
    finally:
        client.close()
        server.stop()
        for sock in sockets:
            sock.close(linger=0)
        context.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
