"""Side by side: SGLang 0.5.23's own ``CommonKVReceiver`` and ours through the same scenarios.

Each scenario runs twice against a prefill of two ranks (PULL sockets registered in a real
bootstrap server, which the test reads): once with SGLang's real decode manager and receiver
(its Mooncake frame builders borrowed, deferred KV release on as in Mooncake), once with our
``DecodeManager``. The outcome that can be observed from outside - the poll values, the failure
and whether it came "from another rank", and what each prefill rank received (control messages
by kind, room and frame count; whether metadata arrived) - must be the same. Where SGLang's
*scheduler* acts on a failed receiver (``decode.py:2861-2917``: ``failure_exception()``, then a
force-armed ABORT), the SGLang run does the same two calls; our manager does both itself.

The waiting timeout runs on SGLang's wall clock (its receiver reads ``time.time()``), set to
0.2 s on its manager; ours runs on a fake clock. Two documented differences are normalised, not
hidden: SGLang's poll stays WaitingForInput (2)
after the metadata where ours says Transferring (3) (spec/lifecycle.md), and a room's ABORT goes
out when our receiver fails rather than at the scheduler's next step.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from statemachine.completion import KVPoll
from statemachine.decode.plan import DecodeLayout, RankPlan
from statemachine.errors import FailedOnAnotherRank, TopologyMismatch, TransferFailed
from tests.support.sglang_receiver_support import PLAN2, Prefill, manager_of, prefill_of, pusher
from tests.support.sglang_support import (
    import_sglang,
    make_kv_args,
    requires_sglang,
    set_sglang_ranks,
)
from tests.support.sglang_support import sglang_server_args as server_args_of

pytestmark = requires_sglang

FAILED, WAITING, SUCCESS = int(KVPoll.Failed), int(KVPoll.WaitingForInput), int(KVPoll.Success)
PAGE_SIZE = 16  # route_payload's default, which SGLang's decode checks against its own


@dataclass(frozen=True)
class Outcome:
    """What a scenario shows from outside, comparable across the two decodes."""

    polls: tuple[int, ...]
    failure: str | None  # "transfer: <reason>", "from another rank", or None
    #: per rank: each control message as (kind, room, frame count); "metadata" for metadata
    received: tuple[tuple[tuple[str, int, int], ...], ...]


def _poll(value: object) -> int:
    # Normalise the one documented difference: waiting for the KV is 2 in SGLang, 3 here.
    number = int(value)  # type: ignore[call-overload]
    return WAITING if number == int(KVPoll.Transferring) else number


def _received(prefill: Prefill, room: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per rank, in order: ABORT/BOOTSTRAP by (kind, room, frames) and metadata of ``room``."""
    per_rank = []
    for rank in range(len(prefill.ranks)):
        prefill.received(rank, b"", quiet=0.3)  # drain what is in flight
        seen = []
        for frames in prefill.seen[rank]:
            kind = frames[0]
            if kind in (b"ABORT", b"BOOTSTRAP") and int(frames[1]) == room:
                seen.append((kind.decode().lower(), room, len(frames)))
            elif (kind == b"metadata" and frames[1] == b"%d" % room) or kind == b"%d" % room:
                seen.append(("metadata", room, 0))  # ours, or SGLang's Mooncake layout
        per_rank.append(tuple(seen))
    return tuple(per_rank)


# --- SGLang's side ------------------------------------------------------------------------------


@contextmanager
def sglang_decode(prefill: Prefill, **fields: Any) -> Iterator[tuple[Any, Any]]:
    """SGLang's decode ``CommonKVManager`` (tp 1: it pulls from both prefill ranks) with
    Mooncake's frame builders, its topology for ``prefill`` fetched; yields (conn, manager)."""
    conn = import_sglang()
    mooncake = importlib.import_module("sglang.srt.disaggregation.mooncake.conn")
    builders = mooncake.MooncakeKVManager

    class Decode(conn.CommonKVManager):  # type: ignore[misc, name-defined]
        supports_deferred_decode_kv_release = True  # as Mooncake's (mooncake/conn.py:260)
        build_receiver_registration_message = builders.build_receiver_registration_message
        build_receiver_metadata_message = builders.build_receiver_metadata_message

        def get_session_id(self) -> str:
            return f"127.0.0.1:{self.rank_port}"

    with ExitStack() as stack:
        args = stack.enter_context(
            server_args_of(disaggregation_mode="decode", host="127.0.0.1", tp_size=1, **fields)
        )
        set_sglang_ranks(tp_rank=0)
        kv_args = make_kv_args(engine_rank=0, page_size=PAGE_SIZE)
        manager = Decode(kv_args, conn.DisaggregationMode.DECODE, args, is_mla_backend=False)
        stack.callback(conn.CommonKVReceiver.close_all_sockets)
        stack.callback(manager._zmq_ctx.destroy, linger=0)
        assert manager.enable_deferred_decode_kv_release
        assert manager.try_ensure_parallel_info(prefill.addr)
        yield conn, manager


