"""Drift guards between TLA/BootstrapCache.tla and the Python mirror (names, syntax)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import tla

from statemachine.model import spec
from statemachine.model.cfg import read_cfg

TLA_DIR = Path(__file__).resolve().parents[2] / "TLA"
SPEC_PATH = TLA_DIR / "BootstrapCache.tla"
TLA_FILES = sorted(TLA_DIR.glob("*.tla"))
CFG_FILES = sorted(TLA_DIR.glob("MC*.cfg"))


def _definitions() -> dict[str, Any]:
    tree = tla.parse(SPEC_PATH.read_text(encoding="utf-8"))
    return {u.name: u for u in tree.units if type(u).__name__ == "OperatorDefinition"}


def _applied_names(node: Any, found: set[str]) -> None:
    """Every operator name applied with arguments anywhere under ``node``."""
    if isinstance(node, (list, tuple)) and not hasattr(node, "symbol"):
        for item in node:
            _applied_names(item, found)
        return
    if not hasattr(node, "symbol"):
        return
    if type(node).__name__ == "OperatorApplication" and node.arguments:
        found.add(node.operator)
    for name in node._fields:
        _applied_names(getattr(node, name), found)


def test_tla_files_exist() -> None:
    assert SPEC_PATH in TLA_FILES
    assert {p.name for p in CFG_FILES} >= {
        "MCSmall.cfg",
        "MCLarge.cfg",
        "MCNoInvalidation.cfg",
        "MCInvalidateByKey.cfg",
        "MCPrefixNodeFailure.cfg",
        "MCRetireStaleObservation.cfg",
        "MCReusedPortAcks.cfg",
        "MCTwoKeys.cfg",
        "MCEtcd.cfg",
        "MCEtcdRetireByKey.cfg",
        "MCOne.cfg",
        "MCResponses.cfg",
        "MCHandshake.cfg",
        "MCTwoReceivers.cfg",
        "MCKVRelease.cfg",
        "MCKVReleaseTwoRanks.cfg",
    }


@pytest.mark.parametrize("path", TLA_FILES, ids=lambda p: p.name)
def test_tla_parses_and_has_no_tab(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert "\t" not in text
    module = tla.parse(text)
    assert module.name == path.stem


def test_parser_rejects_a_broken_spec() -> None:
    # The parse test above is only meaningful if the parser can fail.
    broken = SPEC_PATH.read_text(encoding="utf-8").replace("Next ==", "Next == /\\ /\\", 1)
    with pytest.raises(ValueError):
        tla.parse(broken)


def test_next_names_exactly_the_mirror_actions() -> None:
    defs = _definitions()
    applied: set[str] = set()
    _applied_names(defs["Next"].definiens, applied)
    actions = {name for name in applied if name in defs}
    assert actions == set(spec.ACTIONS)
    receiver_side = (*spec.RECEIVER_ACTIONS, *spec.HELPER_ACTIONS)
    two = {name for name in receiver_side if len(defs[name].arity) == 2}
    assert set(spec.KEYED_ACTIONS) | set(spec.RANKED_ACTIONS) == two
    for name in receiver_side:
        assert defs[name].arity[0].operator == "r", name  # the receiver comes first
    for name in spec.KEYED_ACTIONS:
        assert defs[name].arity[1].operator == "a", name  # then the address
    for name in spec.RANKED_ACTIONS:
        assert defs[name].arity[1].operator == "p", name  # or the prefill rank
    for name in spec.ENV_ACTIONS:
        assert defs[name].arity[0].operator == "a", name  # the address comes first
    assert len(defs["RetireInstance"].arity) == 2  # (a, e): the instance observed


def test_receiver_step_is_every_receiver_action_but_abort() -> None:
    defs = _definitions()
    applied: set[str] = set()
    _applied_names(defs["ReceiverStep"].definiens, applied)
    assert {name for name in applied if name in defs} == set(spec.RECEIVER_STEP)


def test_property_and_variable_names_match() -> None:
    defs = _definitions()
    for name in (*spec.INVARIANTS, *spec.ACTION_PROPERTIES, *spec.LIVENESS_PROPERTIES):
        assert name in defs, name
    tree = tla.parse(SPEC_PATH.read_text(encoding="utf-8"))
    variables = [n.operator for u in tree.units if type(u).__name__ == "Variables" for n in u.names]
    constants = [n.operator for u in tree.units if type(u).__name__ == "Constants" for n in u.names]
    assert tuple(variables) == spec.VARIABLES == spec.State._fields
    assert tuple(constants) == spec.CONSTANTS
    # vars lists every variable, in order
    vars_items = [item.operator for item in defs["vars"].definiens.items]
    assert tuple(vars_items) == spec.VARIABLES


def test_action_properties_are_box_action_formulas() -> None:
    defs = _definitions()
    for name in spec.INVARIANTS:
        assert getattr(defs[name].definiens, "operator", None) != "[]", name
    for name in spec.ACTION_PROPERTIES:
        body = defs[name].definiens
        assert body.operator == "[]", name
        assert type(body.arguments[0]).__name__ == "SubscriptedAction", name
    for name in spec.LIVENESS_PROPERTIES:
        applied: set[str] = set()
        _applied_names(defs[name].definiens, applied)
        assert "~>" in applied, name


@pytest.mark.parametrize("path", CFG_FILES, ids=lambda p: p.name)
def test_cfg_names_are_defined_in_the_spec(path: Path) -> None:
    defs = _definitions()
    cfg = read_cfg(path)
    assert cfg.specification == "Spec" and "Spec" in defs
    for name in (*cfg.invariants, *cfg.properties):
        assert name in defs, name
    assert set(cfg.constants) == set(spec.CONSTANTS)


def test_lifecycle_state_sets_match_the_machine() -> None:
    from statemachine import lifecycle

    interp_defs = _definitions()

    def strings(name: str) -> set[str]:
        return {item.value.strip('"') for item in interp_defs[name].definiens.items}

    assert strings("LifecycleStates") == set(lifecycle.STATES)
    assert strings("ActiveStates") == set(lifecycle.ACTIVE_STATES)
    assert strings("FinalStates") == set(lifecycle.FINAL_STATES)


def test_spec_index_names_every_shared_property() -> None:
    """spec/README.md's list of shared names is the mirror's, no more and no fewer."""
    index = (SPEC_PATH.parents[1] / "spec" / "README.md").read_text(encoding="utf-8")
    shared = index[index.index("Names shared between") :].split("tests (")[0]
    listed = set(re.findall(r"`([A-Z][A-Za-z]+)`", shared))
    expected = {*spec.INVARIANTS, *spec.ACTION_PROPERTIES, *spec.LIVENESS_PROPERTIES}
    assert listed == expected
