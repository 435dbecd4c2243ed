"""``make tlc``: run real TLC on every cfg and every spec mutation, and compare with the mirror.

Needs ``TLA2TOOLS_JAR`` (the path of a ``tla2tools.jar``) and ``java``. TLC is not available
from the package registries CI reaches, so without the variable this says plainly that TLC
was skipped and exits 0 (the mirror's side is checked by the tests either way).

Every run works on a temporary copy of the spec (the original text for a cfg, the mutated
text for a mutation, see :mod:`statemachine.model.mutations`) with ``-dump`` (every distinct
state, read back by :mod:`statemachine.model.tlcdump`), ``-continue`` (report
every violated property and explore the whole state space), ``-lncheck final`` (check
liveness once, on the complete graph, so that a liveness violation does not stop the search
early either), ``-noGenerateSpecTE`` and a
temporary ``-metadir``, so nothing is ever written under ``TLA/``. Compared with the mirror,
for each run: the set of violated properties (TLC's "Invariant X is violated", "Action
property X is violated", "Temporal property X was violated" and "Temporal properties X, Y
and Z were violated"), the distinct-state count, the set of distinct states itself (not for
the large configs, whose second exploration in the mirror would double ``make tlc``'s time),
and the exit status (13 exactly when a temporal property is violated; 0 otherwise, since
``-continue`` does not stop on a safety violation).

Exit 0 when everything agrees (or when skipped), 1 on any disagreement, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from statemachine.errors import DumpError
from statemachine.model.check import TLA_DIR, Loaded, load, run
from statemachine.model.checker import explore
from statemachine.model.mutations import (
    MUTATION_TABLE,
    SPEC_NAME,
    SpecMutation,
    load_mutated,
    write_mutated,
)
from statemachine.model.spec import LIVENESS_PROPERTIES, State
from statemachine.model.tlcdump import Value, read_dump, to_state

EXIT_OK, EXIT_LIVENESS = 0, 13
#: Configs too large for CI's time budget: ``make tlc`` checks them, ``--ci`` leaves them out.
LARGE_CONFIGS = frozenset({"MCLarge.cfg"})

_SINGLE = re.compile(
    r"Error: (?:Invariant (\w+) is violated|Action property (\w+) is violated"
    r"|Temporal property (\w+) was violated)"
)
_PLURAL = re.compile(r"Error: Temporal properties (.+?) were violated")


@dataclass
class TlcRun:
    exit_code: int
    distinct_states: int | None
    violated: set[str]
    output: str
    seconds: float = 0.0
    #: every distinct state TLC wrote with -dump, as {variable: value}; None when not dumped
    dumped: list[dict[str, Value]] | None = None


def parse_output(exit_code: int, output: str) -> TlcRun:
    """The distinct-state count and every violated property's name in TLC's output."""
    counts = re.findall(r"^([\d,]+) states generated, ([\d,]+) distinct states found", output, re.M)
    distinct = int(counts[-1][1].replace(",", "")) if counts else None
    violated: set[str] = set()
    for match in _SINGLE.finditer(output):
        violated.update(g for g in match.groups() if g)
    for match in _PLURAL.finditer(output):
        violated.update(n for n in re.split(r",\s*|\s+and\s+", match.group(1).strip()) if n)
    return TlcRun(exit_code, distinct, violated, output)


def run_tlc(jar: str, spec_text: str, cfg_text: str, cfg_name: str, timeout: float) -> TlcRun:
    """TLC on a temporary copy of the spec and cfg (nothing is written next to ``TLA/``)."""
    with tempfile.TemporaryDirectory(prefix="tlc-") as work:
        where = Path(work)
        (where / SPEC_NAME).write_text(spec_text, encoding="utf-8")
        (where / cfg_name).write_text(cfg_text, encoding="utf-8")
        # Each CI run lasts seconds, so the JVM's start-up and JIT dominate: the client
        # compiler only (C1) and the serial collector halve the CPU a small run takes
        # (measured: MCOne 3.3 -> 1.5 s, MCSmall 14 -> 9 s of CPU). A large config runs
        # long enough for the optimising compiler to pay off, so it keeps the defaults.
        quick = cfg_name not in LARGE_CONFIGS
        jvm = ["-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"] if quick else ["-XX:+UseParallelGC"]
        command = [
            "java",
            *jvm,
            "-cp",
            jar,
            "tlc2.TLC",
            "-workers",
            "1",
            "-continue",
            "-lncheck",
            "final",
            "-noGenerateSpecTE",
            "-metadir",
            str(where / "meta"),
            *(["-dump", str(where / "states")] if quick else []),
            "-config",
            cfg_name,
            Path(SPEC_NAME).stem,
        ]
        started = time.monotonic()
        done = subprocess.run(
            command, cwd=where, capture_output=True, text=True, timeout=timeout, check=False
        )
        seconds = time.monotonic() - started
        dump = where / "states.dump"  # TLC adds the extension
        dumped = read_dump(dump) if dump.is_file() else None
    result = parse_output(done.returncode, done.stdout + done.stderr)
    result.seconds = seconds
    result.dumped = dumped
    return result


@dataclass
class Comparison:
    """One row of the table: a cfg (or a mutation on its cfg) in the mirror and in TLC."""

    label: str
    mirror_states: int
    mirror_seconds: float
    mirror_violated: set[str]
    tlc: TlcRun | None = None
    expected: str | None = None  # the property a mutation must break
    problems: list[str] = field(default_factory=list)

    def row(self) -> str:
        violated = ", ".join(sorted(self.mirror_violated)) or "-"
        tlc = (
            f"TLC {self.tlc.distinct_states} states {self.tlc.seconds:.1f} s"
            if self.tlc is not None
            else "TLC skipped"
        )
        verdict = "AGREE" if not self.problems else "DISAGREE: " + "; ".join(self.problems)
        return (
            f"{self.label:<40} violated: {violated:<40} mirror {self.mirror_states} states "
            f"{self.mirror_seconds:.2f} s; {tlc} -- {verdict}"
        )


def _violated(loaded: Loaded) -> tuple[int, float, set[str]]:
    result = run(loaded)
    return (
        result.distinct_states,
        result.seconds,
        {name for name, held in result.verdicts.items() if not held},
    )


def compare(
    label: str,
    loaded: Loaded,
    spec_text: str,
    cfg: Path,
    jar: str | None,
    timeout: float,
    expected: str | None = None,
) -> Comparison:
    states, seconds, violated = _violated(loaded)
    row = Comparison(label, states, seconds, violated, expected=expected)
    if expected is not None and expected not in violated:
        row.problems.append(f"the mirror does not violate {expected}")
    if jar is None:
        return row
    tlc = run_tlc(jar, spec_text, cfg.read_text(encoding="utf-8"), cfg.name, timeout)
    row.tlc = tlc
    expected_exit = EXIT_LIVENESS if violated & set(LIVENESS_PROPERTIES) else EXIT_OK
    if tlc.exit_code != expected_exit:
        row.problems.append(f"TLC exit {tlc.exit_code}, expected {expected_exit}")
    if tlc.violated != violated:
        row.problems.append(f"TLC violates {sorted(tlc.violated)}, mirror {sorted(violated)}")
    if tlc.distinct_states != states:
        row.problems.append(f"TLC found {tlc.distinct_states} distinct states, mirror {states}")
    if tlc.dumped is not None:
        row.problems.extend(_state_set_problems(loaded, tlc.dumped))
    return row


def _state_set_problems(loaded: Loaded, dumped: list[dict[str, Value]]) -> list[str]:
    """TLC's distinct states against the mirror's, as sets."""
    try:
        by_tlc = {to_state(loaded.model, values) for values in dumped}
    except (DumpError, KeyError) as exc:
        return [f"TLC's state dump cannot be read: {exc}"]
    graph, _ = explore(loaded.model, fair=False)
    by_mirror: set[State] = set(graph.states)
    if by_tlc == by_mirror:
        return []
    only_tlc, only_mirror = by_tlc - by_mirror, by_mirror - by_tlc
    shown = min(only_tlc or only_mirror, key=repr)
    side = "only TLC" if only_tlc else "only the mirror"
    return [
        f"{len(only_tlc)} states only TLC reaches, {len(only_mirror)} only the mirror; "
        f"one that {side} reaches:\n{loaded.model.format_state(shown)}"
    ]


def configs(ci_only: bool) -> list[Path]:
    return [
        path
        for path in sorted(TLA_DIR.glob("MC*.cfg"))
        if not (ci_only and path.name in LARGE_CONFIGS)
    ]


def compare_all(
    jar: str | None,
    *,
    ci_only: bool,
    timeout: float = 1800.0,
    cfg_paths: Iterable[Path] | None = None,
    mutations: Iterable[SpecMutation] = MUTATION_TABLE,
    report: Callable[[str], None] = print,
    workers: int | None = None,
) -> list[Comparison]:
    """Every cfg, then every mutation: the mirror, and TLC when ``jar`` is given.

    Rows are compared ``workers`` at a time (default: one per core, at most 4) and reported in
    table order. Each TLC run is a single-worker JVM, so most of a row's time is a child process
    the others can overlap with; the mirror's own search holds the GIL and gains little."""
    spec_text = (TLA_DIR / SPEC_NAME).read_text(encoding="utf-8")
    jobs: list[Callable[[], Comparison]] = [
        functools.partial(_compare_cfg, path, spec_text, jar, timeout)
        for path in (configs(ci_only) if cfg_paths is None else cfg_paths)
    ]
    jobs += [functools.partial(_compare_mutation, mutation, jar, timeout) for mutation in mutations]
    count = workers if workers is not None else min(4, os.cpu_count() or 1)
    rows: list[Comparison] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, count)) as pool:
        for row in pool.map(lambda job: job(), jobs):
            report(row.row())
            rows.append(row)
    return rows


