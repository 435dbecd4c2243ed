"""KV release of failed rooms in the mirror (issue 27): freed on proof, held on silence.

The mirror's steps on hand-picked behaviours of ``MCKVRelease`` (one rank) and
``MCKVReleaseTwoRanks``: after a SIGKILL (the rank's connection reset) or a restart (a new
instance at its address) the room is released at once; after a stop or a cut (silence only) it
stays held until the ABORT_ACK or the timeout. The exhaustive side is the cfgs themselves
(``tests/model/test_model_check.py``) and the mutations that break ``NoReleaseWhileWriterMayWrite``,
``HeldRoomNotReused`` and ``ReleaseCountsOnlyAbortsSent`` (``tests/model/test_model_mutations.py``).
"""

from __future__ import annotations

import pytest

from statemachine.model import validate
from statemachine.model.check import TLA_DIR, load
from statemachine.model.checker import explore
from statemachine.model.spec import PROCESS_ACTIONS, BootstrapCache, State, Step

#: A request that sent its metadata: the room's pages are told to every rank.
SENT = ("Miss(r1, 80)", "FetchOk(r1)", "RegisterOk(r1)", "Publish(r1)", "SendOk(r1)")


def model(cfg: str) -> BootstrapCache:
    return load(TLA_DIR / cfg).model


def parse(text: str) -> Step:
    name, _, rest = text.partition("(")
    params: list[str | int] = []
    for item in rest.rstrip(")").split(", "):
        params.append(int(item) if item.isdigit() else item)
    return Step(name, tuple(params))


def run(m: BootstrapCache, *steps: str) -> State:
    """The state after ``steps`` from the initial state; each must be enabled."""
    (s,) = m.init_states()
    for text in steps:
        t = m.apply(s, parse(text))
        assert t is not None, f"{text} is not enabled"
        s = t
    return s


def enabled(m: BootstrapCache, s: State) -> set[str]:
    return {str(step) for step, _ in m.successors(s)}


def test_the_metadata_tells_every_rank_the_room() -> None:
    m = model("MCKVReleaseTwoRanks.cfg")
    s = run(m, *SENT)
    assert s.kv == ("held",) and s.told == (frozenset({"p1", "p2"}),)
    assert s.kvAddr == (80,) and s.kvEpoch == (0,)
    # A rank that reports its transfer done no longer writes the room.
    assert run(m, *SENT, "Ack(r1, p1)").told == (frozenset({"p2"}),)


def test_a_killed_ranks_room_is_released_without_the_timeout() -> None:
    m = model("MCKVRelease.cfg")
    s = run(m, *SENT, "RankExits(80, p1)", "Timeout(r1)")
    assert "ReleaseOnProvenGone(r1)" not in enabled(m, s)  # exited, but nothing heard yet
    s = run(m, *SENT, "RankExits(80, p1)", "Timeout(r1)", "ResetSeen(80, p1)")
    assert "ReleaseOnProvenGone(r1)" in enabled(m, s)
    released = m.apply(s, Step("ReleaseOnProvenGone", ("r1",)))
    assert released is not None and released.kv == ("released",)
    assert m.no_release_while_writer_may_write(released)


def test_a_new_instance_at_the_address_releases_the_room() -> None:
    m = model("MCKVRelease.cfg")
    s = run(m, *SENT, "Restart(80)", "Timeout(r1)")
    assert s.proc == (("up",),) and s.heard == (("none",),)  # the new process
    assert "ReleaseOnProvenGone(r1)" in enabled(m, s)


def test_silence_keeps_the_room_held_until_the_abort_ack_or_the_timeout() -> None:
    m = model("MCKVRelease.cfg")
    s = run(m, *SENT, "RankStops(80, p1)", "Timeout(r1)", "SilenceSeen(80, p1)")
    steps = enabled(m, s)
    assert "ReleaseOnProvenGone(r1)" not in steps
    assert "AbortAck(r1, p1)" not in steps  # a stopped process answers nothing
    assert "ReleaseOnTimeout(r1)" in steps  # SGLang's accepted risk: "expired", not "released"
    # The process resumes: it acknowledges the ABORT, and only then is the room released.
    s = run(
        m,
        *SENT,
        "RankStops(80, p1)",
        "Timeout(r1)",
        "SilenceSeen(80, p1)",
        "RankResumes(80, p1)",
        "AbortAck(r1, p1)",
    )
    assert s.told == (frozenset(),)
    assert "ReleaseOnAbortAck(r1)" in enabled(m, s)


