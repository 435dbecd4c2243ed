"""Single flight in the model: flights have identity, and nothing but its own flight ends a wait.

The properties (``FollowerGetsLeaderResult``, ``FinishedFlightGone``) and their mutations are
checked with the rest (``tests/model/test_model_mutations.py``, ``tests/model/test_model_tlc.py``).
Here,
on the reachable graph of a correct config, the two facts the old key-based model got wrong:
a follower whose flight failed is never handed a later flight's generation, and every follower
leaves only with its own flight's outcome. Each check is also run on a seeded model with the
old behaviour (followers of the *key* handed whatever the next publish held) and must find
the rescue there, so the check cannot pass vacuously.
"""

from __future__ import annotations

from pathlib import Path

from statemachine.model.check import load
from statemachine.model.checker import explore
from statemachine.model.spec import NONE, BootstrapCache, State, Step

TLA_DIR = Path(__file__).resolve().parents[2] / "TLA"
#: Two receivers, one key, queueing, one spurious failure: a follower, its leader failing, and
#: another leader of the same key can all be there at once.
CONFIG = TLA_DIR / "MCSmall.cfg"


class KeyHandedModel(BootstrapCache):
    """The seeded bug: a publish also hands its generation to every idle receiver waiting on
    the key, whatever flight it joined (the model before flights had identity)."""

    def publish(self, s: State, i: int) -> State | None:
        t = super().publish(s, i)
        if t is None or t.pool[self.addr_index[s.rkey[i]]] == NONE:
            return t
        held = t.pool[self.addr_index[s.rkey[i]]]
        rgen = tuple(
            held if q != i and self.follows(s, q) and s.rkey[q] == s.rkey[i] else g
            for q, g in enumerate(t.rgen)
        )
        return t._replace(rgen=rgen, pooled=t.pooled | {held})


def rescues(model: BootstrapCache) -> tuple[list[tuple[State, Step, State]], int]:
    """Steps that hand a follower of a failed flight a generation, or let it succeed; and how
    many reachable states hold such a follower while another flight of its key is open."""
    found: list[tuple[State, Step, State]] = []
    witnesses: set[State] = set()

    def observe(s: State, step: Step, t: State) -> None:
        for q in range(len(model.receivers)):
            if not model.flight_failed(s, q):
                continue
            j = model.addr_index[s.rkey[q]]
            if s.flight[j] not in (NONE, s.rflight[q]):
                witnesses.add(s)
            if t.rstate[q] == "cached" or (t.rstate[q] == "idle" and t.rgen[q] != NONE):
                found.append((s, step, t))

    explore(model, fair=False, observer=observe)
    return found, len(witnesses)


def test_a_follower_of_a_failed_flight_is_never_rescued_by_a_later_flight() -> None:
    model = load(CONFIG).model
    found, witnesses = rescues(model)
    assert witnesses > 0  # the situation arises: a later flight of the key runs meanwhile
    assert found == []


def test_the_rescue_check_catches_key_based_handing() -> None:
    correct = load(CONFIG).model
    seeded = KeyHandedModel(correct.constants)
    found, _ = rescues(seeded)
    assert found, "the seeded key-based handing must rescue some follower"
    s, step, t = found[0]
    assert step.action == "Publish"
    # And the invariant states the same fact: the seeded model violates it.
    assert not all(seeded.follower_gets_leader_result(x) for x in (s, t))


def test_followers_leave_only_with_their_own_flights_outcome() -> None:
    """A follower reaching ``cached`` holds what its own flight published; one failing without
    spending the fault budget does so because its own flight failed (the leader's reason)."""
    model = load(CONFIG).model
    exits: dict[str, int] = {}

    def observe(s: State, step: Step, t: State) -> None:
        if step.action not in ("Hit", "FetchFail"):
            return
        q = model.receivers.index(str(step.params[0]))
        if not model.follows(s, q):
            return
        fate = s.fate[s.rflight[q] - 1]
        exits[f"{step.action}/{fate}"] = exits.get(f"{step.action}/{fate}", 0) + 1
        if step.action == "Hit":
            assert fate == "published" and t.rgen[q] == s.rgen[q] != NONE
        elif t.faults == s.faults:  # a genuine failure: the leader's
            assert fate == "failed"
        # A flight id is not reused while a follower still holds it.
        assert t.rflight[q] == NONE

    explore(model, fair=False, observer=observe)
    # Every kind of exit happens: adopt, fail with the leader, give up at the deadline.
    assert {"Hit/published", "FetchFail/failed", "FetchFail/open"} <= set(exits)
