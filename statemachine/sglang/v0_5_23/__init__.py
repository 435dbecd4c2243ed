"""SGLang 0.5.23's decode-side wire: Mooncake and NIXL (``spec/sglang-wire.md``).

Pick the backend named after the prefill's ``--disaggregation-transfer-backend``:
:class:`MooncakeBackend` for ``mooncake``, :class:`NixlBackend` for ``nixl``. Other 0.5.23
transfer backends (``mori``, ``ascend``, ``fake``) are not supported.

Inside SGLang's own decode worker, :func:`install` makes SGLang 0.5.23's decode scheduler build
its KV manager and receivers from :mod:`statemachine.sglang.v0_5_23.scheduler` (on a
``DecodeManager``); :func:`uninstall` undoes it (``docs/sglang-decode.md``).
"""

import importlib
from typing import Any

from statemachine.sglang.v0_5_23.kv_args import DecodeKVArgs
from statemachine.sglang.v0_5_23.mooncake import MooncakeBackend
from statemachine.sglang.v0_5_23.nixl import NixlBackend

#: The SGLang release whose wire this package speaks.
SGLANG_VERSION = "0.5.23"

# The installer and the scheduler classes need zmq and requests (through DecodeManager): they
# are imported on first use, so the wire layouts above load alone.
_LAZY = {"install": "installer", "uninstall": "installer", "installed": "installer"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "SGLANG_VERSION",
    "DecodeKVArgs",
    "MooncakeBackend",
    "NixlBackend",
    "install",
    "installed",
    "uninstall",
]
