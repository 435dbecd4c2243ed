"""The exact Python mirror of ``TLA/BootstrapCache.tla``.

Same variables, same actions (same names and parameters), same invariant and property names,
same canonical values, so that a breadth-first search over this mirror finds exactly the
distinct states TLC finds for the same ``.cfg``. Every action of the spec is deterministic once
its parameters are fixed, so an action is a function ``(state, params) -> successor | None``,
and an action formula such as ``Invalidate(r)`` holds for a step ``s -> t`` exactly when
``t`` is that function's result on ``s``. The action properties below are evaluated that way.

Encoding (the same values TLC holds):

* receivers are model values, kept in sorted order; ``rstate``, ``rkey``, ``rgen`` and
  ``acked`` are tuples indexed by that order (a TLA+ function with domain ``Receivers``);
* prefill ranks are model values, sorted; ``acked[i]`` is a tuple indexed by that order
  (the function ``acked[r]`` with domain ``Ranks``); ``notified`` and ``marked`` are
  frozensets of receiver names;
* addresses are port numbers, sorted; ``pool`` and ``epoch`` are indexed by that order;
* object ids are ``1 .. |Addrs| + |Receivers|``; ``objEpoch[o]`` is at index ``o - 1``;
  ``pooled`` is a frozenset of object ids;
* flight ids are ``1 .. |Addrs| + |Receivers|``; ``fate[f]`` is at index ``f - 1``; ``flight``
  is indexed by address, ``rflight`` by receiver;
* ``None`` is ``0`` for keys, objects and flights, as in the spec;
* KV release: ``kv``, ``told`` (frozensets of rank names), ``kvAddr`` and ``kvEpoch`` are indexed
  by receiver; ``proc`` and ``heard`` by address, then by rank (``proc[j][k]``).

A *spec mutation* (``statemachine.model.mutations``) is applied to the mirror by the
``mutation`` argument of :class:`BootstrapCache`, and to a temporary copy of the spec text for
TLC; both must then find the same states and violate the same property.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from statemachine.lifecycle import ACTIVE_STATES, FINAL_STATES, STATES

NONE = 0

#: The spec's variables, in the order of its ``vars`` tuple.
VARIABLES: tuple[str, ...] = (
    "rstate",
    "rkey",
    "rgen",
    "pool",
    "objEpoch",
    "epoch",
    "faults",
    "acked",
    "pooled",
    "watched",
    "marked",
    "notified",
    "flight",
    "rflight",
    "fate",
    "kv",
    "told",
    "kvAddr",
    "kvEpoch",
    "proc",
    "heard",
)

MODES: tuple[str, ...] = ("immediate", "queueing")
VARIANTS: tuple[str, ...] = (
    "Correct",
    "NoInvalidation",
    "InvalidateByKey",
    "PrefixNodeFailure",
    "RetireStaleObservation",
    "ReusedPortAcks",
    "RetireByKey",
)
DISCOVERIES: tuple[str, ...] = ("http", "etcd")

#: Receiver actions: exactly the lifecycle Machine's events, in the order of the spec's ``Next``.
RECEIVER_ACTIONS: tuple[str, ...] = (
    "Hit",
    "Miss",
    "FetchOk",
    "FetchFail",
    "RegisterOk",
    "RegisterFail",
    "Publish",
    "Handshake",
    "PrefillReady",
    "SendOk",
    "SendFail",
    "Complete",
    "Timeout",
    "PeerLost",
    "Invalidate",
    "Abort",
    "NewRequest",
)
#: Steps other threads take for a receiver (single-flight registry, ack listener): they take
#: a receiver parameter but change no lifecycle state and have no Machine event.
#: The KV-release steps for a receiver's room (the manager's, not the Machine's).
RELEASE_ACTIONS: tuple[str, ...] = ("ReleaseOnAbortAck", "ReleaseOnProvenGone", "ReleaseOnTimeout")
HELPER_ACTIONS: tuple[str, ...] = ("JoinFlight", "Ack", "LateAck", "AbortAck", *RELEASE_ACTIONS)
#: Actions that take a receiver and an address.
KEYED_ACTIONS: frozenset[str] = frozenset({"Hit", "Miss", "JoinFlight"})
#: Actions that take a receiver and a prefill rank.
RANKED_ACTIONS: frozenset[str] = frozenset({"Ack", "LateAck", "AbortAck"})
#: Environment actions on a rank process (an address and a prefill rank): KV release.
PROCESS_ACTIONS: tuple[str, ...] = (
    "RankStops",
    "RankResumes",
    "RankExits",
    "ResetSeen",
    "SilenceSeen",
)
#: Environment actions (first parameter: an address); they change no lifecycle state.
ENV_ACTIONS: tuple[str, ...] = (
    "Restart",
    "NodeFailure",
    "RetireInstance",
    "WatchEvent",
    *PROCESS_ACTIONS,
)
ACTIONS: tuple[str, ...] = RECEIVER_ACTIONS + HELPER_ACTIONS + ENV_ACTIONS
#: ``ReceiverStep(r)``: the receiver's weakly fair steps.
RECEIVER_STEP: frozenset[str] = (
    (frozenset(RECEIVER_ACTIONS) - {"Abort"}) | {"Ack"} | frozenset(RELEASE_ACTIONS)
)

INVARIANTS: tuple[str, ...] = (
    "TypeOK",
    "AdoptionCorrect",
    "FollowerGetsLeaderResult",
    "FinishedFlightGone",
    "MarkOfLiveRequest",
    "NoReleaseWhileWriterMayWrite",
)
ACTION_PROPERTIES: tuple[str, ...] = (
    "IdentitySafe",
    "ExactNodeFailure",
    "NoStaleSuccess",
    "NoStaleStart",
    "CompleteNeedsAllResponses",
    "FailedIsTerminal",
    "AbortNotified",
    "HandshakeBeforeSend",
    "OnlyStaleMarked",
    "HeldRoomNotReused",
    "ReleaseCountsOnlyAbortsSent",
)
LIVENESS_PROPERTIES: tuple[str, ...] = ("StaleEntryEvicted", "RequestsSucceed")
CONSTANTS: tuple[str, ...] = (
    "Receivers",
    "Addrs",
    "MaxRestarts",
    "MaxFaults",
    "Mode",
    "Discovery",
    "Variant",
    "Ranks",
    "Policy",
    "KVRelease",
)
POLICIES: tuple[str, ...] = ("early", "prefill_complete")
FLIGHT_STATES = frozenset({"fetching", "fetched", "registered"})
#: States in which a watch event marks a receiver holding an older object.
MARKABLE = frozenset({"idle", "fetched", "registered", "cached", "handshaking", "ready", "waiting"})
#: States ``PeerLost`` fails a receiver from (``done``: failure_exception() after success).
PEER_LOST_FROM = frozenset({"idle", "cached", "handshaking", "ready", "waiting", "done"})
#: ``Initialized``: the request holds its target ranks; an abort from here tells them.
INITIALIZED = frozenset({"cached", "handshaking", "ready", "waiting", "done"})
#: States that hold a published generation (``AdoptionCorrect``).
HOLDING = frozenset({"cached", "handshaking", "ready", "waiting"})
#: ``FlightFates``: what a flight id's ``fate`` can be ("free": no flight uses the id).
FLIGHT_FATES = frozenset({"free", "open", "published", "failed"})
#: ``KVStates``, ``ProcStates``, ``Evidence``: the values of ``kv``, ``proc`` and ``heard``.
KV_STATES = frozenset({"none", "held", "released", "expired"})
PROC_STATES = frozenset({"up", "silent", "exited"})
EVIDENCE = frozenset({"none", "silence", "reset"})
#: ``RoomEnded(r)``: the request ended without success; its room waits for a release.
ROOM_ENDED = frozenset({"failed", "invalidated", "aborted"})

#: Spec mutations the mirror reproduces (see ``statemachine.model.mutations``).
MUTATIONS: tuple[str, ...] = (
    "PublishOverwrites",
    "LoserKeepsOwn",
    "InvalidateByKey",
    "TimeoutKeepsEntry",
    "RetireStaleObservation",
    "CompleteWithoutAck",
    "AckWithoutLiveness",
    "PrefixNodeFailure",
    "HeartbeatFalsePositive",
    "NoFairness",
    "UnboundedFaults",
    "WeakFairLookups",
    "NoWatermark",
    "NoFanOutMark",
    "FirstResponseCompletes",
    "LateAckCompletes",
    "AbortBeforeSendSilent",
    "TimeoutSilent",
    "SendWithoutHandshake",
    "LeaderFailureUntold",
    "FlightStaysRegistered",
    "PublishHandsFollowersNothing",
    "WatchMarksCurrent",
    "MarkOutlivesRequest",
    "ReleaseOnSilence",
    "ReleaseOnOneRankGone",
    "HeartbeatDisconnectIsProof",
    "NewRequestOnHeldRoom",
    "AckOfUnsentAbort",
)


class State(NamedTuple):
    """One state: the value of every spec variable (field names are the TLA+ names)."""

    rstate: tuple[str, ...]
    rkey: tuple[int, ...]
    rgen: tuple[int, ...]
    pool: tuple[int, ...]
    objEpoch: tuple[int, ...]
    epoch: tuple[int, ...]
    faults: int
    acked: tuple[tuple[int, ...], ...]
    pooled: frozenset[int]
    watched: tuple[int, ...]
    marked: frozenset[str]
    notified: frozenset[str]
    flight: tuple[int, ...]
    rflight: tuple[int, ...]
    fate: tuple[str, ...]
    kv: tuple[str, ...]
    told: tuple[frozenset[str], ...]
    kvAddr: tuple[int, ...]
    kvEpoch: tuple[int, ...]
    proc: tuple[tuple[str, ...], ...]
    heard: tuple[tuple[str, ...], ...]


class Step(NamedTuple):
    """An action with its parameters, e.g. ``Hit(r1, 80)``."""

    action: str
    params: tuple[str | int, ...]

    def __str__(self) -> str:
        return f"{self.action}({', '.join(str(p) for p in self.params)})"


@dataclass(frozen=True)
class Constants:
    """Values of the spec's CONSTANTS (as a .cfg gives them)."""

    receivers: tuple[str, ...]
    addrs: tuple[int, ...]
    max_restarts: int
    max_faults: int
    mode: str
    variant: str
    discovery: str = "http"
    ranks: tuple[str, ...] = ("p1",)
    policy: str = "early"
    kv_release: bool = False

    def __post_init__(self) -> None:
        # The spec's ASSUME, checked the same way.
        if not self.receivers or list(self.receivers) != sorted(set(self.receivers)):
            raise ValueError("Receivers must be a non-empty set (kept sorted)")
        if not self.addrs or list(self.addrs) != sorted(set(self.addrs)):
            raise ValueError("Addrs must be a non-empty set (kept sorted)")
        if any(a <= 0 for a in self.addrs):
            raise ValueError("Addrs must be port numbers > 0")
        if self.max_restarts < 0 or self.max_faults < 0:
            raise ValueError("MaxRestarts and MaxFaults must be naturals")
        if self.mode not in MODES:
            raise ValueError(f"Mode must be one of {MODES}")
        if self.variant not in VARIANTS:
            raise ValueError(f"Variant must be one of {VARIANTS}")
        if self.discovery not in DISCOVERIES:
            raise ValueError(f"Discovery must be one of {DISCOVERIES}")
        if not self.ranks or list(self.ranks) != sorted(set(self.ranks)):
            raise ValueError("Ranks must be a non-empty set (kept sorted)")
        if self.policy not in POLICIES:
            raise ValueError(f"Policy must be one of {POLICIES}")


