"""The receiver's SGLang 0.5.23 semantics (spec/manager.md MGR-13..MGR-17), on real parts.

A real bootstrap server on 127.0.0.1 and, as the prefill, PULL sockets registered as its ranks
(so a test sees every message each rank receives), pushing SGLang's Mooncake-layout statuses and
ABORT_ACKs to the decode manager's own listener over real ZMQ. The decode speaks SGLang's
layouts for the messages these rules are about (BOOTSTRAP, ABORT with and without a generation,
status, ABORT_ACK: reference §2.4, §2.5, §2.7, §2.8 in docs/sglang-reference.md) through a small
test backend, so what each rank receives can be compared with what SGLang's receiver sends.
"""

from __future__ import annotations

import time

import pytest

from statemachine import lifecycle as life
from statemachine.completion import (
    AbortAck,
    KVPoll,
)
from statemachine.decode.completions import DEFAULT_FAILED_REASON
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import DecodeLayout, RankPlan
from statemachine.errors import (
    Aborted,
    ConfigurationError,
    FailedOnAnotherRank,
    InvalidRoom,
    InvalidTransition,
    TopologyMismatch,
    TransferFailed,
    WaitingTimeout,
)
from statemachine.wire.reference import SimpleBackend
from tests.support.sglang_receiver_support import (
    BOUND_S,
    PLAN2,
    QUIET_S,
    Prefill,
    SGLangStyleBackend,
    manager_of,
    prefill_of,
    pusher,
)

TIMEOUT_S = 10.0  # the waiting timeout, on a fake clock


def waiting(manager: DecodeManager, prefill: Prefill, room: int, plan: RankPlan = PLAN2) -> object:
    receiver = manager.receiver(prefill.addr, room, plan, prefill_dp_rank=0)
    assert receiver.init() == KVPoll.WaitingForInput
    assert receiver.send_metadata((1, 2)) == KVPoll.Transferring
    return receiver


# --- MGR-13 completion by distinct prefill responses ------------------------------------------


def test_mgr_13_completion_needs_every_distinct_prefill_rank_and_a_repeat_counts_once() -> None:
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        receiver = waiting(manager, prefill, 7)
        assert receiver.expected_acks() == PLAN2.required_prefill_response_num == 2
        push.status(7, KVPoll.Success, 0)
        push.status(7, KVPoll.Success, 0)  # the same rank again
        push.settle(2)
        assert receiver.poll() == KVPoll.Transferring
        push.status(7, KVPoll.WaitingForInput, 1)  # not a status the early policy acts on
        push.settle(3)
        assert receiver.poll() == KVPoll.Transferring
        push.status(7, KVPoll.Success, 1)
        push.settle(4)
        assert receiver.poll() == KVPoll.Success
        assert manager.stats().completed == 1


def test_mgr_13_external_completion_counts_prefill_ranks_the_same_way() -> None:
    with prefill_of() as prefill:
        backend = SGLangStyleBackend("127.0.0.1", 1, "engine")
        with manager_of(completion="external", backend=backend, backend_factory=None) as manager:
            receiver = waiting(manager, prefill, 8)
            assert manager.complete(8, prefill_rank=1)
            assert not manager.complete(8, prefill_rank=1)
            assert receiver.poll() == KVPoll.Transferring
            assert manager.complete(8, prefill_rank=0)
            assert receiver.poll() == KVPoll.Success
            assert not manager.complete(8, prefill_rank=0)  # ended: not in flight


# --- MGR-14 Failed is terminal ----------------------------------------------------------------


def test_mgr_14_a_late_success_after_a_failure_status_stays_failed_with_the_reason() -> None:
    """Scenario (a): SGLang's update_status never promotes a Failed room."""
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        receiver = waiting(manager, prefill, 9)
        push.status(9, KVPoll.Failed, 1, b"rdma write failed on rank 1")
        push.status(9, KVPoll.Success, 0)
        push.status(9, KVPoll.Success, 1)
        push.settle(3)
        assert receiver.poll() == KVPoll.Failed
        failure = receiver.failure
        assert isinstance(failure, TransferFailed)
        assert failure.reason == "rdma write failed on rank 1" and failure.prefill_rank == 1
        assert "rdma write failed on rank 1" in str(failure)
        assert receiver.poll() == KVPoll.Failed  # and stays so


