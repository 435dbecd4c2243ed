"""Stub ``triton``: GPU kernels in SGLang's layers are ``@triton.jit`` at import time; the
stand-in decorator returns each kernel function unchanged, and none is ever launched.

Pinned: ``runtime.driver.active`` raises on every use, as triton does on a machine without a
GPU driver. SGLang's device probes (``fla/utils.py``'s ``get_available_device``, reached when
``sglang.srt.managers.scheduler`` is imported) catch that and answer "cpu"; a stand-in there
would answer a stand-in class as the device name.
"""

import types

from _sglang_stub import stub_package

__version__ = "3.6.0+stub"


class _NoActiveDriver:
    def __getattr__(self, name: str) -> object:
        raise RuntimeError("0 active drivers: no GPU on this machine (triton stub)")


stub_package(__name__)

from triton import runtime  # noqa: E402  (a stub submodule, made by stub_package's finder)

runtime.driver = types.SimpleNamespace(active=_NoActiveDriver())