def test_one_rank_proven_gone_is_not_enough_while_another_is_silent() -> None:
    m = model("MCKVReleaseTwoRanks.cfg")
    s = run(
        m,
        *SENT,
        "RankExits(80, p1)",
        "RankStops(80, p2)",
        "Timeout(r1)",
        "ResetSeen(80, p1)",
        "SilenceSeen(80, p2)",
    )
    assert "ReleaseOnProvenGone(r1)" not in enabled(m, s)
    s = m.apply(s, Step("RankExits", (80, "p2")))
    assert s is not None
    s = m.apply(s, Step("ResetSeen", (80, "p2")))
    assert s is not None and "ReleaseOnProvenGone(r1)" in enabled(m, s)


def test_a_held_room_blocks_the_slots_next_request_until_released() -> None:
    m = model("MCKVRelease.cfg")
    s = run(m, *SENT, "RankStops(80, p1)", "Timeout(r1)", "Invalidate(r1)")
    assert "NewRequest(r1)" not in enabled(m, s)
    s = run(m, *SENT, "RankStops(80, p1)", "Timeout(r1)", "Invalidate(r1)", "ReleaseOnTimeout(r1)")
    assert s.kv == ("expired",)
    after = m.apply(s, Step("NewRequest", ("r1",)))
    assert after is not None and after.kv == ("none",) and after.told == (frozenset(),)


def test_a_held_room_handed_to_a_new_request_is_named_by_held_room_not_reused() -> None:
    """Seeded spec bug NewRequestOnHeldRoom: the next request starts on a room a stopped rank
    may still write. NoReleaseWhileWriterMayWrite cannot see it (the room is forgotten, never
    "released"); HeldRoomNotReused does."""
    right = model("MCKVRelease.cfg")
    wrong = BootstrapCache(right.constants, mutation="NewRequestOnHeldRoom")
    ended = ("RankStops(80, p1)", "Timeout(r1)", "Invalidate(r1)")
    s = run(wrong, *SENT, *ended)
    assert s.kv == ("held",) and s.proc == (("silent",),)
    t = wrong.apply(s, Step("NewRequest", ("r1",)))
    assert t is not None and t.rstate == ("idle",) and t.kv == ("none",)
    assert not wrong.held_room_not_reused(s, t)
    assert wrong.no_release_while_writer_may_write(t)
    # The correct spec's next request waits for a release: every NewRequest it takes holds.
    assert right.apply(run(right, *SENT, *ended), Step("NewRequest", ("r1",))) is None


def test_an_abort_ack_without_an_abort_is_named_by_release_counts_only_aborts_sent() -> None:
    """Seeded spec bug AckOfUnsentAbort: an ABORT_ACK counts while the decode sent no ABORT
    (the request is still waiting), the rank leaves the room's writers, and the failed room
    is then released with that rank still running. NoReleaseWhileWriterMayWrite ranges over
    the writers left (none) and holds; ReleaseCountsOnlyAbortsSent names the ack."""
    right = model("MCKVRelease.cfg")
    wrong = BootstrapCache(right.constants, mutation="AckOfUnsentAbort")
    s = run(wrong, *SENT)
    assert s.notified == frozenset()
    assert right.apply(s, Step("AbortAck", ("r1", "p1"))) is None
    t = wrong.apply(s, Step("AbortAck", ("r1", "p1")))
    assert t is not None and t.told == (frozenset(),)
    assert not wrong.release_counts_only_aborts_sent(s, t)
    # The harm it leads to: the room freed while its rank still runs and may write.
    freed = run(wrong, *SENT, "AbortAck(r1, p1)", "RankStops(80, p1)", "Timeout(r1)")
    freed = wrong.apply(freed, Step("ReleaseOnAbortAck", ("r1",)))
    assert freed is not None and freed.kv == ("released",) and freed.proc == (("silent",),)
    assert wrong.no_release_while_writer_may_write(freed)
    # An ABORT_ACK of an ABORT sent (the timeout's) counts, and the property holds on it.
    sent = run(right, *SENT, "RankStops(80, p1)", "Timeout(r1)", "RankResumes(80, p1)")
    acked = right.apply(sent, Step("AbortAck", ("r1", "p1")))
    assert acked is not None and acked.told == (frozenset(),)
    assert right.release_counts_only_aborts_sent(sent, acked)


