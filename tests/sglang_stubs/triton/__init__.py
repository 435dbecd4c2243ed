"""Stub ``triton``: GPU kernels in SGLang's layers are ``@triton.jit`` at import time; the
stand-in decorator returns each kernel function unchanged, and none is ever launched."""

from _sglang_stub import stub_package

__version__ = "3.6.0+stub"

stub_package(__name__)