def _compare_cfg(path: Path, spec_text: str, jar: str | None, timeout: float) -> Comparison:
    return compare(path.name, load(path), spec_text, path, jar, timeout)


def _compare_mutation(mutation: SpecMutation, jar: str | None, timeout: float) -> Comparison:
    with tempfile.TemporaryDirectory(prefix="mutation-") as work:
        cfg = write_mutated(mutation, Path(work))
        text = (Path(work) / SPEC_NAME).read_text(encoding="utf-8")
        label = f"{mutation.name} on {mutation.cfg}"
        return compare(label, load_mutated(mutation), text, cfg, jar, timeout, mutation.violates)


def jar_from_environment() -> str | None:
    """``TLA2TOOLS_JAR`` when it names a file and java is on PATH, else None."""
    jar = os.environ.get("TLA2TOOLS_JAR")
    if not jar or not Path(jar).is_file() or shutil.which("java") is None:
        return None
    return jar


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m statemachine.model.tlc", description=__doc__)
    parser.add_argument("configs", nargs="*", help="cfg files (default: every TLA/MC*.cfg)")
    parser.add_argument("--ci", action="store_true", help="leave out the large configs")
    parser.add_argument("--no-mutations", action="store_true", help="cfgs only")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per TLC run")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    named = os.environ.get("TLA2TOOLS_JAR")
    if not named:
        print("make tlc: TLC SKIPPED -- TLA2TOOLS_JAR is not set (point it at a tla2tools.jar).")
        return 0
    jar = jar_from_environment()
    if jar is None:
        print(f"make tlc: cannot run: jar {named!r} missing or java not on PATH", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        rows = compare_all(
            jar,
            ci_only=args.ci,
            timeout=args.timeout,
            cfg_paths=[Path(c).resolve() for c in args.configs] or None,
            mutations=() if args.no_mutations else MUTATION_TABLE,
        )
    except subprocess.TimeoutExpired as exc:
        print(f"make tlc: a TLC run did not finish within {exc.timeout:.0f} s", file=sys.stderr)
        return 1
    failures = [row for row in rows if row.problems]
    for row in failures:
        if row.tlc is not None:
            print(
                f"--- {row.label}: end of TLC's output\n{row.tlc.output[-3000:]}", file=sys.stderr
            )
    print(
        f"{len(rows) - len(failures)} of {len(rows)} runs agree with TLC "
        f"({time.monotonic() - started:.0f} s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