def _put(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    return (*values[:index], value, *values[index + 1 :])


def _put_state(values: tuple[str, ...], index: int, value: str) -> tuple[str, ...]:
    return (*values[:index], value, *values[index + 1 :])


def _put_acks(
    values: tuple[tuple[int, ...], ...], index: int, value: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    return (*values[:index], value, *values[index + 1 :])


def _put_ranks(
    values: tuple[frozenset[str], ...], index: int, value: frozenset[str]
) -> tuple[frozenset[str], ...]:
    return (*values[:index], value, *values[index + 1 :])


def _put_rank_state(
    values: tuple[tuple[str, ...], ...], j: int, k: int, value: str
) -> tuple[tuple[str, ...], ...]:
    """``[f EXCEPT ![a][p] = value]`` for a function of addresses to functions of ranks."""
    return (*values[:j], _put_state(values[j], k, value), *values[j + 1 :])


def digit_prefix(p: int, n: int) -> bool:
    """``DigitPrefix(p, n)``: "host:p" is a string prefix of "host:n"."""
    return any(n // 10**k == p for k in range(10))


#: A step predicate: does the step ``s -> t`` satisfy the property's action formula?
StepPredicate = Callable[[State, State], bool]
StatePredicate = Callable[[State], bool]


class LivenessCase(NamedTuple):
    """One instance ``P ~> Q`` of a ``\\A x : P(x) ~> Q(x)`` property."""

    label: str
    premise: StatePredicate
    conclusion: StatePredicate


class Fairness(NamedTuple):
    """``WF_vars(A)`` or ``SF_vars(A)``; ``covers(step)`` says whether a step is an A-step."""

    kind: str  # "WF" or "SF"
    name: str
    covers: Callable[[Step], bool]


def _receiver_step_of(r: str) -> Callable[[Step], bool]:
    """Is a step a ``ReceiverStep(r)`` step?"""

    def covers(step: Step) -> bool:
        return step.action in RECEIVER_STEP and step.params[0] == r

    return covers


def _lookup_of(a: int) -> Callable[[Step], bool]:
    """Is a step a ``Lookup(a)`` step (``Hit(r, a)`` or ``Miss(r, a)`` for some ``r``)?"""

    def covers(step: Step) -> bool:
        return step.action in ("Hit", "Miss") and step.params[1] == a

    return covers


class BootstrapCache:
    """The mirror for one set of constants (and, optionally, one spec mutation)."""

    def __init__(self, constants: Constants, mutation: str | None = None) -> None:
        if mutation is not None and mutation not in MUTATIONS:
            raise ValueError(f"unknown mutation {mutation!r}")
        self.constants = c = constants
        self.mutation = mutation
        self.receivers = c.receivers
        self.addrs = c.addrs
        self.addr_index = {a: j for j, a in enumerate(c.addrs)}
        self.n_objects = len(c.addrs) + len(c.receivers)
        self.object_ids = range(1, self.n_objects + 1)
        self.flight_ids = range(1, len(c.addrs) + len(c.receivers) + 1)
        self.queueing = c.mode == "queueing"
        self.variant = c.variant
        self.etcd = c.discovery == "etcd"
        self.ranks = c.ranks
        self.no_acks = (0,) * len(c.ranks)
        self.handshake_policy = c.policy == "prefill_complete"
        self.kv_release = c.kv_release
        self.all_ranks = frozenset(c.ranks)
        self.fresh_procs = ("up",) * len(c.ranks)  # FreshProcs
        self.nothing_heard = ("none",) * len(c.ranks)  # NothingHeard
        self._receiver_table: dict[str, Callable[[State, int], State | None]] = {
            "FetchOk": self.fetch_ok,
            "FetchFail": self.fetch_fail,
            "RegisterOk": self.register_ok,
            "RegisterFail": self.register_fail,
            "Publish": self.publish,
            "Handshake": self.handshake,
            "PrefillReady": self.prefill_ready,
            "SendOk": self.send_ok,
            "SendFail": self.send_fail,
            "Complete": self.complete,
            "Timeout": self.timeout,
            "PeerLost": self.peer_lost,
            "Invalidate": self.invalidate,
            "Abort": self.abort,
            "NewRequest": self.new_request,
            "ReleaseOnAbortAck": self.release_on_abort_ack,
            "ReleaseOnProvenGone": self.release_on_proven_gone,
            "ReleaseOnTimeout": self.release_on_timeout,
        }
        self._unkeyed = tuple((name, self._receiver_table[name]) for name in RECEIVER_ACTIONS[2:])
        self._releases = tuple((name, self._receiver_table[name]) for name in RELEASE_ACTIONS)
        self._ranked: dict[str, Callable[[State, int, int], State | None]] = {
            "Ack": self.ack,
            "LateAck": self.late_ack,
            "AbortAck": self.abort_ack,
        }
        self._process: dict[str, Callable[[State, int, int], State | None]] = {
            "RankStops": self.rank_stops,
            "RankResumes": self.rank_resumes,
            "RankExits": self.rank_exits,
            "ResetSeen": self.reset_seen,
            "SilenceSeen": self.silence_seen,
        }
        prefix = c.variant == "PrefixNodeFailure" or mutation == "PrefixNodeFailure"
        self._drops = tuple(
            tuple((digit_prefix(a, b) if prefix else a == b) for b in c.addrs) for a in c.addrs
        )
        self._retire_stale = (
            c.variant == "RetireStaleObservation" or mutation == "RetireStaleObservation"
        )

    # --- helpers (the spec's operators) -----------------------------------------------------

    def referenced(self, pool: tuple[int, ...], rgen: tuple[int, ...]) -> set[int]:
        return {o for o in pool if o != NONE} | {o for o in rgen if o != NONE}

    def collect(
        self, pool: tuple[int, ...], rgen: tuple[int, ...], obj_epoch: tuple[int, ...]
    ) -> tuple[int, ...]:
        ref = self.referenced(pool, rgen)
        collected = tuple(obj_epoch[o - 1] if o in ref else 0 for o in self.object_ids)
        # Keep the old tuple when nothing changed (equal values; saves memory).
        return obj_epoch if collected == obj_epoch else collected

    def keep_pooled(
        self, pooled: frozenset[int], pool: tuple[int, ...], rgen: tuple[int, ...]
    ) -> frozenset[int]:
        kept = pooled & self.referenced(pool, rgen)
        return pooled if kept == pooled else frozenset(kept)

    def free_id(self, s: State) -> int:
        ref = self.referenced(s.pool, s.rgen)
        return min(o for o in self.object_ids if o not in ref)

    def live(self, s: State, i: int) -> bool:
        return s.objEpoch[s.rgen[i] - 1] == s.epoch[self.addr_index[s.rkey[i]]]

    def failure(self, s: State, genuine: bool) -> int | None:
        """``Failure(genuine)``: the new ``faults``, or None when the budget forbids it."""
        if genuine or self.mutation == "UnboundedFaults":
            return s.faults
        if s.faults < self.constants.max_faults:
            return s.faults + 1
        return None

    def stale(self, s: State, j: int) -> bool:
        o = s.pool[j]
        return o != NONE and s.objEpoch[o - 1] < s.epoch[j]

    def live_entry(self, s: State, j: int) -> bool:
        o = s.pool[j]
        return o != NONE and s.objEpoch[o - 1] == s.epoch[j]

    def led(self, s: State, f: int) -> bool:
        """``Led(f)``: f's leader is still fetching, registering or publishing it."""
        return any(
            g == f and st in FLIGHT_STATES for g, st in zip(s.rflight, s.rstate, strict=True)
        )

    @staticmethod
    def follows(s: State, i: int) -> bool:
        return s.rstate[i] == "idle" and s.rflight[i] != NONE

    def flight_failed(self, s: State, i: int) -> bool:
        return self.follows(s, i) and s.fate[s.rflight[i] - 1] == "failed"

    @staticmethod
    def flight_refs(flight: tuple[int, ...], rflight: tuple[int, ...]) -> set[int]:
        return {f for f in flight if f != NONE} | {f for f in rflight if f != NONE}

    def collect_flights(
        self, flight: tuple[int, ...], rflight: tuple[int, ...], fate: tuple[str, ...]
    ) -> tuple[str, ...]:
        ref = self.flight_refs(flight, rflight)
        collected = tuple(fate[f - 1] if f in ref else "free" for f in self.flight_ids)
        return fate if collected == fate else collected

    def free_flight(self, s: State) -> int:
        ref = self.flight_refs(s.flight, s.rflight)
        return min(f for f in self.flight_ids if f not in ref)

    def unflight(self, s: State, i: int, outcome: str, t: State) -> State:
        """``t`` with the ``flight``, ``rflight`` and ``fate`` of ``Unflight(r, o)`` from ``s``."""
        f = s.rflight[i]
        if f == NONE:
            return t
        leads = s.rstate[i] in FLIGHT_STATES
        flight = s.flight
        fate = s.fate
        if leads:
            j = self.addr_index[s.rkey[i]]
            if self.mutation != "FlightStaysRegistered" and flight[j] == f:
                flight = _put(flight, j, NONE)
            if self.mutation != "LeaderFailureUntold" or outcome == "published":
                fate = _put_state(fate, f - 1, outcome)
        rflight = _put(s.rflight, i, NONE)
        return t._replace(
            flight=flight, rflight=rflight, fate=self.collect_flights(flight, rflight, fate)
        )

    def fail_early(self, s: State, i: int, faults: int) -> State:
        """``FailEarly(r)`` with the new ``faults``."""
        rgen = _put(s.rgen, i, NONE)
        return self.unflight(
            s,
            i,
            "failed",
            s._replace(
                faults=faults,
                rkey=_put(s.rkey, i, NONE),
                rgen=rgen,
                objEpoch=self.collect(s.pool, rgen, s.objEpoch),
                pooled=self.keep_pooled(s.pooled, s.pool, rgen),
                marked=self.unmark(s.marked, i),
                rstate=_put_state(s.rstate, i, "failed"),
            ),
        )

    def unmark(self, marked: frozenset[str], i: int) -> frozenset[str]:
        r = self.receivers[i]
        return marked - {r} if r in marked else marked

    # --- KV release (the spec's operators) ----------------------------------------------------

    def writer_alive(self, s: State, i: int, k: int) -> bool:
        """``WriterAlive(r, p)``: the process of rank ``k`` told ``i``'s room still runs."""
        j = self.addr_index[s.kvAddr[i]]
        return s.kvEpoch[i] == s.epoch[j] and s.proc[j][k] != "exited"

    def proven_gone(self, s: State, i: int, k: int) -> bool:
        """``ProvenGone(r, p)``: a newer instance at the address, or a reset/refused connection."""
        j = self.addr_index[s.kvAddr[i]]
        proof = ("reset", "silence") if self.mutation == "ReleaseOnSilence" else ("reset",)
        return s.kvEpoch[i] < s.epoch[j] or s.heard[j][k] in proof

    def rank_down(self, s: State, i: int) -> bool:
        """``RankDown(r)``: a rank of the live process ``i`` holds does not answer."""
        if s.rgen[i] == NONE or not self.live(s, i):
            return False
        return any(x != "up" for x in s.proc[self.addr_index[s.rkey[i]]])

    def rank_reset(self, s: State, i: int) -> bool:
        """``RankReset(r)``: a rank of the live process ``i`` holds was reset or refused."""
        if s.rgen[i] == NONE or not self.live(s, i):
            return False
        return any(x == "reset" for x in s.heard[self.addr_index[s.rkey[i]]])

    def clear_room(self, s: State, i: int, t: State) -> State:
        """``t`` with ``ClearRoom(r)``: the room of receiver ``i`` forgotten."""
        if s.kv[i] == "none" and not s.told[i] and s.kvAddr[i] == NONE and s.kvEpoch[i] == 0:
            return t
        return t._replace(
            kv=_put_state(s.kv, i, "none"),
            told=_put_ranks(s.told, i, frozenset()),
            kvAddr=_put(s.kvAddr, i, NONE),
            kvEpoch=_put(s.kvEpoch, i, 0),
        )

    def _untold(self, s: State, i: int, k: int) -> tuple[frozenset[str], ...]:
        p = self.ranks[k]
        return s.told if p not in s.told[i] else _put_ranks(s.told, i, s.told[i] - {p})

    # --- Init ---------------------------------------------------------------------------------

    def init_states(self) -> list[State]:
        nr, na = len(self.receivers), len(self.addrs)
        return [
            State(
                rstate=("idle",) * nr,
                rkey=(NONE,) * nr,
                rgen=(NONE,) * nr,
                pool=(NONE,) * na,
                objEpoch=(0,) * self.n_objects,
                epoch=(0,) * na,
                faults=0,
                acked=(self.no_acks,) * nr,
                pooled=frozenset(),
                watched=(0,) * na,
                marked=frozenset(),
                notified=frozenset(),
                flight=(NONE,) * na,
                rflight=(NONE,) * nr,
                fate=("free",) * len(self.flight_ids),
                kv=("none",) * nr,
                told=(frozenset(),) * nr,
                kvAddr=(NONE,) * nr,
                kvEpoch=(0,) * nr,
                proc=(self.fresh_procs,) * na,
                heard=(self.nothing_heard,) * na,
            )
        ]

    # --- receiver actions (i: receiver index, j: address index) ----------------------------

    def hit(self, s: State, i: int, j: int) -> State | None:
        if s.rstate[i] != "idle":
            return None
        a = self.addrs[j]
        if s.rkey[i] == NONE:
            if s.pool[j] == NONE:
                return None
            rgen = _put(s.rgen, i, s.pool[j])
        else:
            if s.rkey[i] != a or s.rgen[i] == NONE:
                return None
            rgen = s.rgen
        return self.unflight(
            s,
            i,
            "published",
            s._replace(
                rstate=_put_state(s.rstate, i, "cached"),
                rkey=_put(s.rkey, i, a),
                rgen=rgen,
            ),
        )

    def miss(self, s: State, i: int, j: int) -> State | None:
        if s.rstate[i] != "idle" or s.rkey[i] != NONE or s.pool[j] != NONE:
            return None
        o = self.free_id(s)
        t = s._replace(
            rgen=_put(s.rgen, i, o),
            objEpoch=_put(s.objEpoch, o - 1, s.epoch[j]),
            rstate=_put_state(s.rstate, i, "fetching"),
            rkey=_put(s.rkey, i, self.addrs[j]),
        )
        if s.flight[j] != NONE:
            return t  # a fetch the registry does not see: it leads no flight
        f = self.free_flight(s)
        return t._replace(
            flight=_put(s.flight, j, f),
            rflight=_put(s.rflight, i, f),
            fate=_put_state(s.fate, f - 1, "open"),
        )

    def fetch_ok(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "fetching":
            return None
        return s._replace(
            objEpoch=_put(s.objEpoch, s.rgen[i] - 1, s.epoch[self.addr_index[s.rkey[i]]]),
            rstate=_put_state(s.rstate, i, "fetched"),
        )

    def fetch_fail(self, s: State, i: int) -> State | None:
        state = s.rstate[i]
        if state == "idle":
            genuine = self.flight_failed(s, i)
        elif state == "fetching":
            genuine = not self.live(s, i)  # objEpoch < epoch: epochs only grow
        else:
            return None
        faults = self.failure(s, genuine)
        if faults is None:
            return None
        return self.fail_early(s, i, faults)

    def register_ok(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "fetched" or not (self.queueing or self.live(s, i)):
            return None
        return s._replace(rstate=_put_state(s.rstate, i, "registered"))

    def register_fail(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "fetched":
            return None
        faults = self.failure(s, not self.queueing and not self.live(s, i))
        if faults is None:
            return None
        return self.unflight(
            s,
            i,
            "failed",
            s._replace(
                faults=faults,
                rstate=_put_state(s.rstate, i, "failed"),
            ),
        )

    def publish(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "registered":
            return None
        a = s.rkey[i]
        k = self.addr_index[a]
        own = s.rgen[i]
        watermark = self.mutation == "NoWatermark" or s.objEpoch[own - 1] >= s.watched[k]
        fresh = own if watermark else NONE
        if self.mutation == "PublishOverwrites":
            held = own
        else:
            held = fresh if s.pool[k] == NONE else s.pool[k]
        keep_own = self.mutation == "LoserKeepsOwn"
        f = s.rflight[i]
        hand = f != NONE and self.mutation != "PublishHandsFollowersNothing"
        pool = _put(s.pool, k, held)
        rgen = tuple(
            held
            if held != NONE
            and ((q == i and not keep_own) or (q != i and hand and s.rflight[q] == f))
            else g
            for q, g in enumerate(s.rgen)
        )
        published = s.pooled | {held} if held != NONE else s.pooled
        return self.unflight(
            s,
            i,
            "published" if held != NONE else "failed",
            s._replace(
                pool=pool,
                rgen=rgen,
                objEpoch=self.collect(pool, rgen, s.objEpoch),
                pooled=self.keep_pooled(published, pool, rgen),
                rstate=_put_state(s.rstate, i, "cached"),
            ),
        )

    def handshake(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "cached" or not self.handshake_policy:
            return None
        if self.receivers[i] in s.marked or not (self.queueing or self.live(s, i)):
            return None
        return s._replace(rstate=_put_state(s.rstate, i, "handshaking"))

    def prefill_ready(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "handshaking" or not self.live(s, i):
            return None
        return s._replace(rstate=_put_state(s.rstate, i, "ready"))

    def send_ok(self, s: State, i: int) -> State | None:
        state = s.rstate[i]
        if state == "cached":
            if self.handshake_policy and self.mutation != "SendWithoutHandshake":
                return None
        elif state != "ready":
            return None
        if self.receivers[i] in s.marked or not (self.queueing or self.live(s, i)):
            return None
        t = s._replace(rstate=_put_state(s.rstate, i, "waiting"))
        if not self.kv_release:
            return t
        return t._replace(
            kv=_put_state(s.kv, i, "held"),
            told=_put_ranks(s.told, i, self.all_ranks),
            kvAddr=_put(s.kvAddr, i, s.rkey[i]),
            kvEpoch=_put(s.kvEpoch, i, s.objEpoch[s.rgen[i] - 1]),
        )

    def send_fail(self, s: State, i: int) -> State | None:
        state = s.rstate[i]
        if state == "idle" and s.rkey[i] == NONE:
            faults = self.failure(s, False)
            return None if faults is None else self.fail_early(s, i, faults)
        if state not in ("cached", "handshaking", "ready"):
            return None
        faults = self.failure(s, not self.queueing and not self.live(s, i))
        if faults is None:
            return None
        return s._replace(faults=faults, rstate=_put_state(s.rstate, i, "failed"))

    def complete(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "waiting":
            return None
        if self.mutation == "FirstResponseCompletes":
            enough = any(s.acked[i])
        else:
            enough = self.mutation == "CompleteWithoutAck" or all(s.acked[i])
        if not enough:
            return None
        return self.clear_room(s, i, self._end_request(s, i, "done"))

    def _end_request(self, s: State, i: int, state: str) -> State:
        """Receiver ``i`` ends in ``state``: it lets go of its key, generation, acks and mark."""
        rgen = _put(s.rgen, i, NONE)
        return s._replace(
            rkey=_put(s.rkey, i, NONE),
            rgen=rgen,
            objEpoch=self.collect(s.pool, rgen, s.objEpoch),
            pooled=self.keep_pooled(s.pooled, s.pool, rgen),
            acked=self._no_acks_for(s.acked, i),
            marked=self.unmark(s.marked, i),
            rstate=_put_state(s.rstate, i, state),
        )

    def timeout(self, s: State, i: int) -> State | None:
        state = s.rstate[i]
        if not (state == "handshaking" or (state == "waiting" and not all(s.acked[i]))):
            return None
        faults = self.failure(s, not self.live(s, i) or self.rank_down(s, i))
        if faults is None:
            return None
        notified = s.notified
        if self.mutation != "TimeoutSilent":
            notified = notified | {self.receivers[i]}
        acked = self._no_acks_for(s.acked, i)
        if self.mutation == "TimeoutKeepsEntry":
            return self.fail_early(s, i, faults)._replace(notified=notified, acked=acked)
        return s._replace(
            faults=faults,
            notified=notified,
            acked=acked,
            rstate=_put_state(s.rstate, i, "failed"),
        )

    def peer_lost(self, s: State, i: int) -> State | None:
        state = s.rstate[i]
        if state not in PEER_LOST_FROM:
            return None
        genuine = (
            self.receivers[i] in s.marked
            or (s.rgen[i] != NONE and not self.live(s, i))
            or self.rank_reset(s, i)
        )
        faults = self.failure(s, genuine)
        if faults is None:
            return None
        if state == "idle":
            return self.fail_early(s, i, faults)
        return s._replace(
            faults=faults,
            rstate=_put_state(s.rstate, i, "failed"),
            acked=self._no_acks_for(s.acked, i),
        )

    def invalidate(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "failed":
            return None
        g = s.rgen[i]
        variant = self.variant
        if variant == "NoInvalidation":
            drop = False
        elif variant == "InvalidateByKey" or self.mutation == "InvalidateByKey":
            drop = g != NONE
        else:
            drop = g != NONE and s.pool[self.addr_index[s.rkey[i]]] == g
        pool = _put(s.pool, self.addr_index[s.rkey[i]], NONE) if drop else s.pool
        rgen = _put(s.rgen, i, NONE)
        return s._replace(
            pool=pool,
            rkey=_put(s.rkey, i, NONE),
            rgen=rgen,
            objEpoch=self.collect(pool, rgen, s.objEpoch),
            pooled=self.keep_pooled(s.pooled, pool, rgen),
            marked=s.marked if self.mutation == "MarkOutlivesRequest" else self.unmark(s.marked, i),
            rstate=_put_state(s.rstate, i, "invalidated"),
        )

    def abort(self, s: State, i: int) -> State | None:
        state = s.rstate[i]
        if state not in ACTIVE_STATES and state != "done":
            return None
        faults = self.failure(s, False)
        if faults is None:
            return None
        tells = (
            state == "waiting" if self.mutation == "AbortBeforeSendSilent" else state in INITIALIZED
        )
        told = s._replace(
            faults=faults, notified=s.notified | {self.receivers[i]} if tells else s.notified
        )
        return self.unflight(s, i, "failed", self._end_request(told, i, "aborted"))

    def new_request(self, s: State, i: int) -> State | None:
        if s.rstate[i] not in FINAL_STATES:
            return None
        if s.kv[i] == "held" and self.mutation != "NewRequestOnHeldRoom":
            return None
        r = self.receivers[i]
        notified = s.notified - {r} if r in s.notified else s.notified
        return self.clear_room(
            s, i, s._replace(rstate=_put_state(s.rstate, i, "idle"), notified=notified)
        )

    # --- steps of other threads for a receiver -----------------------------------------------

    def join_flight(self, s: State, i: int, j: int) -> State | None:
        f = s.flight[j]
        if s.rstate[i] != "idle" or s.rkey[i] != NONE or s.pool[j] != NONE or f == NONE:
            return None
        return s._replace(rkey=_put(s.rkey, i, self.addrs[j]), rflight=_put(s.rflight, i, f))

    def ack(self, s: State, i: int, k: int) -> State | None:
        """``Ack(r, p)`` for receiver index ``i`` and rank index ``k``."""
        if s.rstate[i] != "waiting":
            return None
        reused = self.variant == "ReusedPortAcks" and self.queueing
        if not (self.live(s, i) or reused or self.mutation == "AckWithoutLiveness"):
            return None
        j = self.addr_index[s.rkey[i]]
        if s.proc[j][k] != "up":
            return None  # a stopped, cut-off or exited rank sends nothing
        told = self._untold(s, i, k)  # rank p finished writing r's room
        if s.acked[i][k] != 0:
            # a repeated report from rank p: the first one is kept
            return s if told is s.told else s._replace(told=told)
        epoch = s.epoch[j]
        return s._replace(acked=_put_acks(s.acked, i, _put(s.acked[i], k, epoch + 1)), told=told)

    def late_ack(self, s: State, i: int, k: int) -> State | None:
        """``LateAck(r, p)``: a report for a failed request changes nothing."""
        if s.rstate[i] != "failed" or s.rgen[i] == NONE or not self.live(s, i):
            return None
        if self.mutation == "LateAckCompletes":
            return s._replace(rstate=_put_state(s.rstate, i, "done"))
        return s

    def abort_ack(self, s: State, i: int, k: int) -> State | None:
        """``AbortAck(r, p)``: rank ``k``'s process acknowledges ``i``'s ABORT."""
        if s.kv[i] != "held":
            return None
        if self.receivers[i] not in s.notified and self.mutation != "AckOfUnsentAbort":
            return None
        if self.ranks[k] not in s.told[i]:
            return None
        j = self.addr_index[s.kvAddr[i]]
        if s.kvEpoch[i] != s.epoch[j] or s.proc[j][k] != "up":
            return None
        return s._replace(told=self._untold(s, i, k))

    # --- the KV-release steps for a receiver's room -------------------------------------------

    def _release(self, s: State, i: int, how: str) -> State | None:
        if s.kv[i] != "held" or s.rstate[i] not in ROOM_ENDED:
            return None
        return s._replace(kv=_put_state(s.kv, i, how))

    def release_on_abort_ack(self, s: State, i: int) -> State | None:
        if s.told[i]:
            return None
        return self._release(s, i, "released")

    def release_on_proven_gone(self, s: State, i: int) -> State | None:
        if s.kv[i] != "held" or not s.told[i]:
            return None
        ranks = [self.ranks.index(p) for p in s.told[i]]
        one = self.mutation == "ReleaseOnOneRankGone"
        proven = (any if one else all)(self.proven_gone(s, i, k) for k in ranks)
        return self._release(s, i, "released") if proven else None

    def release_on_timeout(self, s: State, i: int) -> State | None:
        return self._release(s, i, "expired")

    def _no_acks_for(
        self, acked: tuple[tuple[int, ...], ...], i: int
    ) -> tuple[tuple[int, ...], ...]:
        return acked if acked[i] == self.no_acks else _put_acks(acked, i, self.no_acks)

    # --- environment actions (j: address index) ---------------------------------------------

    def restart(self, s: State, j: int) -> State | None:
        if s.epoch[j] >= self.constants.max_restarts:
            return None
        return self._fresh_processes(s._replace(epoch=_put(s.epoch, j, s.epoch[j] + 1)), j)

    def _fresh_processes(self, t: State, j: int) -> State:
        """``t`` with the processes at address ``j`` new (a restart): up, nothing heard."""
        if t.proc[j] == self.fresh_procs and t.heard[j] == self.nothing_heard:
            return t
        return t._replace(
            proc=(*t.proc[:j], self.fresh_procs, *t.proc[j + 1 :]),
            heard=(*t.heard[:j], self.nothing_heard, *t.heard[j + 1 :]),
        )

    def node_failure(self, s: State, j: int) -> State | None:
        if self.mutation == "HeartbeatFalsePositive":
            epoch = s.epoch
        elif s.epoch[j] >= self.constants.max_restarts:
            return None
        else:
            epoch = _put(s.epoch, j, s.epoch[j] + 1)
        drops = self._drops[j]
        pool = tuple(NONE if drops[b] else o for b, o in enumerate(s.pool))
        t = s._replace(
            epoch=epoch,
            pool=pool,
            objEpoch=self.collect(pool, s.rgen, s.objEpoch),
            pooled=self.keep_pooled(s.pooled, pool, s.rgen),
        )
        return self._fresh_processes(t, j)

    def retire_instance(self, s: State, j: int, e: int) -> State | None:
        o = s.pool[j]
        if e > s.epoch[j] or o == NONE:
            return None
        held = s.objEpoch[o - 1]
        if not (held != e if self._retire_stale else held < e):
            return None
        pool = _put(s.pool, j, NONE)
        return s._replace(
            pool=pool,
            objEpoch=self.collect(pool, s.rgen, s.objEpoch),
            pooled=self.keep_pooled(s.pooled, pool, s.rgen),
        )

    def watch_event(self, s: State, j: int) -> State | None:
        if not self.etcd or s.watched[j] >= s.epoch[j]:
            return None
        w = s.watched[j] + 1
        o = s.pool[j]
        drop = o != NONE and (self.variant == "RetireByKey" or s.objEpoch[o - 1] < w)
        pool = _put(s.pool, j, NONE) if drop else s.pool
        a = self.addrs[j]
        marked = s.marked
        if self.mutation != "NoFanOutMark":
            # WatchMarksCurrent: holders of the revision just delivered are marked too.
            newer = w + 1 if self.mutation == "WatchMarksCurrent" else w
            marked = marked | {
                r
                for i, r in enumerate(self.receivers)
                if s.rkey[i] == a
                and s.rgen[i] != NONE
                and s.rstate[i] in MARKABLE
                and s.objEpoch[s.rgen[i] - 1] < newer
            }
        return s._replace(
            watched=_put(s.watched, j, w),
            pool=pool,
            objEpoch=self.collect(pool, s.rgen, s.objEpoch),
            pooled=self.keep_pooled(s.pooled, pool, s.rgen),
            marked=marked if marked != s.marked else s.marked,
        )

    # --- rank processes and the decode's evidence (j: address index, k: rank index) ---------

    def rank_stops(self, s: State, j: int, k: int) -> State | None:
        if not self.kv_release or s.proc[j][k] != "up":
            return None
        return s._replace(proc=_put_rank_state(s.proc, j, k, "silent"))

    def rank_resumes(self, s: State, j: int, k: int) -> State | None:
        if s.proc[j][k] != "silent":
            return None
        return s._replace(proc=_put_rank_state(s.proc, j, k, "up"))

    def rank_exits(self, s: State, j: int, k: int) -> State | None:
        if not self.kv_release or s.proc[j][k] not in ("up", "silent"):
            return None
        return s._replace(proc=_put_rank_state(s.proc, j, k, "exited"))

    def reset_seen(self, s: State, j: int, k: int) -> State | None:
        # HeartbeatDisconnectIsProof: a heartbeat's expiry reported as a disconnect.
        if self.mutation == "HeartbeatDisconnectIsProof":
            gone = s.proc[j][k] != "up"
        else:
            gone = s.proc[j][k] == "exited"
        if not gone or s.heard[j][k] == "reset":
            return None
        return s._replace(heard=_put_rank_state(s.heard, j, k, "reset"))

    def silence_seen(self, s: State, j: int, k: int) -> State | None:
        if s.proc[j][k] == "up" or s.heard[j][k] != "none":
            return None
        return s._replace(heard=_put_rank_state(s.heard, j, k, "silence"))

    # --- Next -----------------------------------------------------------------------------

    def apply(self, s: State, step: Step) -> State | None:
        """The successor of ``s`` by ``step``, or None when the step is not enabled.

        Raises ``ValueError`` for an unknown action or parameters outside the constants.
        """
        try:
            if step.action in KEYED_ACTIONS:
                r, a = step.params
                i, j = self.receivers.index(str(r)), self.addr_index[int(a)]
                keyed = {"Hit": self.hit, "Miss": self.miss, "JoinFlight": self.join_flight}
                return keyed[step.action](s, i, j)
            if step.action in RANKED_ACTIONS:
                r, p = step.params
                i, k = self.receivers.index(str(r)), self.ranks.index(str(p))
                return self._ranked[step.action](s, i, k)
            if step.action in self._receiver_table:
                (r,) = step.params
                return self._receiver_table[step.action](s, self.receivers.index(str(r)))
            if step.action in ("Restart", "NodeFailure", "WatchEvent"):
                (a,) = step.params
                j = self.addr_index[int(a)]
                env = {
                    "Restart": self.restart,
                    "NodeFailure": self.node_failure,
                    "WatchEvent": self.watch_event,
                }
                return env[step.action](s, j)
            if step.action in self._process:
                a, p = step.params
                j, k = self.addr_index[int(a)], self.ranks.index(str(p))
                return self._process[step.action](s, j, k)
            if step.action == "RetireInstance":
                a, e = step.params
                e = int(e)
                if not 0 <= e <= self.constants.max_restarts:
                    raise ValueError(e)
                return self.retire_instance(s, self.addr_index[int(a)], e)
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"bad parameters for {step}") from exc
        raise ValueError(f"unknown action {step.action!r}")

    def successors(self, s: State) -> Iterator[tuple[Step, State]]:
        """Every enabled step of ``Next`` from ``s`` with its successor (stuttering included)."""
        addrs = tuple(enumerate(self.addrs))
        for i, r in enumerate(self.receivers):
            for j, a in addrs:
                t = self.hit(s, i, j)
                if t is not None:
                    yield Step("Hit", (r, a)), t
            for j, a in addrs:
                t = self.miss(s, i, j)
                if t is not None:
                    yield Step("Miss", (r, a)), t
            for name, action in self._unkeyed:
                t = action(s, i)
                if t is not None:
                    yield Step(name, (r,)), t
            for j, a in addrs:
                t = self.join_flight(s, i, j)
                if t is not None:
                    yield Step("JoinFlight", (r, a)), t
            for name, ranked in self._ranked.items():
                for k, p in enumerate(self.ranks):
                    t = ranked(s, i, k)
                    if t is not None:
                        yield Step(name, (r, p)), t
            for name, action in self._releases:
                t = action(s, i)
                if t is not None:
                    yield Step(name, (r,)), t
        for j, a in addrs:
            t = self.restart(s, j)
            if t is not None:
                yield Step("Restart", (a,)), t
            t = self.node_failure(s, j)
            if t is not None:
                yield Step("NodeFailure", (a,)), t
            for e in range(self.constants.max_restarts + 1):
                t = self.retire_instance(s, j, e)
                if t is not None:
                    yield Step("RetireInstance", (a, e)), t
            t = self.watch_event(s, j)
            if t is not None:
                yield Step("WatchEvent", (a,)), t
            for name, process in self._process.items():
                for k, p in enumerate(self.ranks):
                    t = process(s, j, k)
                    if t is not None:
                        yield Step(name, (a, p)), t

    # --- invariants and properties ---------------------------------------------------------

    def type_ok(self, s: State) -> bool:
        c = self.constants
        keys = set(self.addrs) | {NONE}
        objects = set(self.object_ids) | {NONE}
        return (
            len(s.rstate) == len(self.receivers)
            and all(x in STATES for x in s.rstate)
            and all(k in keys for k in s.rkey)
            and all(o in objects for o in s.rgen)
            and all(o in objects for o in s.pool)
            and all(0 <= e <= c.max_restarts for e in s.objEpoch)
            and all(0 <= e <= c.max_restarts for e in s.epoch)
            and 0 <= s.faults <= c.max_faults
            and len(s.acked) == len(self.receivers)
            and all(
                len(row) == len(self.ranks) and all(0 <= x <= c.max_restarts + 1 for x in row)
                for row in s.acked
            )
            and s.pooled <= set(self.object_ids)
            and all(0 <= w <= c.max_restarts for w in s.watched)
            and s.marked <= set(self.receivers)
            and s.notified <= set(self.receivers)
            and len(s.flight) == len(self.addrs)
            and all(f == NONE or f in self.flight_ids for f in s.flight)
            and len(s.rflight) == len(self.receivers)
            and all(f == NONE or f in self.flight_ids for f in s.rflight)
            and len(s.fate) == len(self.flight_ids)
            and all(x in FLIGHT_FATES for x in s.fate)
            and len(s.kv) == len(self.receivers)
            and all(x in KV_STATES for x in s.kv)
            and len(s.told) == len(self.receivers)
            and all(told <= self.all_ranks for told in s.told)
            and all(k in keys for k in s.kvAddr)
            and all(0 <= e <= c.max_restarts for e in s.kvEpoch)
            and len(s.proc) == len(self.addrs)
            and all(len(row) == len(self.ranks) and set(row) <= PROC_STATES for row in s.proc)
            and len(s.heard) == len(self.addrs)
            and all(len(row) == len(self.ranks) and set(row) <= EVIDENCE for row in s.heard)
        )

    def adoption_correct(self, s: State) -> bool:
        return all(
            st not in HOLDING or g in s.pooled or r in s.marked
            for r, st, g in zip(self.receivers, s.rstate, s.rgen, strict=True)
        )

    def follower_gets_leader_result(self, s: State) -> bool:
        for q in range(len(self.receivers)):
            if not self.follows(s, q):
                continue
            f = s.rflight[q]
            fate, g = s.fate[f - 1], s.rgen[q]
            if fate == "open":
                ok = self.led(s, f) and g == NONE
            elif fate == "published":
                ok = g in s.pooled
            else:
                ok = fate == "failed" and g == NONE
            if not ok:
                return False
        return True

    def finished_flight_gone(self, s: State) -> bool:
        for j, f in enumerate(s.flight):
            if f == NONE:
                continue
            if s.fate[f - 1] != "open":
                return False
            a = self.addrs[j]
            if not any(
                s.rflight[i] == f and s.rstate[i] in FLIGHT_STATES and s.rkey[i] == a
                for i in range(len(self.receivers))
            ):
                return False
        return True

    def no_release_while_writer_may_write(self, s: State) -> bool:
        for i, kv in enumerate(s.kv):
            if kv != "released":
                continue
            if any(self.writer_alive(s, i, self.ranks.index(p)) for p in s.told[i]):
                return False
        return True

    def mark_of_live_request(self, s: State) -> bool:
        return all(
            s.rstate[i] not in FINAL_STATES and s.rgen[i] != NONE
            for i, r in enumerate(self.receivers)
            if r in s.marked
        )

    def only_stale_marked(self, s: State, t: State) -> bool:
        if t.marked == s.marked:
            return True
        for i, r in enumerate(self.receivers):
            if r in t.marked and r not in s.marked and (s.rgen[i] == NONE or self.live(s, i)):
                return False
        return True

    def identity_safe(self, s: State, t: State) -> bool:
        if t.rstate == s.rstate:
            return True
        for j in range(len(self.addrs)):
            if self.live_entry(s, j) and t.pool[j] != s.pool[j]:
                explained = any(
                    s.rgen[i] == s.pool[j]
                    and s.rstate[i] == "failed"
                    and t.rstate[i] == "invalidated"
                    for i in range(len(self.receivers))
                )
                if not explained:
                    return False
        return True

    def exact_node_failure(self, s: State, t: State) -> bool:
        if t.rstate != s.rstate:
            return True
        for j, o in enumerate(s.pool):
            if o != NONE and t.pool[j] != o and not s.objEpoch[o - 1] < t.epoch[j]:
                return False
        return True

    def _completes(self, s: State, t: State, i: int) -> bool:
        """Is ``s -> t`` a ``Complete(r)`` step for receiver index ``i``?"""
        return t.rstate[i] == "done" and s.rstate[i] == "waiting" and t == self.complete(s, i)

    def no_stale_success(self, s: State, t: State) -> bool:
        for i in range(len(self.receivers)):
            if self._completes(s, t, i):
                right = s.objEpoch[s.rgen[i] - 1] + 1
                if any(x not in (0, right) for x in s.acked[i]):
                    return False
        return True

    def complete_needs_all_responses(self, s: State, t: State) -> bool:
        return all(all(s.acked[i]) for i in range(len(self.receivers)) if self._completes(s, t, i))

    def failed_is_terminal(self, s: State, t: State) -> bool:
        return all(
            b != "failed" or a in ("failed", "invalidated")
            for b, a in zip(s.rstate, t.rstate, strict=True)
        )

    def abort_notified(self, s: State, t: State) -> bool:
        for i, r in enumerate(self.receivers):
            before, after = s.rstate[i], t.rstate[i]
            aborts = before in INITIALIZED and after == "aborted"
            times_out = (
                before in ("handshaking", "waiting")
                and after == "failed"
                and t == self.timeout(s, i)
            )
            if (aborts or times_out) and r not in t.notified:
                return False
        return True

    def handshake_before_send(self, s: State, t: State) -> bool:
        if not self.handshake_policy:
            return True
        return all(
            b == "waiting" or a != "waiting" or b == "ready"
            for b, a in zip(s.rstate, t.rstate, strict=True)
        )

    def no_stale_start(self, s: State, t: State) -> bool:
        for i in range(len(self.receivers)):
            if s.rstate[i] in ("cached", "ready") and t.rstate[i] == "waiting":
                j = self.addr_index[s.rkey[i]]
                if s.objEpoch[s.rgen[i] - 1] < s.watched[j]:
                    return False
        return True

    def held_room_not_reused(self, s: State, t: State) -> bool:
        return all(
            kv != "held" or before == "idle" or after != "idle"
            for before, after, kv in zip(s.rstate, t.rstate, s.kv, strict=True)
        )

    def release_counts_only_aborts_sent(self, s: State, t: State) -> bool:
        for i, r in enumerate(self.receivers):
            if t.kv[i] == "none" or r in s.notified:
                continue
            if any(t.acked[i][self.ranks.index(p)] == 0 for p in s.told[i] - t.told[i]):
                return False
        return True

    def invariant(self, name: str) -> StatePredicate:
        table: dict[str, StatePredicate] = {
            "TypeOK": self.type_ok,
            "AdoptionCorrect": self.adoption_correct,
            "FollowerGetsLeaderResult": self.follower_gets_leader_result,
            "FinishedFlightGone": self.finished_flight_gone,
            "MarkOfLiveRequest": self.mark_of_live_request,
            "NoReleaseWhileWriterMayWrite": self.no_release_while_writer_may_write,
        }
        return table[name]

    def action_property(self, name: str) -> StepPredicate:
        table: dict[str, StepPredicate] = {
            "IdentitySafe": self.identity_safe,
            "ExactNodeFailure": self.exact_node_failure,
            "NoStaleSuccess": self.no_stale_success,
            "NoStaleStart": self.no_stale_start,
            "CompleteNeedsAllResponses": self.complete_needs_all_responses,
            "FailedIsTerminal": self.failed_is_terminal,
            "AbortNotified": self.abort_notified,
            "HandshakeBeforeSend": self.handshake_before_send,
            "OnlyStaleMarked": self.only_stale_marked,
            "HeldRoomNotReused": self.held_room_not_reused,
            "ReleaseCountsOnlyAbortsSent": self.release_counts_only_aborts_sent,
        }
        return table[name]

    def liveness(self, name: str) -> list[LivenessCase]:
        """The instances of a ``\\A x : P ~> Q`` property, one per ``x``."""
        if name == "StaleEntryEvicted":
            return [
                LivenessCase(
                    f"Stale({a}) ~> ~Stale({a})", self._stale_at(j, True), self._stale_at(j, False)
                )
                for j, a in enumerate(self.addrs)
            ]
        if name == "RequestsSucceed":
            return [
                LivenessCase(
                    f'rstate[{r}] = "idle" ~> rstate[{r}] = "done"',
                    self._in_state(i, "idle"),
                    self._in_state(i, "done"),
                )
                for i, r in enumerate(self.receivers)
            ]
        raise KeyError(name)

    def _stale_at(self, j: int, stale: bool) -> StatePredicate:
        def predicate(s: State) -> bool:
            return self.stale(s, j) == stale

        return predicate

    @staticmethod
    def _in_state(i: int, lifecycle_state: str) -> StatePredicate:
        def predicate(s: State) -> bool:
            return s.rstate[i] == lifecycle_state

        return predicate

    def fairness(self) -> list[Fairness]:
        """``Fairness`` of the spec: WF per receiver's steps, SF per key's lookups."""
        if self.mutation == "NoFairness":
            return []
        conditions = [
            Fairness("WF", f"ReceiverStep({r})", _receiver_step_of(r)) for r in self.receivers
        ]
        lookup = "WF" if self.mutation == "WeakFairLookups" else "SF"
        conditions += [Fairness(lookup, f"Lookup({a})", _lookup_of(a)) for a in self.addrs]
        return conditions

    # --- printing ---------------------------------------------------------------------------

    def _domain(self, var: str) -> tuple[str | int, ...]:
        if var in ("rstate", "rkey", "rgen", "acked", "rflight", "kv", "told", "kvAddr", "kvEpoch"):
            return self.receivers
        if var in ("pool", "epoch", "watched", "flight", "proc", "heard"):
            return self.addrs
        if var == "fate":
            return tuple(self.flight_ids)
        return tuple(self.object_ids)

    def _show(self, var: str, value: object) -> str:
        if var == "rstate":
            return str(value)
        if var in ("proc", "heard") and isinstance(value, tuple):
            return (
                "(" + ", ".join(f"{p}: {x}" for p, x in zip(self.ranks, value, strict=True)) + ")"
            )
        if var in ("rkey", "rgen", "pool", "flight", "rflight", "kvAddr") and value == NONE:
            return "None"
        if isinstance(value, frozenset):
            return "{" + ", ".join(sorted(str(v) for v in value)) + "}"
        return str(value)

    def format_state(self, s: State) -> str:
        lines = []
        for var in VARIABLES:
            value = getattr(s, var)
            if isinstance(value, frozenset):
                lines.append(f"  {var} = {{{', '.join(str(o) for o in sorted(value))}}}")
                continue
            if isinstance(value, int):
                lines.append(f"  {var} = {value}")
                continue
            items = ", ".join(
                f"{d}: {self._show(var, v)}" for d, v in zip(self._domain(var), value, strict=True)
            )
            lines.append(f"  {var} = ({items})")
        return "\n".join(lines)

    def format_changes(self, s: State, t: State) -> str:
        lines = []
        for var in VARIABLES:
            before, after = getattr(s, var), getattr(t, var)
            if before == after:
                continue
            if isinstance(before, frozenset) and isinstance(after, frozenset):
                shown = ", ".join(str(o) for o in sorted(after))
                lines.append(f"  {var} = {{{shown}}}")
                continue
            if isinstance(before, int) and isinstance(after, int):
                lines.append(f"  {var}: {before} -> {after}")
                continue
            for d, b, a in zip(self._domain(var), before, after, strict=True):
                if b != a:
                    lines.append(f"  {var}[{d}]: {self._show(var, b)} -> {self._show(var, a)}")
        return "\n".join(lines) if lines else "  (nothing changed: stuttering)"
