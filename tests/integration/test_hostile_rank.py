"""The reference prefill rank: a dead decode, and start failures (spec/protocol.md ACK-1, ACK-4).

Real processes and sockets on 127.0.0.1: a prefill rank subprocess, a live decode's ack
listener, and a dead decode (an ack listener that was closed: nothing listens on its port).
"""

from __future__ import annotations

import time

import pytest

from statemachine.decode.ranks.acks import AckListener
from statemachine.decode.ranks.outbox import Outbox
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.errors import PrefillRankStartFailed
from statemachine.pool import Generation, RankInfo
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.metadata import MetadataRequest
from statemachine.wire.reference import SimpleBackend
from tests.support.bootstrap_support import TOKEN
from tests.support.zmq_support import LOOPBACK, AckRecorder


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
        Outbox(transport, dead_backend).register(generation)
        Outbox(transport, live_backend).register(generation)
        for room in range(10):
            Outbox(transport, dead_backend).metadata(generation, MetadataRequest(room, (), 0))
        done = AckRecorder()
        live.expect(100, 1, done)
        start = time.monotonic()
        Outbox(transport, live_backend).metadata(generation, MetadataRequest(100, (), 0))
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
        Outbox(transport, dead_backend).register(generation)
        Outbox(transport, live_backend).register(generation)
        done = AckRecorder()
        start = time.monotonic()
        for room in range(50):  # interleaved: dead, live, dead, live, ...
            Outbox(transport, dead_backend).metadata(generation, MetadataRequest(room, (), 0))
            live.expect(1000 + room, 1, done)
            Outbox(transport, live_backend).metadata(
                generation, MetadataRequest(1000 + room, (), 0)
            )
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


def test_ack7_a_host_name_decode_ip_is_refused_never_resolved(server: BootstrapServer) -> None:
    """Issue 17: the rank connected to whatever decode ip a message named, so libzmq resolved
    host names on the context's only I/O thread: with a silent resolver a live decode's next ack
    was 7.7 s late. Now a name is refused before any socket exists (HTTP-25), counted and logged,
    and the live decode is served as before. The name here is ``localhost`` (resolved from
    /etc/hosts, so no DNS query leaves the machine): before the fix its decode got its ack."""
    with (
        PrefillRankProcess(server.address, TOKEN) as rank,
        AckListener() as live,
        AckListener() as named,
        ZmqTransport() as transport,
    ):
        generation = Generation((RankInfo(LOOPBACK, rank.port, 0),))
        named_backend = SimpleBackend("localhost", named.port, "named-decode")
        live_backend = SimpleBackend(LOOPBACK, live.port, "live-decode")
        named_done, live_done = AckRecorder(), AckRecorder()
        named.expect(7, 1, named_done)
        live.expect(8, 1, live_done)
        Outbox(transport, named_backend).register(generation)
        Outbox(transport, live_backend).register(generation)
        Outbox(transport, named_backend).metadata(generation, MetadataRequest(7, (), 0))
        Outbox(transport, live_backend).metadata(generation, MetadataRequest(8, (), 0))
        assert live_done.wait(10.0)
        assert not named_done.wait(0.5)
        stats = rank.terminate()
    assert stats is not None
    assert (stats["refused_ip"], stats["register"], stats["acks_sent"]) == (2, 1, 1)


def test_ack8_only_the_session_that_sent_the_metadata_can_abort_its_room(
    server: BootstrapServer,
) -> None:
    """Issue 17: any session, even one that never registered, could abort another decode's
    room (its pending ack was dropped, so that decode waited for nothing). Now an abort only
    drops the aborting session's own pending acks."""
    with (
        PrefillRankProcess(server.address, TOKEN, ack_delay_ms=400) as rank,
        AckListener() as owner,
        AckListener() as other,
        ZmqTransport() as transport,
    ):
        info = RankInfo(LOOPBACK, rank.port, 0)
        generation = Generation((info,))
        owner_backend = SimpleBackend(LOOPBACK, owner.port, "owner-decode")
        other_backend = SimpleBackend(LOOPBACK, other.port, "other-decode")
        stranger_backend = SimpleBackend(LOOPBACK, other.port, "never-registered")
        done = AckRecorder()
        owner.expect(5, 1, done)
        Outbox(transport, owner_backend).register(generation)
        Outbox(transport, other_backend).register(generation)
        Outbox(transport, owner_backend).metadata(generation, MetadataRequest(5, (), 0))
        transport.send((info.ip, info.port), stranger_backend.abort_frames(info, 5))
        transport.send((info.ip, info.port), other_backend.abort_frames(info, 5))
        assert done.wait(10.0), "the owner's ack was dropped by another session's abort"
        stats = rank.terminate()
    assert stats is not None
    assert (stats["aborts"], stats["unregistered"], stats["foreign_aborts"]) == (2, 1, 1)
    assert stats["acks_sent"] == 1
