"""The reference prefill rank: a dead decode, and start failures (spec/protocol.md ACK-1, ACK-4).

Real processes and sockets on 127.0.0.1: a prefill rank subprocess, a live decode's ack
listener, and a dead decode (an ack listener that was closed: nothing listens on its port).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from zmq_support import LOOPBACK, AckRecorder

from statemachine.backend import MetadataRequest, SimpleBackend
from statemachine.decode.ranks.acks import AckListener
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.pool import Generation, RankInfo
from statemachine.prefill.rank import PrefillRankProcess, PrefillRankStartFailed
from statemachine.prefill.server import BootstrapServer

TOKEN = "hostile-rank-token"


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    with BootstrapServer(token=TOKEN) as running:
        yield running


def test_ack1_dead_decode_does_not_delay_a_live_decodes_ack(server: BootstrapServer) -> None:
    """Before: each ack to the dead decode blocked the rank for SNDTIMEO (1 s), so after ten
    of them the live decode's ack arrived 10.02 s late."""
    dead = AckListener()
    dead_port = dead.port
    dead.close()  # the decode died: nothing listens on its ack port any more
    with (
        PrefillRankProcess(server.address, TOKEN) as rank,
        AckListener() as live,
        ZmqTransport() as transport,
    ):
        generation = Generation((RankInfo(LOOPBACK, rank.port, 0),))
        dead_backend = SimpleBackend(LOOPBACK, dead_port, "dead-decode")
        live_backend = SimpleBackend(LOOPBACK, live.port, "live-decode")
        transport.register(generation, dead_backend)
        transport.register(generation, live_backend)
        for room in range(10):
            transport.send_metadata(generation, dead_backend, MetadataRequest(room, (), 0))
        done = AckRecorder()
        live.expect(100, 1, done)
        start = time.monotonic()
        transport.send_metadata(generation, live_backend, MetadataRequest(100, (), 0))
        assert done.wait(10.0)
        late = time.monotonic() - start
        # One blocked send to the dead decode would already cost SNDTIMEO = 1 s.
        assert late < 0.9, f"live ack {late:.3f} s late"
        time.sleep(1.3)  # past --ack-send-timeout-ms: the dead decode's acks are dropped
        stats = rank.terminate()
    assert stats is not None
    assert stats["acks_sent"] == 1
    assert stats["ack_failures"] == 10


def test_ack1_live_decode_acks_keep_flowing_while_another_is_dead(
    server: BootstrapServer,
) -> None:
    dead = AckListener()
    dead_port = dead.port
    dead.close()
    with (
        PrefillRankProcess(server.address, TOKEN) as rank,
        AckListener() as live,
        ZmqTransport() as transport,
    ):
        generation = Generation((RankInfo(LOOPBACK, rank.port, 0),))
        dead_backend = SimpleBackend(LOOPBACK, dead_port, "dead-decode")
        live_backend = SimpleBackend(LOOPBACK, live.port, "live-decode")
        transport.register(generation, dead_backend)
        transport.register(generation, live_backend)
        done = AckRecorder()
        start = time.monotonic()
        for room in range(50):  # interleaved: dead, live, dead, live, ...
            transport.send_metadata(generation, dead_backend, MetadataRequest(room, (), 0))
            live.expect(1000 + room, 1, done)
            transport.send_metadata(generation, live_backend, MetadataRequest(1000 + room, (), 0))
        deadline = time.monotonic() + 10.0
        while len(done.rooms) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(done.rooms) == [1000 + r for r in range(50)]
        assert time.monotonic() - start < 5.0  # before: 50 x SNDTIMEO = 50 s


def test_ack4_start_failure_carries_the_childs_last_stderr_lines(server: BootstrapServer) -> None:
    """Before: "prefill rank exited with 1 before READY", no reason."""
    rank = PrefillRankProcess(server.address, "wrong-token")
    with pytest.raises(PrefillRankStartFailed) as caught:
        rank.start()
    assert "exited with 1 before READY" in str(caught.value)
    assert "missing or wrong bearer token" in caught.value.stderr_tail
    assert "last stderr lines" in str(caught.value)
    assert "registration failed" in str(caught.value)
