"""The reference prefill rank as a real process, with a real bootstrap server (127.0.0.1).

Requirement IDs refer to ``spec/zmq.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from statemachine.decode import liveness_bound
from statemachine.decode.client import BootstrapClient
from statemachine.decode.ranks.acks import AckListener
from statemachine.decode.ranks.outbox import Outbox
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.errors import PrefillRankStartFailed
from statemachine.pool import Generation, RankInfo
from statemachine.prefill.rank import parse_args
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from statemachine.prefill.status_sender import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    RECONNECT_ATTEMPT_MS,
    AckSender,
    StatusSocketOptions,
)
from statemachine.wire.metadata import MetadataRequest
from statemachine.wire.reference import SimpleBackend
from tests.support.bootstrap_support import TOKEN
from tests.support.zmq_support import LOOPBACK, AckRecorder, first_send_failure


@pytest.fixture
def acks() -> Iterator[AckListener]:
    with AckListener() as listener:
        yield listener


@pytest.fixture
def transport() -> Iterator[ZmqTransport]:
    with ZmqTransport() as running:
        yield running


def _generation(*ranks: PrefillRankProcess) -> Generation:
    return Generation(tuple(RankInfo(LOOPBACK, r.port, r.pp_rank) for r in ranks))


def test_zmq13_ranks_register_receive_and_ack(
    server: BootstrapServer, acks: AckListener, transport: ZmqTransport
) -> None:
    """ZMQ-13: READY after PUT /route; register + metadata in, one ack per rank out."""
    ranks = [PrefillRankProcess(server.address, TOKEN, tp_rank=i, tp_size=2) for i in range(2)]
    try:
        for rank in ranks:
            rank.start()
        client = BootstrapClient()
        try:
            for rank in ranks:
                route = client.get_rank(
                    server.address, dp_rank=0, cp_rank=0, tp_rank=rank.tp_rank, pp_rank=0
                )
                assert (route.rank_ip, route.rank_port) == (LOOPBACK, rank.port)
        finally:
            client.close()
        backend = SimpleBackend(LOOPBACK, acks.port, "decode-1")
        generation = _generation(*ranks)
        done = AckRecorder()
        acks.expect(41, 2, done)
        Outbox(transport, backend).register(generation)
        Outbox(transport, backend).metadata(generation, MetadataRequest(41, (0, 1, 2), 0))
        assert done.wait()
        # Junk and a register for pp rank 1 (these ranks are pp rank 0) are counted, not used.
        transport.send((LOOPBACK, ranks[0].port), [b"register", b"junk"])
        transport.send((LOOPBACK, ranks[0].port), [b"hello"])
        transport.send((LOOPBACK, ranks[0].port), backend.register_frames(RankInfo("x", 1, 1)))
        # The ack of a later request proves the rank handled everything sent before it.
        after = AckRecorder()
        acks.expect(42, 1, after)
        Outbox(transport, backend).metadata(
            Generation(generation.ranks[:1]), MetadataRequest(42, (), 0)
        )
        assert after.wait()
        stats = [rank.terminate() for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert done.rooms == [41]
    assert acks.stats().received == 3
    common = {"register": 1, "ack_failures": 0, "unregistered": 0, "stale_instance": 0}
    common.update(bootstrap=0, aborts=0, refused_ip=0, foreign_aborts=0)
    assert stats[0] == {**common, "metadata": 2, "acks_sent": 2, "malformed": 2, "misaddressed": 1}
    assert stats[1] == {**common, "metadata": 1, "acks_sent": 1, "malformed": 0, "misaddressed": 0}


def test_zmq13_metadata_from_an_unregistered_session_is_not_acked(
    server: BootstrapServer, acks: AckListener, transport: ZmqTransport
) -> None:
    """ZMQ-13: without the decode's KV args a real backend could not transfer: no ack."""
    with PrefillRankProcess(server.address, TOKEN) as rank:
        generation = _generation(rank)
        stranger = SimpleBackend(LOOPBACK, acks.port, "never-registered")
        known = SimpleBackend(LOOPBACK, acks.port, "registered")
        unacked, acked = AckRecorder(), AckRecorder()
        acks.expect(1, 1, unacked)
        acks.expect(2, 1, acked)
        # One socket, one peer: handled in this order, so room 1's ack would come first.
        Outbox(transport, stranger).metadata(generation, MetadataRequest(1, (), 0))
        Outbox(transport, known).register(generation)
        Outbox(transport, known).metadata(generation, MetadataRequest(2, (), 0))
        assert acked.wait()
        stats = rank.terminate()
    assert unacked.rooms == []
    assert stats is not None
    assert (stats["metadata"], stats["unregistered"], stats["acks_sent"]) == (2, 1, 1)


