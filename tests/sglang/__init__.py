"""Tests that run SGLang 0.5.23's own code against this library (or this library's SGLang-facing
classes)."""
