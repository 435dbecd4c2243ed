"""Stub ``tvm_ffi`` (PyPI ``apache-tvm-ffi``): a compiled kernel-binding layer SGLang's kernel
loaders import; there is no kernel to bind on a CPU test machine."""

from _sglang_stub import stub_package

__version__ = "0.1.11+stub"

stub_package(__name__)
