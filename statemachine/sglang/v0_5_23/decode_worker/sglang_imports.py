"""SGLang's modules and environment settings, as the decode classes read them.

``sglang`` is not a dependency of this package: the decode classes import SGLang's modules
only when a manager is built (inside an SGLang process, where they are there), and read
SGLang's ``SGLANG_*`` settings through SGLang's own ``envs``, so a setting's default and
parsing are SGLang's.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["sglang_env", "sglang_module"]


def sglang_module(name: str) -> Any:
    """SGLang's module ``name`` (any module: typed ``Any``, as SGLang's are untyped here)."""
    return importlib.import_module(name)


def sglang_env(name: str) -> Any:
    """SGLang's environment setting ``name``, read through SGLang's own ``envs``."""
    return getattr(sglang_module("sglang.srt.environ").envs, name).get()
