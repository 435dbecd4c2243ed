"""Silence: how soon a stopped or cut-off prefill is found, and how soon requests succeed again.

The reference prefill (bootstrap server + 2 tp ranks), or with ``--prefill sglang`` SGLang
0.5.23's bootstrap server and one rank (its statuses through SGLang's own status sockets, a
stand-in answering for its transfer engine: ``tests/support/sglang_netns_prefill.py``), runs as
processes in a network namespace this benchmark creates (``tests/support/netns_support.py``; needs
root, ``ip`` and ``nft``). A ``DecodeManager`` on the host side issues a request every 20 ms
through its public API (``receiver`` → ``init`` → ``send_metadata`` → ``poll``), and a fault
lasts ``--fault-s``:

* ``hang``: every prefill process SIGSTOPped, then SIGCONTed;
* ``partition``: every packet between decode and prefill dropped both ways (no resets), then
  let through again; ``partition-to-prefill`` / ``partition-from-prefill``: one way only;
* ``rank-cut``: only the ranks' ZMQ ports cut, the bootstrap server still answers;
* ``replace``: every prefill process SIGKILLed and a new instance started behind the same
  bootstrap address (the "heal" is the moment it serves again).

Figures per run: *detection* (fault → the first request Failed), requests failed, the longest
wait of a request, and *first success after heal* (the heal or SIGCONT → the first request that
completes with Success). Configurations, in the same run:

* ``before``: main's parts before the bound: a transport without heartbeats and a fetch client
  with a 2 s connect / 5 s read handed to the manager, and health probes every 5 s bounded by
  5 s (``liveness_timeout_s=20``, the nearest the one setting comes to main's 5 s interval and
  2 s / 3 s probe);
* ``bound=3s`` (the default) / ``bound=1s``: ``DecodeManager(liveness_timeout_s=N)``, every
  part built by the manager from the one setting
  (:class:`~statemachine.decode.liveness_bound.LivenessBound`), with the hold-off of a silent
  bootstrap server (MGR-22).

Then, unless ``--no-in-flight``, *statuses in flight* (ZMQ-27): a second prefill whose statuses
leave 200 ms after their metadata (a transfer time), so that statuses are in flight when the cut
begins, cut both ways and each way alone, its status sockets as they were before (libzmq's
defaults) and with the bound, against the default decode (``bound=3s``). ``--ack-delay-ms N``
gives the first table's prefill a transfer time too; ``--status-sockets before`` gives it
libzmq's defaults. ``--prefill-sysctl name=value`` sets a kernel setting in the
prefill's namespace only (its host), e.g. ``net.ipv4.tcp_rto_max_ms=1000``.

Figures come from a machine shared with other work: indicative only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.decode.receiver import BootstrapReceiver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support

from tests.support.netns_support import (
    NetNamespace,
    NetnsPrefill,
    SGLangNetnsPrefill,
    netns_unavailable,
)

#: The reference prefill's two tp ranks; SGLang's (``--prefill sglang``) has one.
PLANS = {"reference": RankPlan(tp_ranks=(0, 1)), "sglang": RankPlan(tp_ranks=(0,))}
Prefill = NetnsPrefill | SGLangNetnsPrefill
PERIOD_S = 0.02
WARMUP_S = 1.0
#: --smoke: requests flow for half a second before the fault (25 of them).
SMOKE_WARMUP_S = 0.5
#: After the heal, watch until the first success plus this, or at most AFTER_MAX_S.
AFTER_SUCCESS_S = 0.5
AFTER_MAX_S = 15.0
FAULTS = ("hang", "partition", "rank-cut", "replace")
#: The one-way cuts (ZMQ-27): what the decode sends the prefill, or what the prefill sends back.
ONE_WAY = {"partition-to-prefill": "to-ns", "partition-from-prefill": "from-ns"}
#: The statuses-in-flight table (ZMQ-27): a transfer time, the cuts, the default bound.
IN_FLIGHT_TRANSFER_MS = 200
IN_FLIGHT_FAULTS = ("partition", *ONE_WAY)
IN_FLIGHT_CONFIG = "bound=3s"


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    error: str


@dataclass
class RunFigures:
    config: str
    fault: str
    detection_s: float | None
    failed: int
    longest_wait_s: float
    first_success_after_heal_s: float | None
    requests: int
    errors: dict[str, int] = field(default_factory=dict)


class Load:
    """A request every ``PERIOD_S``: init and send on a pool of workers, polled by one thread."""

    def __init__(self, manager: DecodeManager, addr: str, plan: RankPlan) -> None:
        self.manager = manager
        self.addr = addr
        self.plan = plan
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._pending: list[tuple[float, BootstrapReceiver]] = []
        self._stop = threading.Event()
        self._workers = ThreadPoolExecutor(max_workers=48, thread_name_prefix="bench-init")
        self._threads = [
            threading.Thread(target=self._issue, name="bench-issue", daemon=True),
            threading.Thread(target=self._poll, name="bench-poll", daemon=True),
        ]
        self._room = 0

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        self._workers.shutdown(wait=True, cancel_futures=True)

    def _issue(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._room += 1
            self._workers.submit(self._start_one, self._room)
            next_at += PERIOD_S
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _start_one(self, room: int) -> None:
        start = time.monotonic()
        try:
            receiver = self.manager.receiver(self.addr, room, self.plan, prefill_dp_rank=0)
            if receiver.init(0) == KVPoll.WaitingForInput:
                receiver.send_metadata((1, 2, 3), aux_index=0)
        except Exception as exc:
            self._record(start, False, type(exc).__name__)
            return
        with self._lock:
            self._pending.append((start, receiver))

    def _poll(self) -> None:
        """Poll every pending request each 5 ms until stopped (what is left then, the
        manager's close fails)."""
        while not self._stop.is_set():
            with self._lock:
                pending, self._pending = self._pending, []
            still = []
            for start, receiver in pending:
                status = receiver.poll()
                if status == KVPoll.Success:
                    self._record(start, True, "")
                elif status == KVPoll.Failed:
                    self._record(start, False, type(receiver.failure).__name__)
                else:
                    still.append((start, receiver))
            with self._lock:
                self._pending.extend(still)
            time.sleep(0.005)

    def succeeded_since(self, since: float) -> bool:
        with self._lock:
            return any(o.ok and o.end >= since for o in self.outcomes)

    def _record(self, start: float, ok: bool, error: str) -> None:
        with self._lock:
            self.outcomes.append(Outcome(start, time.monotonic(), ok, error))


@contextmanager
def manager_for(config: str, ack_ip: str) -> Iterator[DecodeManager]:
    """``before``: main's parts; ``bound=Ns``: the manager built from the one setting."""
    closers: list[Callable[[], None]] = []
    if config == "before":
        transport = ZmqTransport()
        client = BootstrapClient()
        closers += [transport.close, client.close_all]
        manager = DecodeManager(
            ack_ip=ack_ip, transport=transport, source=client, liveness_timeout_s=20.0
        )
    else:
        seconds = float(config.removeprefix("bound=").rstrip("s"))
        manager = DecodeManager(ack_ip=ack_ip, liveness_timeout_s=seconds)
    try:
        yield manager
    finally:
        manager.close()
        for close in closers:
            close()


def run_one(
    ns: NetNamespace,
    prefill: Prefill,
    config: str,
    fault: str,
    fault_s: float,
    warmup_s: float = WARMUP_S,
) -> RunFigures:
    plan = PLANS["reference" if isinstance(prefill, NetnsPrefill) else "sglang"]
    with manager_for(config, ns.host_ip) as manager, Load(manager, prefill.addr, plan) as load:
        time.sleep(warmup_s)
        fault_at = time.monotonic()
        if fault == "hang":
            prefill.hang()
        elif fault == "partition":
            ns.partition()
        elif fault in ONE_WAY:
            ns.partition(ONE_WAY[fault])
        elif fault == "rank-cut":
            ns.cut_ports(
                prefill.rank_ports if isinstance(prefill, NetnsPrefill) else [prefill.rank_port]
            )
        elif fault == "replace":
            assert isinstance(prefill, NetnsPrefill), "replace runs the reference prefill only"
            prefill.kill()
        time.sleep(fault_s)
        if fault == "hang":
            prefill.resume()
        elif fault == "replace":
            assert isinstance(prefill, NetnsPrefill)
            prefill.start(server_port=int(prefill.addr.rsplit(":", 1)[1]))
        else:
            ns.heal()
        heal_at = time.monotonic()
        deadline = heal_at + AFTER_MAX_S
        while time.monotonic() < deadline:
            if load.succeeded_since(heal_at):
                time.sleep(AFTER_SUCCESS_S)
                break
            time.sleep(0.05)
    outcomes = sorted(load.outcomes, key=lambda o: o.end)
    failures = [o for o in outcomes if not o.ok and o.end >= fault_at]
    errors: dict[str, int] = {}
    for outcome in failures:
        errors[outcome.error] = errors.get(outcome.error, 0) + 1
    healed = [o.end - heal_at for o in outcomes if o.ok and o.end >= heal_at]
    return RunFigures(
        config=config,
        fault=fault,
        detection_s=failures[0].end - fault_at if failures else None,
        failed=len(failures),
        longest_wait_s=max((o.end - o.start for o in outcomes), default=0.0),
        first_success_after_heal_s=min(healed) if healed else None,
        requests=len(outcomes),
        errors=errors,
    )


def _fmt(value: float | None) -> str:
    return "never" if value is None else f"{value:6.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault-s", type=float, default=8.0, help="how long each fault lasts")
    parser.add_argument("--reps", type=int, default=1, help="runs per configuration and fault")
    parser.add_argument(
        "--smoke", action="store_true", help="a seconds-long run: 1.5 s faults, hang and partition"
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated faults")
    parser.add_argument(
        "--configs", default="before,bound=3s,bound=1s", help="comma-separated configurations"
    )
    parser.add_argument(
        "--ack-delay-ms",
        type=int,
        default=0,
        help="the prefill's transfer time (ms)",
    )
    parser.add_argument(
        "--status-sockets",
        choices=("before", "bound"),
        default="bound",
        help="the prefill's status sockets: libzmq's defaults (before) or the bound (ZMQ-27)",
    )
    parser.add_argument(
        "--prefill",
        choices=("reference", "sglang"),
        default="reference",
        help="the reference prefill, or SGLang 0.5.23's bootstrap server and rank answering "
        "each transfer through SGLang's own status sockets (tests/support/sglang_netns_prefill.py)",
    )
    parser.add_argument(
        "--no-in-flight", action="store_true", help="skip the statuses-in-flight table"
    )
    parser.add_argument(
        "--prefill-sysctl",
        action="append",
        default=[],
        help="NAME=VALUE set in the prefill's namespace (repeatable)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    reason = netns_unavailable()
    if reason is not None:
        print(f"bench_liveness skipped: {reason}")
        return 0
    faults = args.faults.split(",")
    configs = args.configs.split(",")
    fault_s, warmup_s = args.fault_s, WARMUP_S
    if args.smoke:
        # A 1.5 s fault still outlasts bound=1s's detection (0.65-1.1 s measured), and 0.5 s of
        # warm-up still has requests flowing: 18 -> 14 s of the smoke run (load 5-7).
        faults, configs = ["hang", "partition"], ["before", "bound=1s"]
        fault_s, warmup_s = 1.5, SMOKE_WARMUP_S
    print(
        f"a request every {PERIOD_S * 1000:.0f} ms; faults of {fault_s:g} s; "
        f"{args.reps} run(s) each; the {args.prefill} prefill in its own network namespace; "
        f"transfer {args.ack_delay_ms} ms; status sockets "
        f"{'SGLang' + chr(39) + 's' if args.prefill == 'sglang' else args.status_sockets}"
        + "".join(f"; {setting}" for setting in args.prefill_sysctl),
        flush=True,
    )
    results: dict[tuple[str, str], list[RunFigures]] = {}
    with NetNamespace() as ns:
        for setting in args.prefill_sysctl:
            name, _, value = setting.partition("=")
            ns.sysctl(name, int(value))
        prefill: Prefill
        if args.prefill == "sglang":
            prefill = SGLangNetnsPrefill(ns, transfer_ms=args.ack_delay_ms)
        else:
            prefill = NetnsPrefill(
                ns,
                ack_delay_ms=args.ack_delay_ms,
                status_liveness_s=0.0 if args.status_sockets == "before" else None,
            )
        with prefill:
            _run_all(ns, prefill, args.reps, faults, configs, fault_s, warmup_s, results)
    _print_medians(args.reps, results)
    if not args.no_in_flight:
        in_flight(args, fault_s, warmup_s)
    return 0


def in_flight(args: argparse.Namespace, fault_s: float, warmup_s: float) -> None:
    """The statuses-in-flight table: the reference prefill's status sockets before and with the
    bound (SGLang's own, with ``--prefill sglang``), every cut of IN_FLIGHT_FAULTS."""
    faults = ["partition"] if args.smoke else list(IN_FLIGHT_FAULTS)
    sockets = ["bound"] if args.smoke else ["before", "bound"]
    if args.prefill == "sglang":
        sockets = ["SGLang's"]
    print(
        f"statuses in flight: transfer {IN_FLIGHT_TRANSFER_MS} ms, faults of {fault_s:g} s, "
        f"decode {IN_FLIGHT_CONFIG}",
        flush=True,
    )
    results: dict[tuple[str, str], list[RunFigures]] = {}
    with NetNamespace() as ns:
        for setting in args.prefill_sysctl:
            name, _, value = setting.partition("=")
            ns.sysctl(name, int(value))
        for socks in sockets:
            prefill: Prefill
            if args.prefill == "sglang":
                prefill = SGLangNetnsPrefill(ns, transfer_ms=IN_FLIGHT_TRANSFER_MS)
            else:
                prefill = NetnsPrefill(
                    ns,
                    ack_delay_ms=IN_FLIGHT_TRANSFER_MS,
                    status_liveness_s=0.0 if socks == "before" else None,
                )
            print(f" status sockets {socks}:", flush=True)
            with prefill:
                _run_all(
                    ns, prefill, args.reps, faults, [IN_FLIGHT_CONFIG], fault_s, warmup_s, results
                )
            _print_medians(args.reps, results)
            results.clear()


def _print_medians(reps: int, results: dict[tuple[str, str], list[RunFigures]]) -> None:
    if reps > 1:
        print("medians:")
        for (fault, config), runs in results.items():
            print(
                f"  {fault:9} {config:9} detection {_fmt(_median([r.detection_s for r in runs]))}"
                f"  first success after heal "
                f"{_fmt(_median([r.first_success_after_heal_s for r in runs]))}"
            )


def _run_all(
    ns: NetNamespace,
    prefill: Prefill,
    reps: int,
    faults: list[str],
    configs: list[str],
    fault_s: float,
    warmup_s: float,
    results: dict[tuple[str, str], list[RunFigures]],
) -> None:
    for _ in range(reps):
        for fault in faults:
            for config in configs:  # interleaved: a slow moment hits every configuration
                figures = run_one(ns, prefill, config, fault, fault_s, warmup_s)
                results.setdefault((fault, config), []).append(figures)
                print(
                    f"  {fault:9} {config:9} detection {_fmt(figures.detection_s)}  "
                    f"failed {figures.failed:4}  longest wait {figures.longest_wait_s:6.2f} s  "
                    f"first success after heal {_fmt(figures.first_success_after_heal_s)}  "
                    f"({figures.requests} requests; {figures.errors})",
                    flush=True,
                )


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


if __name__ == "__main__":
    raise SystemExit(main())
