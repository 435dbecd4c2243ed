"""Command line: ``pd-bootstrap <command>`` (or ``python -m statemachine <command>``).

Each subcommand lives in its own module and is imported only when used, so ``check`` does not
pay for aiohttp and ``serve`` does not pay for the model checker.
"""

from __future__ import annotations

import importlib
import os
import sys

from statemachine import __version__
from statemachine.errors import MissingExtra
from statemachine.progname import prog

# subcommand -> (module, one-line help). Each module exposes ``main(argv: list[str]) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("statemachine.demo.cli", "end-to-end run through a prefill restart"),
    "serve": ("statemachine.prefill.serve", "run the reference bootstrap server"),
    "check": ("statemachine.model.check", "model-check the Python mirror of the TLA+ spec"),
    "table": ("statemachine.lifecycle_cli", "print the lifecycle table and Mermaid diagram"),
    "etcd": ("statemachine.discovery.etcd_cli", "start a local etcd for trying the etcd source"),
    "sglang-check": (
        "statemachine.sglang.v0_5_23.decode_worker.check",
        "what an SGLang scheduler started here gets (PD_BOOTSTRAP_SGLANG_DECODE)",
    ),
}


def _usage() -> str:
    lines = [f"usage: {prog()} <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", f"'{prog()} <command> --help' describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"pd-bootstrap-statemachine {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
    except KeyboardInterrupt:  # Ctrl-C while the command's modules load: nothing to clean up
        print(f"interrupted: {prog(name)} stopped before it started", file=sys.stderr)
        return 130
    except MissingExtra as exc:
        if "-h" in rest or "--help" in rest:
            # Its options live in the module that needs the extra: say what the command is
            # for and what to install, and do not fail a request for help.
            print(f"usage: {prog(name)} [options]\n\n{SUBCOMMANDS[name][1]}.\n\n{exc}")
            print("Its options are listed here once the extra is installed.")
            return 0
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result: int = module.main(rest)
    except KeyboardInterrupt:  # Ctrl-C outside the command's own handler: one line, no traceback
        print(f"interrupted: {prog(name)} stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `pd-bootstrap table | head`: the reader left, which is no error
        # Python would report the pipe again when it flushes stdout at exit: point it elsewhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return result


if __name__ == "__main__":
    raise SystemExit(main())