def test_zmq13_sigkill_then_restart_gets_a_new_port_and_serves_again(
    server: BootstrapServer, acks: AckListener, transport: ZmqTransport
) -> None:
    """ZMQ-13, ZMQ-2: a crash kills the old endpoint; the restarted rank re-registers."""
    backend = SimpleBackend(LOOPBACK, acks.port, "decode-1")
    with PrefillRankProcess(server.address, TOKEN) as rank:
        old = _generation(rank)
        Outbox(transport, backend).register(old)
        old_port = rank.port
        rank.kill()
        # Sends in the moment before libzmq sees the disconnect are queued and dropped with
        # the connection (see test_transport ZMQ-8); then sends fail.
        failure = first_send_failure(
            lambda room: Outbox(transport, backend).metadata(old, MetadataRequest(room, (), 0))
        )
        assert failure.endpoint == f"tcp://{LOOPBACK}:{old_port}"
        new_port = rank.restart()
        assert new_port != old_port and rank.starts == 2
        client = BootstrapClient()
        try:
            route = client.get_rank(server.address, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
        finally:
            client.close()
        assert route.rank_port == new_port  # last writer wins
        fresh = _generation(rank)
        done = AckRecorder()
        acks.expect(5000, 1, done)
        Outbox(transport, backend).register(fresh)
        Outbox(transport, backend).metadata(fresh, MetadataRequest(5000, (7,), 1))
        assert done.wait()


def test_zmq13_delayed_acks_all_arrive(
    server: BootstrapServer, acks: AckListener, transport: ZmqTransport
) -> None:
    """ZMQ-13: --ack-delay-ms holds acks in a heap; every room is still acked."""
    with PrefillRankProcess(server.address, TOKEN, ack_delay_ms=30) as rank:
        generation = _generation(rank)
        backend = SimpleBackend(LOOPBACK, acks.port, "decode-1")
        Outbox(transport, backend).register(generation)
        all_done = threading.Event()
        finished: list[int] = []

        def on_done(room: int) -> None:
            finished.append(room)
            if len(finished) == 20:
                all_done.set()

        for room in range(20):
            acks.expect(room, 1, on_done)
            Outbox(transport, backend).metadata(generation, MetadataRequest(room, (room,), 0))
        assert all_done.wait(10)
        stats = rank.terminate()
    assert sorted(finished) == list(range(20))
    assert stats is not None and stats["acks_sent"] == 20


def test_zmq13_wrong_token_fails_start_with_a_typed_error(server: BootstrapServer) -> None:
    rank = PrefillRankProcess(server.address, "wrong-token")
    with pytest.raises(PrefillRankStartFailed):
        rank.start()
    assert not rank.alive()


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp-rank", "2", "--tp-size", "2"],
        ["--pp-size", "0"],
        ["--ack-delay-ms", "-1"],
        ["--tp-rank", "x"],
        ["--liveness-timeout-s", "0.2"],
        ["--liveness-timeout-s", "-1"],
    ],
)
def test_zmq13_bad_arguments_are_rejected(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_args(["--bootstrap", "127.0.0.1:1", "--token", "t", *argv])
    assert caught.value.code == 2


def test_zmq27_the_status_sockets_bound_is_the_decodes_default_and_derived_as_its_own() -> None:
    """The reference prefill may not import the decode side, so it keeps the two constants of
    the one bound itself: they must stay the decode's."""
    assert DEFAULT_LIVENESS_TIMEOUT_S == liveness_bound.DEFAULT_LIVENESS_TIMEOUT_S
    assert RECONNECT_ATTEMPT_MS == liveness_bound.RECONNECT_ATTEMPT_MS
    ours = StatusSocketOptions.from_bound(DEFAULT_LIVENESS_TIMEOUT_S)
    decodes = liveness_bound.LivenessBound.from_timeout(DEFAULT_LIVENESS_TIMEOUT_S)
    assert (ours.heartbeat_ivl_ms, ours.heartbeat_timeout_ms, ours.heartbeat_ttl_ms) == (
        decodes.heartbeat_ivl_ms,
        decodes.heartbeat_timeout_ms,
        decodes.heartbeat_ttl_ms,
    )
    assert parse_args(["--bootstrap", "127.0.0.1:1", "--token", "t"]).liveness_timeout_s == 3.0


@pytest.mark.parametrize("bound", [0, 1.0])
def test_zmq27_a_status_socket_carries_the_bounds_options_or_libzmqs_defaults(
    acks: AckListener, bound: float
) -> None:
    """What libzmq reads back from the socket an ack leaves through: the bound's heartbeats,
    ``TCP_MAXRT`` and reconnect timing, or (``--liveness-timeout-s 0``) libzmq's defaults. The
    behaviour across a real cut is tests/integration/test_liveness_netns.py's ``test_zmq27_*``."""
    options = StatusSocketOptions.from_bound(bound) if bound else None
    counts = {"acks_sent": 0, "ack_failures": 0}
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sender = AckSender(context, counts, 1000, options)
    try:
        sender.send(acks.endpoint, [b"ack", b"1", b"0", b"0"])
        (sock,) = [peer.socket for peer in sender._peers.values()]
        read = {
            name: sock.getsockopt(getattr(zmq, name))
            for name in ("HEARTBEAT_IVL", "HEARTBEAT_TIMEOUT", "TCP_MAXRT", "CONNECT_TIMEOUT")
        }
        if options is None:
            assert read == {
                "HEARTBEAT_IVL": 0,
                "HEARTBEAT_TIMEOUT": -1,
                "TCP_MAXRT": 0,
                "CONNECT_TIMEOUT": 0,
            }
        else:
            assert read == {
                "HEARTBEAT_IVL": 250,
                "HEARTBEAT_TIMEOUT": 500,
                "TCP_MAXRT": 1000,
                "CONNECT_TIMEOUT": RECONNECT_ATTEMPT_MS,
            }
            assert sock.getsockopt(zmq.RECONNECT_IVL_MAX) == RECONNECT_ATTEMPT_MS
    finally:
        sender.close()
        context.term()
