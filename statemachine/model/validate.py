"""Trace validation: replay an implementation's NDJSON trace against the model's rules.

``statemachine.trace`` records what the implementation does: one event per receiver lifecycle
step (``{"action": <event>, "receiver": <id>, "entries": [[key, token], ...], "state": ...}``;
``"key"``/``"generation"`` for a single entry is accepted too) and one per pool operation
(``PoolPublish``, ``PoolInvalidate``, ``PoolInvalidateAddress``, ``PoolRetireInstance``).
:func:`validate` replays it against the model's semantics, projected to what the
implementation can observe, and reports the first event the model does not allow:

* every receiver step is an allowed lifecycle transition from that receiver's previous state
  (a receiver first seen starts in ``idle``), reaching the state the event reports;
* ``PoolPublish`` follows ``setdefault``: the held generation is the fresh one when the key was
  empty, else the one already pooled (POOL-2);
* ``PoolInvalidate`` removes exactly the recorded generations that are still pooled, by identity
  (POOL-3, ``IdentitySafe``): removing more means a replacement was deleted;
* ``PoolInvalidateAddress`` removes exactly the entries of that address (POOL-5,
  ``ExactNodeFailure``); ``PoolRetireInstance`` removes entries of that address only (POOL-6);
* a receiver reaching ``cached`` by ``Hit`` or ``Publish`` holds generations that were published
  under those keys (``AdoptionCorrect``); ``FetchOk`` generations are new objects;
* an ``Invalidate`` step is preceded by a ``PoolInvalidate`` of exactly that receiver's recorded
  entries; ``Abort`` invalidates nothing;
* ``NoStaleSuccess`` across processes: the reference prefill rank's trace (``--trace``) has one
  ``Ack`` event per ack (``room``, the acking rank's ``instance``, the message's ``target``
  instance or null). Given those events with the decode's, a receiver's ``Complete`` (its
  ``room``) with generations of instance ``I`` must not be preceded by an ack for that room from
  a process of another instance that could be for it (``target`` ``I`` or null): that is a
  transfer acked by a process of another epoch than the one whose ports the request used (the
  model's ``Ack(r)`` guard ``Live(r)``; the ``ReusedPortAcks`` variant). The check runs once all
  events are read, since two processes' ``seq`` numbers do not interleave; acks of a rank that
  knows no instance, and generations whose instance no ``PoolPublish`` named, are not judged;
* ``CompleteNeedsAllResponses``: a ``Complete`` event that carries ``required`` (the plan's
  ``required_prefill_response_num``) needs acks for its room from that many distinct prefill
  ranks (the ``Ack`` events' ``tp_rank``, ``pp_rank``, ``cp_rank`` where given) of its
  generations' instance; a rank that acked twice counts once. Judged at the end too;
* ``FailedIsTerminal``: nothing but ``Invalidate`` follows ``Failed`` (a late ack, status or
  call that completes or revives a failed request is named by this rule);
* ``AbortNotified``: an ``AbortNotice`` event (``receiver``, ``room``: the decode told every
  target rank it gave up) must belong to each ``Timeout`` and to each ``Abort`` taken from a
  state that holds the target ranks (``cached`` through ``done``), in the same request (before
  or after the step, before ``NewRequest``). A trace with no ``AbortNotice`` event at all comes
  from a decode that does not record them, and is not judged on this rule;
* ``NoReleaseWhileWriterMayWrite`` (KV release of failed rooms, the model's
  ``ReleaseOnProvenGone``): a ``ReleaseOnProvenGone`` event (``room``, ``instance``: the one
  its metadata named, ``writers``: the endpoints of the ranks that could still write it) needs,
  earlier, proof that each writer's process of that instance is gone: a ``ResetSeen``
  (``endpoint``, ``instance``: its connection reset or a reconnect refused) or a
  ``NewInstanceSeen`` (``endpoint``, ``instance``, ``new_instance``: another process answers at
  that endpoint). A ``SilenceSeen`` (timeouts only) is no proof. ``ReleaseOnAbortAck`` and
  ``ReleaseOnTimeout`` (``room``) are accepted as they come.

Events are replayed in ``seq`` order. ``BootstrapPool`` takes a pool event's ``seq`` under its
lock and writes the line after releasing it (POOL-7), so ``seq`` order is the order the lock
serialised the operations, also with many threads, even where lines reach the file in another
order; :func:`read_trace` sorts. ``PoolRetireInstance`` names the keys it removed; for a trace
without them the affected keys are "unknown" until the next publish, and checks on them are
relaxed to what is still certain.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statemachine.errors import InvalidTransition, TraceFormatError
from statemachine.lifecycle import EVENTS, INITIAL, next_state

Key = tuple[Any, ...]
Token = int


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: A pool slot whose content the trace does not determine (after a partial retirement).
UNKNOWN = _Unknown()

POOL_EVENTS = frozenset(
    {"PoolPublish", "PoolInvalidate", "PoolInvalidateAddress", "PoolRetireInstance"}
)
#: written by the reference prefill rank (``prefill/rank.py --trace``), not by the decode
ACK_EVENT = "Ack"
#: written by the decode when it sends its ABORT to every target rank of a request
ABORT_NOTICE = "AbortNotice"
#: the decode's evidence about a rank process (the model's ResetSeen, SilenceSeen, and a newer
#: epoch at the address) and its releases of a failed room's KV (issue 27)
RESET_SEEN, SILENCE_SEEN, NEW_INSTANCE_SEEN = "ResetSeen", "SilenceSeen", "NewInstanceSeen"
RELEASE_ON_PROVEN_GONE = "ReleaseOnProvenGone"
OTHER_RELEASES = frozenset({"ReleaseOnAbortAck", "ReleaseOnTimeout"})
#: the lifecycle states in which a request holds its target ranks (the model's Initialized)
INITIALIZED = frozenset({"cached", "handshaking", "ready", "waiting", "done"})


@dataclass
class Violation:
    """The first event the model does not allow."""

    index: int  # position in the trace, 0-based
    event: Mapping[str, Any]
    rule: str  # the property or rule broken
    reason: str

    def __str__(self) -> str:
        seq = self.event.get("seq", self.index)
        return f"event #{seq} {self.event.get('action')!r}: {self.rule}: {self.reason}"


@dataclass
class Report:
    events: int
    violation: Violation | None = None

    @property
    def ok(self) -> bool:
        return self.violation is None


@dataclass
class _Receiver:
    state: str = INITIAL
    entries: dict[Key, Token] = field(default_factory=dict)
    #: this request sent its ABORT notice (the model's ``r \in notified``)
    notified: bool = False
    #: this request took a step that must notify: (index, event) of the first such step
    must_notify: tuple[int, Mapping[str, Any]] | None = None


class _Violated(Exception):
    def __init__(self, rule: str, reason: str) -> None:
        super().__init__(reason)
        self.rule = rule
        self.reason = reason


def _key(value: Any) -> Key:
    if not isinstance(value, list) or not value:
        raise TraceFormatError(f"a key must be a non-empty list, got {value!r}")
    return tuple(value)


def _token(value: Any) -> Token:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceFormatError(f"a generation must be an integer token, got {value!r}")
    return value


def _entries(event: Mapping[str, Any], name: str = "entries") -> dict[Key, Token]:
    if name in event:
        raw = event[name]
        if not isinstance(raw, list) or not all(
            isinstance(pair, list) and len(pair) == 2 for pair in raw
        ):
            raise TraceFormatError(f"{name} must be a list of [key, generation] pairs")
        return {_key(k): _token(g) for k, g in raw}
    if "key" in event:  # the single-entry form
        generation = event.get("generation")
        return {} if generation is None else {_key(event["key"]): _token(generation)}
    return {}


def _count(event: Mapping[str, Any], name: str) -> int:
    value = event.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceFormatError(f"{name} must be a natural number")
    return value


class Validator:
    """Replays events one at a time; :meth:`step` raises on the first disallowed one."""

    def __init__(self) -> None:
        self.receivers: dict[Any, _Receiver] = {}
        self.pool: dict[Key, Token | _Unknown] = {}
        #: every generation ever published under each key
        self.published: dict[Key, set[Token]] = {}
        #: every generation token seen anywhere (FetchOk must bring new ones)
        self.seen_tokens: set[Token] = set()
        #: PoolInvalidate entry sets not yet claimed by a receiver's Invalidate step
        self.pending_invalidations: list[dict[Key, Token]] = []
        #: the instance id of each generation, where PoolPublish named it
        self.instance_of: dict[Token, str | None] = {}
        #: prefill-side acks by room: (acking instance, target instance, acking rank) triples
        self.acks: dict[int, list[tuple[str, str | None, tuple[Any, ...]]]] = {}
        #: receivers' Complete steps: (index, event, room, generation tokens), judged at the end
        self.completions: list[tuple[int, Mapping[str, Any], int, list[Token]]] = []
        #: requests that had to notify but had not when they ended: (index, event), judged at
        #: the end (only if the trace records notices at all)
        self.unnotified: list[tuple[int, Mapping[str, Any]]] = []
        self.records_notices = False
        #: the strongest evidence heard about each (rank endpoint, instance): "silence", or a
        #: proof that the process is gone ("reset", "new_instance")
        self.evidence: dict[tuple[str, str], str] = {}
        #: position and event being replayed (finish(): the completion it rejects)
        self.index = 0
        self.at: Mapping[str, Any] = {}

    # --- pool events ------------------------------------------------------------------------

    def _publish(self, event: Mapping[str, Any]) -> None:
        key = _key(event.get("key"))
        held = _token(event.get("generation"))
        fresh = _token(event.get("fresh"))
        current = self.pool.get(key)
        if current is None:
            if held != fresh:
                raise _Violated(
                    "POOL-2 setdefault",
                    f"key {list(key)} was empty but the pool kept {held} instead of {fresh}",
                )
        elif current is not UNKNOWN and held != current:
            raise _Violated(
                "POOL-2 setdefault",
                f"key {list(key)} held {current} but publish returned {held}: "
                "the pooled generation was replaced",
            )
        self.pool[key] = held
        self.published.setdefault(key, set()).add(held)
        self.seen_tokens.update((held, fresh))
        for token, name in ((held, "instance"), (fresh, "fresh_instance")):
            if name in event:
                instance = event[name]
                if instance is not None and not isinstance(instance, str):
                    raise TraceFormatError(f"{name} must be a string or null")
                self.instance_of[token] = instance

    def _invalidate(self, event: Mapping[str, Any]) -> None:
        entries = _entries(event)
        removed = _count(event, "removed")
        definite = [k for k, g in entries.items() if self.pool.get(k) == g]
        unknown = [k for k in entries if self.pool.get(k) is UNKNOWN]
        if removed > len(definite) + len(unknown):
            raise _Violated(
                "IdentitySafe",
                f"removed {removed} entries but only {len(definite)} of the recorded "
                "generations were still pooled: a generation the receiver never recorded "
                "(a concurrent replacement) was deleted",
            )
        if removed < len(definite):
            raise _Violated(
                "IdentitySafe",
                f"removed {removed} entries but {len(definite)} recorded generations were "
                "still pooled and must go",
            )
        for k in definite:
            del self.pool[k]
        if unknown and removed == len(definite) + len(unknown):
            for k in unknown:
                del self.pool[k]
        self.pending_invalidations.append(entries)

    def _address(self, event: Mapping[str, Any], *, retire: bool) -> None:
        addr = event.get("addr")
        if not isinstance(addr, str):
            raise TraceFormatError("addr must be a string")
        removed = _count(event, "removed")
        exact = [k for k in self.pool if k[0] == addr]
        if retire:
            if removed > len(exact):
                raise _Violated(
                    "ExactNodeFailure",
                    f"retired {removed} entries but {addr!r} had only {len(exact)}: "
                    "entries of another address were removed",
                )
            keys = event.get("keys")
            if keys is not None:
                gone = [tuple(k) for k in keys]
                foreign = [k for k in gone if k not in exact]
                if foreign or len(gone) != removed:
                    raise _Violated(
                        "ExactNodeFailure",
                        f"retirement of {addr!r} removed {foreign or gone}, not only "
                        "entries of that address",
                    )
                self._check_retired_instance(event, addr, exact, gone)
                for k in gone:
                    del self.pool[k]
            elif removed == len(exact):
                for k in exact:
                    del self.pool[k]
            elif removed:
                for k in exact:  # an old trace without "keys": which ones is unknown
                    self.pool[k] = UNKNOWN
            return
        if removed != len(exact):
            raise _Violated(
                "ExactNodeFailure",
                f"node failure of {addr!r} removed {removed} entries; exactly {len(exact)} "
                "have that address"
                + (" (another address's entries were removed too)" if removed > len(exact) else ""),
            )
        for k in exact:
            del self.pool[k]

    def _check_retired_instance(
        self, event: Mapping[str, Any], addr: str, exact: list[Key], gone: list[Key]
    ) -> None:
        """POOL-6: exactly the entries of the named instance go (the trace does not record
        the probe answers that show the instance was replaced, so that part is not checked)."""
        instance = event.get("instance_id")
        if not isinstance(instance, str):
            return  # a trace without the id: the address check is all there is
        known = {}
        for k in exact:
            token = self.pool[k]
            if isinstance(token, int) and token in self.instance_of:
                known[k] = self.instance_of[token]
        wrong = [list(k) for k in gone if k in known and known[k] != instance]
        if wrong:
            raise _Violated(
                "ExactNodeFailure",
                f"retirement of instance {instance!r} at {addr!r} removed {wrong}, entries "
                "of another instance (a stale observer dropping a newer instance's entries)",
            )
        kept = [list(k) for k in exact if known.get(k) == instance and k not in gone]
        if kept:
            raise _Violated(
                "ExactNodeFailure", f"retirement of instance {instance!r} left {kept} behind"
            )

    # --- acks (NoStaleSuccess) ----------------------------------------------------------------

    def _ack(self, event: Mapping[str, Any]) -> None:
        room = _count(event, "room")
        instance, target = event.get("instance"), event.get("target")
        for name, value in (("instance", instance), ("target", target)):
            if value is not None and not isinstance(value, str):
                raise TraceFormatError(f"Ack {name} must be a string or null")
        rank = tuple(event.get(name) for name in ("tp_rank", "pp_rank", "cp_rank"))
        if instance is not None:  # a rank that knows no instance cannot be judged
            self.acks.setdefault(room, []).append((instance, target, rank))

    def _notice(self, event: Mapping[str, Any]) -> None:
        rid = event.get("receiver")
        if rid is None:
            raise TraceFormatError("AbortNotice event without a receiver id")
        self.records_notices = True
        self.receivers.setdefault(rid, _Receiver()).notified = True

    def _end_request(self, receiver: _Receiver) -> None:
        if receiver.must_notify is not None and not receiver.notified:
            self.unnotified.append(receiver.must_notify)
        receiver.notified, receiver.must_notify = False, None

    def finish(self) -> None:
        """The checks that need every process's events: raise on a completion acked by a
        process of another instance than its generations', on one without the responses it
        required, and on a give-up that told no prefill rank."""
        for receiver in self.receivers.values():
            self._end_request(receiver)
        if self.records_notices and self.unnotified:
            self.index, self.at = self.unnotified[0]
            raise _Violated(
                "AbortNotified",
                f"receiver {self.at.get('receiver')} took {self.at.get('action')} after it "
                "learned its target ranks, and its request sent them no ABORT",
            )
        for index, event, room, tokens in self.completions:
            instances = {i for t in tokens if (i := self.instance_of.get(t)) is not None}
            required = event.get("required")
            if required is not None:
                self._check_responses(index, event, room, instances, _count(event, "required"))
            if not instances:
                continue
            for acking, target, _ in self.acks.get(room, ()):
                if acking not in instances and (target is None or target in instances):
                    self.index, self.at = index, event
                    raise _Violated(
                        "NoStaleSuccess",
                        f"receiver {event.get('receiver')} completed room {room} on generations "
                        f"of instance {sorted(instances)}, acked by a process of instance "
                        f"{acking!r} (message target {target!r}): a transfer acked by another "
                        "epoch than the one whose ports the request used",
                    )

    def _check_responses(
        self,
        index: int,
        event: Mapping[str, Any],
        room: int,
        instances: set[str],
        required: int,
    ) -> None:
        """CompleteNeedsAllResponses: distinct acking ranks (of the generations' instance
        when it is known) for the room, at least ``required`` of them."""
        ranks = {
            rank
            for acking, _, rank in self.acks.get(room, ())
            if not instances or acking in instances
        }
        if len(ranks) < required:
            self.index, self.at = index, event
            raise _Violated(
                "CompleteNeedsAllResponses",
                f"receiver {event.get('receiver')} completed room {room} with responses from "
                f"{len(ranks)} distinct prefill ranks; its plan requires {required}",
            )

    # --- KV release (NoReleaseWhileWriterMayWrite) -------------------------------------------

    @staticmethod
    def _text(event: Mapping[str, Any], name: str) -> str:
        value = event.get(name)
        if not isinstance(value, str) or not value:
            raise TraceFormatError(f"{event.get('action')} needs {name} as a non-empty string")
        return value

    def _heard(self, event: Mapping[str, Any]) -> None:
        action = event["action"]
        writer = (self._text(event, "endpoint"), self._text(event, "instance"))
        if action == NEW_INSTANCE_SEEN:
            if self._text(event, "new_instance") == writer[1]:
                raise TraceFormatError("NewInstanceSeen names the same instance twice")
            self.evidence[writer] = "new_instance"
        elif action == RESET_SEEN:
            self.evidence[writer] = "reset"
        else:
            self.evidence.setdefault(writer, "silence")  # silence never undoes a proof

    def _release_on_proof(self, event: Mapping[str, Any]) -> None:
        room = _count(event, "room")
        instance = self._text(event, "instance")
        writers = event.get("writers")
        if not isinstance(writers, list) or not writers:
            raise TraceFormatError(
                "ReleaseOnProvenGone needs writers: the endpoints of the ranks that could still "
                "write the room (with none left, the release is ReleaseOnAbortAck)"
            )
        for endpoint in writers:
            if not isinstance(endpoint, str):
                raise TraceFormatError("writers must be endpoint strings")
            heard = self.evidence.get((endpoint, instance))
            if heard in ("reset", "new_instance"):
                continue
            what = "only silence" if heard == "silence" else "nothing"
            raise _Violated(
                "NoReleaseWhileWriterMayWrite",
                f"room {room} released while the rank at {endpoint} (instance {instance!r}) may "
                f"still write it: the decode heard {what} that proves that process gone (a "
                "reset or refused connection, or another instance at that endpoint)",
            )

    # --- receiver events --------------------------------------------------------------------

    def _receiver(self, event: Mapping[str, Any]) -> None:
        action = str(event["action"])
        rid = event.get("receiver")
        if rid is None:
            raise TraceFormatError(f"{action} event without a receiver id")
        receiver = self.receivers.setdefault(rid, _Receiver())
        try:
            after = next_state(receiver.state, action)
        except InvalidTransition:
            rule = "FailedIsTerminal" if receiver.state == "failed" else "lifecycle"
            raise _Violated(
                rule, f"receiver {rid}: {action} is not allowed in {receiver.state!r}"
            ) from None
        reported = event.get("state")
        if reported is not None and reported != after:
            raise _Violated(
                "lifecycle",
                f"receiver {rid}: {action} from {receiver.state!r} leads to {after!r}, "
                f"trace says {reported!r}",
            )
        entries = _entries(event)
        if action in ("Hit", "Miss", "Publish"):
            for k, g in entries.items():
                if action == "Miss" and receiver.entries.get(k) == g:
                    continue
                if k not in self.published and k not in self.pool:
                    # A key the trace never saw published (pool filled before tracing began).
                    self.pool[k] = g
                    self.published[k] = {g}
                if g not in self.published.get(k, set()):
                    raise _Violated(
                        "AdoptionCorrect",
                        f"receiver {rid} holds generation {g} for {list(k)}, which was never "
                        "published under that key",
                    )
        elif action == "FetchOk":
            for k, g in entries.items():
                if receiver.entries.get(k) != g and g in self.seen_tokens:
                    raise _Violated(
                        "FetchOk", f"receiver {rid}: fetched generation {g} is not a new object"
                    )
        elif action == "Invalidate":
            recorded = receiver.entries
            match = next(
                (i for i, e in enumerate(self.pending_invalidations) if e == recorded), None
            )
            if match is None:
                raise _Violated(
                    "IdentitySafe",
                    f"receiver {rid} invalidated without a pool invalidation of exactly its "
                    f"recorded entries {sorted(recorded.values())}",
                )
            del self.pending_invalidations[match]
        if action == "Complete" and "room" in event:
            self.completions.append(
                (self.index, event, _count(event, "room"), list(entries.values()))
            )
        self.seen_tokens.update(entries.values())
        gives_up = action == "Timeout" or (action == "Abort" and receiver.state in INITIALIZED)
        if gives_up and receiver.must_notify is None:
            receiver.must_notify = (self.index, event)
        if action == "NewRequest":
            self._end_request(receiver)
        receiver.state = after
        receiver.entries = {} if action in ("Invalidate", "NewRequest") else entries

    def step(self, event: Mapping[str, Any]) -> None:
        action = event.get("action")
        if not isinstance(action, str):
            raise TraceFormatError("event without an action")
        if action == "PoolPublish":
            self._publish(event)
        elif action == "PoolInvalidate":
            self._invalidate(event)
        elif action == "PoolInvalidateAddress":
            self._address(event, retire=False)
        elif action == "PoolRetireInstance":
            self._address(event, retire=True)
        elif action in EVENTS:
            self._receiver(event)
        elif action == ACK_EVENT:
            self._ack(event)
        elif action == ABORT_NOTICE:
            self._notice(event)
        elif action in (RESET_SEEN, SILENCE_SEEN, NEW_INSTANCE_SEEN):
            self._heard(event)
        elif action == RELEASE_ON_PROVEN_GONE:
            self._release_on_proof(event)
        elif action in OTHER_RELEASES:
            _count(event, "room")
        else:
            raise _Violated("model", f"unknown action {action!r}")


def validate(events: Iterable[Mapping[str, Any]]) -> Report:
    """Replay ``events``; the report names the first one the model does not allow.

    Raises :class:`TraceFormatError` on a malformed event.
    """
    validator = Validator()
    count = 0
    for index, event in enumerate(events):
        count = index + 1
        if not isinstance(event, Mapping):
            raise TraceFormatError(f"event {index} is not a JSON object")
        validator.index = index
        try:
            validator.step(event)
        except _Violated as violated:
            return Report(count, Violation(index, event, violated.rule, violated.reason))
    try:
        validator.finish()
    except _Violated as violated:
        return Report(
            count, Violation(validator.index, validator.at, violated.rule, violated.reason)
        )
    return Report(count)


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Load an NDJSON trace; :class:`TraceFormatError` on unreadable or non-JSON input."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from None
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{number}: not JSON: {exc.msg}") from None
    if all(isinstance(e, dict) and isinstance(e.get("seq"), int) for e in events):
        events.sort(key=lambda e: e["seq"])
    return events


def main(argv: list[str]) -> int:
    """``python -m statemachine.model.validate TRACE``: exit 0 valid, 1 violation, 2 bad input."""
    parser = argparse.ArgumentParser(prog="python -m statemachine.model.validate")
    parser.add_argument(
        "trace",
        nargs="+",
        help="NDJSON traces written by statemachine.trace.tracing: the decode's, then any "
        "prefill ranks' (prefill/rank.py --trace), each in its own seq order",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        report = validate([event for path in args.trace for event in read_trace(path)])
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if report.violation is None:
        print(f"{report.events} events: every step is allowed by the model")
        return 0
    print(f"{report.events} events read; first step the model does not allow:")
    print(f"  {report.violation}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
