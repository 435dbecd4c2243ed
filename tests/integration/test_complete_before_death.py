"""A transfer whose every status arrived stays Success, whatever evidence came before the poll
(issue 32 item 5; MGR-14).

Real parts: the reference prefill's bootstrap server and two rank *processes* on 127.0.0.1,
one SIGKILLed; the real ZMQ transport with its monitors (the kill's evidence), the real ack
listener (the statuses), all owned by a real DecodeManager, driven through its public API only.

What it pins: ``BootstrapReceiver.poll`` looks at "every response arrived" before "the fan-out
said the prefill is lost". The other half of MGR-14, evidence that arrives *after* every
status (the fan-out then leaves the room alone), is
``test_manager.py::test_mgr_1_a_room_whose_acks_all_arrived_succeeds_despite_later_evidence``;
here the evidence is stored first and the last status comes after it, both before the owner's
next poll — the order in which only ``poll`` decides.
"""

from __future__ import annotations

import threading

from statemachine.completion import KVPoll
from statemachine.errors import RankDead
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from tests.support.manager_support import FAIL_BOUND_S, manager_for, wait_until
from tests.support.receiver_support import PLAN, TOKEN, TP, Prefill, stop_prefill

#: When the surviving rank reports, after the metadata: past the kill's evidence (which the
#: manager tests bound by FAIL_BOUND_S), well inside the waiting timeout.
LATE_RANK_ACK_MS = int((FAIL_BOUND_S + 1.0) * 1000)


def test_mgr_14_a_transfer_complete_before_its_prefill_died_stays_success() -> None:
    """Rank 0 reports its share and is SIGKILLed; the transport proves it gone and the fan-out
    marks the request lost (stored, not yet acted on: nobody polled); then rank 1 reports its
    share. Every rank the request needs reported: its pages are whole, so the next poll says
    Success — failing it would throw the finished transfer away. Swapping the two checks in
    ``poll`` (evidence first) turns this into Failed (``tests/code_mutants``:
    ``poll_evidence_before_acks``)."""
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    prefill = Prefill(server)
    assert TP == 2
    try:
        for tp_rank, delay_ms in ((0, 0), (1, LATE_RANK_ACK_MS)):
            rank = PrefillRankProcess(
                server.address, TOKEN, tp_rank=tp_rank, tp_size=TP, ack_delay_ms=delay_ms
            )
            prefill.ranks.append(rank)
            rank.start()
        with manager_for(waiting_timeout_s=60.0) as manager:
            receiver = manager.receiver(prefill.addr, 1, PLAN, prefill_dp_rank=0)
            wakes: list[bool] = []  # at each wake-up: was the request marked lost by then?
            woken_twice = threading.Event()

            def woken() -> None:
                wakes.append(receiver.lost is not None)
                if len(wakes) >= 2:
                    woken_twice.set()

            receiver.on_change = woken
            assert receiver.init() == KVPoll.WaitingForInput
            assert receiver.send_metadata((1,)) == KVPoll.Transferring
            acks = manager.acks
            assert acks is not None
            assert wait_until(lambda: acks.stats().received >= 1), "rank 0 never reported"
            prefill.ranks[0].kill()
            assert wait_until(lambda: receiver.lost is not None), "the kill was never evidenced"
            assert isinstance(receiver.lost, RankDead)
            assert acks.stats().received == 1, "rank 1 reported before the evidence: no race run"
            assert woken_twice.wait(LATE_RANK_ACK_MS / 1000.0 + FAIL_BOUND_S), "rank 1 silent"
            assert wakes == [True, True]  # the evidence's wake, then every response's
            assert receiver.poll() == KVPoll.Success
            assert receiver.failure is None
            stats = manager.stats()
            assert stats.completed == 1 and stats.failures == {}
    finally:
        stop_prefill(prefill)
