"""ZmqTransport with its socket monitor against real peer processes killed and restarted.

ZMQ-16 (liveness), ZMQ-19 (circuit breaker), ZMQ-20 (resources follow generations) of
``spec/zmq.md``. Bounds here are generous correctness bounds (the machine is shared); the
figures are measured in ``benchmarks/bench_transport.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from statemachine.decode.ranks.outbox import Outbox
from statemachine.decode.ranks.transport import EXIT_PROVEN, ZmqTransport
from statemachine.demo.baselines import QueueingTransport
from statemachine.errors import SendFailed
from tests.support.zmq_support import (
    LOOPBACK,
    SinkProcess,
    VerdictRecorder,
    dead_port,
    fd_count,
    pull_peer,
    recv_n,
    wait_until,
    with_deadline,
)

# Longer than any verdict takes, so a send that returns well before it did not wait for it.
SLOW_MS = 5000


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _threads() -> int:
    """Monitor threads alive (by name: other tests' daemon threads may come and go)."""
    return sum(1 for t in threading.enumerate() if t.name == "zmq-endpoint-monitor")


def _timed_send(transport: ZmqTransport, endpoint: tuple[str, int]) -> tuple[float, bool]:
    started = time.monotonic()
    try:
        transport.send(endpoint, [b"x"])
        ok = True
    except SendFailed:
        ok = False
    return time.monotonic() - started, ok


def test_zmq16_a_killed_peer_is_reported_dead_and_its_sends_fail_fast() -> None:
    """ZMQ-16, ZMQ-19: SIGKILL a real peer: alive=False reaches the listener, the circuit
    opens, and five sends in a row fail without waiting (SNDTIMEO is 5 s here)."""
    verdicts = VerdictRecorder()
    with ZmqTransport(send_timeout_ms=SLOW_MS) as transport, SinkProcess() as sink:
        transport.subscribe(verdicts)
        endpoint = (LOOPBACK, sink.port)
        transport.retain([endpoint])
        transport.send(endpoint, [b"warm"])
        assert not transport.is_down(endpoint)
        killed = time.monotonic()
        sink.kill()
        reason, at = verdicts.wait_for(endpoint, alive=False, timeout=SLOW_MS / 1000)
        assert reason == f"disconnected, reconnect refused; {EXIT_PROVEN}"  # ZMQ-26
        assert transport.stats().exits == 1
        assert at - killed < 2.0
        assert transport.is_down(endpoint)
        stalls = [_timed_send(transport, endpoint) for _ in range(5)]
        assert not any(ok for _, ok in stalls)
        assert max(stall for stall, _ in stalls) < 0.5, stalls
        with pytest.raises(SendFailed) as caught:
            transport.send(endpoint, [b"x"])
        assert "is down (disconnected, reconnect refused)" in str(caught.value)
        assert "refetch" in str(caught.value)
        stats = transport.stats()
    assert stats.dead_verdicts == 1 and stats.circuit_failures >= 6
    assert verdicts.of(endpoint) == [False]


def test_zmq19_a_send_racing_the_kill_waits_for_the_verdict_not_sndtimeo() -> None:
    """ZMQ-19: the first send after a kill waits at most until the verdict, not SNDTIMEO."""
    with ZmqTransport(send_timeout_ms=SLOW_MS) as transport, SinkProcess() as sink:
        endpoint = (LOOPBACK, sink.port)
        transport.send(endpoint, [b"warm"])
        sink.kill()
        # Until libzmq's I/O thread notices the disconnect, sends are still queued on the
        # dying connection (ZMQ-8) and "succeed"; a loaded machine can take a few ms for it.
        stalls = []
        deadline = time.monotonic() + 10
        while len(stalls) < 5 and time.monotonic() < deadline:
            stall, ok = _timed_send(transport, endpoint)
            if ok:
                time.sleep(0.0005)
            else:
                stalls.append(stall)
        assert len(stalls) == 5
        assert max(stalls) < 2.0, stalls  # well under SNDTIMEO = 5 s


def test_zmq19_first_send_to_a_dead_port_fails_on_the_verdict() -> None:
    """A fresh socket to a port nobody listens on: the refused connect is the verdict."""
    verdicts = VerdictRecorder()
    with ZmqTransport(send_timeout_ms=SLOW_MS, down_hold_ms=60_000) as transport:
        transport.subscribe(verdicts)
        endpoint = (LOOPBACK, dead_port())
        stall, ok = _timed_send(transport, endpoint)
        assert not ok and stall < 2.0
        # and the probe confirms the refusal: an exit (ZMQ-26)
        reason = verdicts.wait_for(endpoint, alive=False)[0]
        assert reason == f"connect refused; {EXIT_PROVEN}"
        # Nobody retains it: closed at once, no reconnect attempts while idle, verdict held.
        assert wait_until(lambda: transport.stats().sockets_open == 0)
        time.sleep(0.05)  # the monitor reads its last event (MONITOR_STOPPED) and closes
        events = transport.stats().monitor_events
        time.sleep(0.2)
        assert transport.stats().monitor_events == events
        assert transport.is_down(endpoint)
        again, ok = _timed_send(transport, endpoint)
        assert not ok and again < 0.5
        assert transport.stats().sockets_created == 1


def test_zmq20_a_remembered_verdict_expires_after_down_hold_ms(context: zmq.Context) -> None:
    """ZMQ-20: the verdict on a dead endpoint nobody retains outlives its closed socket for
    ``down_hold_ms`` only; then it is forgotten, and the next send opens a new socket and
    reaches a peer that listens on that port by now. Catches a held verdict that never
    expires (every later send to the port fails in microseconds for ever, though a rank
    listens there again) and a hold kept in the wrong unit (milliseconds read as seconds)."""
    hold_ms = 300
    verdicts = VerdictRecorder()
    with ZmqTransport(send_timeout_ms=SLOW_MS, down_hold_ms=hold_ms) as transport:
        transport.subscribe(verdicts)
        endpoint = (LOOPBACK, dead_port())
        _, ok = _timed_send(transport, endpoint)
        assert not ok
        verdicts.wait_for(endpoint, alive=False)
        assert wait_until(lambda: transport.stats().sockets_open == 0)
        with pull_peer(context, endpoint[1]) as (peer, _):
            # The hold is a time by definition: wait (bounded) for it to end.
            assert wait_until(lambda: not transport.is_down(endpoint), hold_ms / 1000 + 5.0)
            assert transport.stats().endpoints_down == 0
            transport.send(endpoint, [b"back"])
            assert recv_n(peer, 1) == [[b"back"]]
        assert transport.stats().sockets_created == 2


def test_zmq16_a_retained_endpoint_comes_back_alive_behind_the_same_port(
    context: zmq.Context,
) -> None:
    """ZMQ-16: a retained dead endpoint keeps reconnecting (with back-off); a new process on
    the same port is reported alive=True and sends reach it again."""
    verdicts = VerdictRecorder()
    with ZmqTransport(send_timeout_ms=SLOW_MS) as transport:
        transport.subscribe(verdicts)
        sink = SinkProcess()
        endpoint = (LOOPBACK, sink.port)
        transport.retain([endpoint])
        transport.send(endpoint, [b"warm"])
        sink.kill()
        verdicts.wait_for(endpoint, alive=False)
        assert transport.stats().sockets_open == 1  # retained: kept, to see it come back
        with pull_peer(context, sink.port) as (peer, _):
            verdicts.wait_for(endpoint, alive=True, timeout=10)
            assert not transport.is_down(endpoint)
            transport.send(endpoint, [b"back"])
            assert recv_n(peer, 1) == [[b"back"]]
        stats = transport.stats()
    assert stats.reconnects == 1 and verdicts.of(endpoint) == [False, True]


def test_zmq16_a_peer_that_reconnects_within_the_grace_is_never_reported_dead(
    context: zmq.Context,
) -> None:
    """ZMQ-16: a disconnect is evidence, not proof. The peer's socket is closed and a new one
    bound on the same port before ZMQ's next reconnect attempt: no verdict, sends go on."""
    verdicts = VerdictRecorder()
    with ZmqTransport(send_timeout_ms=5000, reconnect_ivl_ms=1000, dead_grace_ms=5000) as transport:
        transport.subscribe(verdicts)
        with pull_peer(context) as (peer, port):
            endpoint = (LOOPBACK, port)
            transport.send(endpoint, [b"one"])
            assert recv_n(peer, 1) == [[b"one"]]
        rebound = None
        deadline = time.monotonic() + 0.8  # ZMQ's next attempt is 1 s after the disconnect
        while rebound is None and time.monotonic() < deadline:
            try:  # the old listener closes asynchronously
                rebound = pull_peer(context, port)
                peer, _ = rebound.__enter__()
            except zmq.ZMQError:
                rebound = None
                time.sleep(0.005)
        assert rebound is not None, "could not rebind the port in time"
        try:
            # A send in the moment before libzmq notices the old connection closed is lost
            # with it (ZMQ-8); sends after that wait for the reconnect and arrive.
            for _ in range(10):
                with_deadline(lambda: transport.send(endpoint, [b"two"]), 10)
                if peer.poll(1000, zmq.POLLIN):
                    break
            assert peer.recv_multipart() == [b"two"]
        finally:
            rebound.__exit__(None, None, None)
    assert verdicts.of(endpoint) == []


def test_zmq19_one_rank_down_five_requests_only_the_first_may_wait() -> None:
    """ZMQ-19, issue 8: a generation of two real ranks, one killed, the bootstrap server still
    naming its dead port. Five requests in a row each send to both ranks: the live rank gets
    every message, the dead one fails each request, and no request after the first waits."""
    with (
        ZmqTransport(send_timeout_ms=SLOW_MS) as transport,
        SinkProcess() as live,
        SinkProcess() as doomed,
    ):
        endpoints = [(LOOPBACK, live.port), (LOOPBACK, doomed.port)]
        for endpoint in endpoints:
            transport.send(endpoint, [b"warm"])
        doomed.kill()
        stalls: list[float] = []
        silent = 0  # requests queued on the dying connection before libzmq noticed (ZMQ-8)
        while len(stalls) < 5 and silent < 1000:
            transport.retain(endpoints)  # a refetched generation with the same ports
            started = time.monotonic()
            try:
                for endpoint in endpoints:
                    transport.send(endpoint, [b"request"])
                silent += 1
                assert not stalls, "a request after the first failure reached the dead rank"
                time.sleep(0.0005)
            except SendFailed:
                stalls.append(time.monotonic() - started)
            transport.release(endpoints)  # the caller invalidated it
        assert len(stalls) == 5
        assert max(stalls[1:]) < 0.5, stalls
        assert stalls[0] < SLOW_MS / 1000


def test_zmq19_a_send_timeout_opens_the_circuit_for_a_black_hole() -> None:
    """No monitor verdict (an endpoint that never answers): the failed send itself opens the
    circuit, so the next send fails at once. A non-routable TEST-NET address stands in for
    a black hole only if connect() hangs there; loopback peers never do, so the test uses a
    peer that accepts TCP but never speaks ZMTP (the handshake never completes)."""
    import socket

    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(16)
    endpoint = (LOOPBACK, listener.getsockname()[1])
    try:
        with ZmqTransport(send_timeout_ms=200, dead_grace_ms=10_000) as transport:
            first, ok = _timed_send(transport, endpoint)
            assert not ok and first >= 0.15
            assert transport.is_down(endpoint)
            second, ok = _timed_send(transport, endpoint)
            assert not ok and second < 0.1
    finally:
        listener.close()


def test_zmq20_release_closes_sockets_and_the_cache_is_bounded(context: zmq.Context) -> None:
    """ZMQ-20: a socket closes when its last retain is released; unretained sockets are an
    LRU bounded by max_sockets; retained ones are never evicted."""
    with ZmqTransport(max_sockets=3) as transport:
        peers = [pull_peer(context) for _ in range(6)]
        opened = [p.__enter__() for p in peers]
        try:
            endpoints = [(LOOPBACK, port) for _, port in opened]
            transport.retain(endpoints[:2])
            transport.retain(endpoints[:1])  # two generations use the first
            for (peer, _), endpoint in zip(opened, endpoints, strict=True):
                transport.send(endpoint, [b"x"])
                # Delivered before an eviction closes the socket (LINGER=0 drops a queue).
                assert recv_n(peer, 1) == [[b"x"]]
            stats = transport.stats()
            # 2 retained + at most one unretained beyond the bound.
            assert stats.sockets_open == 3 and stats.lru_evictions == 3
            transport.release(endpoints[:2])
            assert transport.stats().sockets_open == 2  # endpoints[1] closed, [0] still held
            transport.release(endpoints[:1])
            transport.release(endpoints[:1])  # unbalanced: ignored
            assert transport.stats().sockets_open == 1
            for (peer, _), endpoint in zip(opened, endpoints, strict=True):
                transport.send(endpoint, [b"y"])  # evicted ones reopen transparently
                assert recv_n(peer, 1) == [[b"y"]]
        finally:
            for p in peers:
                p.__exit__(None, None, None)
        assert transport.stats().retained == 0


def test_zmq20_fds_threads_and_sockets_stay_flat_over_real_restarts() -> None:
    """ZMQ-20, issue 8: 25 SIGKILL/restarts of the reference prefill rank process, each on a
    new port (a new generation that is registered, sent metadata, then released after the
    verdict): fds, monitor threads and sockets_open after the last equal those after the
    first (issue 8 measured +29 sockets and fds over 30 restarts before)."""
    from statemachine.decode.ranks.transport import generation_endpoints
    from statemachine.pool import Generation, RankInfo
    from statemachine.prefill.rank_process import PrefillRankProcess
    from statemachine.prefill.server import BootstrapServer
    from statemachine.wire.metadata import MetadataRequest
    from statemachine.wire.reference import SimpleBackend

    token = "test-token"
    verdicts = VerdictRecorder()
    backend = SimpleBackend(LOOPBACK, 5555, "soak")
    # The OS may give a new rank the port of one killed a moment ago: hold no verdict, so
    # that port is judged afresh (ZMQ-20) rather than failing fast for down_hold_ms.
    with (
        BootstrapServer(token=token) as server,
        ZmqTransport(down_hold_ms=1) as transport,
    ):
        transport.subscribe(verdicts)
        rank = PrefillRankProcess(server.address, token)
        samples = []
        try:
            for room in range(25):
                rank.restart()
                generation = Generation((RankInfo(LOOPBACK, rank.port, 0),))
                endpoints = generation_endpoints(generation)
                transport.retain(endpoints)
                Outbox(transport, backend).register(generation)
                Outbox(transport, backend).metadata(generation, MetadataRequest(room, (1,), 0))
                mark = verdicts.mark()
                rank.kill()
                verdicts.wait_for(endpoints[0], alive=False, since=mark)
                transport.release(endpoints)  # the generation that named it is gone
                assert wait_until(lambda: transport.stats().sockets_open == 0)
                samples.append((fd_count(), _threads()))
        finally:
            rank.kill()
        # libzmq's reaper thread frees a closed socket's fds a moment later: wait for it.
        first_fds, first_threads = samples[0]
        assert wait_until(lambda: fd_count() <= first_fds, 5), [fds for fds, _ in samples]
        assert _threads() <= first_threads, samples
        stats = transport.stats()
    assert stats.sockets_open == 0 and stats.retained == 0
    # A port the OS reused for a later rank is reported alive again, then dead again.
    assert stats.dead_verdicts == 25 and stats.sockets_created == 25, stats


def test_zmq16_listener_errors_are_contained_and_counted() -> None:
    verdicts = VerdictRecorder()

    def broken(endpoint: tuple[str, int], alive: bool, reason: str) -> None:
        raise RuntimeError("listener bug")

    with ZmqTransport() as transport:
        transport.subscribe(broken)
        transport.subscribe(verdicts)
        with pytest.raises(TypeError):
            transport.subscribe("not callable")  # type: ignore[arg-type]
        first, second = (LOOPBACK, dead_port()), (LOOPBACK, dead_port())
        for endpoint in (first, second):
            with pytest.raises(SendFailed):
                transport.send(endpoint, [b"x"])
            verdicts.wait_for(endpoint, alive=False)  # the second listener still ran
        assert transport.stats().listener_errors == 2


def test_zmq16_one_monitor_thread_per_transport(context: zmq.Context) -> None:
    before = _threads()
    with ZmqTransport() as transport:
        assert _threads() == before + 1
        peers = [pull_peer(context) for _ in range(8)]
        for p in peers:
            _, port = p.__enter__()
            transport.send((LOOPBACK, port), [b"x"])
        assert _threads() == before + 1
        for p in peers:
            p.__exit__(None, None, None)
    assert wait_until(lambda: _threads() == before)


def test_zmq16_queueing_mode_has_no_monitor() -> None:
    before = _threads()
    with QueueingTransport() as transport:
        assert _threads() == before
        transport.send((LOOPBACK, dead_port()), [b"queued"])  # SGLang: silently queued
        assert transport.stats().monitor_events == 0


def test_zmq16_a_listener_may_release_and_close_from_the_monitor_thread() -> None:
    """The manager's reaction runs on the monitor thread: release() there does not deadlock,
    and even close() from a listener returns."""
    done = threading.Event()
    transport = ZmqTransport()

    def react(endpoint: tuple[str, int], alive: bool, reason: str) -> None:
        transport.release([endpoint])
        transport.close()
        done.set()

    transport.subscribe(react)
    endpoint = (LOOPBACK, dead_port())
    transport.retain([endpoint])
    with pytest.raises(SendFailed):
        transport.send(endpoint, [b"x"])
    assert done.wait(10)
    assert transport.stats().sockets_open == 0


def test_zmq19_a_dead_decode_does_not_delay_acks_to_a_live_one() -> None:
    """Issue 10 item 7, through the reference prefill rank (its acks go out through a
    ZmqTransport): ten metadata messages from a decode whose ack port is dead, then a live
    decode's request. Each ack to the dead decode used to take SNDTIMEO (10 s in all); now
    the first fails on the monitor's verdict and the others at once."""
    from statemachine.decode.ranks.acks import AckListener
    from statemachine.pool import Generation, RankInfo
    from statemachine.prefill.rank_process import PrefillRankProcess
    from statemachine.prefill.server import BootstrapServer
    from statemachine.wire.metadata import MetadataRequest
    from statemachine.wire.reference import SimpleBackend

    token = "test-token"
    with BootstrapServer(token=token) as server, PrefillRankProcess(server.address, token) as rank:
        generation = Generation((RankInfo(LOOPBACK, rank.port, 0),))
        with ZmqTransport() as transport, AckListener() as acks:
            dead = SimpleBackend(LOOPBACK, dead_port(), "dead-decode")
            Outbox(transport, dead).register(generation)
            for room in range(10):
                Outbox(transport, dead).metadata(generation, MetadataRequest(room, (1,), 0))
            live = SimpleBackend(LOOPBACK, acks.port, "live-decode")
            Outbox(transport, live).register(generation)
            done = threading.Event()
            acks.expect(99, 1, lambda room: done.set())
            started = time.monotonic()
            Outbox(transport, live).metadata(generation, MetadataRequest(99, (1,), 0))
            assert done.wait(30)
            assert time.monotonic() - started < 5.0  # was 10 s: one SNDTIMEO per dead ack
        # The rank queues acks per decode peer and drops what a peer has not taken within its
        # ack timeout (1 s by default, ACK-1): wait that out, so the dead ones are counted.
        time.sleep(1.5)
        counts = rank.terminate()
    assert counts is not None and counts["ack_failures"] == 10 and counts["acks_sent"] == 1


def test_zmq20_a_generation_retains_and_releases_every_rank_dummy_included(
    context: zmq.Context,
) -> None:
    from statemachine.decode.ranks.transport import generation_endpoints
    from statemachine.pool import Generation, RankInfo
    from statemachine.wire.reference import SimpleBackend

    with (
        pull_peer(context) as (peer, port),
        pull_peer(context) as (dummy, dummy_port),
        ZmqTransport() as transport,
    ):
        generation = Generation(
            (RankInfo(LOOPBACK, port, 0), RankInfo(LOOPBACK, dummy_port, 0, is_dummy=True))
        )
        endpoints = generation_endpoints(generation)
        assert endpoints == ((LOOPBACK, port), (LOOPBACK, dummy_port))
        transport.retain(endpoints)
        Outbox(transport, SimpleBackend(LOOPBACK, 5555, "s")).register(generation)
        assert len(recv_n(peer, 1)) == len(recv_n(dummy, 1)) == 1
        assert transport.stats().retained == 2 and transport.stats().sockets_open == 2
        transport.release(endpoints)
        assert transport.stats().sockets_open == 0 and transport.stats().retained == 0
