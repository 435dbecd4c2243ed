"""Tests of this repository: the `statemachine` package and the repository around it (docs, layout,
benchmarks)."""
