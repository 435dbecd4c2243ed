"""``pd-bootstrap table``: print the receiver lifecycle (its table and its Mermaid diagram).

The command's side of :mod:`statemachine.lifecycle`, kept out of it so that the lifecycle, a pure
core every receiver imports, imports no command-line code.
"""

from __future__ import annotations

import sys

from statemachine import cli_help
from statemachine.lifecycle import mermaid, table_markdown
from statemachine.progname import prog


def main(argv: list[str]) -> int:
    """``python -m statemachine table [--mermaid]``."""
    parser = cli_help.parser(
        prog("table"),
        "Print the receiver lifecycle: the Markdown table (event, from, to) derived from the\n"
        "transitions Machine, then its Mermaid state diagram (as in docs/lifecycle.mmd).",
    )
    parser.add_argument("--mermaid", action="store_true", help="print only the diagram")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if not args.mermaid:
        sys.stdout.write(table_markdown() + "\n")
    sys.stdout.write(mermaid())
    return 0
