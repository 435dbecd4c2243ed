"""Real TLC against the mirror, on every CI cfg and every spec mutation (when a jar exists).

``.ci/run`` points ``TLA2TOOLS_JAR`` at a ``tla2tools.jar`` when one is there; then this runs
the whole table (``python -m statemachine.model.tlc --ci`` does the same from the command line)
and requires, for every run, the same set of violated properties, the same distinct-state
count and the same set of distinct states (TLC's ``-dump``) in TLC and in the mirror. Without
a jar the comparison is skipped (and says so); the parsing of TLC's messages and of its state
dump is tested either way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from statemachine.errors import DumpError
from statemachine.model.check import TLA_DIR, load
from statemachine.model.checker import explore
from statemachine.model.tlc import (
    _state_set_problems,
    compare_all,
    jar_from_environment,
    parse_output,
)
from statemachine.model.tlcdump import parse_value, read_dump, to_state


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


# --- TLC's state dump, compared with the mirror's states as sets -----------------------------

DUMP = """State 1:
/\\ epoch = (80 :> 0)
/\\ rgen = (r1 :> 0)
/\\ rkey = (r1 :> 0)
/\\ watched = (80 :> 0)
/\\ faults = 0
/\\ marked = {}
/\\ pool = (80 :> 0)
/\\ objEpoch = <<0, 0>>
/\\ pooled = {}
/\\ acked = (r1 :> (p1 :> 0))
/\\ notified = {}
/\\ rstate = (r1 :> "idle")
/\\ flight = (80 :> 0)
/\\ rflight = (r1 :> 0)
/\\ fate = <<"free", "free">>
/\\ kv = (r1 :> "none")
/\\ told = (r1 :> {})
/\\ kvAddr = (r1 :> 0)
/\\ kvEpoch = (r1 :> 0)
/\\ proc = (80 :> (p1 :> "up"))
/\\ heard = (80 :> (p1 :> "none"))

"""


def test_parse_value_reads_every_form_the_spec_holds() -> None:
    assert parse_value('(r1 :> "idle" @@ r2 :> "cached")') == {"r1": "idle", "r2": "cached"}
    assert parse_value("(r1 :> (p1 :> 0 @@ p2 :> 2))") == {"r1": {"p1": 0, "p2": 2}}
    assert parse_value("<<0, 1, -1>>") == (0, 1, -1)
    assert parse_value("{r2, r1}") == frozenset({"r1", "r2"})
    assert parse_value("{}") == frozenset()
    with pytest.raises(DumpError):
        parse_value("[a |-> 1]")  # a record: not a value of this spec


def test_a_dumped_state_is_the_mirrors_initial_state(tmp_path: Path) -> None:
    (tmp_path / "s.dump").write_text(DUMP, encoding="utf-8")
    loaded = load(TLA_DIR / "MCOne.cfg")
    (values,) = read_dump(tmp_path / "s.dump")
    assert to_state(loaded.model, values) == loaded.model.init_states()[0]


def test_a_state_set_that_differs_is_reported(tmp_path: Path) -> None:
    loaded = load(TLA_DIR / "MCOne.cfg")
    graph, _ = explore(loaded.model, fair=False)
    lines = []
    for n, state in enumerate(graph.states, 1):
        lines.append(f"State {n}:")
        lines.append("/\\ rstate = (r1 :> " + f'"{state.rstate[0]}")')
        lines.append(f"/\\ rkey = (r1 :> {state.rkey[0]})")
        lines.append(f"/\\ rgen = (r1 :> {state.rgen[0]})")
        lines.append(f"/\\ pool = (80 :> {state.pool[0]})")
        lines.append(f"/\\ objEpoch = <<{', '.join(map(str, state.objEpoch))}>>")
        lines.append(f"/\\ epoch = (80 :> {state.epoch[0]})")
        lines.append(f"/\\ faults = {state.faults}")
        lines.append(f"/\\ acked = (r1 :> (p1 :> {state.acked[0][0]}))")
        lines.append(f"/\\ pooled = {{{', '.join(map(str, sorted(state.pooled)))}}}")
        lines.append(f"/\\ watched = (80 :> {state.watched[0]})")
        lines.append(f"/\\ marked = {{{', '.join(sorted(state.marked))}}}")
        lines.append(f"/\\ notified = {{{', '.join(sorted(state.notified))}}}")
        lines.append(f"/\\ flight = (80 :> {state.flight[0]})")
        lines.append(f"/\\ rflight = (r1 :> {state.rflight[0]})")
        fates = ", ".join(f'"{x}"' for x in state.fate)
        lines.append(f"/\\ fate = <<{fates}>>")
        lines.append(f'/\\ kv = (r1 :> "{state.kv[0]}")')
        lines.append(f"/\\ told = (r1 :> {{{', '.join(sorted(state.told[0]))}}})")
        lines.append(f"/\\ kvAddr = (r1 :> {state.kvAddr[0]})")
        lines.append(f"/\\ kvEpoch = (r1 :> {state.kvEpoch[0]})")
        lines.append(f'/\\ proc = (80 :> (p1 :> "{state.proc[0][0]}"))')
        lines.append(f'/\\ heard = (80 :> (p1 :> "{state.heard[0][0]}"))')
        lines.append("")
    (tmp_path / "s.dump").write_text("\n".join(lines), encoding="utf-8")
    dumped = read_dump(tmp_path / "s.dump")
    assert _state_set_problems(loaded, dumped) == []
    # One state drifts (TLC would have found faults = 7, beyond the budget, where the mirror
    # has 0): the state only TLC has and the one only the mirror has both show.
    dumped[0]["faults"] = 7
    (problem,) = _state_set_problems(loaded, dumped)
    assert "1 states only TLC reaches, 1 only the mirror" in problem
