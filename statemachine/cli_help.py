"""The one ``--help`` layout of every command: the description as written, each option's default.

argparse's own ``ArgumentDefaultsHelpFormatter`` also prints ``(default: False)`` for every flag
and ``(default: None)`` for every optional value, which says nothing; this one shows a default
only where there is one to show, and keeps the description's line breaks (its examples).
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help when X is a real value."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the shared layout: ``description`` is the purpose line first,
    then anything the command wants a user to read before its options."""
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=DefaultsHelpFormatter
    )