def _sglang_scheduler_failed(receiver: Any) -> str:
    """What SGLang's transfer queue does with a Failed receiver (decode.py:2861-2917)."""
    try:
        receiver.failure_exception()
    except Exception as error:
        label = (
            "from another rank"
            if getattr(error, "is_from_another_rank", False)
            else f"transfer: {getattr(error, 'failure_reason', error)}"
        )
    else:  # pragma: no cover - it always raises
        raise AssertionError("failure_exception() did not raise")
    if not receiver.abort_notified:
        receiver.ensure_abort_notified(force_arm=True)
    return label


def _metadata(receiver: Any) -> None:
    receiver.send_metadata(np.array([1, 2], dtype=np.int32), 0, None)


def _our_label(error: object) -> str | None:
    if isinstance(error, FailedOnAnotherRank):
        return "from another rank"
    if isinstance(error, TransferFailed):
        return f"transfer: {error.reason}"
    return None if error is None else type(error).__name__


# --- the scenarios ------------------------------------------------------------------------------


def test_a_late_success_after_a_failure_stays_failed() -> None:
    room = 101
    with prefill_of() as prefill, sglang_decode(prefill) as (conn, manager):
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        _metadata(receiver)
        polls = [_poll(receiver.poll())]
        manager.apply_prefill_status(
            bootstrap_room=room, status=KVPoll.Failed, prefill_rank=1, failure_reason="boom"
        )
        for rank in (0, 1):
            manager.apply_prefill_status(
                bootstrap_room=room, status=KVPoll.Success, prefill_rank=rank
            )
        polls.append(_poll(receiver.poll()))
        failure = _sglang_scheduler_failed(receiver)
        theirs = Outcome(tuple(polls), failure, _received(prefill, room))

    with prefill_of() as prefill, manager_of() as ours, pusher(ours) as push:
        receiver = ours.receiver(prefill.addr, room, PLAN2, prefill_dp_rank=0)
        receiver.init()
        receiver.send_metadata((1, 2))
        polls = [_poll(receiver.poll())]
        push.status(room, KVPoll.Failed, 1, b"boom")
        push.status(room, KVPoll.Success, 0)
        push.status(room, KVPoll.Success, 1)
        push.settle(3)
        polls.append(_poll(receiver.poll()))
        mine = Outcome(tuple(polls), _our_label(receiver.failure), _received(prefill, room))

    assert theirs == mine
    assert mine.polls == (WAITING, FAILED) and mine.failure == "transfer: boom"
    assert all(r == (("metadata", room, 0), ("abort", room, 5)) for r in mine.received)


def test_b_failure_exception_on_a_succeeded_receiver_fails_it_from_another_rank() -> None:
    room = 102
    with prefill_of() as prefill, sglang_decode(prefill) as (conn, manager):
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        _metadata(receiver)
        for rank in (0, 1):
            manager.apply_prefill_status(
                bootstrap_room=room, status=KVPoll.Success, prefill_rank=rank
            )
        polls = [_poll(receiver.poll())]
        failure = _sglang_scheduler_failed(receiver)  # a sibling rank's poll said Failed
        polls.append(_poll(receiver.poll()))
        theirs = Outcome(tuple(polls), failure, _received(prefill, room))

    with prefill_of() as prefill, manager_of() as ours, pusher(ours) as push:
        receiver = ours.receiver(prefill.addr, room, PLAN2, prefill_dp_rank=0)
        receiver.init()
        receiver.send_metadata((1, 2))
        push.status(room, KVPoll.Success, 0)
        push.status(room, KVPoll.Success, 1)
        push.settle(2)
        polls = [_poll(receiver.poll())]
        with pytest.raises(FailedOnAnotherRank):
            receiver.failure_exception()
        polls.append(_poll(receiver.poll()))
        mine = Outcome(tuple(polls), _our_label(receiver.failure), _received(prefill, room))

    assert theirs == mine
    assert mine.polls == (SUCCESS, FAILED) and mine.failure == "from another rank"
    assert all(r == (("metadata", room, 0), ("abort", room, 5)) for r in mine.received)