@pytest.mark.parametrize("cfg", ["MCKVRelease.cfg", "MCKVReleaseTwoRanks.cfg"])
def test_every_release_step_is_reached_and_the_proof_release_is_not_vacuous(cfg: str) -> None:
    m = model(cfg)
    taken: set[str] = set()
    proof_with_writers: list[State] = []

    def observe(s: State, step: Step, t: State) -> None:
        taken.add(step.action)
        if step.action == "ReleaseOnProvenGone" and any(s.told):
            proof_with_writers.append(t)

    explore(m, fair=False, observer=observe)
    assert {
        "AbortAck",
        "ReleaseOnAbortAck",
        "ReleaseOnProvenGone",
        "ReleaseOnTimeout",
        "RankStops",
        "RankResumes",
        "RankExits",
        "ResetSeen",
        "SilenceSeen",
    } <= taken
    assert proof_with_writers
    assert all(m.no_release_while_writer_may_write(t) for t in proof_with_writers)


def test_without_kv_release_the_new_variables_never_move() -> None:
    """The gate: with ``KVRelease = FALSE`` (every other cfg) the KV variables keep their
    initial values, so those cfgs' state counts are what they were before the KV part."""
    m = model("MCSmall.cfg")
    (init,) = m.init_states()
    moved: list[Step] = []

    def observe(s: State, step: Step, t: State) -> None:
        if step.action in PROCESS_ACTIONS or (t.kv, t.told, t.proc, t.heard) != (
            init.kv,
            init.told,
            init.proc,
            init.heard,
        ):
            moved.append(step)

    explore(m, fair=False, observer=observe)
    assert moved == []


# --- the same rule on the code's traces (statemachine/model/validate.py) ----------------------

RANK = "tcp://127.0.0.1:7001"
OTHER = "tcp://127.0.0.1:7002"


def _validate(*events: dict[str, object]) -> validate.Report:
    return validate.validate([{"seq": n, **e} for n, e in enumerate(events)])


def test_a_release_after_a_reset_or_a_new_instance_validates() -> None:
    report = _validate(
        {"action": "SilenceSeen", "endpoint": RANK, "instance": "A"},
        {"action": "ResetSeen", "endpoint": RANK, "instance": "A"},
        {"action": "NewInstanceSeen", "endpoint": OTHER, "instance": "A", "new_instance": "B"},
        {"action": "ReleaseOnProvenGone", "room": 7, "instance": "A", "writers": [RANK, OTHER]},
        {"action": "ReleaseOnTimeout", "room": 8},
        {"action": "ReleaseOnAbortAck", "room": 9},
    )
    assert report.ok, report.violation


def test_a_release_on_silence_is_named_by_the_property() -> None:
    report = _validate(
        {"action": "ResetSeen", "endpoint": RANK, "instance": "A"},
        {"action": "SilenceSeen", "endpoint": OTHER, "instance": "A"},
        {"action": "ReleaseOnProvenGone", "room": 7, "instance": "A", "writers": [RANK, OTHER]},
    )
    assert report.violation is not None and report.violation.index == 2
    assert report.violation.rule == "NoReleaseWhileWriterMayWrite"
    assert "only silence" in report.violation.reason and OTHER in report.violation.reason


def test_a_reset_of_another_instance_proves_nothing_about_the_rooms_writer() -> None:
    report = _validate(
        {"action": "ResetSeen", "endpoint": RANK, "instance": "B"},
        {"action": "ReleaseOnProvenGone", "room": 7, "instance": "A", "writers": [RANK]},
    )
    assert report.violation is not None
    assert "heard nothing" in report.violation.reason


@pytest.mark.parametrize(
    "event",
    [
        {"action": "ReleaseOnProvenGone", "room": 7, "instance": "A", "writers": []},
        {"action": "ReleaseOnProvenGone", "room": 7, "writers": [RANK]},
        {"action": "ResetSeen", "endpoint": RANK},
        {"action": "NewInstanceSeen", "endpoint": RANK, "instance": "A", "new_instance": "A"},
        {"action": "ReleaseOnTimeout"},
    ],
)
def test_malformed_kv_release_events_are_format_errors(event: dict[str, object]) -> None:
    with pytest.raises(validate.TraceFormatError):
        _validate(event)
