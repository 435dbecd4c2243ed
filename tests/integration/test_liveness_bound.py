"""One bound on silence (ZMQ-25, HEALTH-5, MGR-22) on loopback: what the bound derives, and the
parts built from it finding a real stopped peer process and a real silent listener. Runs anywhere
(no root); the namespace faults are in ``tests/integration/test_liveness_netns.py``."""

from __future__ import annotations

import math
import os
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.config import DecodeConfig
from statemachine.decode.health import HealthMonitor
from statemachine.decode.liveness_bound import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    RECONNECT_ATTEMPT_MS,
    LivenessBound,
)
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.errors import (
    ConfigurationError,
    InvalidArgument,
    NotReady,
    PrefillSilent,
    SendFailed,
    TransportFailure,
)
from statemachine.pool import BootstrapPool
from statemachine.prefill.server import BootstrapServer
from tests.support.zmq_support import SinkProcess, VerdictRecorder, wait_until

LOAD_MARGIN_S = 0.5  # what a loaded 2-core machine may add to a deadline


@pytest.mark.parametrize("seconds", [DEFAULT_LIVENESS_TIMEOUT_S, 1.0, 0.5])
def test_zmq25_every_verdict_of_silence_falls_within_the_bound(seconds: float) -> None:
    bound = LivenessBound.from_timeout(seconds)
    assert bound.liveness_timeout_s == seconds
    assert bound.rank_detection_s <= seconds
    assert math.isclose(bound.health_detection_s, seconds)
    assert bound.fetch_read_timeout_s <= seconds and bound.fetch_connect_timeout_s < seconds
    # Recovery does not grow with the bound: one attempt plus one wait.
    assert bound.connect_timeout_ms + bound.reconnect_ivl_max_ms == 2 * RECONNECT_ATTEMPT_MS
    # Each part takes its options as they are.
    ZmqTransport(**bound.transport_options()).close()
    HealthMonitor(BootstrapPool(), **bound.health_options()).stop()
    BootstrapClient(**bound.client_options()).close_all()


@pytest.mark.parametrize("bad", [0.4, 0, -3, float("nan"), "3", True, None])
def test_zmq25_a_bound_that_is_not_a_number_of_seconds_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="liveness_timeout_s must be"):
        LivenessBound.from_timeout(bad)  # type: ignore[arg-type]


def test_zmq25_heartbeats_are_refused_half_given_and_bad_values_are_named() -> None:
    with pytest.raises(InvalidArgument, match="need heartbeat_ivl_ms"):
        ZmqTransport(heartbeat_timeout_ms=500)
    with pytest.raises(InvalidArgument, match="heartbeat_ivl_ms must be a positive int"):
        ZmqTransport(heartbeat_ivl_ms=0)
    with pytest.raises(InvalidArgument, match="heartbeat_ttl_ms must be a positive int"):
        ZmqTransport(heartbeat_ivl_ms=100, heartbeat_ttl_ms=-1)
    with pytest.raises(InvalidArgument, match="connect_timeout_ms must be a positive int"):
        ZmqTransport(connect_timeout_ms=0)


@pytest.fixture
def stopped_peer() -> Iterator[SinkProcess]:
    """A real PULL peer process; continued (SIGCONT) and killed on exit whatever happened."""
    with SinkProcess() as sink:
        try:
            yield sink
        finally:
            os.kill(sink.proc.pid, signal.SIGCONT)


