"""The name the command line was started by, for usage lines and help.

The same commands run as the ``pd-bootstrap`` console script and as ``python -m statemachine``;
a usage line should show the one the user typed.
"""

from __future__ import annotations

import os
import sys

SCRIPT = "pd-bootstrap"
MODULE = "python -m statemachine"


def prog(subcommand: str = "") -> str:
    """``pd-bootstrap serve`` under the console script, ``python -m statemachine serve`` else."""
    started_as = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    # The console script is `pd-bootstrap` (`pd-bootstrap.exe` on Windows); `python -m` sets
    # argv[0] to the path of statemachine/__main__.py.
    name = SCRIPT if started_as.startswith(SCRIPT) else MODULE
    return f"{name} {subcommand}" if subcommand else name
