"""SGLang's plug-in entry point: the decode classes in every process SGLang starts, on request.

SGLang 0.5.23 runs every setuptools entry point of the group ``sglang.srt.plugins`` first thing
in each of its processes (``load_plugins()``: the launching process, ``Engine.__init__`` and
``_launch_subprocesses``; each scheduler, ``run_scheduler_process``; the data-parallel
controller; the detokenizer). This package declares :func:`activate` there (pyproject.toml), so
``python -m sglang.launch_server``, ``sglang serve`` and ``sglang.Engine(...)`` pick it up in
every process SGLang spawns, whatever the start method.

It does something only when ``PD_BOOTSTRAP_SGLANG_DECODE`` names transfer backends
(``mooncake``, ``nixl``, comma-separated): installing this package never changes an SGLang
server by itself. A wrong SGLang release or an unknown backend name stops the process:
``load_plugins()`` catches ``Exception`` from a plug-in and only logs it, so the refusal is a
``SystemExit`` (a ``BaseException``), which ends the launching process before it spawns
anything, and a scheduler before it reports ready (SGLang's launcher then fails naming the
rank that died). Each scheduler logs one line at start, on this module's logger at INFO (under
SGLang's own log format and level), naming the classes its ``decode.py`` will use.

This module imports only the standard library at load time, and everything else inside
:func:`activate`, where a failure becomes the same ``SystemExit``. Loading it still imports the
``statemachine`` package and this one (their declared dependencies); a broken installation
failing there is the one error ``load_plugins()`` would only log, and ``pd-bootstrap
sglang-check`` reports it (the backends then get SGLang's classes, not what was asked).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_VAR", "activate", "requested_backends", "scheduler_line"]

#: The operator's switch: comma-separated transfer backends; unset or empty changes nothing.
ENV_VAR = "PD_BOOTSTRAP_SGLANG_DECODE"
#: Where SGLang's ``configure_scheduler_process`` runs once per scheduler, after SGLang's
#: logging is configured (``managers/scheduler.py``): the start-up line is logged right after.
_SCHEDULER_START = "sglang.srt.managers.scheduler.configure_scheduler_process"

logger = logging.getLogger(__name__)


def requested_backends(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The backends ``PD_BOOTSTRAP_SGLANG_DECODE`` names, in order, blanks dropped (empty: off)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    names = (name.strip().lower() for name in value.split(","))
    return tuple(dict.fromkeys(name for name in names if name))


def activate() -> None:
    """The ``sglang.srt.plugins`` entry point: install the decode classes in this process for
    the backends ``PD_BOOTSTRAP_SGLANG_DECODE`` names, and have each scheduler log what it got.

    Raises ``SystemExit`` (the message says what to change) for another SGLang release or a
    backend this library does not replace; does nothing when the variable is unset or empty.
    """
    backends = requested_backends()
    if not backends:
        return
    try:
        from statemachine.errors import ConfigurationError
        from statemachine.sglang.v0_5_23.decode_worker import installer

        try:
            current = installer.installed()
            if current != frozenset(backends):
                if current:
                    installer.uninstall()
                installer.install(backends)
        except ConfigurationError as exc:
            raise SystemExit(
                f"pd-bootstrap-statemachine: {ENV_VAR}={','.join(backends)} refused: {exc}. "
                f"Fix it, or unset {ENV_VAR} to run SGLang's own decode classes."
            ) from exc
        _log_at_scheduler_start()
    except SystemExit:
        raise
    except Exception as exc:  # load_plugins() would only log it: stop instead, loudly
        raise SystemExit(
            f"pd-bootstrap-statemachine: {ENV_VAR}={','.join(backends)} could not install "
            f"the decode classes ({type(exc).__name__}: {exc}); unset {ENV_VAR} to run "
            "SGLang's own classes, or reinstall pd-bootstrap-statemachine"
        ) from exc


def _log_at_scheduler_start() -> None:
    import importlib

    hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
    hooks.HookRegistry.register(_SCHEDULER_START, _after_scheduler_configured, hooks.HookType.AFTER)


def _after_scheduler_configured(result: Any, *args: Any, **kwargs: Any) -> None:
    logger.info("%s", scheduler_line())


def scheduler_line() -> str:
    """The start-up line: library and SGLang versions, what was installed, and the manager and
    receiver classes this process's ``decode.py`` answers for this scheduler's transfer backend
    (asked of ``decode.get_kv_class`` itself, as the scheduler will ask it)."""
    import importlib
    import importlib.metadata

    from statemachine import __version__
    from statemachine.sglang.v0_5_23.decode_worker import installer

    head = (
        f"pd-bootstrap-statemachine {__version__} on SGLang "
        f"{importlib.metadata.version('sglang')}: decode classes installed for "
        f"{','.join(sorted(installer.installed())) or '(none)'}"
    )
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    disagg = importlib.import_module("sglang.srt.runtime_context").get_disagg()
    mode = str(disagg.disaggregation_mode)
    backend = str(disagg.disaggregation_transfer_backend)
    if mode != "decode":
        return f"{head}; this scheduler (disaggregation mode {mode}) keeps SGLang's classes"
    transfer = utils.TransferBackend(backend)
    manager = decode.get_kv_class(transfer, utils.KVClassType.MANAGER)
    receiver = decode.get_kv_class(transfer, utils.KVClassType.RECEIVER)
    return (
        f"{head}; this decode scheduler ({backend}) uses "
        f"{manager.__module__}.{manager.__qualname__} and {receiver.__qualname__}"
    )
