"""``make tlc``: run real TLC on every ``TLA/MC*.cfg`` and compare it with the mirror.

Needs ``TLA2TOOLS_JAR`` (the path of a ``tla2tools.jar``) and ``java``. TLC is not available
from the package registries CI reaches, so without the variable this says plainly that it
skipped and exits 0.

For each cfg the mirror is run first; then TLC (``-workers 1``). Compared:

* the verdict: TLC's exit status (0 ok, 12 safety violated, 13 liveness violated) against the
  mirror's first violated property, and TLC's property name when its message names one;
* the distinct-state count, when the whole state space is explored by both: every passing cfg
  and liveness violations (TLC completes the search before checking liveness on graphs this
  small). A safety violation stops TLC early, so its count is then not comparable.

Exit 0 when everything agrees (or when skipped), 1 on any disagreement, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from statemachine.model.check import TLA_DIR, load, run

EXIT_OK, EXIT_SAFETY, EXIT_LIVENESS = 0, 12, 13


@dataclass
class TlcRun:
    exit_code: int
    distinct_states: int | None
    violated: str | None
    output: str


def parse_output(exit_code: int, output: str) -> TlcRun:
    """Pull the distinct-state count and the violated property's name out of TLC's output."""
    counts = re.findall(r"([\d,]+) distinct states found", output)
    distinct = int(counts[-1].replace(",", "")) if counts else None
    name = re.search(
        r"Error: (?:Invariant (\w+) is violated|Action property (\w+) is violated"
        r"|Temporal property (\w+) was violated)",
        output,
    )
    violated = next((g for g in name.groups() if g), None) if name else None
    if violated is None and "Temporal properties were violated" in output:
        violated = "<temporal>"
    return TlcRun(exit_code, distinct, violated, output)


def run_tlc(jar: str, cfg: Path, timeout: float) -> TlcRun:
    with tempfile.TemporaryDirectory(prefix="tlc-") as meta:
        command = [
            "java",
            "-XX:+UseParallelGC",
            "-cp",
            jar,
            "tlc2.TLC",
            "-config",
            cfg.name,
            "-workers",
            "1",
            "-metadir",
            meta,
            "BootstrapCache",
        ]
        done = subprocess.run(
            command,
            cwd=cfg.parent,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    return parse_output(done.returncode, done.stdout + done.stderr)


def compare_one(jar: str, cfg: Path, timeout: float) -> list[str]:
    """Disagreements between TLC and the mirror for one cfg (empty when they agree)."""
    loaded = load(cfg)
    mirror = run(loaded)
    violation = mirror.first_violation()
    tlc = run_tlc(jar, cfg, timeout)
    problems: list[str] = []
    if violation is None:
        expected_exit = EXIT_OK
    elif violation.kind == "liveness":
        expected_exit = EXIT_LIVENESS
    else:
        expected_exit = EXIT_SAFETY
    # An action property is a safety property (12); accept 13 too, as TLC versions differ in
    # how they classify a violated [][A]_v given under PROPERTY.
    allowed = {EXIT_SAFETY, EXIT_LIVENESS} if violation and violation.kind == "action" else set()
    if tlc.exit_code != expected_exit and tlc.exit_code not in allowed:
        problems.append(f"TLC exit {tlc.exit_code}, mirror expects {expected_exit}")
    if violation is not None and tlc.violated not in (None, "<temporal>"):
        mirror_names = [n for n, held in mirror.verdicts.items() if not held]
        if tlc.violated not in mirror_names:
            problems.append(f"TLC reports {tlc.violated}, mirror {mirror_names}")
    comparable = violation is None or violation.kind == "liveness"
    if comparable and tlc.distinct_states != mirror.distinct_states:
        problems.append(
            f"TLC found {tlc.distinct_states} distinct states, mirror {mirror.distinct_states}"
        )
    verdict = "ok" if violation is None else f"{violation.property} violated"
    print(
        f"{cfg.name}: mirror {mirror.distinct_states} states, {verdict}; TLC exit "
        f"{tlc.exit_code}, {tlc.distinct_states} states"
        + (f", reports {tlc.violated}" if tlc.violated else "")
        + (" -- AGREE" if not problems else " -- DISAGREE: " + "; ".join(problems))
    )
    if problems:
        print(tlc.output[-3000:], file=sys.stderr)
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m statemachine.model.tlc", description=__doc__)
    parser.add_argument("configs", nargs="*", help="cfg files (default: every TLA/MC*.cfg)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per TLC run")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    jar = os.environ.get("TLA2TOOLS_JAR")
    if not jar:
        print("make tlc: SKIPPED -- TLA2TOOLS_JAR is not set (point it at a tla2tools.jar).")
        return 0
    if not Path(jar).is_file() or shutil.which("java") is None:
        print(f"make tlc: cannot run: jar {jar!r} missing or java not on PATH", file=sys.stderr)
        return 2
    configs = [Path(c).resolve() for c in args.configs] or sorted(TLA_DIR.glob("MC*.cfg"))
    failures = 0
    for cfg in configs:
        try:
            problems = compare_one(jar, cfg, args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{cfg.name}: TLC did not finish within {args.timeout:.0f} s")
            problems = ["timeout"]
        failures += bool(problems)
    print(f"{len(configs) - failures} of {len(configs)} cfgs agree with TLC")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
