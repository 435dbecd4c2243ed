"""``BootstrapReceiver``: one per request; ties each lifecycle step to its effect.

The lifecycle (``statemachine.lifecycle``) says *which* steps exist; this class does them:
pool lookups, fetches through the manager's :class:`~statemachine.decode.source.BootstrapSource`
(single-flight per key, :mod:`statemachine.decode.flight`), ZMQ sends through
:class:`~statemachine.decode.ranks.transport.ZmqTransport`, and on any failure the identity-safe
invalidation of exactly the generations this receiver used (``spec/lifecycle.md`` lists the
effect of every event, ``spec/manager.md`` the manager's part).

Receivers are made by a :class:`~statemachine.decode.manager.DecodeManager`, which owns the
shared parts, knows every receiver in flight, and completes or fails them; the two know each
other only through :mod:`statemachine.decode.receiver_host` (``ReceiverHost``: what a receiver
may ask of its manager; ``HostedReceiver``: what the manager may ask of a receiver). The API
follows SGLang's decode-side receiver (``init``, ``send_metadata``, ``poll``, ``failure_exception``,
``abort``, ``clear``, ``invalidate_cached_bootstrap_infos``). One thread drives a receiver; the
cross-thread inputs are single stores, each consumed by the owner's next call: the prefill's
reports from the ack listener's thread (a success adds its rank to ``_responses`` and, at the
plan's ``required_prefill_response_num``, sets ``_acked``; a failure sets ``_reported``; the
handshake answer sets ``_ready``) and the manager's failure fan-out (``_lost``), turned into
``Complete`` / ``PeerLost`` / ``PrefillReady`` by ``init``/``send_metadata``/``poll``. So no
lock per receiver.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from statemachine import call_deadline, trace
from statemachine import lifecycle as life
from statemachine.backend import KVBackend, MetadataRequest
from statemachine.decode.flight import Flight
from statemachine.decode.plan import DEFAULT_PLAN, DecodeLayout, RankPlan
from statemachine.decode.ranks.transport import ZmqTransport, endpoint_url
from statemachine.decode.receiver_host import ReceiverHost
from statemachine.decode.source import BootstrapQueries, as_source
from statemachine.errors import (
    Aborted,
    BootstrapError,
    BootstrapHTTPError,
    BootstrapTimeout,
    ConfigurationError,
    FailedOnAnotherRank,
    InvalidRoom,
    InvalidTransition,
    PeerLost,
    RanksUnreachable,
    SendFailed,
    TransferFailed,
    WaitingTimeout,
)
from statemachine.lifecycle import KVPoll
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo

__all__ = [
    "DEFAULT_PLAN",
    "DEFAULT_WAITING_TIMEOUT_S",
    "BootstrapReceiver",
    "Decode",
    "DecodeLayout",
    "RankPlan",
]

#: SGLang's default ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``.
DEFAULT_WAITING_TIMEOUT_S = 300.0
_MAX_ROOM = 2**64 - 1

_receiver_ids = itertools.count(1)
#: Guards every receiver's set of responding prefill ranks: the ack listener's thread and a
#: transfer engine's may both report one room. One lock for all (never on the hit path), so
#: that a receiver needs none of its own.
_RESPONSES_LOCK = threading.Lock()

# What must come first, per public method, for InvalidTransition messages.
_INIT_NEEDS = "init() runs once, on a new receiver; create a new receiver for a new request"
_SEND_NEEDS = "send_metadata() runs once, after init() returned WaitingForInput"
_INVALIDATE_NEEDS = "only a failed receiver has generations to invalidate (it does so itself)"
_POLL_NEEDS = (
    "call init() first: poll() reports a request's progress once init() ran (before it, "
    "nothing is in progress and nothing was sent)"
)
_FAILURE_NEEDS = "failure_exception() cannot run while init() is fetching on the owner's thread"
_HANDSHAKE_NEEDS = (
    "under the prefill_complete policy, send_metadata() runs once poll() returned "
    "WaitingForInput (the prefill answered the BOOTSTRAP handshake)"
)
#: SGLang's reason for a Failed status that carries none (``common/conn.py:312-314``).
DEFAULT_FAILED_REASON = "Failed to get kvcache from prefill instance, it might be dead"
#: The policy under which the decode allocates KV only once the prefill finished (§ MGR-16).
PREFILL_COMPLETE = "prefill_complete"

_TERMINAL = frozenset({life.DONE, life.INVALIDATED, life.ABORTED})
#: Where ``Hit`` leads from ``idle``, read from the Machine's table once (the hit path's step).
_HIT_TO = life.TABLE[life.HIT][life.IDLE]
_INITIAL = life.INITIAL
_IDLE = life.IDLE
# The poll results as module constants: reading an enum member through its class costs
# ~45 ns on Python 3.11 (EnumType attribute lookup), a sixth of init() on a hit (issue 18).
_BOOTSTRAPPING = KVPoll.Bootstrapping
_WAITING_FOR_INPUT = KVPoll.WaitingForInput
_TRANSFERRING = KVPoll.Transferring
_FAILED = KVPoll.Failed


@dataclass(frozen=True)
class Decode:
    """The parts every receiver of one decode process shares, as one bundle: the manager
    builds one from its parts (``DecodeManager.decode``).

    Checked at construction: a missing or wrong-typed part raises
    :class:`~statemachine.errors.ConfigurationError` here, not an ``AttributeError`` on the
    first request.
    """

    pool: BootstrapPool
    client: BootstrapQueries
    transport: ZmqTransport
    backend: KVBackend
    waiting_timeout_s: float = DEFAULT_WAITING_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        check_parts(
            pool=self.pool,
            source=self.client,
            transport=self.transport,
            backend=self.backend,
            waiting_timeout_s=self.waiting_timeout_s,
            clock=self.clock,
        )


def _takes_keyword(function: object, keyword: str) -> bool:
    """Whether ``function`` accepts ``keyword=`` (a signature it cannot show is trusted)."""
    try:
        parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == keyword and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def check_parts(
    *,
    pool: object,
    source: object,
    transport: object,
    backend: object,
    waiting_timeout_s: object,
    clock: object,
) -> None:
    """Raise ConfigurationError naming the first missing or wrong-typed shared part."""
    if not isinstance(pool, BootstrapPool):
        raise ConfigurationError(
            f"pool must be a BootstrapPool, not {type(pool).__name__}: pass BootstrapPool()"
        )
    as_source(source)  # the three questions at least (the one rule, in source.py)
    if not isinstance(transport, ZmqTransport):
        raise ConfigurationError(
            f"transport must be a ZmqTransport, not {type(transport).__name__}"
        )
    for method in (
        "register_frames",
        "metadata_frames",
        "abort_frames",
        "bootstrap_frames",
        "decode_message",
    ):
        function = getattr(backend, method, None)
        if not callable(function):
            raise ConfigurationError(
                f"backend must be a KVBackend with {method}() (e.g. SimpleBackend), "
                f"not {type(backend).__name__}"
            )
        keywords = {"abort_frames": ("instance_id", "generation"), "decode_message": ()}
        for keyword in keywords.get(method, ("instance_id",)):
            if not _takes_keyword(function, keyword):
                # Checked here, once: otherwise the first send would raise an untyped TypeError.
                raise ConfigurationError(
                    f"{type(backend).__name__}.{method}() must accept the keyword argument "
                    f"{keyword} (spec/zmq.md ZMQ-21, ZMQ-22); a backend that has no use for it "
                    "may ignore it"
                )
    if (
        isinstance(waiting_timeout_s, bool)
        or not isinstance(waiting_timeout_s, (int, float))
        or not waiting_timeout_s > 0
    ):
        raise ConfigurationError(
            f"waiting_timeout_s must be a positive number, not {waiting_timeout_s!r}"
        )
    if not callable(clock):
        raise ConfigurationError("clock must be a callable returning seconds")


def check_room(room: object) -> int:
    """``room`` if it is an int in [0, 2**64); else :class:`InvalidRoom`."""
    if type(room) is not int or not 0 <= room <= _MAX_ROOM:
        raise InvalidRoom(
            f"bootstrap room must be an int in [0, 2**64), not {room!r}: use the request's "
            "bootstrap_room as the router assigned it"
        )
    return room


class BootstrapReceiver:
    """Bootstraps one request against one prefill bootstrap address.

    Made by :meth:`DecodeManager.receiver`::

        receiver = manager.receiver("10.0.0.5:8998", room, prefill_dp_rank=0)
        receiver.init()                              # lookup / fetch / register / publish
        receiver.send_metadata(kv_indices, aux_index)  # to every rank; expects the acks
        while receiver.poll() == _TRANSFERRING: ...
    """

    __slots__ = (
        "_acked",
        "_asked_dp",
        "_call_at",
        "_dp_rank",
        "_failure",
        "_lost",
        "_m",
        "_metadata_sent",
        "_needed",
        "_notified",
        "_ready",
        "_reported",
        "_responses",
        "_sent_at",
        "addr",
        "awaiting_dp_rank",
        "entries",
        "id",
        "on_change",
        "plan",
        "room",
        "state",
    )

    def __init__(
        self,
        manager: ReceiverHost,
        addr: str,
        room: int,
        plan: RankPlan | None = None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        # prefill_dp_rank may be passed by position: calling a class with a keyword argument
        # costs a kwargs dict (~0.12 us on Python 3.11), a tenth of a hit (issue 18).
        if type(room) is not int or not 0 <= room <= _MAX_ROOM:
            check_room(room)
        if prefill_dp_rank is not None and (
            type(prefill_dp_rank) is not int or prefill_dp_rank < 0
        ):
            raise InvalidRoom(f"prefill_dp_rank must be an int >= 0, not {prefill_dp_rank!r}")
        self._m = manager
        self.addr = addr
        self.room = room
        self.plan = plan
        self._dp_rank = prefill_dp_rank
        self.id = next(_receiver_ids)
        #: The lifecycle state (``statemachine.lifecycle``), stepped only by ``_fire``.
        self.state: str = _INITIAL
        #: The exact generation objects this receiver used, by key: what ``Invalidate`` drops.
        self.entries: dict[PoolKey, Generation] = {}
        self._failure: BootstrapError | None = None
        #: Set by the manager's fan-out (another thread): the owner's next call fires PeerLost.
        self._lost: BootstrapError | None = None
        #: when the metadata was sent (or, while the dp rank is pending, when that began)
        self._sent_at = 0.0
        self._acked = False
        #: The room waits for the manager's batched dp-rank query (read by the manager).
        self.awaiting_dp_rank = False
        #: init() ran and left the room waiting for its dp rank (the one way to stay ``idle``
        #: after init(): poll() before any init() raises instead of saying Bootstrapping)
        self._asked_dp = False
        #: when this init() call's questions to the source must end (0.0: none asked yet)
        self._call_at = 0.0
        # Completion by distinct prefill responses (MGR-13): written by the ack listener's
        # thread (or a transfer engine's), read by the owner's poll.
        #: how many distinct prefill ranks must report success (known once the plan is)
        self._needed: int | None = None
        #: the prefill ranks that reported success for this room (made at the first report,
        #: under _RESPONSES_LOCK: a hit that never hears from the prefill allocates none)
        self._responses: set[int] | None = None
        #: a failure the prefill reported: terminal, and it wins over any success (MGR-14)
        self._reported: BootstrapError | None = None
        #: the prefill answered the BOOTSTRAP handshake (MGR-16)
        self._ready = False
        #: the metadata went out (or began to): a later ABORT carries a generation (MGR-15)
        self._metadata_sent = False
        #: the room's prefill ranks were sent an ABORT (at most once per room, MGR-15)
        self._notified = False
        #: Called (from any thread) when this receiver has news for its owner: acks arrived or
        #: the manager failed it. A scheduler can set it to wake its wait.
        self.on_change: Callable[[], None] | None = None
        # Known to the manager by room (one dict store): what the fan-out scans.
        if manager.admit_room(room, self) is not self:
            raise InvalidRoom(
                f"room {room} is already in flight: finish, abort or clear its receiver "
                "before reusing the room"
            )

    # --- lifecycle plumbing -------------------------------------------------------------

    def _fire(self, event: str) -> None:
        """One lifecycle step through the Machine's table (LIFE-1); InvalidTransition if the
        event is not allowed here."""
        try:
            self.state = life.TABLE[event][self.state]
        except KeyError:
            raise InvalidTransition(self.state, event) from None
        if trace.ENABLED:
            trace.emit(
                event,
                receiver=self.id,
                room=self.room,  # joins a Complete with the prefill ranks' Ack events
                entries=self.entries,
                state=self.state,
            )

    def _fail(self, event: str, error: BootstrapError) -> KVPoll:
        """Take a failure event, then drop this receiver's own generations (LIFE-3); tell the
        prefill ranks as SGLang 0.5.23 does (MGR-15)."""
        self._failure = error
        prior = self.state
        self._fire(event)
        if self._metadata_sent:
            # SGLang's transfer queue force-arms an ABORT for every failed room whose
            # metadata went out: the prefill may be writing into our pages.
            self._tell_abort(armed=True)
        elif prior == life.HANDSHAKING:
            self._tell_abort(armed=False)  # SGLang's abort() on the prefill wait
        self._invalidate(event)
        self._m.receiver_ended(self, error)
        return _FAILED

    def _tell_abort(self, *, armed: bool) -> None:
        """The room's ranks are told once (MGR-15): the first time the room has ranks."""
        if not self._notified:
            self._notified = self._m.send_abort(self, armed=armed)

    def _invalidate(self, cause: str) -> int:
        removed = self._m.pool.invalidate(self.entries)
        self._fire(life.INVALIDATE)
        dropped = self.entries
        self.entries = {}
        self._m.entries_invalidated(dropped, removed, cause)
        return removed

    # --- the SGLang-shaped API ------------------------------------------------------------

    def init(self, prefill_dp_rank: int | None = None) -> KVPoll:
        """Set up the bootstrap infos: pool hit, or fetch + register + publish.

        The prefill dp rank is resolved in SGLang's order: ``prefill_dp_rank`` given here or
        when the receiver was made (the router's); a prefill with one dp rank: 0;
        ``follow_bootstrap_room``: ``room % dp_size``; else the room waits for the manager's
        batched ``POST /query_dp_ranks`` (:meth:`DecodeManager.step`) and ``init`` returns
        ``Bootstrapping`` until then: call it again after a step. Returns ``poll()``:
        WaitingForInput on success, Failed on failure, Bootstrapping while the dp rank is
        pending. Under the ``prefill_complete`` allocation policy a successful init sends
        BOOTSTRAP to every rank and returns Bootstrapping: ``poll()`` says WaitingForInput
        once the prefill answered (MGR-16).
        """
        if self.state != _IDLE:
            raise InvalidTransition(self.state, life.HIT, method="init", requires=_INIT_NEEDS)
        if prefill_dp_rank is not None:
            self._dp_rank = prefill_dp_rank
        m = self._m
        if self.plan is None and self._lost is None:
            # The hit path: the address's plan, response count, keys and policy verdict are
            # resolved once (ReceiverHost.address_plans); here only the pool lookup is left.
            known = m.address_plans.get(self.addr)
            if known is not None:
                keys = known.keys.get(self._dp_rank)  # type: ignore[arg-type]
                if keys is not None:
                    self.plan = plan = known.plan
                    self._needed = known.needed
                    # _look_up, inlined for the hit (one Python call less per request)
                    pool = m.pool
                    entries = self.entries
                    for key in keys:
                        generation = pool.peek_hit(key)  # pool.lookup in two C calls
                        if generation is None:
                            generation = pool.lookup(key)  # counts the miss
                            if generation is None:
                                result = self._missed(plan, keys, key)
                                break
                        else:
                            pool.count_hit()
                        entries[key] = generation
                    else:
                        self.state = _HIT_TO  # the Hit step (the Machine's table, read once)
                        if trace.ENABLED:
                            trace.emit(life.HIT, receiver=self.id, entries=entries, state=_HIT_TO)
                        if m.prefill_complete:
                            return self._handshake()
                        return _WAITING_FOR_INPUT
                    if result is _WAITING_FOR_INPUT and m.prefill_complete:
                        return self._handshake()
                    return result
        result = self._init()
        if result is _WAITING_FOR_INPUT and m.prefill_complete:
            return self._handshake()
        return result

    def _init(self) -> KVPoll:
        """``init()`` off the hit path: the address is not resolved yet, the plan was given,
        the dp rank is pending, or the fan-out failed the request already."""
        if self._lost is not None:
            return self._fail(life.PEER_LOST, self._lost)
        m = self._m
        plan = self.plan
        dp_rank = self._dp_rank
        try:
            if plan is None:
                if m.preparing(self.addr):
                    # Resolved in the background (prepare): not fetched here; poll() says
                    # Bootstrapping until a later init() goes on (as for a pending dp rank).
                    self._asked_dp = True
                    return _BOOTSTRAPPING
                known = m.address_plans.get(self.addr)
                if known is None:  # the topology is asked: inside this call's window
                    with self._window():
                        known = m.address_plan(self.addr)  # SGLang checks in init() too
                plan = self.plan = known.plan
            elif m.policy_checked:
                # SGLang checks in init(), before the routes
                if self.addr in m.topologies:
                    m.check_prefill(self.addr)
                else:
                    with self._window():
                        m.check_prefill(self.addr)
            if dp_rank is None:
                dp_rank = self._resolve_dp_rank()
                if dp_rank is None:
                    self._call_at = 0.0  # the next init() is a new call
                    return _BOOTSTRAPPING
        except BootstrapError as error:
            return self._fail(life.FETCH_FAIL, error)
        self._needed = plan.required_prefill_response_num
        return self._look_up(plan, plan.keys_for(self.addr, dp_rank))

    def _look_up(self, plan: RankPlan, keys: tuple[PoolKey, ...]) -> KVPoll:
        """Each key in the pool (no lock): all found is the Hit step, else the miss path."""
        lookup = self._m.pool.lookup
        entries = self.entries
        for key in keys:
            generation = lookup(key)
            if generation is None:
                return self._missed(plan, keys, key)
            entries[key] = generation
        self._fire(life.HIT)
        return _WAITING_FOR_INPUT

    def _missed(self, plan: RankPlan, keys: tuple[PoolKey, ...], first: PoolKey) -> KVPoll:
        """``first`` missed the pool: look the keys after it up, then the miss path."""
        lookup = self._m.pool.lookup
        missing = [first]
        for key in keys[keys.index(first) + 1 :]:
            generation = lookup(key)
            if generation is None:
                missing.append(key)
            else:
                self.entries[key] = generation
        return self._miss(plan, missing)

    def send_metadata(
        self,
        kv_indices: Sequence[int] | Any,
        aux_index: int = 0,
        *,
        prefix_len: int = 0,
        state_indices: Sequence[Sequence[int] | Any | None] | None = (),
    ) -> KVPoll:
        """Send this room's metadata to every rank (dummy ranks flagged); start the clock.

        ``kv_indices``: any sequence of ints or a 1-d numpy integer array (packed once, in C).
        ``state_indices``: a hybrid model's state slots, one index list per state type (SGLang's
        ``send_metadata`` argument of that name; :class:`~statemachine.backend.MetadataRequest`).
        With the manager's ack listener, the completion is expected before the first send,
        and forgotten on every terminal path. Before a successful ``init`` this fails the
        request (``SendFail`` from ``idle``, as SGLang does) instead of raising.
        """
        state = self.state
        if state == life.HANDSHAKING and self._ready:
            self._fire(life.PREFILL_READY)  # the answer arrived since the last poll
            state = life.READY
        if state == life.CACHED or state == life.IDLE or state == life.READY:
            if self._lost is not None:
                return self._fail(life.PEER_LOST, self._lost)
            if state == life.IDLE:
                return self._fail(
                    life.SEND_FAIL,
                    InvalidTransition(
                        state,
                        life.SEND_FAIL,
                        method="send_metadata",
                        requires="init() must return WaitingForInput first; the request "
                        "failed and published nothing: retry it with a new receiver",
                    ),
                )
        elif state == life.FAILED or state == life.INVALIDATED or state == life.ABORTED:
            # SGLang records the failure and returns; the recorded reason (init's) stays.
            return _FAILED
        else:
            requires = _HANDSHAKE_NEEDS if state == life.HANDSHAKING else _SEND_NEEDS
            raise InvalidTransition(state, life.SEND_OK, method="send_metadata", requires=requires)
        m = self._m
        if m.watermarked:
            # The source marked a generation we hold (etcd: a watch event retired it after we
            # adopted it): fail instead of starting a transfer on it (NoStaleStart).
            marked = m.source.stale_mark(self.addr, self.entries.values())
            if marked is not None:
                marked.evidence_at = m.clock()
                return self._fail(life.PEER_LOST, marked)
        plan = self.plan
        request = MetadataRequest(
            self.room,
            kv_indices,
            aux_index,
            prefix_len,
            required_dst_info_num=1 if plan is None else plan.required_dst_info_num,
            state_indices=state_indices,
        )
        if self._needed == 0:
            self._acked = True  # every rank is a dummy for us: nothing will be transferred
        transport = m.transport
        backend = m.backend
        self._metadata_sent = True  # from the first send on, the prefill may write our pages
        try:
            for generation in self.entries.values():
                transport.send_metadata(generation, backend, request)
        except SendFailed as error:
            m.send_failed(error)
            return self._fail(life.SEND_FAIL, error)
        self._sent_at = m.clock()
        self._fire(life.SEND_OK)
        return _TRANSFERRING

    def mark_transferred(self, room: int | None = None) -> None:
        """The whole room arrived, as a transfer engine that reports completion itself says
        (no per-rank count; :meth:`DecodeManager.complete` counts ranks). ``poll()``
        completes the request unless the prefill reported a failure (MGR-14).

        ``room`` is accepted so this method can be an ``AckListener`` callback as it is.
        """
        self._acked = True
        self._wake()

    def responded(self, prefill_rank: int) -> bool:
        """A Success from ``prefill_rank`` (any thread). Counts once per distinct rank; the
        room is transferred when ``required_prefill_response_num`` ranks did (SGLang's
        ``apply_prefill_status``). Returns whether this report was new."""
        with _RESPONSES_LOCK:  # the listener's and an engine's thread may both report
            responses = self._responses
            if responses is None:
                responses = self._responses = set()
            elif prefill_rank in responses:
                return False
            responses.add(prefill_rank)
            count = len(responses)
        needed = self._needed
        if needed is not None and count >= needed and self._reported is None:
            self._acked = True
            self._wake()
        return True

    def failed_by_prefill(self, error: BootstrapError) -> None:
        """A Failed status (any thread): terminal, and it wins over an unpolled success."""
        if self._reported is None:
            self._reported = error
            self._wake()

    def prefill_ready(self) -> None:
        """The prefill's WaitingForInput answer to our BOOTSTRAP (any thread)."""
        self._ready = True
        self._wake()

    def lose(self, error: BootstrapError) -> bool:
        """The manager's fan-out (any thread): store the reason (one attribute store) and wake
        the owner, whose next ``poll``/``send_metadata``/``init`` fires ``PeerLost``.

        A room whose every response arrived is left alone: as SGLang's node-failure handler
        fails only rooms not yet Success, evidence after the transfer changes nothing. Returns
        whether the receiver was failed."""
        if self.state in _TERMINAL or self._lost is not None or self._acked:
            return False
        self._lost = error
        self._wake()
        return True

    def _wake(self) -> None:
        """Call the owner's ``on_change``. It runs on whatever thread brought the news (the
        fan-out, the ack listener, another request's send): what it raises is contained and
        reported to the manager (counted, logged once), so it can neither stop a fan-out nor
        surface in another request's call (MGR-18)."""
        wake = self.on_change
        if wake is not None:
            try:
                wake()
            except Exception as exc:
                self._m.callback_raised(self, exc)

    def expected_acks(self) -> int:
        """How many distinct prefill ranks must report success: the plan's
        ``required_prefill_response_num`` (0 before the plan is known)."""
        return self._needed or 0

    def poll(self) -> KVPoll:
        """SGLang-compatible status; completes, times out (``elapsed >= timeout``) or applies
        the manager's fan-out failure."""
        state = self.state
        if state == life.WAITING:
            if self._reported is not None:  # Failed is terminal: no success may follow it
                self._fail(life.PEER_LOST, self._reported)
            elif self._acked:  # every response arrived: done, whatever evidence came after
                self._fire(life.COMPLETE)
                self._m.receiver_ended(self, None)
            elif self._lost is not None:
                self._fail(life.PEER_LOST, self._lost)
            elif self._m.clock() - self._sent_at >= self._m.waiting_timeout_s:
                self._fail(
                    life.TIMEOUT,
                    WaitingTimeout(
                        f"room {self.room}: no transfer from {self.addr} within "
                        f"{self._m.waiting_timeout_s:g} s: the prefill is slow or lost the "
                        "request; retry it (its generation was dropped and will be refetched)"
                    ),
                )
        elif state == life.CACHED or state == life.IDLE or state == life.READY:
            lost = self._reported or self._lost
            if lost is not None:
                self._fail(life.PEER_LOST, lost)
            elif self.awaiting_dp_rank and self._bootstrap_expired():
                self._fail(life.FETCH_FAIL, self._bootstrap_timeout())
            elif state == life.IDLE and not self._asked_dp:
                # Never init()ed: Bootstrapping would be reported forever (MGR-7).
                raise InvalidTransition(state, life.HIT, method="poll", requires=_POLL_NEEDS)
        elif state == life.HANDSHAKING:
            self._poll_handshake()
        return life.POLL_OF_STATE[self.state]

    def _handshake(self) -> KVPoll:
        """``prefill_complete``: BOOTSTRAP to every rank, then wait for the prefill (MGR-16)."""
        m = self._m
        self._sent_at = m.clock()  # the prefill wait clock (SGLang's waiting timeout value)
        self._fire(life.HANDSHAKE)
        try:
            m.send_bootstrap(self)
        except SendFailed as error:
            m.send_failed(error)
            return self._fail(life.SEND_FAIL, error)
        return _BOOTSTRAPPING

    def _poll_handshake(self) -> None:
        lost = self._reported or self._lost
        if lost is not None:
            self._fail(life.PEER_LOST, lost)
        elif self._ready:
            self._fire(life.PREFILL_READY)
        elif self._m.clock() - self._sent_at >= self._m.waiting_timeout_s:
            self._fail(
                life.TIMEOUT,
                WaitingTimeout(
                    f"room {self.room}: timed out waiting for prefill completion: {self.addr} "
                    f"did not answer the BOOTSTRAP handshake within "
                    f"{self._m.waiting_timeout_s:g} s; retry the request, and check that the "
                    "prefill runs with --disaggregation-decode-allocation-policy "
                    "prefill_complete"
                ),
            )

    @property
    def failure(self) -> BootstrapError | None:
        """Why this request failed or was aborted, or ``None``."""
        return self._failure

    def failure_exception(self) -> None:
        """Raise the recorded failure (as SGLang's receiver does).

        With no local reason, the room failed on another rank (SGLang's caller asks after a
        sibling rank's poll said Failed): the receiver fails now - an unfinished one and, as
        in SGLang, a succeeded one too - and :class:`FailedOnAnotherRank` is raised.
        """
        if self._failure is not None:
            raise self._failure
        state = self.state
        lost = self._reported or self._lost
        if lost is None:
            lost = FailedOnAnotherRank(
                f"room {self.room}: failed with no local reason, from another rank of this "
                "room (that rank's failure is the cause); retry the request",
                addr=self.addr,
            )
        if state in life.TABLE[life.PEER_LOST]:
            self._fail(life.PEER_LOST, lost)
            raise lost
        # fetching/fetched/registered exist only inside init() on the owner's thread.
        raise InvalidTransition(  # pragma: no cover
            state, life.PEER_LOST, method="failure_exception", requires=_FAILURE_NEEDS
        )

    def abort(self) -> None:
        """The owner gives up. Every prefill rank that got this room's metadata is told once
        (so it frees the slot); idempotent. No invalidation: an abort says nothing about the
        prefill."""
        state = self.state
        if state in life.ACTIVE_STATES or state == life.DONE:
            self._failure = Aborted(f"room {self.room} aborted in state {state}")
            self._fire(life.ABORT)
            # Once the room has its ranks (after init), every rank is told once: the legacy
            # ABORT before the metadata, one with a generation after it (MGR-15).
            self._tell_abort(armed=self._metadata_sent)
            self._m.receiver_ended(self, self._failure)

    def clear(self) -> None:
        """Forget this request. A terminal result is kept (Success stays Success, Failed stays
        Failed); an unfinished request becomes Failed (``Abort``), so a late completion can no
        longer complete it. The pool is not touched."""
        state = self.state
        if state in life.ACTIVE_STATES:
            self._failure = Aborted(f"room {self.room} cleared in state {state}")
            self._fire(life.ABORT)
            if self._m.prefill_complete:  # SGLang tells the prefill here under this policy
                self._tell_abort(armed=self._metadata_sent)
            self._m.receiver_ended(self, self._failure)
        self.entries = {}

    def invalidate_cached_bootstrap_infos(self) -> int:
        """Drop this receiver's generations from the pool, by identity; return how many.

        Only allowed after a failure (the receiver does it by itself then); idempotent in
        ``invalidated``.
        """
        state = self.state
        if state == life.INVALIDATED:
            return 0
        if state != life.FAILED:
            raise InvalidTransition(
                state,
                life.INVALIDATE,
                method="invalidate_cached_bootstrap_infos",
                requires=_INVALIDATE_NEEDS,
            )
        return self._invalidate(life.INVALIDATE)  # pragma: no cover - _fail does it at once

    # --- effects -----------------------------------------------------------------------------

    def _resolve_dp_rank(self) -> int | None:
        """SGLang's order after a router-given rank; None while the room is pending."""
        m = self._m
        topology = m.topologies.get(self.addr)
        if topology is None:
            with self._window():
                topology = m.topology(self.addr)
        if topology.dp_size == 1:
            return 0
        if topology.follow_bootstrap_room is not False:  # never set means True (SGLang)
            return self.room % topology.dp_size
        if not self.awaiting_dp_rank:
            self.awaiting_dp_rank = self._asked_dp = True
            self._sent_at = m.clock()
            m.await_dp_rank(self)
        elif self._bootstrap_expired():
            raise self._bootstrap_timeout()
        return None

    def _window(self) -> call_deadline.Until:
        """This init() call's deadline window: opened at its first question to the source,
        ``fetch_deadline_s`` long, shared by every question after it (MGR-21)."""
        at = self._call_at
        if not at:
            at = self._call_at = time.monotonic() + self._m.fetch_deadline_s
        return call_deadline.Until(at)

    def resolved(self, dp_rank: int) -> None:
        """The manager's batched query answered (called from the stepping thread)."""
        self._dp_rank = dp_rank
        self.awaiting_dp_rank = False  # no bootstrap timeout any more: the next init() goes on
        self._wake()

    def _bootstrap_expired(self) -> bool:
        return self._m.clock() - self._sent_at >= self._m.bootstrap_timeout_s

    def _bootstrap_timeout(self) -> BootstrapTimeout:
        return BootstrapTimeout(
            f"room {self.room}: {self.addr} did not know its dp rank within "
            f"{self._m.bootstrap_timeout_s:g} s; retry the request, or route it with an "
            "explicit prefill_dp_rank"
        )

    def _miss(self, plan: RankPlan, missing: list[PoolKey]) -> KVPoll:
        """Single-flight: follow the fetches in flight for our keys, or lead all of them."""
        m = self._m
        dead = m.known_dead(self.addr, missing)
        if dead is not None:  # a rank the source still names is known dead: no refetch
            return self._fail(life.FETCH_FAIL, dead)
        flights = m.flights
        if flights is None:  # the anchor's behaviour: every miss fetches for itself
            return self._lead(plan, missing, {})
        deadline = m.clock() + m.flight_timeout_s
        while True:
            led, followed = flights.claim(missing)
            if not followed:
                break
            for flight in followed:
                try:
                    self.entries[flight.key] = flight.wait(deadline - m.clock())
                except BootstrapError as error:
                    return self._fail(life.FETCH_FAIL, error)
            if self._lost is not None:
                return self._fail(life.PEER_LOST, self._lost)
            missing = [key for key in missing if key not in self.entries]
            still: list[PoolKey] = []
            for key in missing:
                generation = m.pool.lookup(key)
                if generation is None:
                    still.append(key)
                else:
                    self.entries[key] = generation
            if not still:
                self._fire(life.HIT)
                return _WAITING_FOR_INPUT
            missing = still
        # We lead. A flight that closed between our lookup and our claim published first:
        # its generation is in the pool now, so look once more before fetching.
        present = {key: g for key in led if (g := m.pool.get(key)) is not None}
        if present:
            flights.resolve({key: led.pop(key) for key in present}, present)
            self.entries.update(present)
            missing = [key for key in missing if key not in present]
            if not missing:
                self._fire(life.HIT)
                return _WAITING_FOR_INPUT
        try:
            return self._lead(plan, missing, led)
        finally:
            # Whatever happened, no follower may wait for a flight nobody will resolve.
            unresolved = {key: f for key, f in led.items() if not f.done}
            if unresolved:
                flights.fail(
                    unresolved,
                    self._failure
                    or PeerLost(f"{self.addr}: the fetch this request waited for was abandoned"),
                )

    def _lead(self, plan: RankPlan, missing: list[PoolKey], led: dict[PoolKey, Flight]) -> KVPoll:
        m = self._m
        flights = m.flights
        self._fire(life.MISS)
        try:
            with self._window():  # every rank's query ends by this call's deadline (MGR-21)
                fresh = self._fetch(plan, missing)
            # One retry rule on every source (MGR-19): ranks the transport already judged
            # dead, answered again (a store still listing a crashed prefill, a server that
            # kept a dead rank's port), fail this request as retryable, in microseconds.
            try:
                _refuse_known_dead(self.addr, m.transport, fresh.values())
            except RanksUnreachable as error:
                m.still_named_dead(fresh, error)  # the manager may hold the key off (MGR-1)
                raise
        except BootstrapError as error:
            if flights is not None:
                flights.fail(led, error)
            return self._fail(life.FETCH_FAIL, error)
        # Health-watch the address with the instance id just fetched as the baseline: no probe
        # runs inside this request (MGR-21).
        m.watch_address(self.addr, next(iter(fresh.values())).instance_id if fresh else None)
        self.entries.update(fresh)
        self._fire(life.FETCH_OK)
        try:
            for generation in fresh.values():
                m.transport.register(generation, m.backend)
        except SendFailed as error:
            m.send_failed(error)  # the evidence, for the other requests on that endpoint
            # Nothing of this request reached a prefill: retryable, as above (MGR-19).
            unreachable = _unreachable(self.addr, error.endpoint, "registering with it failed")
            unreachable.__cause__ = error
            if flights is not None:
                flights.fail(led, unreachable)
            return self._fail(life.REGISTER_FAIL, unreachable)
        self._fire(life.REGISTER_OK)
        published: dict[PoolKey, Generation] = {}
        refused: BootstrapError | None = None
        source, pool = m.source, m.pool
        for key, generation in fresh.items():
            # setdefault: a concurrent winner's generation replaces ours in our records.
            held = source.publish(pool, key, generation)
            if held is None:
                # The source's watermark (etcd: the watch applied a change this fetch
                # predates): the object is not published and this request fails (the model's
                # Publish with fresh = None, then PeerLost).
                refused = refused or source.refusal(self.addr, generation)
                continue
            if held is generation:
                m.retain_sockets(generation)
            self.entries[key] = published[key] = held
        if flights is not None:
            flights.resolve({k: f for k, f in led.items() if k in published}, published)
            if refused is not None:
                flights.fail({k: f for k, f in led.items() if k not in published}, refused)
        self._fire(life.PUBLISH)
        if refused is not None:
            return self._fail(life.PEER_LOST, refused)
        if self._lost is not None:  # failed by the fan-out while we fetched
            return self._fail(life.PEER_LOST, self._lost)
        return _WAITING_FOR_INPUT

    def _fetch(self, plan: RankPlan, keys: list[PoolKey]) -> dict[PoolKey, Generation]:
        """Ask the source for every (tp, pp) rank of each key; one generation each.

        Runs outside the pool lock. When the answering instance differs from the instance of
        entries this receiver adopted before the fetch, that older instance was replaced:
        its entries of this address are retired (POOL-6) and ours are fetched again.
        """
        adopted = dict(self.entries)
        fresh = self._fetch_keys(plan, keys)
        instance_ids = {g.instance_id for g in fresh.values() if g.instance_id is not None}
        if len(instance_ids) == 1:
            (instance_id,) = instance_ids
            stale = [
                key
                for key, g in adopted.items()
                if g.instance_id is not None and g.instance_id != instance_id
            ]
            if stale:
                old_ids = {g.instance_id for k, g in adopted.items() if k in stale}
                self._m.instance_replaced(self.addr, old_ids, instance_id, self)
                fresh.update(self._fetch_keys(plan, stale))
        return fresh

    def _fetch_keys(self, plan: RankPlan, keys: list[PoolKey]) -> dict[PoolKey, Generation]:
        m = self._m
        source = m.source
        fresh: dict[PoolKey, Generation] = {}
        for key in keys:
            stamp = source.stamp()  # etcd: the watch's revision before the first get_rank
            ranks: list[RankInfo] = []
            instance_ids: set[str | None] = set()
            for tp_rank, pp_rank in plan.fetch_order:
                reply = source.get_rank(
                    self.addr,
                    dp_rank=key.dp_rank,
                    cp_rank=key.cp_rank,
                    tp_rank=tp_rank,
                    pp_rank=pp_rank,
                )
                if reply.instance_id not in instance_ids:
                    instance_ids.add(reply.instance_id)
                    m.fetched_from(self.addr, reply.instance_id)  # new instance: re-plan (MGR-20)
                ranks.append(
                    RankInfo(
                        reply.rank_ip,
                        reply.rank_port,
                        pp_rank,
                        tp_rank in plan.dummy_tp_ranks,
                    )
                )
            if len(instance_ids) != 1:
                # The server restarted between two rank queries: the answers mix instances.
                raise BootstrapHTTPError(
                    f"{self.addr} restarted while its ranks were fetched; retry the request",
                    addr=self.addr,
                )
            fresh[key] = source.generation(tuple(ranks), instance_ids.pop(), stamp)
        return fresh

    def ranks(self) -> list[tuple[Generation, RankInfo]]:
        """Every (generation, rank) of this room, each endpoint once (what an ABORT or a
        BOOTSTRAP goes to)."""
        seen: set[tuple[str, int]] = set()
        out: list[tuple[Generation, RankInfo]] = []
        for generation in self.entries.values():
            for rank in generation.ranks:
                if (rank.ip, rank.port) not in seen:
                    seen.add((rank.ip, rank.port))
                    out.append((generation, rank))
        return out

    @property
    def ended(self) -> bool:
        """True once the request reached a final state (done, invalidated or aborted)."""
        return self.state in _TERMINAL

    def __repr__(self) -> str:
        return f"BootstrapReceiver(id={self.id}, room={self.room}, state={self.state!r})"


