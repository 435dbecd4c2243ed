"""The exact Python mirror of ``TLA/BootstrapCache.tla``.

Same variables, same actions (same names and parameters), same invariant and property names,
same canonical values, so that a breadth-first search over this mirror finds exactly the
distinct states TLC finds for the same ``.cfg``. Every action of the spec is deterministic once
its parameters are fixed, so an action is a function ``(state, params) -> successor | None``,
and an action formula such as ``Invalidate(r)`` holds for a step ``s -> t`` exactly when
``t`` is that function's result on ``s``. The action properties below are evaluated that way.

Encoding (the same values TLC holds):

* receivers are model values, kept in sorted order; ``rstate``, ``rkey`` and ``rgen`` are
  tuples indexed by that order (a TLA+ function with domain ``Receivers``);
* addresses are port numbers, sorted; ``pool`` and ``epoch`` are indexed by that order;
* object ids are ``1 .. |Addrs| + |Receivers|``; ``objEpoch[o]`` is at index ``o - 1``;
* ``None`` is ``0`` for keys and objects, as in the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from statemachine.lifecycle import ACTIVE_STATES, FINAL_STATES, STATES

NONE = 0

#: The spec's variables, in the order of its ``vars`` tuple.
VARIABLES: tuple[str, ...] = ("rstate", "rkey", "rgen", "pool", "objEpoch", "epoch", "faults")

MODES: tuple[str, ...] = ("immediate", "queueing")
VARIANTS: tuple[str, ...] = ("Correct", "NoInvalidation", "InvalidateByKey", "PrefixNodeFailure")

#: Receiver actions, with their parameters, in the order of the spec's ``Next``.
RECEIVER_ACTIONS: tuple[str, ...] = (
    "Hit",
    "Miss",
    "FetchOk",
    "FetchFail",
    "RegisterOk",
    "RegisterFail",
    "Publish",
    "SendOk",
    "SendFail",
    "Complete",
    "Timeout",
    "Invalidate",
    "Abort",
    "NewRequest",
)
#: Receiver actions that also take an address.
KEYED_ACTIONS: frozenset[str] = frozenset({"Hit", "Miss"})
#: Environment actions (parameter: an address); they change no receiver's lifecycle state.
ENV_ACTIONS: tuple[str, ...] = ("Restart", "NodeFailure", "RetireInstance")
ACTIONS: tuple[str, ...] = RECEIVER_ACTIONS + ENV_ACTIONS
#: ``ReceiverStep(r)``: the receiver's weakly fair steps (all but Abort).
RECEIVER_STEP: frozenset[str] = frozenset(RECEIVER_ACTIONS) - {"Abort"}

INVARIANTS: tuple[str, ...] = ("TypeOK",)
ACTION_PROPERTIES: tuple[str, ...] = (
    "IdentitySafe",
    "AdoptionCorrect",
    "NoStaleSuccess",
    "ExactNodeFailure",
)
LIVENESS_PROPERTIES: tuple[str, ...] = ("StaleEntryEvicted", "RequestsSucceed")
CONSTANTS: tuple[str, ...] = (
    "Receivers",
    "Addrs",
    "MaxRestarts",
    "MaxFaults",
    "Mode",
    "Variant",
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


def _put(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    return (*values[:index], value, *values[index + 1 :])


def _put_state(values: tuple[str, ...], index: int, value: str) -> tuple[str, ...]:
    return (*values[:index], value, *values[index + 1 :])


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
        return step.action in KEYED_ACTIONS and step.params[1] == a

    return covers


class BootstrapCache:
    """The mirror for one set of constants."""

    def __init__(self, constants: Constants) -> None:
        self.constants = c = constants
        self.receivers = c.receivers
        self.addrs = c.addrs
        self.addr_index = {a: j for j, a in enumerate(c.addrs)}
        self.n_objects = len(c.addrs) + len(c.receivers)
        self.object_ids = range(1, self.n_objects + 1)
        self.queueing = c.mode == "queueing"
        self._receiver_table: dict[str, Callable[[State, int], State | None]] = {
            "FetchOk": self.fetch_ok,
            "FetchFail": self.fetch_fail,
            "RegisterOk": self.register_ok,
            "RegisterFail": self.register_fail,
            "Publish": self.publish,
            "SendOk": self.send_ok,
            "SendFail": self.send_fail,
            "Complete": self.complete,
            "Timeout": self.timeout,
            "Invalidate": self.invalidate,
            "Abort": self.abort,
            "NewRequest": self.new_request,
        }
        self._unkeyed = tuple((name, self._receiver_table[name]) for name in RECEIVER_ACTIONS[2:])
        self._env_table: dict[str, Callable[[State, int], State | None]] = {
            "Restart": self.restart,
            "NodeFailure": self.node_failure,
            "RetireInstance": self.retire_instance,
        }
        self._drops = tuple(
            tuple(
                (digit_prefix(a, b) if c.variant == "PrefixNodeFailure" else a == b)
                for b in c.addrs
            )
            for a in c.addrs
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

    def free_id(self, s: State) -> int:
        ref = self.referenced(s.pool, s.rgen)
        return min(o for o in self.object_ids if o not in ref)

    def live(self, s: State, i: int) -> bool:
        return s.objEpoch[s.rgen[i] - 1] == s.epoch[self.addr_index[s.rkey[i]]]

    def failure(self, s: State, genuine: bool) -> int | None:
        """``Failure(genuine)``: the new ``faults``, or None when the budget forbids it."""
        if genuine:
            return s.faults
        if s.faults < self.constants.max_faults:
            return s.faults + 1
        return None

    def stale(self, s: State, j: int) -> bool:
        o = s.pool[j]
        return o != NONE and s.objEpoch[o - 1] < s.epoch[j]

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
            )
        ]

    # --- receiver actions (i: receiver index, j: address index) ----------------------------

    def hit(self, s: State, i: int, j: int) -> State | None:
        if s.rstate[i] != "idle" or s.pool[j] == NONE:
            return None
        return s._replace(
            rstate=_put_state(s.rstate, i, "cached"),
            rkey=_put(s.rkey, i, self.addrs[j]),
            rgen=_put(s.rgen, i, s.pool[j]),
        )

    def miss(self, s: State, i: int, j: int) -> State | None:
        if s.rstate[i] != "idle" or s.pool[j] != NONE:
            return None
        return s._replace(
            rstate=_put_state(s.rstate, i, "fetching"), rkey=_put(s.rkey, i, self.addrs[j])
        )

    def fetch_ok(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "fetching":
            return None
        o = self.free_id(s)
        return s._replace(
            rgen=_put(s.rgen, i, o),
            objEpoch=_put(s.objEpoch, o - 1, s.epoch[self.addr_index[s.rkey[i]]]),
            rstate=_put_state(s.rstate, i, "fetched"),
        )

    def fetch_fail(self, s: State, i: int) -> State | None:
        if s.rstate[i] not in ("idle", "fetching"):
            return None
        faults = self.failure(s, False)
        if faults is None:
            return None
        return s._replace(
            faults=faults, rstate=_put_state(s.rstate, i, "failed"), rkey=_put(s.rkey, i, NONE)
        )

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
        return s._replace(faults=faults, rstate=_put_state(s.rstate, i, "failed"))

    def publish(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "registered":
            return None
        k = self.addr_index[s.rkey[i]]
        held = s.rgen[i] if s.pool[k] == NONE else s.pool[k]
        pool = _put(s.pool, k, held)
        rgen = _put(s.rgen, i, held)
        return s._replace(
            pool=pool,
            rgen=rgen,
            objEpoch=self.collect(pool, rgen, s.objEpoch),
            rstate=_put_state(s.rstate, i, "cached"),
        )

    def send_ok(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "cached" or not (self.queueing or self.live(s, i)):
            return None
        return s._replace(rstate=_put_state(s.rstate, i, "waiting"))

    def send_fail(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "cached":
            return None
        faults = self.failure(s, not self.queueing and not self.live(s, i))
        if faults is None:
            return None
        return s._replace(faults=faults, rstate=_put_state(s.rstate, i, "failed"))

    def complete(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "waiting" or not self.live(s, i):
            return None
        rgen = _put(s.rgen, i, NONE)
        return s._replace(
            rkey=_put(s.rkey, i, NONE),
            rgen=rgen,
            objEpoch=self.collect(s.pool, rgen, s.objEpoch),
            rstate=_put_state(s.rstate, i, "done"),
        )

    def timeout(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "waiting":
            return None
        faults = self.failure(s, not self.live(s, i))
        if faults is None:
            return None
        return s._replace(faults=faults, rstate=_put_state(s.rstate, i, "failed"))

    def invalidate(self, s: State, i: int) -> State | None:
        if s.rstate[i] != "failed":
            return None
        g = s.rgen[i]
        variant = self.constants.variant
        if variant == "NoInvalidation":
            drop = False
        elif variant == "InvalidateByKey":
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
            rstate=_put_state(s.rstate, i, "invalidated"),
        )

    def abort(self, s: State, i: int) -> State | None:
        if s.rstate[i] not in ACTIVE_STATES:
            return None
        faults = self.failure(s, False)
        if faults is None:
            return None
        rgen = _put(s.rgen, i, NONE)
        return s._replace(
            faults=faults,
            rkey=_put(s.rkey, i, NONE),
            rgen=rgen,
            objEpoch=self.collect(s.pool, rgen, s.objEpoch),
            rstate=_put_state(s.rstate, i, "aborted"),
        )

    def new_request(self, s: State, i: int) -> State | None:
        if s.rstate[i] not in FINAL_STATES:
            return None
        return s._replace(rstate=_put_state(s.rstate, i, "idle"))

    # --- environment actions (j: address index) ---------------------------------------------

    def restart(self, s: State, j: int) -> State | None:
        if s.epoch[j] >= self.constants.max_restarts:
            return None
        return s._replace(epoch=_put(s.epoch, j, s.epoch[j] + 1))

    def node_failure(self, s: State, j: int) -> State | None:
        drops = self._drops[j]
        pool = tuple(NONE if drops[b] else o for b, o in enumerate(s.pool))
        if pool == s.pool:
            return s  # nothing to drop: a stuttering step
        return s._replace(pool=pool, objEpoch=self.collect(pool, s.rgen, s.objEpoch))

    def retire_instance(self, s: State, j: int) -> State | None:
        if not self.stale(s, j):
            return None
        pool = _put(s.pool, j, NONE)
        return s._replace(pool=pool, objEpoch=self.collect(pool, s.rgen, s.objEpoch))

    # --- Next -----------------------------------------------------------------------------

    def _receiver_action(self, name: str) -> Callable[[State, int], State | None]:
        return self._receiver_table[name]

    def _env_action(self, name: str) -> Callable[[State, int], State | None]:
        return self._env_table[name]

    def apply(self, s: State, step: Step) -> State | None:
        """The successor of ``s`` by ``step``, or None when the step is not enabled.

        Raises ``ValueError`` for an unknown action or parameters outside the constants.
        """
        try:
            if step.action in KEYED_ACTIONS:
                r, a = step.params
                i, j = self.receivers.index(str(r)), self.addr_index[int(a)]
                return self.hit(s, i, j) if step.action == "Hit" else self.miss(s, i, j)
            if step.action in RECEIVER_ACTIONS:
                (r,) = step.params
                return self._receiver_action(step.action)(s, self.receivers.index(str(r)))
            if step.action in ENV_ACTIONS:
                (a,) = step.params
                return self._env_action(step.action)(s, self.addr_index[int(a)])
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"bad parameters for {step}") from exc
        raise ValueError(f"unknown action {step.action!r}")

    def successors(self, s: State) -> Iterator[tuple[Step, State]]:
        """Every enabled step of ``Next`` from ``s`` with its successor (stuttering included)."""
        for i, r in enumerate(self.receivers):
            for j, a in enumerate(self.addrs):
                t = self.hit(s, i, j)
                if t is not None:
                    yield Step("Hit", (r, a)), t
            for j, a in enumerate(self.addrs):
                t = self.miss(s, i, j)
                if t is not None:
                    yield Step("Miss", (r, a)), t
            for name, action in self._unkeyed:
                t = action(s, i)
                if t is not None:
                    yield Step(name, (r,)), t
        for j, a in enumerate(self.addrs):
            for name in ENV_ACTIONS:
                t = self._env_action(name)(s, j)
                if t is not None:
                    yield Step(name, (a,)), t

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
        )

    def identity_safe(self, s: State, t: State) -> bool:
        for i in range(len(self.receivers)):
            # Cheap necessary condition of Invalidate(r) before evaluating it exactly.
            if t.rstate[i] == "invalidated" and t == self.invalidate(s, i):
                for j, a in enumerate(self.addrs):
                    if t.pool[j] != s.pool[j] and not (a == s.rkey[i] and s.pool[j] == s.rgen[i]):
                        return False
        return True

    def adoption_correct(self, s: State, t: State) -> bool:
        for i in range(len(self.receivers)):
            if t.rstate[i] != "cached" or s.rstate[i] not in ("idle", "registered"):
                continue  # neither Hit(r, a) nor Publish(r) can be this step
            adopted = t == self.publish(s, i) or any(
                t == self.hit(s, i, j) for j in range(len(self.addrs))
            )
            if adopted and t.rgen[i] != t.pool[self.addr_index[t.rkey[i]]]:
                return False
        return True

    def no_stale_success(self, s: State, t: State) -> bool:
        for i in range(len(self.receivers)):
            if t.rstate[i] == "done" and t == self.complete(s, i) and not self.live(s, i):
                return False
        return True

    def exact_node_failure(self, s: State, t: State) -> bool:
        if t.rstate != s.rstate or t.rgen != s.rgen or t.epoch != s.epoch:
            return True  # NodeFailure(a), RetireInstance(a) change none of these
        for j in range(len(self.addrs)):
            removal = t == self.node_failure(s, j) or t == self.retire_instance(s, j)
            if removal and any(t.pool[b] != s.pool[b] for b in range(len(self.addrs)) if b != j):
                return False
        return True

    def invariant(self, name: str) -> StatePredicate:
        if name == "TypeOK":
            return self.type_ok
        raise KeyError(name)

    def action_property(self, name: str) -> StepPredicate:
        table: dict[str, StepPredicate] = {
            "IdentitySafe": self.identity_safe,
            "AdoptionCorrect": self.adoption_correct,
            "NoStaleSuccess": self.no_stale_success,
            "ExactNodeFailure": self.exact_node_failure,
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
        conditions = [
            Fairness("WF", f"ReceiverStep({r})", _receiver_step_of(r)) for r in self.receivers
        ]
        conditions += [Fairness("SF", f"Lookup({a})", _lookup_of(a)) for a in self.addrs]
        return conditions

    # --- printing ---------------------------------------------------------------------------

    def _domain(self, var: str) -> tuple[str | int, ...]:
        if var in ("rstate", "rkey", "rgen"):
            return self.receivers
        if var in ("pool", "epoch"):
            return self.addrs
        return tuple(self.object_ids)

    @staticmethod
    def _show(var: str, value: str | int) -> str:
        if var == "rstate":
            return str(value)
        if var in ("rkey", "rgen", "pool") and value == NONE:
            return "None"
        return str(value)

    def format_state(self, s: State) -> str:
        lines = []
        for var in VARIABLES:
            value = getattr(s, var)
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
            if isinstance(before, int) and isinstance(after, int):
                lines.append(f"  {var}: {before} -> {after}")
                continue
            for d, b, a in zip(self._domain(var), before, after, strict=True):
                if b != a:
                    lines.append(f"  {var}[{d}]: {self._show(var, b)} -> {self._show(var, a)}")
        return "\n".join(lines) if lines else "  (nothing changed: stuttering)"
