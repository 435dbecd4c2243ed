"""Long steps say what they are doing and roughly for how long before they go quiet.

The first ``make`` installs for about a minute with pip kept quiet; ``make crosshair`` runs for
25-60 s (two processes) without output; the soak for about a minute. Each prints a line first.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make_dry_run(*args: str) -> str:
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=True,
    )
    return done.stdout


@needs_make
def test_first_install_announces_itself() -> None:
    # -W: as if pyproject.toml had just changed, so the install recipe is what would run.
    plan = _make_dry_run("-W", "pyproject.toml", ".venv/.installed")
    lines = plan.splitlines()
    assert lines[0].startswith('echo "installing the project and its dev tools into .venv')
    assert "(about a minute, once;" in lines[0]
    assert lines[-1] == 'echo "installed into .venv."'


@needs_make
def test_crosshair_says_how_long_it_takes() -> None:
    plan = _make_dry_run("crosshair")
    assert (
        "echo \"crosshair: symbolic check of statemachine/pool.py's contracts "
        '(25-60 s on an idle 2-core machine, minutes under load)..."'
    ) in plan
    assert 'echo "crosshair: still checking' in plan  # a line every 15 s while it runs


@pytest.mark.slow
def test_soak_says_what_it_does_first() -> None:
    # The smallest real soak: 40 requests in 1 s, no restart, no trace (a few seconds).
    argv = ["--requests", "40", "--duration", "1", "--restarts", "0", "--no-trace"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.stdout.splitlines()[0] == (
        "soak: 40 requests over 1 s through 0 prefill restarts "
        "(about 6 s; a summary and checks follow)..."
    )
