"""The allocation-policy check in a manager without a layout (issue 27 item 3, MGR-16).

A real bootstrap server on 127.0.0.1 with a rank registered under SGLang's ``prefill_complete``
policy; real ZMQ sockets. SGLang 0.5.23's receiver with its default policy refuses such a
prefill in ``init()`` (``tests/sglang/test_sglang_receiver_interop.py`` runs the two side by side);
here, without SGLang's wheel: the text of the refusal names both policies and the remedy, and a
manager whose layout names the policy is not refused.
"""

from __future__ import annotations

from statemachine.completion import KVPoll
from statemachine.decode.plan import DecodeLayout
from statemachine.errors import TopologyMismatch
from tests.support.sglang_receiver_support import manager_of, prefill_of

POLICY = "prefill_complete"


def test_mgr_16_no_layout_is_sglangs_default_policy_and_refuses_prefill_complete() -> None:
    with prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill, manager_of() as manager:
        receiver = manager.receiver(prefill.addr, 7, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.Failed  # at once, not after the waiting timeout
        error = receiver.failure
        assert isinstance(error, TopologyMismatch)
        text = str(error)
        # what happened ...
        assert "decode allocation policy mismatch: prefill=prefill_complete, decode=early" in text
        assert "no DecodeLayout given: SGLang's default policy" in text
        # ... and what to do: the flag on both roles, and where it goes here
        assert "--disaggregation-decode-allocation-policy identically on both roles" in text
        assert (
            "DecodeManager(layout=DecodeLayout(decode_allocation_policy='prefill_complete'" in text
        )
        # a plan given to receiver() is checked too, once the topology is known
        given = manager.receiver(prefill.addr, 8, manager.plan_for(prefill.addr))
        assert given.init() == KVPoll.Failed
        assert isinstance(given.failure, TopologyMismatch)
        assert manager.stats().in_flight == 0


def test_mgr_16_a_layout_with_the_policy_is_served() -> None:
    layout = DecodeLayout(decode_allocation_policy=POLICY)
    with (
        prefill_of(tp=1, decode_allocation_policy=POLICY) as prefill,
        manager_of(layout=layout) as manager,
    ):
        receiver = manager.receiver(prefill.addr, 9, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.Bootstrapping  # the BOOTSTRAP handshake went out
        receiver.abort()


def test_mgr_16_an_early_prefill_needs_no_layout() -> None:
    with prefill_of(tp=1) as prefill, manager_of() as manager:
        receiver = manager.receiver(prefill.addr, 10, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput
        receiver.abort()
