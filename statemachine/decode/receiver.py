"""``BootstrapReceiver``: one per request; ties each lifecycle step to its effect.

The lifecycle (``statemachine.lifecycle``) says *which* steps exist; this class takes them, in
SGLang's call shape (``init``, ``send_metadata``, ``poll``, ``failure_exception``, ``abort``,
``clear``, ``invalidate_cached_bootstrap_infos``), and is the only thing that takes them. It is
handed its decode process's parts as one :class:`~statemachine.decode.parts.Parts` value: the
pool and route cache (the hit path, all in :meth:`BootstrapReceiver.init`), the fetcher (the
miss path's steps, which answer with values), the outbox (metadata, BOOTSTRAP, ABORT), the
fan-out (for the evidence a failed send is) and the room table. It never calls the manager.

One thread drives a receiver; the cross-thread inputs are single stores, each consumed by the
owner's next call: the prefill's reports from the ack listener's thread (a success adds its
rank to ``_responses`` and, at the plan's ``required_prefill_response_num``, sets ``_acked``; a
failure sets ``_reported``; the handshake answer sets ``_ready``) and the fan-out's verdict
(``_lost``), turned into ``Complete`` / ``PeerLost`` / ``PrefillReady`` by
``init``/``send_metadata``/``poll``. So no lock per receiver.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from statemachine import call_deadline, trace
from statemachine import lifecycle as life
from statemachine.completion import KVPoll
from statemachine.decode.fetcher import Claim
from statemachine.decode.parts import Parts
from statemachine.decode.plan import DEFAULT_PLAN, DecodeLayout, RankPlan
from statemachine.decode.rooms import MAX_ROOM, check_room, distinct_ranks
from statemachine.decode.routes import Pending
from statemachine.errors import (
    Aborted,
    BootstrapError,
    BootstrapTimeout,
    FailedOnAnotherRank,
    InvalidRoom,
    InvalidTransition,
    SendFailed,
    WaitingTimeout,
)
from statemachine.pool import Generation, PoolKey, RankInfo
from statemachine.wire.metadata import MetadataRequest

__all__ = [
    "DEFAULT_PLAN",
    "BootstrapReceiver",
    "DecodeLayout",
    "RankPlan",
]

_receiver_ids = itertools.count(1)
#: Guards every receiver's set of responding prefill ranks: the ack listener's thread and a
#: transfer engine's may both report one room. One lock for all (never on the hit path), so
#: that a receiver needs none of its own.
_RESPONSES_LOCK = threading.Lock()

_TERMINAL = frozenset({life.DONE, life.INVALIDATED, life.ABORTED})


class BootstrapReceiver:
    """Bootstraps one request against one prefill bootstrap address.

    Made by :meth:`DecodeManager.receiver`::

        receiver = manager.receiver("10.0.0.5:8998", room, prefill_dp_rank=0)
        receiver.init()                              # lookup / fetch / register / publish
        receiver.send_metadata(kv_indices, aux_index)  # to every rank; expects the acks
        while receiver.poll() == KVPoll.Transferring: ...
    """

    __slots__ = (
        "_acked",
        "_asked_dp",
        "_call_at",
        "_dp_rank",
        "_failure",
        "_lost",
        "_metadata_sent",
        "_needed",
        "_notified",
        "_parts",
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
        parts: Parts,
        addr: str,
        room: int,
        plan: RankPlan | None = None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        if type(room) is not int or not 0 <= room <= MAX_ROOM:
            check_room(room)  # raises, naming what a room must be
        if prefill_dp_rank is not None and (
            type(prefill_dp_rank) is not int or prefill_dp_rank < 0
        ):
            raise InvalidRoom(f"prefill_dp_rank must be an int >= 0, not {prefill_dp_rank!r}")
        self._parts = parts
        self.addr = addr
        self.room = room
        self.plan = plan
        self._dp_rank = prefill_dp_rank
        self.id = next(_receiver_ids)
        #: The lifecycle state (``statemachine.lifecycle``), stepped only by :meth:`fire`.
        self.state: str = life.INITIAL
        #: The exact generation objects this receiver used, by key: what ``Invalidate`` drops.
        self.entries: dict[PoolKey, Generation] = {}
        self._failure: BootstrapError | None = None
        #: Set by the fan-out (another thread): the owner's next call fires PeerLost.
        self._lost: BootstrapError | None = None
        #: when the metadata was sent (or, while the dp rank is pending, when that began)
        self._sent_at = 0.0
        self._acked = False
        #: The room waits for the batched dp-rank query (read by ``DpRankQueries``).
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
        #: the prefill ranks that reported success (made at the first, under _RESPONSES_LOCK)
        self._responses: set[int] | None = None
        #: a failure the prefill reported: terminal, and it wins over any success (MGR-14)
        self._reported: BootstrapError | None = None
        #: the prefill answered the BOOTSTRAP handshake (MGR-16)
        self._ready = False
        #: the metadata went out (or began to): a later ABORT carries an abort_seq (MGR-15)
        self._metadata_sent = False
        #: the room's prefill ranks were sent an ABORT (at most once per room, MGR-15)
        self._notified = False
        #: Called (from any thread) when this receiver has news for its owner: acks arrived or
        #: the fan-out failed it. A scheduler can set it to wake its wait.
        self.on_change: Callable[[], None] | None = None
        # Known by room from now on (what the fan-out scans): one dict store, no call around it.
        rooms = parts.rooms
        if rooms.closed or rooms.by_room.setdefault(room, self) is not self:
            rooms.refuse(self)

    # --- lifecycle steps (only this receiver takes them) -----------------------------------

    def fire(self, event: str) -> None:
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

    def fail(self, event: str, error: BootstrapError) -> KVPoll:
        """Take a failure event, then drop this receiver's own generations (LIFE-3); tell the
        prefill ranks as SGLang 0.5.23 does (MGR-15)."""
        self._failure = error
        prior = self.state
        self.fire(event)
        if self._metadata_sent:
            # SGLang's transfer queue force-arms an ABORT for every failed room whose
            # metadata went out: the prefill may be writing into our pages.
            self._tell_abort(armed=True)
        elif prior == life.HANDSHAKING:
            self._tell_abort(armed=False)  # SGLang's abort() on the prefill wait
        self._invalidate(event)
        self._end(error)
        return KVPoll.Failed

    @property
    def lost(self) -> BootstrapError | None:
        """The evidence this request is lost, stored and not yet acted on (or ``None``)."""
        return self._lost

    def window(self) -> call_deadline.Until:
        """This init() call's deadline window: opened at its first question to the source,
        ``fetch_deadline_s`` long, shared by every question after it (MGR-21)."""
        at = self._call_at
        if not at:
            at = self._call_at = time.monotonic() + self._parts.config.fetch_deadline_s
        return call_deadline.Until(at)

    def _end(self, error: BootstrapError | None) -> None:
        """A final state: leave the room table (and the pending dp-rank rooms)."""
        self._parts.rooms.ended(self, error)
        if self.awaiting_dp_rank:
            self._parts.dp_ranks.forget(self)

    def _tell_abort(self, *, armed: bool) -> None:
        """The room's ranks are told once (MGR-15): the first time the room has ranks (none
        before ``init``). ``armed``: the metadata went out, so the prefill may be writing our
        pages: the ABORT carries a new abort sequence number and the room's KV is held until
        every rank acknowledged it or is proven gone; otherwise SGLang's legacy ABORT, nothing
        held."""
        if self._notified:
            return
        ranks = self.ranks()
        if ranks:
            parts = self._parts
            abort_seq = parts.completions.hold(self.room, ranks) if armed else None
            parts.outbox.abort(self.room, ranks, abort_seq=abort_seq)
            self._notified = True

    def _invalidate(self, cause: str) -> int:
        removed = self._parts.pool.invalidate(self.entries)
        self.fire(life.INVALIDATE)
        dropped = self.entries
        self.entries = {}
        self._parts.fanout.invalidated(dropped, removed, cause)
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

        The hit path is this function: the address's plan, response count and keys per dp
        rank are resolved once per address (``Routes.known``), then one pool lookup per key;
        the keys that missed go to the fetcher.
        """
        if self.state != life.IDLE:
            raise life.out_of_order(self.state, life.HIT, "init")
        if prefill_dp_rank is not None:
            self._dp_rank = prefill_dp_rank
        parts = self._parts
        missing: list[PoolKey] | None = None
        if self.plan is None and self._lost is None:
            known = parts.routes.known.get(self.addr)
            if known is not None:
                keys = known.keys.get(self._dp_rank)  # type: ignore[arg-type]
                if keys is not None:
                    self.plan = known.plan
                    self._needed = known.needed
                    missing = []
                    lookup = parts.pool.lookup
                    entries = self.entries
                    for key in keys:
                        generation = lookup(key)
                        if generation is None:
                            missing.append(key)
                        else:
                            entries[key] = generation
        if missing is None or missing:
            # Not a hit: before anything is asked, what is known to fail is refused.
            if missing is None and self._lost is not None:
                return self.fail(life.PEER_LOST, self._lost)
            silent = parts.silent.refusal(self.addr)
            if silent is not None:  # its server was judged dead, unanswered since (MGR-22)
                return self.fail(life.FETCH_FAIL, silent)
            if missing is None:
                resolved = self._resolve_missing()
                if not isinstance(resolved, list):
                    return resolved  # Bootstrapping (pending) or Failed
                missing = resolved
        if missing:
            dead = parts.dead_keys.refusal(self.addr, missing)
            if dead is not None:  # a rank the source still names is known dead: no refetch
                return self.fail(life.FETCH_FAIL, dead)
            result = self._miss(missing)
            if result != KVPoll.WaitingForInput:
                return result
        else:
            self.fire(life.HIT)
        if parts.prefill_complete:
            return self._handshake()
        return KVPoll.WaitingForInput

    def _resolve_missing(self) -> list[PoolKey] | KVPoll:
        """This request's keys from its route (``Routes.route``), looked up in the pool as
        the hit path does: the keys that missed; a KVPoll when there are no keys (yet)."""
        routes = self._parts.routes
        try:
            plan = routes.route(self.addr, self.plan, window=self.window)
            if isinstance(plan, Pending):
                # Resolved in the background (prepare): poll() says Bootstrapping until a
                # later init() goes on (as for a pending dp rank).
                self._asked_dp = True
                return KVPoll.Bootstrapping
            self.plan = plan
            dp_rank = self._dp_rank
            if dp_rank is None:
                dp_rank = routes.dp_rank(self.addr, self.room, window=self.window)
                if dp_rank is None:
                    self._wait_for_dp_rank()
                    self._call_at = 0.0  # the next init() is a new call
                    return KVPoll.Bootstrapping
        except BootstrapError as error:
            return self.fail(life.FETCH_FAIL, error)
        self._needed = plan.required_prefill_response_num
        lookup = self._parts.pool.lookup
        entries = self.entries
        missing: list[PoolKey] = []
        for key in plan.keys_for(self.addr, dp_rank):
            generation = lookup(key)
            if generation is None:
                missing.append(key)
            else:
                entries[key] = generation
        return missing

    def _miss(self, missing: list[PoolKey]) -> KVPoll:
        """The miss path (``decode/fetcher.py``): each step answers, this receiver steps."""
        parts = self._parts
        fetcher = parts.fetcher
        config = parts.config
        deadline = config.clock() + config.flight_timeout_s
        while True:
            claim = fetcher.claim(missing, self.entries, deadline)
            if isinstance(claim, BootstrapError):
                return self.fail(life.FETCH_FAIL, claim)
            if claim.followed and self._lost is not None:
                return self.fail(life.PEER_LOST, self._lost)
            missing = claim.missing
            if not missing:
                self.fire(life.HIT)
                return KVPoll.WaitingForInput
            if not claim.followed:
                break
        try:
            return self._lead(claim)
        finally:
            fetcher.abandon(self.addr, claim, self._failure)

    def _lead(self, claim: Claim) -> KVPoll:
        """Fetch, register and publish what ``claim`` leads (its followers get the result)."""
        fetcher = self._parts.fetcher
        addr = self.addr
        plan = self.plan
        assert plan is not None  # resolved before any lookup
        self.fire(life.MISS)
        with self.window():  # every rank's query ends by this call's deadline (MGR-21)
            fetched = fetcher.fetch(addr, plan, claim, room=self.room, adopted=self.entries)
        if isinstance(fetched, BootstrapError):
            return self.fail(life.FETCH_FAIL, fetched)
        self.entries.update(fetched)
        self.fire(life.FETCH_OK)
        refused = fetcher.register(addr, claim, fetched)
        if refused is not None:
            return self.fail(life.REGISTER_FAIL, refused)
        self.fire(life.REGISTER_OK)
        published = fetcher.publish(addr, claim, fetched)
        self.entries.update(published.entries)
        self.fire(life.PUBLISH)
        if published.stale is not None:
            return self.fail(life.PEER_LOST, published.stale)
        if self._lost is not None:  # failed by the fan-out while we fetched
            return self.fail(life.PEER_LOST, self._lost)
        return KVPoll.WaitingForInput

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
            self.fire(life.PREFILL_READY)  # the answer arrived since the last poll
            state = life.READY
        if state == life.CACHED or state == life.IDLE or state == life.READY:
            if self._lost is not None:
                return self.fail(life.PEER_LOST, self._lost)
            if state == life.IDLE:
                return self.fail(
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
            return KVPoll.Failed
        else:
            order = "send_metadata after the handshake" if state == life.HANDSHAKING else ""
            raise life.out_of_order(state, life.SEND_OK, "send_metadata", order)
        parts = self._parts
        if parts.checks_stale_marks:
            # The source marked a generation we hold (etcd: a watch event retired it after we
            # adopted it): fail instead of starting a transfer on it (NoStaleStart).
            marked = parts.source.stale_mark(self.addr, self.entries.values())
            if marked is not None:
                marked.evidence_at = parts.config.clock()
                return self.fail(life.PEER_LOST, marked)
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
        self._metadata_sent = True  # from the first send on, the prefill may write our pages
        metadata = parts.outbox.metadata
        try:
            for generation in self.entries.values():
                metadata(generation, request)
        except SendFailed as error:
            parts.fanout.send_failed(error)
            return self.fail(life.SEND_FAIL, error)
        self._sent_at = parts.config.clock()
        self.fire(life.SEND_OK)
        return KVPoll.Transferring

    def mark_transferred(self, room: int | None = None) -> None:
        """The whole room arrived, as a transfer engine that reports completion itself says
        (no per-rank count; :meth:`DecodeManager.complete` counts ranks). ``poll()``
        completes the request unless the prefill reported a failure (MGR-14).

        ``room`` is accepted so this method can be an ``AckListener`` callback as it is.
        """
        self._acked = True
        self._wake()

    def rank_succeeded(self, prefill_rank: int) -> bool:
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

    def mark_lost(self, error: BootstrapError) -> bool:
        """The fan-out (any thread): store the reason (one attribute store) and wake the
        owner, whose next ``poll``/``send_metadata``/``init`` fires ``PeerLost``.

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
        reported to the room table (counted, logged once), so it can neither stop a fan-out
        nor surface in another request's call (MGR-18)."""
        wake = self.on_change
        if wake is not None:
            try:
                wake()
            except Exception as exc:
                self._parts.rooms.callback_raised(self, exc)

    def expected_acks(self) -> int:
        """How many distinct prefill ranks must report success: the plan's
        ``required_prefill_response_num`` (0 before the plan is known)."""
        return self._needed or 0

    def poll(self) -> KVPoll:
        """SGLang-compatible status; completes, times out (``elapsed >= timeout``) or applies
        the fan-out's failure."""
        state = self.state
        config = self._parts.config
        if state == life.WAITING:
            if self._reported is not None:  # Failed is terminal: no success may follow it
                self.fail(life.PEER_LOST, self._reported)
            elif self._acked:  # every response arrived: done, whatever evidence came after
                self.fire(life.COMPLETE)
                self._end(None)
            elif self._lost is not None:
                self.fail(life.PEER_LOST, self._lost)
            elif config.clock() - self._sent_at >= config.waiting_timeout_s:
                self.fail(
                    life.TIMEOUT,
                    WaitingTimeout(
                        f"room {self.room}: no transfer from {self.addr} within "
                        f"{config.waiting_timeout_s:g} s: the prefill is slow or lost the "
                        "request; retry it (its generation was dropped and will be refetched)"
                    ),
                )
        elif state == life.CACHED or state == life.IDLE or state == life.READY:
            lost = self._reported or self._lost
            if lost is not None:
                self.fail(life.PEER_LOST, lost)
            elif self.awaiting_dp_rank and self._bootstrap_expired():
                self.fail(life.FETCH_FAIL, self._bootstrap_timeout())
            elif state == life.IDLE and not self._asked_dp:
                # Never init()ed: Bootstrapping would be reported forever (MGR-7).
                raise life.out_of_order(state, life.HIT, "poll")
        elif state == life.HANDSHAKING:
            self._poll_handshake()
        return life.POLL_OF_STATE[self.state]

    def _handshake(self) -> KVPoll:
        """``prefill_complete``: BOOTSTRAP to every rank, then wait for the prefill (MGR-16)."""
        parts = self._parts
        self._sent_at = parts.config.clock()  # the prefill wait clock (SGLang's waiting timeout)
        self.fire(life.HANDSHAKE)
        try:
            parts.outbox.bootstrap(self.room, self.ranks())
        except SendFailed as error:
            parts.fanout.send_failed(error)
            return self.fail(life.SEND_FAIL, error)
        return KVPoll.Bootstrapping

    def _poll_handshake(self) -> None:
        config = self._parts.config
        lost = self._reported or self._lost
        if lost is not None:
            self.fail(life.PEER_LOST, lost)
        elif self._ready:
            self.fire(life.PREFILL_READY)
        elif config.clock() - self._sent_at >= config.waiting_timeout_s:
            self.fail(
                life.TIMEOUT,
                WaitingTimeout(
                    f"room {self.room}: timed out waiting for prefill completion: {self.addr} "
                    f"did not answer the BOOTSTRAP handshake within "
                    f"{config.waiting_timeout_s:g} s; retry the request, and check that the "
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
            self.fail(life.PEER_LOST, lost)
            raise lost
        # fetching/fetched/registered exist only inside init() on the owner's thread.
        raise life.out_of_order(state, life.PEER_LOST, "failure_exception")  # pragma: no cover

    def abort(self) -> None:
        """The owner gives up. Every prefill rank that got this room's metadata is told once
        (so it frees the slot); idempotent. No invalidation: an abort says nothing about the
        prefill."""
        state = self.state
        if state in life.ACTIVE_STATES or state == life.DONE:
            self._failure = Aborted(f"room {self.room} aborted in state {state}")
            self.fire(life.ABORT)
            # Once the room has its ranks (after init), every rank is told once: the legacy
            # ABORT before the metadata, one with an abort sequence number after it (MGR-15).
            self._tell_abort(armed=self._metadata_sent)
            self._end(self._failure)

    def clear(self) -> None:
        """Forget this request. A terminal result is kept (Success stays Success, Failed stays
        Failed); an unfinished request becomes Failed (``Abort``), so a late completion can no
        longer complete it. The pool is not touched."""
        state = self.state
        if state in life.ACTIVE_STATES:
            self._failure = Aborted(f"room {self.room} cleared in state {state}")
            self.fire(life.ABORT)
            if self._parts.prefill_complete:  # SGLang tells the prefill here under this policy
                self._tell_abort(armed=self._metadata_sent)
            self._end(self._failure)
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
            raise life.out_of_order(state, life.INVALIDATE, "invalidate_cached_bootstrap_infos")
        return self._invalidate(life.INVALIDATE)  # pragma: no cover - fail() does it at once

    # --- the dp rank ---------------------------------------------------------------------

    def _wait_for_dp_rank(self) -> None:
        """Only the manager's batched query can tell the dp rank: wait for it, or raise
        BootstrapTimeout once the wait is over."""
        if not self.awaiting_dp_rank:
            self.awaiting_dp_rank = self._asked_dp = True
            self._sent_at = self._parts.config.clock()
            self._parts.dp_ranks.wait_for(self)
        elif self._bootstrap_expired():
            raise self._bootstrap_timeout()

    def dp_rank_answered(self, dp_rank: int) -> None:
        """The batched query answered (called from the stepping thread)."""
        self._dp_rank = dp_rank
        self.awaiting_dp_rank = False  # no bootstrap timeout any more: the next init() goes on
        self._wake()

    def _bootstrap_expired(self) -> bool:
        config = self._parts.config
        return config.clock() - self._sent_at >= config.bootstrap_timeout_s

    def _bootstrap_timeout(self) -> BootstrapTimeout:
        return BootstrapTimeout(
            f"room {self.room}: {self.addr} did not know its dp rank within "
            f"{self._parts.config.bootstrap_timeout_s:g} s; retry the request, or route it "
            "with an explicit prefill_dp_rank"
        )

    def ranks(self) -> list[tuple[Generation, RankInfo]]:
        """Every (generation, rank) of this room, each endpoint once (what an ABORT or a
        BOOTSTRAP goes to)."""
        return distinct_ranks(self.entries.values())

    @property
    def ended(self) -> bool:
        """True once the request reached a final state (done, invalidated or aborted)."""
        return self.state in _TERMINAL

    def __repr__(self) -> str:
        return f"BootstrapReceiver(id={self.id}, room={self.room}, state={self.state!r})"
