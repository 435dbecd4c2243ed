"""``pd-bootstrap demo --prefill sglang``: the restart demo in front of SGLang 0.5.23's own
prefill, moving real KV bytes, beside SGLang's own decode.

Loaded only for ``--prefill sglang``: SGLang, its transfer engines and the harness that runs its
prefill (``tests/real_prefill`` of a source checkout, with the CPU import stand-ins of
``tests/sglang_stubs``) never become a dependency of the library. Where any of them is missing
this says what to install instead of failing.

The peers log a lot (SGLang's managers, Mooncake's and NIXL's engines, in this process from C++
as well as Python, and the prefill's rank processes): all of it goes to the file ``--peer-log``
names, so that the terminal shows the demo's own lines and tables. The JSON report
(``--report``) lists every failure with its type, its times from the kill and from READY, and
whose it was.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from statemachine.demo.report import write_json
from statemachine.demo.sglang_report import (
    append_rank_logs,
    load_average,
    peer_output_to,
    run_report,
)

#: Where a source checkout keeps the harness, relative to this package's parent.
_TESTS = Path(__file__).resolve().parents[2] / "tests"
NEEDS = (
    "needs a source checkout with SGLang's interop packages and the transfer engines on "
    "Python 3.11: run `make demo-sglang` (it installs them: `make .venv/.engines`)"
)


KINDS = {"warm": "warm (started at the kill)", "cold": "cold (started after)"}


def missing() -> str | None:
    """What ``--prefill sglang`` lacks here, or None."""
    if sys.version_info[:2] != (3, 11):
        return f"SGLang 0.5.23's wheel is cp311 only and this is Python {sys.version.split()[0]}"
    if not (_TESTS / "real_prefill" / "harness.py").is_file():
        return f"no SGLang prefill harness at {_TESTS / 'real_prefill'} (not a source checkout)"
    for module in ("sglang", "mooncake.engine"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        except ImportError as exc:  # mooncake's parent imports, its .so may not load
            return f"{module} does not import ({exc})"
    return None


def one_run(
    restart: Any, args: argparse.Namespace, backend: str, kind: str, peer_log: Path, out: TextIO
) -> dict[str, Any]:
    """One restart (``kind``: warm or cold) on ``backend``: its table on ``out``, its report."""
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="demo-sglang-") as logs:
        try:
            reports, timeline = restart.run_restart(
                backend,
                warm=kind == "warm",
                kill_at_s=args.kill_at,
                after_ready_s=args.after_ready,
                log=lambda line: print(line, file=out),
                log_dir=Path(logs),
            )
        finally:
            append_rank_logs(peer_log, Path(logs), f"{backend}, {kind}")
    down = timeline["ready"] - timeline["kill"]
    title = f"\n{backend}, {kind} replacement (READY {down:.2f} s after the kill)"
    table = restart.table(title, reports)
    print(table, file=out)
    loads = (before, load_average())
    return run_report(restart, backend, kind, reports, timeline, loads, table)


def main(args: argparse.Namespace) -> int:
    reason = missing()
    if reason is not None:
        print(f"error: --prefill sglang: {reason}; {NEEDS}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(_TESTS.parent))  # the checkout's root: the harness is tests.real_prefill
    engines: Any = importlib.import_module("tests.real_prefill.engines")
    restart: Any = importlib.import_module("tests.real_prefill.restart")
    wanted = args.engine or list(engines.BACKENDS)
    backends = [b for b in wanted if engines.engine_unavailable(b) is None]
    kinds = args.replacement or ["warm", "cold"]
    report_path = Path(args.report)
    peer_log = Path(args.peer_log)
    peer_log.write_text("")  # this run's logs only
    print(
        "On 127.0.0.1: SGLang 0.5.23's own prefill (its bootstrap server and Mooncake/NIXL\n"
        "prefill manager in their own process, CPU buffers, real engines over TCP), and two\n"
        "decodes sending it a request every 20 ms: this library's DecodeManager and SGLang's own\n"
        "decode (its KV manager and receivers, driven as its decode.py drives them). Every page\n"
        f"is checked byte for byte. At {args.kill_at:g} s the prefill is SIGKILLed and replaced\n"
        "behind the same bootstrap port, "
        f"{' and '.join(KINDS[k] for k in kinds)}, on {' and '.join(wanted)}.\n"
        f"SGLang's and the engines' logs go to {peer_log}.",
        flush=True,
    )
    # From here to the process's exit the peers' logging goes to the file (an error shows on
    # the terminal); the demo's own lines go to ``out``.
    with peer_output_to(peer_log, restore=False) as out:
        for engine in wanted:
            if engine not in backends:
                print(f"{engine}: skipped: {engines.engine_unavailable(engine)}", file=out)
        runs = [
            one_run(restart, args, backend, kind, peer_log, out)
            for backend in backends
            for kind in kinds
        ]
        write_json(
            report_path,
            {
                "command": "pd-bootstrap demo --prefill sglang",
                "kill_at_s": args.kill_at,
                "after_ready_s": args.after_ready,
                "peer_log": str(peer_log),
                "cpus": os.cpu_count(),
                "runs": runs,
            },
        )
        print(f"\nreport: {report_path}\npeer logs: {peer_log}", file=out)
    return 0
