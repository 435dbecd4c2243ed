"""KV held after a SIGKILL: how long a dead prefill's failed rooms keep their pages (issue 27).

Eight rooms wait for their transfer (the metadata went out: each room's pages are told to both
ranks of a reference prefill that acks after a minute), then every rank process is SIGKILLed.
A scheduler thread polls the receivers and asks ``kv_release(room)`` every millisecond, as a
scheduler that frees a failed room's pages only when told to would. Two designs, same run:

1. ``acks-or-timeout``: SGLang 0.5.23's rule (``decode.py:2996-3108``): a room is freed when
   every rank acknowledged its ABORT or ``kv_release_timeout_s`` passed. A dead process never
   acknowledges, so this is the timeout (SGLang's default 30 s). The anchor is our manager with
   the transport's exit proofs unheard (:class:`AcksOrTimeoutOnly`).
2. ``ours``: the same, plus release as soon as every rank told the room is proven gone (the
   port refused a connect: ZMQ-26, MGR-15).

Figures: rooms held when every room had failed, rooms still held 1 s after the kill, and the
time from the kill until the last room was released. Indicative only (a shared machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.transport import ExitListener, ZmqTransport
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer

_TOKEN = "bench-kv-release"
_TP = 2


class AcksOrTimeoutOnly(ZmqTransport):
    """SGLang's release rule as an anchor: nobody hears that a rank's process exited."""

    def subscribe_exits(self, listener: ExitListener) -> None:
        del listener


def _run(design: str, rooms: int, release_timeout_s: float) -> dict[str, float | int | None]:
    server = BootstrapServer("127.0.0.1", 0, token=_TOKEN).start()
    ranks = [
        PrefillRankProcess(server.address, _TOKEN, tp_rank=r, tp_size=_TP, ack_delay_ms=60_000)
        for r in range(_TP)
    ]
    transport_class = AcksOrTimeoutOnly if design == "acks-or-timeout" else ZmqTransport
    transport = transport_class(send_timeout_ms=500)
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    manager = DecodeManager(
        source=client,
        transport=transport,
        health_probes=False,
        kv_release_timeout_s=release_timeout_s,
    )
    try:
        for rank in ranks:
            rank.start()
        plan = RankPlan(tp_ranks=tuple(range(_TP)))
        receivers = []
        for room in range(1, rooms + 1):
            receiver = manager.receiver(server.address, room, plan, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.WaitingForInput
            receiver.send_metadata((room,))
            receivers.append(receiver)
        killed = time.monotonic()
        for rank in ranks:
            rank.kill()
        held_when_failed: int | None = None
        held_at_1s: int | None = None
        pending = set(range(1, rooms + 1))
        released_after: float | None = None
        deadline = killed + release_timeout_s + 5.0
        while time.monotonic() < deadline:
            failed = all(r.poll() == KVPoll.Failed for r in receivers)
            if failed and held_when_failed is None:
                held_when_failed = manager.kv_holds().held
            if failed:
                pending = {room for room in pending if not manager.kv_release(room)}
            now = time.monotonic()
            if held_at_1s is None and now - killed >= 1.0:
                held_at_1s = len(pending) if failed else rooms
            if failed and not pending:
                released_after = now - killed
                break
            time.sleep(0.001)
        stats = manager.kv_holds()
        return {
            "held_when_failed": held_when_failed,
            "held_at_1s": 0 if held_at_1s is None else held_at_1s,
            "released_after_s": released_after,
            "by_proof": stats.released_by_proof,
            "by_timeout": stats.released_by_timeout,
        }
    finally:
        manager.close()
        transport.close()
        client.close()
        for rank in ranks:
            rank.kill()
        server.stop()


def _print(rows: Iterable[tuple[str, dict[str, float | int | None]]]) -> None:
    print(
        f"{'design':<16} {'held at fail':>12} {'held at 1 s':>12} {'all released':>13} "
        f"{'by proof':>9} {'by timeout':>11}"
    )
    for design, row in rows:
        after = row["released_after_s"]
        released = "never" if after is None else f"{after:.3f} s"
        print(
            f"{design:<16} {row['held_when_failed']!s:>12} {row['held_at_1s']!s:>12} "
            f"{released:>13} {row['by_proof']!s:>9} {row['by_timeout']!s:>11}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv_release")
    parser.add_argument("--rooms", type=int, default=8)
    parser.add_argument(
        "--release-timeout",
        type=float,
        default=30.0,
        help="kv_release_timeout_s (SGLang's default 30 s; the anchor waits this long)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long run for the tests: 2 rooms, a 2 s release timeout",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rooms, args.release_timeout = 2, 2.0
    rows = []
    for design in ("acks-or-timeout", "ours"):
        print(f"bench_kv_release: {design}: SIGKILL with {args.rooms} rooms in flight ...")
        rows.append((design, _run(design, args.rooms, args.release_timeout)))
    _print(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
