"""Stub ``torch``: SGLang's package import reaches it everywhere (platforms, layers, configs).

The disaggregation code under test never runs a tensor op. Pinned values, each read by SGLang at
import time as a fact about the machine:

- ``version.cuda/hip/musa`` are None: a stand-in there would make ``is_hip()`` say ROCm.
- ``npu`` is absent: ``is_npu()`` raises when the attribute exists but reports no device.
- ``__version__`` is a PEP 440 string, so version parsers (transformers') accept it.
"""

import types

from _sglang_stub import stub_package

__version__ = "2.14.1+stub"

version = types.ModuleType("torch.version")
version.__version__ = __version__
version.cuda = None
version.hip = None
version.musa = None
version.git_version = "stub"

stub_package(__name__, absent=("npu", "version"))
