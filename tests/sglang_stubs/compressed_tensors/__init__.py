"""Stub ``compressed_tensors``: SGLang's quantization configs import it, and the real package
builds pydantic models over real torch dtypes at import time (and would pull real torch in)."""

from _sglang_stub import stub_package

__version__ = "0.18.0+stub"

stub_package(__name__)
