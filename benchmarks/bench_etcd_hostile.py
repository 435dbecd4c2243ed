"""The etcd source against a broken gateway (issue 17), each figure beside a baseline of the
same run: the same source process against a healthy stand-in gateway.

1. A compaction storm (every watch cancelled as compacted): list calls/s reaching the gateway
   and the source process's CPU, over ``--seconds``. Baseline: a quiet, healthy gateway.
2. A list reply whose header is not an object: list calls/s (was a "cluster replaced" loop).
3. A 150 MB list reply (``--reply-mb``): the source process's peak RSS once the reply was
   refused (or, without a cap, read), against the same process that listed a small reply.

The source runs in a child process (its CPU and RSS are its own); the stand-in gateway is the
test suite's (``tests/support/etcd_gateway_support.py``), so the benchmark measures what the tests
check.

    .venv/bin/python -m benchmarks bench_etcd_hostile [--seconds 3] [--reply-mb 150]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support

from tests.support.etcd_gateway_support import FakeGateway, created, hold_open, line, range_reply

PREFIX = "/bench/ranks"


def _watch_quiet(request: dict[str, Any]) -> Iterator[bytes | float]:
    yield created(3)
    yield from hold_open()


def _watch_compacted(request: dict[str, Any]) -> Iterable[bytes | float]:
    return [created(3), line({"canceled": True, "compact_revision": "9"})]


def _list_small(request: dict[str, Any]) -> Iterable[bytes | float]:
    return [range_reply(3, [])]


def _list_headless(request: dict[str, Any]) -> Iterable[bytes | float]:
    return [json.dumps({"header": "nope", "kvs": []}).encode()]


def _list_huge(megabytes: int) -> Any:
    def script(request: dict[str, Any]) -> Iterator[bytes | float]:
        yield b'{"header":{"cluster_id":"7","revision":"3"},"kvs":[{"key":"'
        chunk = b"A" * (1 << 20)
        for _ in range(megabytes):
            yield chunk
        yield b'"}]}'

    return script


def child(endpoint: str, seconds: float, until_first_reply: bool) -> None:
    """Run a source against ``endpoint``; print one JSON line of what it cost."""
    from statemachine.discovery.etcd_source import EtcdBootstrapSource
    from statemachine.discovery.gateway import EtcdGateway

    source = EtcdBootstrapSource(EtcdGateway([endpoint]), prefix=PREFIX).start()
    cpu0 = time.process_time()
    start = time.monotonic()
    deadline = start + seconds
    while time.monotonic() < deadline:
        stats = source.stats()
        answered = stats.lists + stats.reconnects + getattr(stats, "bad_replies", 0)
        if until_first_reply and answered:
            break
        time.sleep(0.01)
    wall = time.monotonic() - start
    cpu = time.process_time() - cpu0
    stats = source.stats()
    source.close()
    print(
        json.dumps(
            {
                "wall": wall,
                "cpu": cpu,
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "lists": stats.lists,
                "compactions": stats.compactions,
                "bad_replies": getattr(stats, "bad_replies", None),
                "last_error": stats.last_error,
            }
        ),
        flush=True,
    )


def run_child(gateway: FakeGateway, seconds: float, until_first_reply: bool = False) -> dict:
    argv = [sys.executable, "-m", "benchmarks.bench_etcd_hostile", "--child", gateway.endpoint]
    argv += ["--seconds", str(seconds)]
    if until_first_reply:
        argv.append("--until-first-reply")
    out = subprocess.run(argv, capture_output=True, check=True, timeout=seconds + 120)
    result: dict = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


def bench_storm(seconds: float) -> None:
    print(f"\n-- list calls and CPU over {seconds:g} s (source in a child process)")
    rows = [
        ("healthy, quiet (baseline)", _list_small, _watch_quiet),
        ("compaction on every watch", _list_small, _watch_compacted),
        ("list header not an object", _list_headless, _watch_quiet),
    ]
    for name, lister, watcher in rows:
        with FakeGateway({"kv/range": lister, "watch": watcher}) as gateway:
            result = run_child(gateway, seconds)
            calls = gateway.calls["kv/range"]
        print(
            f"{name:28s} list calls {calls:5d} ({calls / result['wall']:7.1f}/s)  "
            f"CPU {100 * result['cpu'] / result['wall']:5.1f} %  "
            f"compactions {result['compactions']}  bad replies {result['bad_replies']}"
        )


def bench_rss(megabytes: int) -> None:
    print(f"\n-- peak RSS of the source process: a {megabytes} MB list reply vs a small one")
    with FakeGateway({"kv/range": _list_small, "watch": _watch_quiet}) as gateway:
        small = run_child(gateway, 10.0, until_first_reply=True)
    with FakeGateway({"kv/range": _list_huge(megabytes), "watch": _watch_quiet}) as gateway:
        huge = run_child(gateway, 60.0, until_first_reply=True)
        sent = max(gateway.sent, default=0)
    delta = (huge["maxrss_kb"] - small["maxrss_kb"]) / 1024
    print(f"small reply (baseline)  peak RSS {small['maxrss_kb'] / 1024:7.1f} MB")
    print(
        f"{megabytes} MB reply           peak RSS {huge['maxrss_kb'] / 1024:7.1f} MB "
        f"(+{delta:.1f} MB); gateway got {sent / 2**20:.1f} MB onto the wire; "
        f"error: {(huge['last_error'] or '-')[:90]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks bench_etcd_hostile")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reply-mb", type=int, default=150)
    parser.add_argument("--child", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--until-first-reply", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="0.5 s storm, 2 MB reply")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.seconds, args.reply_mb = 0.5, 2
    if args.child:
        child(args.child, args.seconds, args.until_first_reply)
        return 0
    bench_storm(args.seconds)
    bench_rss(args.reply_mb)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
