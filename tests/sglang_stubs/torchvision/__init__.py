"""Stub ``torchvision``: imported by SGLang's multimodal processors on the package import path;
no image is processed in the interop tests."""

from _sglang_stub import stub_package

__version__ = "0.29.1+stub"

stub_package(__name__)