def test_mgr_14_failure_without_a_reason_gets_sglangs_text_and_fail_room_is_terminal() -> None:
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        receiver = waiting(manager, prefill, 10)
        push.status(10, KVPoll.Failed, 0)
        push.settle(1)
        assert receiver.poll() == KVPoll.Failed
        assert isinstance(receiver.failure, TransferFailed)
        assert receiver.failure.reason == DEFAULT_FAILED_REASON
        # fail_room (a transfer engine's report) is terminal too: a later complete is ignored.
        other = waiting(manager, prefill, 11)
        assert manager.fail_room(11, "engine said no")
        assert manager.complete(11, prefill_rank=0) and manager.complete(11, prefill_rank=1)
        assert other.poll() == KVPoll.Failed and isinstance(other.failure, TransferFailed)


def test_mgr_14_a_failure_after_success_was_polled_leaves_success() -> None:
    """SGLang's receiver keeps its first conclusion: Success, once seen, stays."""
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        receiver = waiting(manager, prefill, 12)
        push.status(12, KVPoll.Success, 0)
        push.status(12, KVPoll.Success, 1)
        push.settle(2)
        assert receiver.poll() == KVPoll.Success
        push.status(12, KVPoll.Failed, 0, b"late")
        push.settle(3)
        assert receiver.poll() == KVPoll.Success and receiver.failure is None


def test_mgr_14_failure_exception_on_a_succeeded_receiver_fails_it_from_another_rank() -> None:
    """Scenario (b): SGLang marks it Failed and raises is_from_another_rank; its ranks get the
    force-armed ABORT (with a generation) of a failed room whose metadata went out."""
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        receiver = waiting(manager, prefill, 13)
        push.status(13, KVPoll.Success, 0)
        push.status(13, KVPoll.Success, 1)
        push.settle(2)
        assert receiver.poll() == KVPoll.Success
        with pytest.raises(FailedOnAnotherRank, match="from another rank") as caught:
            receiver.failure_exception()
        assert caught.value.is_from_another_rank
        assert receiver.poll() == KVPoll.Failed and receiver.state == life.INVALIDATED
        for rank in (0, 1):
            (abort,) = prefill.wait_for(rank, b"ABORT")
            assert len(abort) == 5 and abort[1] == b"13"  # with its generation
        with pytest.raises(FailedOnAnotherRank):
            receiver.failure_exception()  # the recorded reason, again


