"""``Outbox`` (statemachine/decode/ranks/outbox.py, spec/zmq.md ZMQ-14, ZMQ-21, spec/manager.md
MGR-15, MGR-16): what the decode sends each rank, addressed to the generation's instance, over
a fake transport that records the sends."""

from __future__ import annotations

import pytest

from statemachine.decode.ranks.outbox import Outbox
from statemachine.errors import SendFailed
from statemachine.pool import Generation
from statemachine.wire.metadata import MetadataRequest

from ..fakes import FakeBackend, FakeTransport, generation, rank


def outbox() -> tuple[Outbox, FakeTransport]:
    transport = FakeTransport()
    return Outbox(transport, FakeBackend()), transport  # type: ignore[arg-type]


def test_zmq_14_register_goes_to_every_rank_dummy_ranks_included() -> None:
    box, transport = outbox()
    fetched = Generation((rank(5001), rank(5002, dummy=True)), "instance-a")
    box.register(fetched)
    assert transport.sends == [
        (("127.0.0.1", 5001), [b"register", b"5001", b"", b"instance-a"]),  # ZMQ-21
        (("127.0.0.1", 5002), [b"register", b"5002", b"", b"instance-a"]),
    ]


def test_zmq_14_register_stops_at_the_first_failed_send() -> None:
    box, transport = outbox()
    transport.failing.add(("127.0.0.1", 5001))
    with pytest.raises(SendFailed):
        box.register(generation(5001, 5002))
    assert transport.sends == []


def test_zmq_14_metadata_goes_to_every_rank_of_the_generation() -> None:
    box, transport = outbox()
    box.metadata(generation(5001, 5002), MetadataRequest(7, [1, 2], 0))
    assert transport.sent_to() == [("127.0.0.1", 5001), ("127.0.0.1", 5002)]
    assert all(frames[0] == b"metadata" for _, frames in transport.sends)


def test_mgr_16_bootstrap_is_told_to_every_rank_and_a_failed_send_propagates() -> None:
    box, transport = outbox()
    held = generation(5001, 5002)
    box.bootstrap(7, [(held, r) for r in held.ranks])
    assert [frames[:3] for _, frames in transport.sends] == [
        [b"bootstrap", b"5001", b"7"],
        [b"bootstrap", b"5002", b"7"],
    ]
    transport.failing.add(("127.0.0.1", 5002))
    with pytest.raises(SendFailed):
        box.bootstrap(7, [(held, r) for r in held.ranks])


def test_mgr_15_abort_is_best_effort_skipping_dead_ranks_and_carrying_the_sequence_number() -> None:
    box, transport = outbox()
    held = generation(5001, 5002, 5003)
    transport.down.add(("127.0.0.1", 5001))  # judged dead: not even tried
    transport.failing.add(("127.0.0.1", 5002))  # the send fails: nothing left to free there
    box.abort(7, [(held, r) for r in held.ranks], abort_seq=3)
    assert transport.sends == [
        (("127.0.0.1", 5003), [b"abort", b"5003", b"7", b"instance-a", b"3"]),
    ]


def test_mgr_15_a_legacy_abort_carries_no_sequence_number() -> None:
    box, transport = outbox()
    held = generation(5001)
    box.abort(7, [(held, held.ranks[0])], abort_seq=None)
    assert transport.sends[0][1][-1] == b""
