"""``make bench``: run every ``benchmarks/bench_*.py`` in turn (or those named on the command line).

Each module exposes ``main(argv: list[str] | None = None) -> int`` and prints its baseline,
ours, and their ratio, as medians of repeated runs. ``--smoke`` runs each in its seconds-long
smoke mode (tiny counts, goals not judged), as ``tests/test_benchmarks_smoke.py`` does.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    wanted = sys.argv[1:] if argv is None else argv
    passed = ["--smoke"] if "--smoke" in wanted else []
    wanted = [name for name in wanted if name != "--smoke"]
    here = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    if wanted:
        names = [n for n in names if n in wanted or n.removeprefix("bench_") in wanted]
    status = 0
    for name in names:
        print(f"\n===== {name} =====", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        status |= module.main(passed)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