def test_mgr_14_send_metadata_after_a_failed_init_records_and_returns_failed() -> None:
    """Scenario (c): SGLang records the failure and returns; nothing reaches a rank."""
    with prefill_of() as prefill, manager_of() as manager:
        receiver = manager.receiver("127.0.0.1:1", 14, PLAN2, prefill_dp_rank=0)  # nobody there
        assert receiver.init() == KVPoll.Failed
        reason = receiver.failure
        assert receiver.send_metadata((1,)) == KVPoll.Failed
        assert receiver.failure is reason and receiver.poll() == KVPoll.Failed
        # a failed init against a live prefill (policy mismatch) likewise sends no metadata
    with prefill_of(decode_allocation_policy="early") as prefill:
        layout = DecodeLayout(tp_size=2, decode_allocation_policy="prefill_complete")
        with manager_of(layout=layout) as manager:
            receiver = manager.receiver(prefill.addr, 15, PLAN2, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Failed
            assert receiver.send_metadata((1,)) == KVPoll.Failed
            assert prefill.received(0, b"metadata") == [] and prefill.received(1, b"metadata") == []


def test_mgr_14_duplicate_room_is_refused_and_the_first_goes_on() -> None:
    """SGLang shares (early) or fails (prefill_complete) a duplicate room's state; we refuse
    the second receiver at creation and leave the first untouched (spec/manager.md MGR-14)."""
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        first = waiting(manager, prefill, 16)
        with pytest.raises(InvalidRoom, match="already in flight"):
            manager.receiver(prefill.addr, 16, PLAN2, prefill_dp_rank=0)
        push.status(16, KVPoll.Success, 0)
        push.status(16, KVPoll.Success, 1)
        push.settle(2)
        assert first.poll() == KVPoll.Success


# --- MGR-15 ABORT and deferred release ---------------------------------------------------------


def test_mgr_15_abort_after_init_before_metadata_tells_each_rank_once_legacy() -> None:
    """Scenario (d): one 4-frame ABORT (no generation) per rank; a second abort sends nothing;
    nothing is held; an abort before init sends nothing."""
    with prefill_of() as prefill, manager_of() as manager:
        never = manager.receiver(prefill.addr, 20, PLAN2, prefill_dp_rank=0)
        never.abort()
        receiver = manager.receiver(prefill.addr, 21, PLAN2, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput
        receiver.abort()
        receiver.abort()
        assert receiver.poll() == KVPoll.Failed and isinstance(receiver.failure, Aborted)
        for rank in (0, 1):
            assert prefill.wait_for(rank, b"ABORT") == [
                [b"ABORT", b"21", b"127.0.0.1", b"%d" % manager.acks.port]  # type: ignore[union-attr]
            ]
        assert prefill.received(0, b"ABORT") == prefill.received(1, b"ABORT")  # still one each
        assert manager.kv_release(21)  # a legacy ABORT holds nothing


def test_mgr_15_waiting_timeout_aborts_each_rank_with_a_generation_and_holds_the_kv() -> None:
    now = [0.0]
    with (
        prefill_of() as prefill,
        manager_of(clock=lambda: now[0], waiting_timeout_s=TIMEOUT_S) as manager,
        pusher(manager) as push,
    ):
        receiver = waiting(manager, prefill, 22)
        now[0] = TIMEOUT_S - 0.001
        assert receiver.poll() == KVPoll.Transferring
        now[0] = TIMEOUT_S  # elapsed >= timeout, as SGLang
        assert receiver.poll() == KVPoll.Failed and isinstance(receiver.failure, WaitingTimeout)
        aborts = [prefill.wait_for(rank, b"ABORT") for rank in (0, 1)]
        assert all(len(a) == 1 and len(a[0]) == 5 for a in aborts)
        generation = int(aborts[0][0][4])
        assert int(aborts[1][0][4]) == generation
        assert not manager.kv_release(22)
        push.abort_ack(22, 0, generation)
        push.abort_ack(22, 1, generation + 100)  # a stale generation: does not count
        push.abort_ack(22, 0, generation)  # a repeat: counts once
        push.settle(3)
        assert not manager.kv_release(22)
        push.abort_ack(22, 1, generation)
        push.settle(4)
        assert manager.kv_release(22)
        assert manager.kv_release(22)  # forgotten: nothing held


def test_mgr_15_a_held_room_is_released_after_the_release_timeout() -> None:
    now = [0.0]
    with (
        prefill_of() as prefill,
        manager_of(
            clock=lambda: now[0], waiting_timeout_s=TIMEOUT_S, kv_release_timeout_s=30.0
        ) as manager,
    ):
        receiver = waiting(manager, prefill, 23)
        receiver.abort()  # after the metadata: armed
        assert len(prefill.wait_for(0, b"ABORT")[0]) == 5
        now[0] = 29.9
        assert not manager.kv_release(23)
        now[0] = 30.0
        assert manager.kv_release(23)


def test_mgr_15_a_prefill_reported_failure_sends_a_force_armed_abort_once() -> None:
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        receiver = waiting(manager, prefill, 24)
        push.status(24, KVPoll.Failed, 0, b"boom")
        push.settle(1)
        assert receiver.poll() == KVPoll.Failed
        receiver.abort()  # already ended: nothing more
        for rank in (0, 1):
            (abort,) = prefill.wait_for(rank, b"ABORT")
            assert len(abort) == 5
        assert prefill.received(0, b"ABORT", quiet=QUIET_S) == prefill.seen[0][-1:]
        assert not manager.kv_release(24)


# --- MGR-16 allocation policy and the BOOTSTRAP handshake --------------------------------------


def test_mgr_16_policy_mismatch_fails_with_both_values_and_what_to_set() -> None:
    with prefill_of(decode_allocation_policy="early") as prefill:
        layout = DecodeLayout(tp_size=2, decode_allocation_policy="prefill_complete")
        with manager_of(layout=layout) as manager:
            receiver = manager.receiver(prefill.addr, 30, PLAN2, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Failed
            failure = receiver.failure
            assert isinstance(failure, TopologyMismatch)
            assert "prefill=early, decode=prefill_complete" in str(failure)
            assert "--disaggregation-decode-allocation-policy" in str(failure)


def test_mgr_16_an_unset_policy_is_early_and_refuses_a_prefill_complete_prefill() -> None:
    with (
        prefill_of(tp=1, decode_allocation_policy="prefill_complete") as prefill,
        manager_of(layout=DecodeLayout()) as manager,
    ):
        receiver = manager.receiver(prefill.addr, 34, RankPlan(), prefill_dp_rank=0)
        assert receiver.init() == KVPoll.Failed
        assert isinstance(receiver.failure, TopologyMismatch)
        assert "prefill=prefill_complete, decode=early" in str(receiver.failure)
    with prefill_of(tp=1) as prefill, manager_of(layout=DecodeLayout()) as manager:
        receiver = manager.receiver(prefill.addr, 35, RankPlan(), prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput  # early against early: no handshake


def test_mgr_16_prefill_complete_needs_a_tp1_prefill() -> None:
    with prefill_of(tp=2, decode_allocation_policy="prefill_complete") as prefill:
        layout = DecodeLayout(decode_allocation_policy="prefill_complete")
        with manager_of(layout=layout) as manager:
            receiver = manager.receiver(prefill.addr, 31, PLAN2, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Failed
            assert isinstance(receiver.failure, TopologyMismatch)
            assert "tp 1, cp 1 and pp 1" in str(receiver.failure)


def test_mgr_16_handshake_bootstrap_then_waiting_for_input_then_transfer() -> None:
    with prefill_of(tp=1, decode_allocation_policy="prefill_complete") as prefill:
        layout = DecodeLayout(decode_allocation_policy="prefill_complete")
        plan = RankPlan()
        with manager_of(layout=layout) as manager, pusher(manager) as push:
            receiver = manager.receiver(prefill.addr, 32, plan, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Bootstrapping
            assert receiver.state == life.HANDSHAKING
            port = b"%d" % manager.acks.port  # type: ignore[union-attr]
            assert prefill.wait_for(0, b"BOOTSTRAP") == [[b"BOOTSTRAP", b"32", b"127.0.0.1", port]]
            with pytest.raises(InvalidTransition, match="prefill_complete"):
                receiver.send_metadata((1,))  # not before the prefill answered
            assert receiver.poll() == KVPoll.Bootstrapping
            push.status(32, KVPoll.WaitingForInput, 0)
            push.settle(1)
            assert receiver.poll() == KVPoll.WaitingForInput and receiver.state == life.READY
            assert receiver.send_metadata((1,)) == KVPoll.Transferring
            push.status(32, KVPoll.Success, 0)
            push.settle(2)
            assert receiver.poll() == KVPoll.Success


def test_mgr_16_a_handshake_never_answered_times_out_and_aborts_legacy() -> None:
    now = [0.0]
    with prefill_of(tp=1, decode_allocation_policy="prefill_complete") as prefill:
        layout = DecodeLayout(decode_allocation_policy="prefill_complete")
        with manager_of(
            layout=layout, clock=lambda: now[0], waiting_timeout_s=TIMEOUT_S
        ) as manager:
            receiver = manager.receiver(prefill.addr, 33, RankPlan(), prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Bootstrapping
            now[0] = TIMEOUT_S
            assert receiver.poll() == KVPoll.Failed
            assert isinstance(receiver.failure, WaitingTimeout)
            assert "prefill completion" in str(receiver.failure)
            (abort,) = prefill.wait_for(0, b"ABORT")
            assert len(abort) == 4  # SGLang's abort() before metadata: no generation
            assert manager.kv_release(33)


def test_mgr_16_prefill_complete_needs_a_backend_that_speaks_bootstrap() -> None:
    layout = DecodeLayout(decode_allocation_policy="prefill_complete")
    with pytest.raises(ConfigurationError, match="bootstrap_frames"):
        DecodeManager(
            layout=layout,
            backend_factory=lambda ip, port: _NoBootstrap(ip, port, "s"),
            health_probes=False,
        )


class _NoBootstrap(SimpleBackend):
    bootstrap_frames = None


# --- MGR-17 staging ------------------------------------------------------------------------------


def test_mgr_17_staging_with_unequal_attn_tp_is_refused_with_a_typed_error() -> None:
    with (
        prefill_of(tp=2) as prefill,
        manager_of(layout=DecodeLayout(tp_size=1), staging=True) as manager,
    ):
        receiver = manager.receiver(prefill.addr, 40, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.Failed
        assert isinstance(receiver.failure, TopologyMismatch)
        assert "staging" in str(receiver.failure)


# --- against the reference prefill rank processes ----------------------------------------------


def test_mgr_15_reference_ranks_acknowledge_the_timeout_abort_and_release_the_kv() -> None:
    """The reference prefill (real processes) drops the room's pending ack on the ABORT and
    answers its generation with an abort_ack (ZMQ-22): the held room is released by acks, well
    before the release timeout, and the late transfer ack never arrives."""
    from tests.support.receiver_support import PLAN, start_prefill, stop_prefill

    now = [0.0]
    prefill = start_prefill(ack_delay_ms=60_000)
    try:
        with manager_of(
            clock=lambda: now[0], waiting_timeout_s=TIMEOUT_S, backend_factory=None
        ) as manager:
            receiver = manager.receiver(prefill.addr, 50, PLAN, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.WaitingForInput
            assert receiver.send_metadata((1, 2)) == KVPoll.Transferring
            now[0] = TIMEOUT_S
            assert receiver.poll() == KVPoll.Failed
            assert isinstance(receiver.failure, WaitingTimeout)
            assert manager.kv_holds().held == 1  # armed before the ABORT went out
            deadline = time.monotonic() + BOUND_S
            while not manager.kv_release(50) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert manager.kv_release(50)  # both ranks acked the generation
            assert manager.kv_holds().released_by_acks == 1
    finally:
        stop_prefill(prefill)


# --- MGR-15 the hold table itself ----------------------------------------------------------------


def test_mgr_15_holds_count_only_the_current_generation_and_stay_bounded() -> None:
    from statemachine.decode.holds import AbortHolds
    from statemachine.pool import Generation

    def ranks(n: int) -> list[tuple[str, Generation]]:
        told = Generation(())
        return [(f"tcp://127.0.0.1:{9000 + i}", told) for i in range(n)]

    now = [0.0]
    holds = AbortHolds(30.0, lambda: now[0], max_rooms=2)
    first = holds.hold(1, ranks(2))
    second = holds.hold(1, ranks(2))  # a new ABORT for the room: a new generation replaces it
    assert second == first + 1 and holds.abort_seq(1) == second
    assert not holds.acked(AbortAck(1, 0, first))  # the old generation: stale
    assert not holds.acked(AbortAck(1, 0, None))  # a legacy ack names no generation
    assert not holds.acked(AbortAck(1, None, second))  # names no rank
    assert not holds.acked(AbortAck(9, 0, second))  # a room not held
    assert holds.acked(AbortAck(1, 0, second)) and not holds.released(1)
    assert holds.acked(AbortAck(1, 1, second)) and holds.released(1)
    holds.hold(2, ranks(1))
    holds.hold(3, ranks(1))
    holds.hold(4, ranks(1))  # past max_rooms: the oldest (room 2) is given up
    assert holds.released(2) and not holds.released(3) and not holds.released(4)
    now[0] = 30.0
    assert holds.released(3)
    stats = holds.stats()
    assert (stats.held, stats.released_by_acks, stats.released_by_timeout) == (1, 1, 1)
    assert (stats.evicted, stats.stale_acks) == (1, 4)


def test_mgr_13_messages_for_rooms_not_in_flight_are_dropped_and_counted() -> None:
    with prefill_of() as prefill, manager_of() as manager, pusher(manager) as push:
        receiver = waiting(manager, prefill, 60)
        push.status(61, KVPoll.Success, 0)  # nobody's room
        push.abort_ack(60, 0, 1)  # room 60 is not held
        push.status(60, KVPoll.Success, 0)
        push.status(60, KVPoll.Success, 1)
        push.settle(4)
        assert receiver.poll() == KVPoll.Success
        push.status(60, KVPoll.Failed, 0)  # after the room ended
        push.settle(5)
        assert manager.stats().dropped_events == 3
        assert manager.acks is not None and manager.acks.stats().unknown == 3
        assert manager.stats().kv_held == 0
