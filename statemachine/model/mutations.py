"""Seeded mutations of ``TLA/BootstrapCache.tla``: each must break a named property.

A property that no edit of the spec can break says nothing. Each :class:`SpecMutation` is an
exact text rewrite of the spec (applied to a temporary copy, never to ``TLA/``) together with
the same change in the mirror (``BootstrapCache(constants, mutation=name)``), the CI config
it runs on, and the property it must violate there. ``make tlc`` runs the mutated text
through TLC and the flagged mirror on the same cfg and requires the same verdicts and the
same distinct-state counts; ``tests/model/test_model_mutations.py`` checks the mirror side in CI,
and that every rewrite still applies (a refactor of the spec that silently disarms a mutation
fails there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from statemachine.model.check import TLA_DIR, Loaded, load
from statemachine.model.spec import MUTATIONS, BootstrapCache

SPEC_NAME = "BootstrapCache.tla"


@dataclass(frozen=True)
class SpecMutation:
    name: str  # the mirror's flag (spec.MUTATIONS)
    cfg: str  # the CI config it runs on
    violates: str  # the property it must break there
    edits: tuple[tuple[str, str], ...]  # exact (old, new) rewrites of the spec text
    bug: str  # what the mutated system would do, in user-visible terms


MUTATION_TABLE: tuple[SpecMutation, ...] = (
    SpecMutation(
        "PublishOverwrites",
        "MCTwoReceivers.cfg",
        "IdentitySafe",
        (
            (
                "           held == IF pool[k] = None THEN fresh ELSE pool[k]\n",
                "           held == rgen[r]\n",
            ),
        ),
        "publish is an assignment: a slow stale publisher overwrites the fresh generation",
    ),
    SpecMutation(
        "LoserKeepsOwn",
        "MCTwoReceivers.cfg",
        "AdoptionCorrect",
        (("(q = r \\/ (f # None", "(q # r /\\ (f # None"),),
        "the publish loser keeps its unpublished object: its failure cannot evict the winner",
    ),
    SpecMutation(
        "InvalidateByKey",
        "MCTwoReceivers.cfg",
        "IdentitySafe",
        (
            (
                "                      [] OTHER -> g # None /\\ pool[k] = g)",
                "                      [] OTHER -> g # None)",
            ),
        ),
        "a stale receiver's failure deletes the fresh generation another receiver published",
    ),
    SpecMutation(
        "TimeoutKeepsEntry",
        "MCOne.cfg",
        "StaleEntryEvicted",
        (
            (
                '    /\\ rstate\' = [rstate EXCEPT ![r] = "failed"]\n'
                "    /\\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, pooled, watched,"
                " marked, flight, rflight,\n                   fate>>\n",
                "    /\\ FailEarly(r)\n    /\\ UNCHANGED <<pool, epoch, watched>>\n",
            ),
        ),
        "a timeout does not invalidate: in queueing mode stale ports are reused forever",
    ),
    SpecMutation(
        "RetireStaleObservation",
        "MCOne.cfg",
        "ExactNodeFailure",
        (("          ELSE objEpoch[pool[a]] < e\n", "          ELSE objEpoch[pool[a]] # e\n"),),
        "retire every other instance than a possibly stale observation: the newest goes",
    ),
    SpecMutation(
        "CompleteWithoutAck",
        "MCOne.cfg",
        "CompleteNeedsAllResponses",
        (("    /\\ \\A p \\in Ranks : acked[r][p] # 0\n", ""),),
        "a request completes without a transfer (garbage KV cache served as the prompt's)",
    ),
    SpecMutation(
        "AckWithoutLiveness",
        "MCOne.cfg",
        "NoStaleSuccess",
        (('    /\\ Live(r) \\/ (Variant = "ReusedPortAcks" /\\ Mode = "queueing")\n', ""),),
        "a process of another epoch acknowledges a transfer it never did",
    ),
    SpecMutation(
        "PrefixNodeFailure",
        "MCTwoKeys.cfg",
        "ExactNodeFailure",
        (
            (
                '    IF Variant = "PrefixNodeFailure" THEN DigitPrefix(a, b) ELSE a = b',
                "    DigitPrefix(a, b)",
            ),
        ),
        "the death of host:80 also drops the healthy host:8000's entries",
    ),
    SpecMutation(
        "HeartbeatFalsePositive",
        "MCOne.cfg",
        "ExactNodeFailure",
        (
            (
                "NodeFailure(a) ==\n    /\\ epoch[a] < MaxRestarts\n"
                "    /\\ epoch' = [epoch EXCEPT ![a] = @ + 1]\n",
                "NodeFailure(a) ==\n    /\\ epoch' = epoch\n",
            ),
        ),
        "the heartbeat declares a live prefill dead and its fresh entries are dropped",
    ),
    SpecMutation(
        "NoFairness",
        "MCOne.cfg",
        "RequestsSucceed",
        (("Spec == Init /\\ [][Next]_vars /\\ Fairness", "Spec == Init /\\ [][Next]_vars"),),
        "nothing obliges any step: a request may wait forever",
    ),
    SpecMutation(
        "UnboundedFaults",
        "MCOne.cfg",
        "RequestsSucceed",
        (
            (
                "               ELSE /\\ faults < MaxFaults\n"
                "                    /\\ faults' = faults + 1\n",
                "               ELSE faults' = faults\n",
            ),
        ),
        "spurious failures never stop: a request may fail forever",
    ),
    SpecMutation(
        "WeakFairLookups",
        "MCTwoKeys.cfg",
        "StaleEntryEvicted",
        (("SF_vars(Lookup(a))", "WF_vars(Lookup(a))"),),
        "a key asked for only now and then keeps its stale entry forever",
    ),
    SpecMutation(
        "NoWatermark",
        "MCEtcd.cfg",
        "NoStaleStart",
        (
            (
                "           fresh == IF objEpoch[rgen[r]] >= watched[k] THEN rgen[r] ELSE None\n",
                "           fresh == rgen[r]\n",
            ),
        ),
        "a fetch older than the watch publishes anyway: the next request starts on dead ports",
    ),
    SpecMutation(
        "NoFanOutMark",
        "MCHandshake.cfg",
        "NoStaleStart",
        (("                  {r \\in Receivers :\n", "                  {r \\in {} :\n"),),
        "the watch retires entries but fails no in-flight receiver: they send to dead ports",
    ),
    SpecMutation(
        "FirstResponseCompletes",
        "MCResponses.cfg",
        "CompleteNeedsAllResponses",
        (
            (
                "    /\\ \\A p \\in Ranks : acked[r][p] # 0\n",
                "    /\\ \\E p \\in Ranks : acked[r][p] # 0\n",
            ),
        ),
        "responses are counted, not distinct ranks: one rank's (repeated) Success completes the"
        " request while another rank's KV is still missing",
    ),
    SpecMutation(
        "LateAckCompletes",
        "MCOne.cfg",
        "FailedIsTerminal",
        (("    /\\ rstate' = rstate\n", '    /\\ rstate\' = [rstate EXCEPT ![r] = "done"]\n'),),
        "a Success that arrives after the request failed (timeout, another rank) completes it",
    ),
    SpecMutation(
        "AbortBeforeSendSilent",
        "MCOne.cfg",
        "AbortNotified",
        (
            (
                "notified' = IF rstate[r] \\in Initialized THEN",
                'notified\' = IF rstate[r] = "waiting" THEN',
            ),
        ),
        "abort() after init() but before send_metadata() tells no prefill rank: the prefill"
        " keeps the room's KV until its own timeout",
    ),
    SpecMutation(
        "TimeoutSilent",
        "MCOne.cfg",
        "AbortNotified",
        (("    /\\ notified' = notified \\cup {r}\n", "    /\\ notified' = notified\n"),),
        "the waiting timeout sends the prefill ranks nothing: they hold the room until theirs",
    ),
    SpecMutation(
        "SendWithoutHandshake",
        "MCHandshake.cfg",
        "HandshakeBeforeSend",
        (
            (
                '    /\\ \\/ rstate[r] = "cached" /\\ Policy = "early"\n',
                '    /\\ \\/ rstate[r] = "cached"\n',
            ),
        ),
        "under prefill_complete the metadata goes out before the prefill answered BOOTSTRAP:"
        " the prefill has no room for it yet",
    ),
    SpecMutation(
        "LeaderFailureUntold",
        "MCTwoReceivers.cfg",
        "FollowerGetsLeaderResult",
        (
            (
                "        newFate == IF leads THEN [fate EXCEPT ![f] = o] ELSE fate\n",
                '        newFate == IF leads /\\ o = "published" THEN [fate EXCEPT ![f] = o]'
                " ELSE fate\n",
            ),
        ),
        "a leader whose fetch fails leaves the registry without telling its followers: they"
        " wait for a flight nobody will finish, until their own deadline, and fail with a"
        " misleading timeout instead of the leader's reason",
    ),
    SpecMutation(
        "FlightStaysRegistered",
        "MCOne.cfg",
        "FinishedFlightGone",
        (
            (
                "        newFlight == IF leads /\\ flight[rkey[r]] = f\n"
                "                        THEN [flight EXCEPT ![rkey[r]] = None] ELSE flight\n",
                "        newFlight == flight\n",
            ),
        ),
        "a finished flight stays in the registry: the next request to miss the key follows a"
        " fetch that already ended and is never told a result",
    ),
    SpecMutation(
        "PublishHandsFollowersNothing",
        "MCTwoReceivers.cfg",
        "FollowerGetsLeaderResult",
        (
            (
                "IF held # None /\\ (q = r \\/ (f # None /\\ rflight[q] = f))",
                "IF held # None /\\ q = r",
            ),
        ),
        "the leader publishes but its followers are handed nothing: they wait on a flight that"
        " succeeded, until their deadline",
    ),
    SpecMutation(
        "WatchMarksCurrent",
        "MCHandshake.cfg",
        "OnlyStaleMarked",
        (
            (
                "                      /\\ objEpoch[rgen[r]] < w}",
                "                      /\\ objEpoch[rgen[r]] <= w}",
            ),
        ),
        "the watch's fan-out also fails requests holding the registration it just delivered:"
        " requests on a live prefill fail for nothing",
    ),
    SpecMutation(
        "MarkOutlivesRequest",
        "MCHandshake.cfg",
        "MarkOfLiveRequest",
        (
            (
                "    /\\ marked' = marked \\ {r}\n"
                '    /\\ rstate\' = [rstate EXCEPT ![r] = "invalidated"]\n',
                "    /\\ marked' = marked\n"
                '    /\\ rstate\' = [rstate EXCEPT ![r] = "invalidated"]\n',
            ),
        ),
        "a failure mark survives its request's invalidation: the receiver's next request is"
        " failed by the mark of a request that already ended",
    ),
    SpecMutation(
        "ReleaseOnSilence",
        "MCKVRelease.cfg",
        "NoReleaseWhileWriterMayWrite",
        (
            (
                '    \\/ heard[kvAddr[r]][p] = "reset"\n',
                '    \\/ heard[kvAddr[r]][p] \\in {"reset", "silence"}\n',
            ),
        ),
        "a failed room's KV is freed when its ranks are only silent (stopped or cut off): a"
        " rank that resumes writes the old transfer into pages another request now uses",
    ),
    SpecMutation(
        "ReleaseOnOneRankGone",
        "MCKVReleaseTwoRanks.cfg",
        "NoReleaseWhileWriterMayWrite",
        (
            (
                "    /\\ \\A p \\in told[r] : ProvenGone(r, p)\n",
                "    /\\ \\E p \\in told[r] : ProvenGone(r, p)\n",
            ),
        ),
        "a failed room's KV is freed once one of its ranks is proven gone, while another rank"
        " told the same room is only silent and may still write it",
    ),
    SpecMutation(
        "HeartbeatDisconnectIsProof",
        "MCKVRelease.cfg",
        "NoReleaseWhileWriterMayWrite",
        (
            (
                '    /\\ proc[a][p] = "exited"\n    /\\ heard[a][p] # "reset"\n',
                '    /\\ proc[a][p] # "up"\n    /\\ heard[a][p] # "reset"\n',
            ),
        ),
        "a connection closed because its heartbeat expired (silence) is taken for a reset or"
        " refused one (an exited process): a stopped rank's room is freed and it resumes writing",
    ),
    SpecMutation(
        "NewRequestOnHeldRoom",
        "MCKVRelease.cfg",
        "HeldRoomNotReused",
        (('    /\\ kv[r] # "held"\n', ""),),
        "a failed room's pages go to the next request while a stopped or cut-off rank told them"
        " may still write the old transfer into them",
    ),
    SpecMutation(
        "AckOfUnsentAbort",
        "MCKVRelease.cfg",
        "ReleaseCountsOnlyAbortsSent",
        (("    /\\ r \\in notified\n    /\\ p \\in told[r]\n", "    /\\ p \\in told[r]\n"),),
        "an ABORT_ACK counts for an ABORT the decode never sent (a stale or forged ack): the"
        " room is freed while the rank, never told to stop, may still write it",
    ),
)

BY_NAME = {m.name: m for m in MUTATION_TABLE}
assert tuple(BY_NAME) == MUTATIONS, "spec.MUTATIONS and MUTATION_TABLE must list the same names"


class RewriteNotApplied(AssertionError):
    """A mutation's ``old`` text is not in the spec exactly once."""


def mutated_text(mutation: SpecMutation, text: str | None = None) -> str:
    """The spec text with the mutation's rewrites applied (each ``old`` exactly once)."""
    source = (TLA_DIR / SPEC_NAME).read_text(encoding="utf-8") if text is None else text
    for old, new in mutation.edits:
        count = source.count(old)
        if count != 1:
            raise RewriteNotApplied(f"{mutation.name}: {old!r} found {count} times, expected 1")
        source = source.replace(old, new)
    return source


def load_mutated(mutation: SpecMutation) -> Loaded:
    """The mutation's cfg with the mirror flagged by the mutation."""
    loaded = load(TLA_DIR / mutation.cfg)
    loaded.model = BootstrapCache(loaded.model.constants, mutation=mutation.name)
    return loaded


def write_mutated(mutation: SpecMutation, directory: Path) -> Path:
    """Write the mutated spec and its cfg into ``directory``; return the cfg's path."""
    (directory / SPEC_NAME).write_text(mutated_text(mutation), encoding="utf-8")
    cfg = directory / mutation.cfg
    cfg.write_text((TLA_DIR / mutation.cfg).read_text(encoding="utf-8"), encoding="utf-8")
    return cfg
