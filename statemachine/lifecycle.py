"""The receiver lifecycle: one ``transitions`` Machine, and the fast table derived from it.

The Machine built by :func:`build_machine` is the single definition of the lifecycle. Every
trigger is named after the TLA+ action it corresponds to (``TLA/BootstrapCache.tla``), so the
model, this file and ``spec/lifecycle.md`` share one vocabulary.

Building a Machine per receiver costs ~280 µs and ~45 KB, and a shared Machine slows down
linearly with attached models. So, once at import, :data:`TABLE` is derived from the Machine
through its public introspection (``machine.events`` and each event's transitions), and a
receiver is a ``__slots__`` object that steps through that table: one dict lookup per step.

``python -m statemachine table`` prints the table and the Mermaid diagram.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from transitions import Machine

from statemachine.completion import KVPoll
from statemachine.errors import InvalidTransition

# --- states ---------------------------------------------------------------------------------

IDLE = "idle"  # created; nothing looked up yet
FETCHING = "fetching"  # pool miss: asking the bootstrap server for every rank
FETCHED = "fetched"  # holds a fresh generation, not yet registered with its ranks
REGISTERED = "registered"  # KV args sent to every rank of the fresh generation
CACHED = "cached"  # holds the generation the pool holds (hit, won publish, or adopted)
# Under SGLang's ``prefill_complete`` allocation policy the decode first tells every target
# rank it is here (BOOTSTRAP) and may send metadata only after the prefill answers.
HANDSHAKING = "handshaking"  # BOOTSTRAP sent to every target rank; waiting for the prefill
READY = "ready"  # the prefill answered the handshake; metadata may be sent
WAITING = "waiting"  # metadata sent; waiting for the KV transfer
DONE = "done"  # transfer finished: the request succeeded
FAILED = "failed"  # something failed; its recorded entries are not yet dropped
INVALIDATED = "invalidated"  # its recorded entries were dropped from the pool, by identity
ABORTED = "aborted"  # its owner gave up; nothing was wrong with the prefill, nothing dropped

STATES: tuple[str, ...] = (
    IDLE,
    FETCHING,
    FETCHED,
    REGISTERED,
    CACHED,
    HANDSHAKING,
    READY,
    WAITING,
    DONE,
    FAILED,
    INVALIDATED,
    ABORTED,
)
INITIAL = IDLE
#: States a request ends in; ``NewRequest`` starts the next request from any of them.
FINAL_STATES: frozenset[str] = frozenset({DONE, INVALIDATED, ABORTED})
#: States from which the owner may still abort.
ACTIVE_STATES: tuple[str, ...] = (
    IDLE,
    FETCHING,
    FETCHED,
    REGISTERED,
    CACHED,
    HANDSHAKING,
    READY,
    WAITING,
)

# --- events (= TLA+ action names) ----------------------------------------------------------

HIT = "Hit"
MISS = "Miss"
FETCH_OK = "FetchOk"
FETCH_FAIL = "FetchFail"
REGISTER_OK = "RegisterOk"
REGISTER_FAIL = "RegisterFail"
PUBLISH = "Publish"
HANDSHAKE = "Handshake"
PREFILL_READY = "PrefillReady"
SEND_OK = "SendOk"
SEND_FAIL = "SendFail"
COMPLETE = "Complete"
TIMEOUT = "Timeout"
INVALIDATE = "Invalidate"
ABORT = "Abort"
PEER_LOST = "PeerLost"
NEW_REQUEST = "NewRequest"

#: The lifecycle as data: (trigger, source(s), dest). ``build_machine`` feeds it to
#: ``transitions``; nothing else reads it (everything else reads the Machine or TABLE).
_DEFINITION: tuple[tuple[str, str | tuple[str, ...], str], ...] = (
    (HIT, IDLE, CACHED),
    (MISS, IDLE, FETCHING),
    (FETCH_OK, FETCHING, FETCHED),
    # From IDLE too: resolving the prefill dp rank is a bootstrap query that can fail
    # before any key is known.
    (FETCH_FAIL, (IDLE, FETCHING), FAILED),
    (REGISTER_OK, FETCHED, REGISTERED),
    (REGISTER_FAIL, FETCHED, FAILED),
    (PUBLISH, REGISTERED, CACHED),
    (HANDSHAKE, CACHED, HANDSHAKING),
    (PREFILL_READY, HANDSHAKING, READY),
    (SEND_OK, (CACHED, READY), WAITING),
    # From IDLE too: send_metadata before a successful init fails the request (as SGLang does).
    (SEND_FAIL, (IDLE, CACHED, HANDSHAKING, READY), FAILED),
    (COMPLETE, WAITING, DONE),
    # The prefill may never answer a handshake, as it may never finish a transfer.
    (TIMEOUT, (HANDSHAKING, WAITING), FAILED),
    # The manager learned that a prefill rank or instance this request depends on is dead or
    # restarted (fan-out), or another rank of the room failed. Applied by the owner's thread.
    # From DONE too: SGLang's failure_exception() on a succeeded receiver fails it ("from
    # another rank"), so a decode worker that asks after a sibling rank failed sees Failed.
    (PEER_LOST, (IDLE, CACHED, HANDSHAKING, READY, WAITING, DONE), FAILED),
    (INVALIDATE, FAILED, INVALIDATED),
    # From DONE too: the owner may abort a request whose KV already arrived (the scheduler
    # aborts it before decoding); the prefill is told, and the room ends aborted.
    (ABORT, (*ACTIVE_STATES, DONE), ABORTED),
    (NEW_REQUEST, tuple(sorted(FINAL_STATES)), IDLE),
)
EVENTS: tuple[str, ...] = tuple(dict.fromkeys(trigger for trigger, _, _ in _DEFINITION))


def build_machine(machine_cls: type[Machine] = Machine, **kwargs: Any) -> Machine:
    """The lifecycle Machine, with no receiver attached (receivers step through TABLE).

    ``machine_cls`` and ``kwargs`` let the diagram code pass ``GraphMachine`` and a model.
    """
    kwargs.setdefault("model", None)
    return machine_cls(
        states=list(STATES),
        transitions=[
            {
                "trigger": trigger,
                "source": list(source) if isinstance(source, tuple) else source,
                "dest": dest,
            }
            for trigger, source, dest in _DEFINITION
        ],
        initial=INITIAL,
        auto_transitions=False,
        **kwargs,
    )


def derive_table(machine: Machine) -> dict[str, dict[str, str]]:
    """``{event: {source: dest}}`` read from a Machine through its public introspection.

    The receiver's step is a plain lookup, so the table must be deterministic: a guarded
    transition or two transitions for one (event, source) would need the Machine's run-time
    logic, and are rejected here rather than silently flattened.
    """
    table: dict[str, dict[str, str]] = {}
    for trigger, event in machine.events.items():
        row: dict[str, str] = {}
        for source, transitions in event.transitions.items():
            if len(transitions) != 1:
                raise ValueError(f"{trigger} from {source}: {len(transitions)} transitions")
            (transition,) = transitions
            if transition.conditions or transition.dest is None:
                raise ValueError(f"{trigger} from {source}: guarded or internal transition")
            row[source] = transition.dest
        table[trigger] = row
    return table


def _freeze(table: dict[str, dict[str, str]]) -> Mapping[str, Mapping[str, str]]:
    return MappingProxyType({event: MappingProxyType(row) for event, row in table.items()})


#: The one lifecycle definition, built once at import.
MACHINE: Machine = build_machine()
#: ``TABLE[event][source] -> dest``, derived from :data:`MACHINE`; read-only.
TABLE: Mapping[str, Mapping[str, str]] = _freeze(derive_table(MACHINE))


def next_state(state: str, event: str) -> str:
    """The state after ``event`` in ``state``; :class:`InvalidTransition` if not allowed."""
    try:
        return TABLE[event][state]
    except KeyError:
        raise InvalidTransition(state, event) from None


def allowed_events(state: str) -> tuple[str, ...]:
    """Events allowed in ``state``, in definition order."""
    return tuple(event for event in EVENTS if state in TABLE[event])


class Lifecycle:
    """One receiver's lifecycle position. Cheap: one slot, one dict lookup per step."""

    __slots__ = ("state",)

    def __init__(self, state: str = INITIAL) -> None:
        self.state = state

    def fire(self, event: str) -> str:
        """Take ``event``; return the new state. Raises :class:`InvalidTransition`."""
        try:
            self.state = dest = TABLE[event][self.state]
        except KeyError:
            raise InvalidTransition(self.state, event) from None
        return dest

    def __repr__(self) -> str:
        return f"Lifecycle({self.state!r})"