def test_zmq25_heartbeats_find_a_stopped_peer_that_main_never_finds(
    stopped_peer: SinkProcess,
) -> None:
    """A SIGSTOPped peer keeps its TCP connections: without heartbeats (main's transport) no
    verdict comes; with the bound's, the endpoint is judged dead within the bound, sends fail at
    once, and after SIGCONT the pending handshake completes and a send goes through."""
    bound = LivenessBound.from_timeout(1.0)
    endpoint = ("127.0.0.1", stopped_peer.port)
    with ZmqTransport(**bound.transport_options()) as transport, ZmqTransport() as plain:
        verdicts, plain_verdicts = VerdictRecorder(), VerdictRecorder()
        transport.subscribe(verdicts)
        plain.subscribe(plain_verdicts)
        for part in (transport, plain):
            part.retain([endpoint])
            part.send(endpoint, [b"hello"])
        stopped = time.monotonic()
        os.kill(stopped_peer.proc.pid, signal.SIGSTOP)
        reason, at = verdicts.wait_for(endpoint, alive=False, timeout=10.0)
        assert at - stopped <= bound.rank_detection_s + LOAD_MARGIN_S
        assert "disconnected" in reason
        with pytest.raises(SendFailed, match="is down"):
            transport.send(endpoint, [b"refused at once"])
        assert plain_verdicts.of(endpoint) == []
        os.kill(stopped_peer.proc.pid, signal.SIGCONT)
        verdicts.wait_for(endpoint, alive=True, timeout=5.0)
        transport.send(endpoint, [b"served again"])


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """An address whose kernel accepts connections that nobody ever reads or answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_health_5_probe_timeout_bounds_each_probe(silent_listener: str) -> None:
    deaths: list[tuple[float, str]] = []
    monitor = HealthMonitor(
        BootstrapPool(),
        interval_s=0.05,
        failures_to_dead=2,
        probe_timeout_s=0.2,
        on_dead=lambda addr, reason: deaths.append((time.monotonic(), reason)),
    )
    monitor.watch(silent_listener, instance_id="known")  # no baseline probe
    started = time.monotonic()
    with monitor:
        assert wait_until(lambda: bool(deaths), 5.0)
    # two probes of at most 0.05 s wait + 0.2 s each (main's probe waited 3 s per read)
    assert deaths[0][0] - started <= 2 * (0.05 + 0.2) + LOAD_MARGIN_S
    assert "0.2 s" in deaths[0][1]


def test_health_5_a_probe_timeout_and_a_client_are_not_both_taken() -> None:
    with pytest.raises(ValueError, match="probe_timeout_s or client"):
        HealthMonitor(BootstrapPool(), client=BootstrapClient(), probe_timeout_s=1.0)
    with pytest.raises(ValueError, match="probe_timeout_s must be > 0"):
        HealthMonitor(BootstrapPool(), probe_timeout_s=0)


def test_zmq25_the_manager_takes_one_setting_and_names_what_it_replaced() -> None:
    """``liveness_timeout_s`` is the decode's one setting on silence (default 3 s); a bound
    below the floor is refused as configuration, and the settings it replaced are refused with
    what to write instead."""
    assert DecodeConfig().liveness_timeout_s == DEFAULT_LIVENESS_TIMEOUT_S == 3.0
    assert DecodeConfig(liveness_timeout_s=1.0).liveness == LivenessBound.from_timeout(1.0)
    with pytest.raises(ConfigurationError, match=r"liveness_timeout_s must be at least 0\.5 s"):
        DecodeConfig(liveness_timeout_s=0.2)
    with pytest.raises(
        ConfigurationError, match="set liveness_timeout_s=SECONDS, or health_probes"
    ):
        DecodeManager(health_interval_s=1.0)
    with pytest.raises(ConfigurationError, match="failures_to_dead is derived from liveness"):
        DecodeManager(failures_to_dead=3)
    with pytest.raises(ConfigurationError, match="health_probes must be True or False"):
        DecodeConfig(health_probes=None)  # type: ignore[arg-type]
    with DecodeManager(liveness_timeout_s=1.0) as manager:
        assert manager.health is not None  # probes at the bound's interval
        assert manager.stats().silent_addresses == 0
    with DecodeManager(health_probes=False) as manager:
        assert manager.health is None


def test_mgr22_a_request_for_an_address_judged_silent_fails_at_once_until_it_answers() -> None:
    """The hold-off on a real manager: a bootstrap address whose probes go unanswered (a
    listener whose kernel completes each connect and nobody ever replies: a stopped server)
    makes every request for it fail at once with ``PrefillSilent`` - retryable, naming the
    address and what to do - without a fetch. A refused probe (the listener closed: nothing
    listens now, and the host says so at once) lifts it: the next request asks, is refused in
    turn, and the one after a server listens there again is served. The manager's own monitor
    probes every bound/4 = 0.25 s."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    port = listener.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    plan = RankPlan(tp_ranks=(0,))
    server = None
    with DecodeManager(liveness_timeout_s=1.0) as manager:
        try:
            assert manager.health is not None
            manager.health.watch(addr, instance_id="unknown")  # no baseline probe
            assert wait_until(lambda: manager.stats().silent_addresses == 1, 10.0)
            for room in (1, 2):
                receiver = manager.receiver(addr, room, plan, prefill_dp_rank=0)
                assert receiver.init() == KVPoll.Failed
                failure = receiver.failure
                assert isinstance(failure, PrefillSilent) and isinstance(failure, NotReady)
                assert failure.addr == addr
                assert f"the bootstrap server at {addr} is not answering" in str(failure)
                assert "Nothing of this request was asked or sent; retry it shortly" in str(failure)
            assert manager.stats().refused_silent == 2
            assert manager.stats().misses == 0  # no fetch was made
            listener.close()  # refused from now on: heard, the hold-off is lifted
            assert wait_until(lambda: manager.stats().silent_addresses == 0, 10.0)
            receiver = manager.receiver(addr, 3, plan, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Failed
            assert "connection refused" in str(receiver.failure), receiver.failure
            server = BootstrapServer("127.0.0.1", port, insecure=True).start()
            receiver = manager.receiver(addr, 4, plan, prefill_dp_rank=0)
            receiver.init()  # asks the server (no rank registered: NotReady)
            assert isinstance(receiver.failure, NotReady), receiver.failure
            assert not isinstance(receiver.failure, PrefillSilent), receiver.failure
            assert manager.stats().refused_silent == 2 and manager.stats().misses == 2
        finally:
            listener.close()
            if server is not None:
                server.stop()


def test_mgr22_an_address_that_refuses_connections_is_judged_dead_but_not_held_off() -> None:
    """A bootstrap server that is gone, its host up (SIGKILL: the port refuses at once): the
    probes judge it dead, and a request fails at once all the same - its fetch is refused
    (``TransportFailure``, retryable) - so it is not held off: the first request after a
    server listens there again is served at once, with no probe in between (the probes run
    once an hour here). Held off, it would have failed with ``PrefillSilent`` until the next
    recheck: in a cold restart of SGLang's prefill, the requests of up to one recheck interval
    after the replacement was READY."""
    server = BootstrapServer("127.0.0.1", 0, insecure=True).start()
    addr, port = server.address, server.port
    plan = RankPlan(tp_ranks=(0,))
    with DecodeManager(liveness_timeout_s=14_400.0) as manager:
        assert manager.health is not None
        manager.health.watch(addr)
        server.stop()
        manager.health.probe_once()
        manager.health.probe_once()  # two failures in a row: judged dead
        assert manager.health.stats().deaths_seen == 1
        assert manager.stats().silent_addresses == 0
        receiver = manager.receiver(addr, 1, plan, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.Failed
        assert isinstance(receiver.failure, TransportFailure), receiver.failure
        assert "connection refused" in str(receiver.failure)
        server = BootstrapServer("127.0.0.1", port, insecure=True).start()
        try:
            receiver = manager.receiver(addr, 2, plan, prefill_dp_rank=0)
            receiver.init()  # asks the server again (no rank registered: NotReady)
            assert isinstance(receiver.failure, NotReady), receiver.failure
            assert not isinstance(receiver.failure, PrefillSilent), receiver.failure
            assert manager.stats().refused_silent == 0 and manager.stats().misses == 2
        finally:
            server.stop()
