"""Benchmarks: each ``bench_*.py`` module measures a baseline and ours in the same run."""