def test_c_send_metadata_after_a_failed_init_records_and_returns() -> None:
    """The route fetch fails (a prefill dp rank nobody registered): both record Failed, and
    send_metadata returns without sending anything."""
    room = 103
    with prefill_of() as prefill, sglang_decode(prefill) as (conn, manager):
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(5)
        polls = [_poll(receiver.poll())]
        assert receiver.bootstrap_infos is None  # SGLang's "route fetch failed" state
        _metadata(receiver)
        polls.append(_poll(receiver.poll()))
        theirs = Outcome(tuple(polls), None, _received(prefill, room))

    with prefill_of() as prefill, manager_of() as ours:
        receiver = ours.receiver(prefill.addr, room, PLAN2, prefill_dp_rank=5)
        receiver.init()
        polls = [_poll(receiver.poll())]
        assert receiver.send_metadata((1, 2)) == KVPoll.Failed
        polls.append(_poll(receiver.poll()))
        mine = Outcome(tuple(polls), None, _received(prefill, room))

    assert theirs == mine
    assert mine.polls == (FAILED, FAILED) and mine.received == ((), ())


def test_d_abort_after_init_before_send_metadata_notifies_each_rank_once() -> None:
    room = 104
    with prefill_of() as prefill, sglang_decode(prefill) as (conn, manager):
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        polls = [_poll(receiver.poll())]
        receiver.abort()
        receiver.abort()
        polls.append(_poll(receiver.poll()))
        theirs = Outcome(tuple(polls), None, _received(prefill, room))

    with prefill_of() as prefill, manager_of() as ours:
        receiver = ours.receiver(prefill.addr, room, PLAN2, prefill_dp_rank=0)
        receiver.init()
        polls = [_poll(receiver.poll())]
        receiver.abort()
        receiver.abort()
        polls.append(_poll(receiver.poll()))
        mine = Outcome(tuple(polls), None, _received(prefill, room))

    assert theirs == mine
    assert mine.polls == (WAITING, FAILED)
    assert mine.received == ((("abort", room, 4),), (("abort", room, 4),))


def test_completion_needs_every_distinct_response_and_a_repeat_counts_once() -> None:
    room = 105
    with prefill_of() as prefill, sglang_decode(prefill) as (conn, manager):
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        _metadata(receiver)
        polls = []
        for rank in (0, 0, 1):
            manager.apply_prefill_status(
                bootstrap_room=room, status=KVPoll.Success, prefill_rank=rank
            )
            polls.append(_poll(receiver.poll()))
        theirs = Outcome(tuple(polls), None, _received(prefill, room))

    with prefill_of() as prefill, manager_of() as ours, pusher(ours) as push:
        receiver = ours.receiver(prefill.addr, room, PLAN2, prefill_dp_rank=0)
        receiver.init()
        receiver.send_metadata((1, 2))
        polls = []
        for count, rank in enumerate((0, 0, 1), start=1):
            push.status(room, KVPoll.Success, rank)
            push.settle(count)
            polls.append(_poll(receiver.poll()))
        mine = Outcome(tuple(polls), None, _received(prefill, room))

    assert theirs == mine
    assert mine.polls == (WAITING, WAITING, SUCCESS)


def test_the_waiting_timeout_aborts_each_rank_once_with_a_generation() -> None:
    """After the metadata, the waiting timeout fails the room and sends every rank one ABORT
    carrying an abort generation (5 frames), and the room's KV is held for the acks."""
    room = 106
    with prefill_of() as prefill, sglang_decode(prefill) as (conn, manager):
        manager.waiting_timeout = 0.2  # SGLang reads it once, from its env var, at construction
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        _metadata(receiver)
        polls = [_poll(receiver.poll())]
        time.sleep(0.25)
        polls.append(_poll(receiver.poll()))
        receiver.abort()  # a later abort tells nobody again
        held = room in manager._deferred_abort_ack_tracker
        theirs = (Outcome(tuple(polls), None, _received(prefill, room)), held)

    now = [0.0]
    with prefill_of() as prefill, manager_of(clock=lambda: now[0], waiting_timeout_s=0.2) as ours:
        receiver = ours.receiver(prefill.addr, room, PLAN2, prefill_dp_rank=0)
        receiver.init()
        receiver.send_metadata((1, 2))
        polls = [_poll(receiver.poll())]
        now[0] = 0.25
        polls.append(_poll(receiver.poll()))
        receiver.abort()
        held = not ours.kv_release(room)
        mine = (Outcome(tuple(polls), None, _received(prefill, room)), held)

    assert theirs == mine
    assert mine[0].polls == (WAITING, FAILED) and mine[1]
    assert all(r == (("metadata", room, 0), ("abort", room, 5)) for r in mine[0].received)


POLICY = "prefill_complete"


