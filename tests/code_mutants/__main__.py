"""``make mutate``: apply each seeded bug of :mod:`tests.code_mutants` to a temporary copy of
the tree and run the tests meant to catch it there; print progress and a caught/survived
report. Exit status 1 if a mutant that is not argued equivalent survived (or could not run).

    python -m tests.code_mutants                 # every mutant (minutes: real processes)
    python -m tests.code_mutants NAME [NAME...]  # only these
    python -m tests.code_mutants --list          # the table

A copy, not the worktree: the mutated file never touches the sources, and an interrupted run
leaves nothing behind but a temporary directory. ``PYTHONPATH`` points at the copy, so the
test process and every process it starts (prefill ranks, servers) import the mutated package;
the runner checks that before it trusts a result. The unmutated copy runs first (the baseline):
a test that fails there would make every mutant look caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.code_mutants import BY_NAME, MUTANTS, ROOT, CodeMutant, mutated_source

#: Per mutant; a run past it (a mutant that hangs a test) counts as caught, and says so.
TIMEOUT_S = 900
COPIED = ("statemachine", "tests", "pyproject.toml")


def _copy_tree(into: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=ignore)
        else:
            shutil.copy2(source, into / name)


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _imports_copy(tree: Path) -> bool:
    where = subprocess.run(
        [sys.executable, "-c", "import statemachine; print(statemachine.__file__)"],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    return Path(where).is_relative_to(tree)


def _pytest(tree: Path, tests: tuple[str, ...]) -> tuple[int | None, str]:
    """(exit status, or None on timeout; the last lines of the output)."""
    command = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    command += ["-x", "-q", "--no-header", "-o", "addopts=", *tests]
    try:
        run = subprocess.run(
            command, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT_S} s"
    tail = [line for line in run.stdout.splitlines() if line.strip()][-3:]
    return run.returncode, " | ".join(tail)


def run_one(mutant: CodeMutant | None, tests: tuple[str, ...]) -> tuple[str, str, float]:
    """('caught' | 'survived' | 'error', detail, seconds) for one mutant (None: baseline)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutate-") as name:
        tree = Path(name)
        _copy_tree(tree)
        if mutant is not None:
            target = tree / mutant.module
            target.write_text(mutated_source(mutant, target.read_text()))
        if not _imports_copy(tree):
            return "error", "the test process would not import the copy", 0.0
        status, detail = _pytest(tree, tests)
    seconds = time.monotonic() - started
    if status is None or status == 1:
        return "caught", detail, seconds
    if status == 0:
        return "survived", detail, seconds
    return "error", f"pytest exit {status}: {detail}", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.code_mutants")
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown mutants: {', '.join(unknown)} (see --list)")
    chosen = [BY_NAME[name] for name in args.names] if args.names else list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name:34} {m.module:42} {m.bug}")
        return 0
    if not args.no_baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        print(
            f"mutate: baseline - {len(tests)} targeted tests on the unmutated tree...", flush=True
        )
        result, detail, seconds = run_one(None, tests)
        if result != "survived":  # "survived" = every test passed
            print(f"mutate: the baseline does not pass ({detail}); fix that first", flush=True)
            return 2
        print(f"mutate: baseline passes ({seconds:.0f} s)", flush=True)
    results: list[tuple[CodeMutant, str, str]] = []
    for index, mutant in enumerate(chosen, 1):
        print(f"mutate: [{index}/{len(chosen)}] {mutant.name} ({mutant.module}) ...", flush=True)
        result, detail, seconds = run_one(mutant, mutant.tests)
        results.append((mutant, result, detail))
        print(
            f"mutate: [{index}/{len(chosen)}] {mutant.name}: {result} ({seconds:.0f} s)", flush=True
        )
    print("\nmutate: report")
    bad = 0
    for mutant, result, detail in results:
        note = ""
        if result == "survived" and mutant.equivalent:
            note = f"  equivalent: {mutant.equivalent}"
        elif result != "caught":
            bad += 1
            note = f"  <- {mutant.bug}; {detail}"
        print(f"  {result:8} {mutant.name}{note}")
    caught = sum(1 for _, result, _ in results if result == "caught")
    print(f"mutate: {caught} of {len(results)} caught, {bad} unexplained", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
