"""The mirror against the *text* of TLA/BootstrapCache.tla, evaluated by a TLA+ interpreter.

TLC is not installed in CI, so the spec text is evaluated directly from the ``tla`` parse tree
(``statemachine.model.interp``): every reachable state, every successor set, TypeOK, every
action-property verdict on every step, the fairness actions and ``Stale`` must agree with the
mirror. An edit to either side that the other does not follow fails here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from statemachine.model.check import load
from statemachine.model.interp import Atom, InterpError, Interpreter
from statemachine.model.spec import ACTION_PROPERTIES, INVARIANTS, BootstrapCache, State

TLA_DIR = Path(__file__).resolve().parents[1] / "TLA"
SPEC_TEXT = (TLA_DIR / "BootstrapCache.tla").read_text(encoding="utf-8")


def interpreter_for(model: BootstrapCache, text: str = SPEC_TEXT) -> Interpreter:
    c = model.constants
    return Interpreter(
        text,
        {
            "Receivers": frozenset(Atom(r) for r in c.receivers),
            "Addrs": frozenset(c.addrs),
            "MaxRestarts": c.max_restarts,
            "MaxFaults": c.max_faults,
            "Mode": c.mode,
            "Discovery": c.discovery,
            "Variant": c.variant,
        },
    )


def to_mirror(model: BootstrapCache, d: Mapping[str, Any]) -> State:
    rs = [Atom(r) for r in model.receivers]
    return State(
        rstate=tuple(d["rstate"](r) for r in rs),
        rkey=tuple(d["rkey"](r) for r in rs),
        rgen=tuple(d["rgen"](r) for r in rs),
        pool=tuple(d["pool"](a) for a in model.addrs),
        objEpoch=tuple(d["objEpoch"](o) for o in model.object_ids),
        epoch=tuple(d["epoch"](a) for a in model.addrs),
        faults=d["faults"],
        acked=tuple(d["acked"](r) for r in rs),
        pooled=frozenset(d["pooled"]),
        watched=tuple(d["watched"](a) for a in model.addrs),
        marked=frozenset(str(r) for r in d["marked"]),
    )


def cross_check(model: BootstrapCache, interp: Interpreter, *, fairness: bool) -> int:
    """Explore with the interpreter; assert agreement with the mirror at every state/step."""
    init = interp.init_states()
    assert [to_mirror(model, d) for d in init] == model.init_states()
    seen = {to_mirror(model, d): d for d in init}
    queue = list(seen)
    conditions = model.fairness()
    for s in queue:
        d = seen[s]
        for name in INVARIANTS:
            assert interp.holds(name, d) == model.invariant(name)(s), (name, s)
        for j, a in enumerate(model.addrs):
            assert interp.holds("Stale", d, args=(a,)) == model.stale(s, j)
            assert interp.holds("LiveEntry", d, args=(a,)) == model.live_entry(s, j)
        by_interp = {to_mirror(model, t): t for t in interp.successors("Next", d)}
        labelled = list(model.successors(s))
        assert set(by_interp) == {t for _, t in labelled}, s
        for t, td in by_interp.items():
            if t != s:
                for name in ACTION_PROPERTIES:
                    assert interp.step_property(name, d, td) == model.action_property(name)(s, t), (
                        name,
                        s,
                        t,
                    )
                if fairness:
                    for cond in conditions:
                        opname, _, arg = cond.name.partition("(")
                        value: Any = arg.rstrip(")")
                        value = Atom(value) if opname == "ReceiverStep" else int(value)
                        mirror = any(cond.covers(step) for step, u in labelled if u == t)
                        assert interp.holds(opname, d, td, (value,)) == mirror, (cond.name, s, t)
            if t not in seen:
                seen[t] = td
                queue.append(t)
    return len(seen)


@pytest.mark.parametrize(
    "name, fairness",
    [
        ("MCPrefixNodeFailure.cfg", True),
        ("MCInvalidateByKey.cfg", True),
        ("MCNoInvalidation.cfg", False),
        ("MCSmall.cfg", False),
        ("MCEtcd.cfg", True),
    ],
)
def test_spec_text_and_mirror_agree(name: str, fairness: bool) -> None:
    model = load(TLA_DIR / name).model
    count = cross_check(model, interpreter_for(model), fairness=fairness)
    assert count == len(model_states(model))


def model_states(model: BootstrapCache) -> set[State]:
    seen = set(model.init_states())
    frontier = list(seen)
    while frontier:
        s = frontier.pop()
        for _, t in model.successors(s):
            if t not in seen:
                seen.add(t)
                frontier.append(t)
    return seen


@pytest.mark.parametrize(
    "old, new",
    [
        # Publish overwrites instead of setdefault.
        ("held == IF pool[k] = None THEN fresh ELSE pool[k]", "held == rgen[r]"),
        # A fetch takes the largest free id instead of the smallest.
        (
            "CHOOSE o \\in free : \\A q \\in free : o <= q",
            "CHOOSE o \\in free : \\A q \\in free : o >= q",
        ),
        # Hit forgets to record the key.
        (
            '= "cached"]\n    /\\ rkey\' = [rkey EXCEPT ![r] = a]',
            '= "cached"]\n    /\\ rkey\' = rkey',
        ),
    ],
)
def test_cross_check_detects_a_drifted_spec(old: str, new: str) -> None:
    assert old in SPEC_TEXT
    model = load(TLA_DIR / "MCInvalidateByKey.cfg").model  # two receivers race to publish
    drifted = interpreter_for(model, SPEC_TEXT.replace(old, new, 1))
    with pytest.raises((AssertionError, InterpError)):
        cross_check(model, drifted, fairness=False)