def test_the_prefill_complete_handshake_bootstrap_ready_metadata_success() -> None:
    """Under prefill_complete both send BOOTSTRAP in init() and stay Bootstrapping until the
    prefill's WaitingForInput; then metadata, and Success from the one prefill rank."""
    room = 107
    plan = RankPlan()
    with (
        prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill,
        sglang_decode(prefill, disaggregation_decode_allocation_policy=POLICY) as (conn, manager),
    ):
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        polls = [_poll(receiver.poll())]
        manager.apply_prefill_status(
            bootstrap_room=room, status=KVPoll.WaitingForInput, prefill_rank=0
        )
        polls.append(_poll(receiver.poll()))
        _metadata(receiver)
        manager.apply_prefill_status(bootstrap_room=room, status=KVPoll.Success, prefill_rank=0)
        polls.append(_poll(receiver.poll()))
        theirs = Outcome(tuple(polls), None, _received(prefill, room))

    layout = DecodeLayout(decode_allocation_policy=POLICY)
    with (
        prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill,
        manager_of(layout=layout) as ours,
        pusher(ours) as push,
    ):
        receiver = ours.receiver(prefill.addr, room, plan, prefill_dp_rank=0)
        receiver.init()
        polls = [_poll(receiver.poll())]
        push.status(room, KVPoll.WaitingForInput, 0)
        push.settle(1)
        polls.append(_poll(receiver.poll()))
        receiver.send_metadata((1, 2))
        push.status(room, KVPoll.Success, 0)
        push.settle(2)
        polls.append(_poll(receiver.poll()))
        mine = Outcome(tuple(polls), None, _received(prefill, room))

    assert theirs == mine
    assert mine.polls == (int(KVPoll.Bootstrapping), WAITING, SUCCESS)
    assert mine.received == ((("bootstrap", room, 4), ("metadata", room, 0)),)


def test_a_handshake_never_answered_times_out_with_a_legacy_abort() -> None:
    room = 108
    with (
        prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill,
        sglang_decode(prefill, disaggregation_decode_allocation_policy=POLICY) as (conn, manager),
    ):
        manager.waiting_timeout = 0.2
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        polls = [_poll(receiver.poll())]
        time.sleep(0.25)
        polls.append(_poll(receiver.poll()))
        theirs = Outcome(tuple(polls), None, _received(prefill, room))

    now = [0.0]
    layout = DecodeLayout(decode_allocation_policy=POLICY)
    with (
        prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill,
        manager_of(layout=layout, clock=lambda: now[0], waiting_timeout_s=0.2) as ours,
    ):
        receiver = ours.receiver(prefill.addr, room, RankPlan(), prefill_dp_rank=0)
        receiver.init()
        polls = [_poll(receiver.poll())]
        now[0] = 0.25
        polls.append(_poll(receiver.poll()))
        mine = Outcome(tuple(polls), None, _received(prefill, room))

    assert theirs == mine
    assert mine.polls == (int(KVPoll.Bootstrapping), FAILED)
    assert mine.received == ((("bootstrap", room, 4), ("abort", room, 4)),)


def test_a_prefill_complete_prefill_fails_a_decode_without_a_layout_at_once() -> None:
    """Issue 27 item 3 (MGR-16): SGLang's receiver with its default policy (``early``) fails a
    ``prefill_complete`` prefill in ``init()`` with "Disaggregation decode allocation policy
    mismatch" (``common/conn.py:2527-2542``), telling no rank anything. A DecodeManager made
    without a DecodeLayout has that same default and fails the same way at once — it used to
    accept the prefill and wait out its timeout, since such a prefill answers only decodes that
    sent BOOTSTRAP — with a TopologyMismatch naming both policies and the setting to change."""
    room = 109
    with (
        prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill,
        sglang_decode(prefill) as (conn, manager),  # the default policy
    ):
        receiver = conn.CommonKVReceiver(manager, prefill.addr, room)
        receiver.init(0)
        polls = [_poll(receiver.poll())]
        try:
            receiver.failure_exception()
        except Exception as error:
            sglang_reason = str(getattr(error, "failure_reason", error))
        theirs = Outcome(tuple(polls), "policy mismatch", _received(prefill, room))
    assert "Disaggregation decode allocation policy mismatch" in sglang_reason
    assert "prefill=prefill_complete, decode=early" in sglang_reason

    with prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill, manager_of() as ours:
        # No layout, as a new user would start: a plan from plan_for (which fetches the
        # topology), and the derived plan (init() fetches it).
        given = ours.receiver(prefill.addr, room + 1, ours.plan_for(prefill.addr))
        assert _poll(given.init()) == FAILED
        derived = ours.receiver(prefill.addr, room, prefill_dp_rank=0)
        polls = [_poll(derived.init())]
        error = derived.failure
        label = "policy mismatch" if isinstance(error, TopologyMismatch) else repr(error)
        mine = Outcome(tuple(polls), label, _received(prefill, room))
        assert isinstance(given.failure, TopologyMismatch)

    assert theirs == mine
    assert mine.polls == (FAILED,) and mine.received == ((),)
    text = str(error)
    assert "prefill=prefill_complete, decode=early" in text
    assert "--disaggregation-decode-allocation-policy" in text
    assert "DecodeManager(layout=DecodeLayout(decode_allocation_policy='prefill_complete'" in text
