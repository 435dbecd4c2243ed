"""``pd-bootstrap sglang-check``: what an SGLang scheduler started in this environment would get.

Says whether SGLang's plug-in discovery sees this package's entry point, what
``PD_BOOTSTRAP_SGLANG_DECODE`` asks for, which SGLang is installed, and then runs SGLang's own
``load_plugins()`` in this process, as each scheduler runs it first thing, and asks
``decode.get_kv_class`` (the name SGLang's ``decode.py`` calls) which manager and receiver class
each backend gets. Exits 1 when that is not what the variable asks for, or the plug-in would
stop SGLang at start; 0 otherwise (also when the variable is unset: SGLang's own classes).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
from typing import Any

from statemachine import __version__
from statemachine.progname import prog
from statemachine.sglang.v0_5_23.decode_worker import installer
from statemachine.sglang.v0_5_23.decode_worker.plugin import ENV_VAR, requested_backends

_GROUP = "sglang.srt.plugins"
_TARGET = "statemachine.sglang.v0_5_23.decode_worker.plugin:activate"
_OURS = "statemachine.sglang.v0_5_23.decode_worker.conn"


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _entry_point() -> Any:
    for entry in importlib.metadata.entry_points(group=_GROUP):
        if entry.value.replace(" ", "") == _TARGET:
            return entry
    return None


def check(out: list[str]) -> bool:
    """Append the report's lines to ``out``; True when a scheduler gets what is asked for."""
    ok = True
    out.append(
        f"pd-bootstrap-statemachine {__version__} (decode classes for SGLang "
        f"{installer.SUPPORTED_SGLANG})"
    )
    entry = _entry_point()
    if entry is None:
        ok = False
        out.append(
            f"error: no '{_GROUP}' entry point names {_TARGET} in this environment: "
            "SGLang will not load the plug-in. Install this package here "
            "(pip install <clone or wheel>, docs/sglang-decode.md)"
        )
    else:
        out.append(f"plug-in: {_GROUP} entry point {entry.name} -> {entry.value} (discovered)")
    backends = requested_backends()
    raw = os.environ.get(ENV_VAR)
    if backends:
        out.append(f"{ENV_VAR}={raw}: the library's classes asked for {','.join(backends)}")
    else:
        shown = "unset" if raw is None else f"{raw!r}"
        out.append(f"{ENV_VAR} is {shown}: the plug-in changes nothing (SGLang's own classes)")
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        out.append(
            "error: SGLang is not installed in this environment: run this check where "
            "the SGLang server runs"
        )
        return False
    out.append(f"SGLang {version}")
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed is not None and entry is not None:
        listed = {name.strip() for name in allowed.split(",")}
        note = "includes" if entry.name in listed else "does not include"
        out.append(f"SGLANG_PLUGINS={allowed} {note} {entry.name}")
    plugins = importlib.import_module("sglang.srt.plugins")
    try:
        plugins.load_plugins()
    except SystemExit as exc:
        out.append(
            f"error: SGLang's load_plugins() stops here, as it would stop a scheduler "
            f"at start: {exc}"
        )
        return False
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    out.append("after SGLang's load_plugins(), a decode scheduler gets:")
    for backend in sorted(installer.BACKENDS):
        transfer = utils.TransferBackend(backend)
        manager = decode.get_kv_class(transfer, utils.KVClassType.MANAGER)
        receiver = decode.get_kv_class(transfer, utils.KVClassType.RECEIVER)
        ours = manager.__module__ == _OURS and receiver.__module__ == _OURS
        wanted = backend in backends
        verdict = "as asked" if ours == wanted else "NOT as asked"
        whose = "the library's" if ours else "SGLang's"
        out.append(f"  {backend}: {_name(manager)} / {receiver.__qualname__} ({whose}: {verdict})")
        if ours != wanted:
            ok = False
    if not ok:
        out.append(
            f"error: a scheduler would not get what {ENV_VAR} asks for: check the "
            "lines above (the entry point, SGLANG_PLUGINS)"
        )
    return ok


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(
        prog=prog("sglang-check"),
        description=(
            "Say whether SGLang discovers this package's plug-in, what "
            f"{ENV_VAR} asks for, and which decode KV classes an SGLang scheduler started "
            "in this environment gets (runs SGLang's load_plugins()). Exits 1 when that is "
            "not what was asked."
        ),
    ).parse_args(argv)
    lines: list[str] = []
    ok = check(lines)
    print("\n".join(lines))
    return 0 if ok else 1