#: What ``poll()`` reports in each lifecycle state.
POLL_OF_STATE: Mapping[str, KVPoll] = MappingProxyType(
    {
        IDLE: KVPoll.Bootstrapping,
        FETCHING: KVPoll.Bootstrapping,
        FETCHED: KVPoll.Bootstrapping,
        REGISTERED: KVPoll.Bootstrapping,
        CACHED: KVPoll.WaitingForInput,
        HANDSHAKING: KVPoll.Bootstrapping,
        READY: KVPoll.WaitingForInput,
        WAITING: KVPoll.Transferring,
        DONE: KVPoll.Success,
        FAILED: KVPoll.Failed,
        INVALIDATED: KVPoll.Failed,
        ABORTED: KVPoll.Failed,
    }
)


#: What must come first, per public receiver method (and for send_metadata under the
#: prefill_complete handshake): the ``requires`` text of its InvalidTransition.
CALL_ORDER: dict[str, str] = {
    "init": "init() runs once, on a new receiver; create a new receiver for a new request",
    "send_metadata": "send_metadata() runs once, after init() returned WaitingForInput",
    "send_metadata after the handshake": (
        "under the prefill_complete policy, send_metadata() runs once poll() returned "
        "WaitingForInput (the prefill answered the BOOTSTRAP handshake)"
    ),
    "poll": (
        "call init() first: poll() reports a request's progress once init() ran (before it, "
        "nothing is in progress and nothing was sent)"
    ),
    "failure_exception": (
        "failure_exception() cannot run while init() is fetching on the owner's thread"
    ),
    "invalidate_cached_bootstrap_infos": (
        "only a failed receiver has generations to invalidate (it does so itself)"
    ),
}


def out_of_order(state: str, event: str, method: str, order: str = "") -> InvalidTransition:
    """The InvalidTransition of a receiver's ``method`` called in ``state``: ``event`` has no
    transition from it, and :data:`CALL_ORDER` says what must come first (``order`` names an
    entry other than the method's own)."""
    return InvalidTransition(state, event, method=method, requires=CALL_ORDER[order or method])


# --- documentation output -------------------------------------------------------------------


def mermaid() -> str:
    """The lifecycle as a Mermaid state diagram, drawn by transitions' GraphMachine."""
    from transitions.extensions import GraphMachine

    graph_machine = build_machine(
        GraphMachine,
        model=GraphMachine.self_literal,  # the graph needs a model; the machine itself will do
        graph_engine="mermaid",
        title="receiver lifecycle",
    )
    text: str = graph_machine.get_graph().draw(None)
    return text.rstrip() + "\n"


def table_markdown() -> str:
    """The lifecycle table as Markdown: event, source, next state."""
    rows = ["| event | from | to |", "|---|---|---|"]
    for event in EVENTS:
        for source, dest in TABLE[event].items():
            rows.append(f"| `{event}` | `{source}` | `{dest}` |")
    return "\n".join(rows) + "\n"