def _unreachable(addr: str, endpoint: str, why: str) -> RanksUnreachable:
    return RanksUnreachable(
        f"{addr}: prefill rank {endpoint} cannot be reached ({why}) and no newer registration "
        "is visible yet; nothing of this request was sent: retry shortly (the first request "
        "after the prefill registers again gets through)",
        addr=addr,
        endpoint=endpoint,
    )


def _refuse_known_dead(addr: str, transport: ZmqTransport, fresh: Iterable[Generation]) -> None:
    """``RanksUnreachable`` if a rank of ``fresh`` is at an endpoint the transport judged dead
    (its circuit is open, ZMQ-19): registering there would fail anyway."""
    is_down = transport.is_down
    for generation in fresh:
        for rank in generation.ranks:
            if is_down((rank.ip, rank.port)):
                raise _unreachable(
                    addr,
                    endpoint_url((rank.ip, rank.port)),
                    "the transport's socket monitor judged it dead",
                )


def transfer_failed(
    receiver: BootstrapReceiver, reason: str | None, rank: int | None
) -> BootstrapError:
    """The typed error of a prefill-reported failure, carrying the prefill's reason."""
    text = reason or DEFAULT_FAILED_REASON
    return TransferFailed(
        f"room {receiver.room}: the prefill reported a failed transfer ({text}); retry the request",
        addr=receiver.addr,
        reason=text,
        prefill_rank=rank,
    )
