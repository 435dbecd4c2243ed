"""Real TLC against the mirror, on every CI cfg and every spec mutation (when a jar exists).

``.ci/run`` points ``TLA2TOOLS_JAR`` at a ``tla2tools.jar`` when one is there; then this runs
the whole table (``python -m statemachine.model.tlc --ci`` does the same from the command line)
and requires, for every run, the same set of violated properties and the same distinct-state
count in TLC and in the mirror. Without a jar the comparison is skipped (and says so); the
parsing of TLC's messages is tested either way.
"""

from __future__ import annotations

import os

import pytest

from statemachine.model.tlc import compare_all, jar_from_environment, parse_output


def test_parse_output_reads_every_violation_form() -> None:
    output = "\n".join(
        [
            "Error: Invariant TypeOK is violated.",
            "Error: Action property IdentitySafe is violated.",
            "Error: Temporal property RequestsSucceed was violated.",
            "Error: Temporal properties StaleEntryEvicted and RequestsSucceed were violated.",
            "Error: Temporal properties A, B and C were violated.",
            "Progress(3) at 2026-12-01: 10 states generated, 5 distinct states found, 1 left",
            "4,373 states generated, 1,343 distinct states found, 0 states left on queue.",
        ]
    )
    run = parse_output(13, output)
    assert run.violated == {
        "TypeOK",
        "IdentitySafe",
        "RequestsSucceed",
        "StaleEntryEvicted",
        "A",
        "B",
        "C",
    }
    assert run.distinct_states == 1343  # the summary line, not a progress line


def test_parse_output_of_a_clean_run() -> None:
    run = parse_output(
        0, "16459 states generated, 3858 distinct states found, 0 states left on queue."
    )
    assert run.violated == set() and run.distinct_states == 3858


JAR = jar_from_environment()


@pytest.mark.skipif(
    JAR is None,
    reason="TLC skipped: TLA2TOOLS_JAR is not set"
    if not os.environ.get("TLA2TOOLS_JAR")
    else "TLC skipped: the jar or java is missing",
)
def test_tlc_agrees_with_the_mirror_on_every_cfg_and_mutation() -> None:
    lines: list[str] = []
    rows = compare_all(JAR, ci_only=True, timeout=600.0, report=lines.append)
    assert len(rows) >= 20
    disagreements = [row.row() for row in rows if row.problems]
    assert not disagreements, "\n".join(disagreements)
    assert all(row.tlc is not None and row.tlc.distinct_states for row in rows)
