"""Make SGLang 0.5.23's decode scheduler use this library's KV manager and receiver classes.

``decode.py`` imports ``get_kv_class`` by name from ``sglang.srt.disaggregation.utils`` and
asks it for the manager (``decode.py:765``) and for one receiver per request (``decode.py:905``).
:func:`install` replaces the name ``decode.py`` holds with a function that answers the classes
of :mod:`.conn` for the chosen transfer backends and defers to SGLang's own for everything else
(KVArgs, the prefill's sender and bootstrap server, other backends). Nothing else of SGLang is
touched; :func:`uninstall` (or leaving the ``with`` block) puts SGLang's function back. Only
SGLang 0.5.23 is accepted: another release is refused, since these classes follow 0.5.23's
decode code line by line. In an SGLang server the plug-in entry point (:mod:`.plugin`) calls
:func:`install` in every process SGLang starts.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from statemachine.errors import ConfigurationError
from statemachine.sglang.v0_5_23.decode_worker import conn

__all__ = ["BACKENDS", "Installation", "install", "installed", "uninstall"]

#: The SGLang release these classes follow.
SUPPORTED_SGLANG = "0.5.23"
#: SGLang transfer backend name -> (manager class, receiver class).
BACKENDS: dict[str, tuple[type, type]] = {
    "mooncake": (conn.MooncakeKVManager, conn.MooncakeKVReceiver),
    "nixl": (conn.NixlKVManager, conn.NixlKVReceiver),
}
_DECODE_MODULE = "sglang.srt.disaggregation.decode"

_lock = threading.Lock()
_current: Installation | None = None


class Installation:
    """What :func:`install` did; :meth:`uninstall` (or the end of a ``with`` block) undoes it."""

    def __init__(self, decode: Any, original: Callable[..., Any], backends: frozenset[str]):
        self.decode_module = decode
        self.original = original
        self.backends = backends

    def uninstall(self) -> None:
        """Put SGLang's own ``get_kv_class`` back into ``decode.py`` (idempotent)."""
        global _current
        with _lock:
            if _current is self:
                self.decode_module.get_kv_class = self.original
                _current = None

    def __enter__(self) -> Installation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.uninstall()


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def install(backends: Iterable[str] = ("mooncake", "nixl")) -> Installation:
    """Make SGLang 0.5.23's decode scheduler build its KV manager and receivers from this
    library for ``backends`` (``"mooncake"``, ``"nixl"``: SGLang's
    ``--disaggregation-transfer-backend``). Call it in the decode worker's process before the
    scheduler starts (before ``decode.py`` builds its prealloc queue). Raises
    ``ConfigurationError`` for another SGLang release, an unknown backend, or a second
    install; returns the :class:`Installation` (also a context manager) to undo it."""
    global _current
    wanted = frozenset(backends)
    unknown = sorted(wanted - BACKENDS.keys())
    if unknown or not wanted:
        raise ConfigurationError(
            f"backends {unknown or '(none)'} not supported: choose from {sorted(BACKENDS)} "
            "(SGLang's mori, ascend and fake backends keep SGLang's own classes)"
        )
    version = _installed_version()
    if version != SUPPORTED_SGLANG:
        raise ConfigurationError(
            f"SGLang {version or 'is not installed'}"
            f"{' is installed' if version else ''}: these decode classes follow SGLang "
            f"{SUPPORTED_SGLANG}'s decode code and refuse any other release; install "
            f"sglang=={SUPPORTED_SGLANG} or run SGLang's own classes"
        )
    decode: Any = importlib.import_module(_DECODE_MODULE)
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    with _lock:
        if _current is not None:
            raise ConfigurationError(
                f"already installed for {sorted(_current.backends)}: uninstall() first"
            )
        original = decode.get_kv_class
        kv_class_type = utils.KVClassType
        selected = {utils.TransferBackend(name): BACKENDS[name] for name in sorted(wanted)}

        def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
            classes = selected.get(transfer_backend)
            if classes is not None:
                if class_type == kv_class_type.MANAGER:
                    return classes[0]
                if class_type == kv_class_type.RECEIVER:
                    return classes[1]
            return original(transfer_backend, class_type)

        decode.get_kv_class = get_kv_class  # the name decode.py calls
        _current = Installation(decode, original, wanted)
        return _current


def uninstall() -> None:
    """Undo :func:`install` (nothing to do when nothing is installed)."""
    current = _current
    if current is not None:
        current.uninstall()


def installed() -> frozenset[str]:
    """The backends installed now (empty when none)."""
    current = _current
    return frozenset() if current is None else current.backends
