"""The prefill side, as a reference: the bootstrap server and a prefill rank process.

Tests, the demo and the benchmarks run these as real processes and kill and restart them.
"""
