"""Silence found within one bound, and healed at once, against the reference prefill running as
real processes in a network namespace this module creates (``tests/netns_support.py``).

The faults are real: every prefill process SIGSTOPped (a hang), every packet dropped both ways
with no reset (a partition), only the ranks' ports dropped while the bootstrap server answers
(a rank-path cut), the whole prefill SIGKILLed and replaced behind the same bootstrap address.
The parts are built from :class:`~statemachine.decode.liveness_bound.LivenessBound` as a user's
one setting would build them. Requirement IDs: ZMQ-25, HEALTH-5 (spec/zmq.md).

Detection is checked against the bound and recovery against 0.5 s, each with a margin
(``LOAD_MARGIN_S``) for a loaded 2-core machine; the figures themselves are the benchmark's
(``benchmarks/bench_liveness.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from netns_support import NetNamespace, NetnsPrefill, netns_unavailable

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.health import HealthMonitor
from statemachine.decode.liveness_bound import LivenessBound
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.transport import Endpoint, ZmqTransport
from statemachine.errors import RankDead, SendFailed
from statemachine.pool import BootstrapPool

pytestmark = pytest.mark.skipif(
    netns_unavailable() is not None, reason=f"network namespaces: {netns_unavailable()}"
)

BOUND = LivenessBound.from_timeout(1.0)
#: What a loaded machine may add to a deadline before the test calls it missed.
LOAD_MARGIN_S = 0.5
#: The first success after the path or the process returns (issue 27).
RECOVERY_S = 0.5
PROBE = [b"liveness-probe"]  # a message the reference rank counts as malformed and drops


class Verdicts:
    """Transport listener: the first dead and alive verdict per endpoint, with their times."""

    def __init__(self) -> None:
        self.dead: dict[Endpoint, tuple[float, str]] = {}
        self.alive: dict[Endpoint, float] = {}
        self._lock = threading.Lock()

    def __call__(self, endpoint: Endpoint, alive: bool, reason: str) -> None:
        with self._lock:
            if alive:
                self.alive.setdefault(endpoint, time.monotonic())
            else:
                self.dead.setdefault(endpoint, (time.monotonic(), reason))

    def all_dead(self, endpoints: list[Endpoint]) -> bool:
        return all(endpoint in self.dead for endpoint in endpoints)

    def latest_dead(self, endpoints: list[Endpoint]) -> float:
        return max(self.dead[endpoint][0] for endpoint in endpoints)


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def first_send_after(transport: ZmqTransport, endpoints: list[Endpoint], since: float) -> float:
    """Send to every endpoint until each send succeeds; the seconds from ``since`` to the last."""
    left = list(endpoints)
    deadline = since + 10.0
    while left and time.monotonic() < deadline:
        for endpoint in list(left):
            try:
                transport.send(endpoint, PROBE)
                left.remove(endpoint)
            except SendFailed:
                pass
        time.sleep(0.005)
    assert not left, f"no send to {left} succeeded within 10 s of the heal"
    return time.monotonic() - since


@pytest.fixture(scope="module")
def ns() -> Iterator[NetNamespace]:
    with NetNamespace() as namespace:
        yield namespace


@pytest.fixture(scope="module")
def prefill(ns: NetNamespace) -> Iterator[NetnsPrefill]:
    with NetnsPrefill(ns) as instance:
        yield instance


@pytest.fixture
def watched(prefill: NetnsPrefill) -> Iterator[tuple[ZmqTransport, Verdicts, Verdicts]]:
    """A transport with the bound's heartbeats and one with none (main's), both connected to
    every rank and retained; the verdicts each reported."""
    with (
        ZmqTransport(**BOUND.transport_options()) as transport,
        ZmqTransport() as plain,
    ):
        verdicts, plain_verdicts = Verdicts(), Verdicts()
        transport.subscribe(verdicts)
        plain.subscribe(plain_verdicts)
        endpoints = prefill.rank_endpoints
        for part in (transport, plain):
            part.retain(endpoints)
            first_send_after(part, endpoints, time.monotonic())
        yield transport, verdicts, plain_verdicts


@pytest.fixture
def health(prefill: NetnsPrefill) -> Iterator[tuple[HealthMonitor, list[tuple[float, str]]]]:
    deaths: list[tuple[float, str]] = []
    monitor = HealthMonitor(
        BootstrapPool(),
        on_dead=lambda addr, reason: deaths.append((time.monotonic(), reason)),
        **BOUND.health_options(),
    )
    monitor.watch(prefill.addr)
    with monitor:
        yield monitor, deaths


def test_zmq24_a_stopped_prefill_is_found_within_the_bound_and_served_at_sigcont(
    prefill: NetnsPrefill,
    watched: tuple[ZmqTransport, Verdicts, Verdicts],
    health: tuple[HealthMonitor, list[tuple[float, str]]],
) -> None:
    transport, verdicts, without_heartbeats = watched
    _, deaths = health
    endpoints = prefill.rank_endpoints
    stopped = time.monotonic()
    prefill.hang()
    try:
        assert wait_for(lambda: verdicts.all_dead(endpoints) and bool(deaths), 10.0)
        rank_detection = verdicts.latest_dead(endpoints) - stopped
        health_detection = deaths[0][0] - stopped
        assert rank_detection <= BOUND.rank_detection_s + LOAD_MARGIN_S, rank_detection
        assert health_detection <= BOUND.health_detection_s + LOAD_MARGIN_S, health_detection
        assert "disconnected" in verdicts.dead[endpoints[0]][1]
        assert "health probes in a row failed" in deaths[0][1]
        # Judged dead: a send fails at once, none waits on the stopped rank.
        with pytest.raises(SendFailed, match="is down"):
            transport.send(endpoints[0], PROBE)
        # main's transport, without heartbeats, has seen nothing all this time
        assert not without_heartbeats.dead
    finally:
        prefill.resume()
    resumed = time.monotonic()
    assert first_send_after(transport, endpoints, resumed) <= RECOVERY_S + LOAD_MARGIN_S


def test_zmq24_a_partition_without_resets_is_found_within_the_bound_and_heals_at_once(
    ns: NetNamespace,
    prefill: NetnsPrefill,
    watched: tuple[ZmqTransport, Verdicts, Verdicts],
    health: tuple[HealthMonitor, list[tuple[float, str]]],
) -> None:
    transport, verdicts, without_heartbeats = watched
    _, deaths = health
    endpoints = prefill.rank_endpoints
    cut = time.monotonic()
    ns.partition()
    try:
        assert wait_for(lambda: verdicts.all_dead(endpoints) and bool(deaths), 10.0)
        rank_detection = verdicts.latest_dead(endpoints) - cut
        health_detection = deaths[0][0] - cut
        assert rank_detection <= BOUND.rank_detection_s + LOAD_MARGIN_S, rank_detection
        assert health_detection <= BOUND.health_detection_s + LOAD_MARGIN_S, health_detection
        assert not without_heartbeats.dead
        # Let libzmq's reconnect attempts into the cut run a while: none may be left backing
        # off when the path returns.
        time.sleep(1.0)
    finally:
        ns.heal()
    healed = time.monotonic()
    assert first_send_after(transport, endpoints, healed) <= RECOVERY_S + LOAD_MARGIN_S
    # The bootstrap server answers again too: a fetch on a fresh connection.
    with BootstrapClient(**BOUND.client_options()) as client:
        assert client.health(prefill.addr) == prefill.instance_id


def test_zmq24_a_cut_of_the_rank_path_alone_is_found_while_the_server_answers(
    ns: NetNamespace,
    prefill: NetnsPrefill,
    watched: tuple[ZmqTransport, Verdicts, Verdicts],
    health: tuple[HealthMonitor, list[tuple[float, str]]],
) -> None:
    transport, verdicts, without_heartbeats = watched
    monitor, deaths = health
    endpoints = prefill.rank_endpoints
    cut = time.monotonic()
    ns.cut_ports(prefill.rank_ports)
    try:
        assert wait_for(lambda: verdicts.all_dead(endpoints), 10.0)
        detection = verdicts.latest_dead(endpoints) - cut
        assert detection <= BOUND.rank_detection_s + LOAD_MARGIN_S, detection
        # The health probes still succeed: only the heartbeats can see this cut.
        probes = monitor.stats().probes
        assert wait_for(lambda: monitor.stats().probes >= probes + 2, 5.0)
        assert not deaths and monitor.stats().failures == 0
        assert not without_heartbeats.dead
    finally:
        ns.heal()
    healed = time.monotonic()
    assert first_send_after(transport, endpoints, healed) <= RECOVERY_S + LOAD_MARGIN_S


def test_zmq24_requests_waiting_on_a_stopped_prefill_fail_typed_within_the_bound(
    ns: NetNamespace,
) -> None:
    """Through the manager: the bound's transport and fetch client handed in, requests waiting
    for a transfer (the prefill acks after a minute) fail RankDead within the bound of the
    SIGSTOP, and after SIGCONT a new request is served again."""
    transport = ZmqTransport(**BOUND.transport_options())
    client = BootstrapClient(**BOUND.client_options())
    plan = RankPlan(tp_ranks=(0, 1))
    try:
        with (
            NetnsPrefill(ns, ack_delay_ms=60_000) as slow,
            DecodeManager(
                ack_ip=ns.host_ip,
                transport=transport,
                source=client,
                health_interval_s=BOUND.health_interval_s,
                failures_to_dead=BOUND.failures_to_dead,
            ) as manager,
        ):
            waiting = []
            for room in range(1, 5):
                receiver = manager.receiver(slow.addr, room, plan, prefill_dp_rank=0)
                assert receiver.init(0) == KVPoll.WaitingForInput
                receiver.send_metadata((1, 2, 3), aux_index=0)
                waiting.append(receiver)
            stopped = time.monotonic()
            slow.hang()
            try:
                assert wait_for(lambda: all(r.poll() == KVPoll.Failed for r in waiting), 10.0)
                detection = time.monotonic() - stopped
                assert detection <= BOUND.rank_detection_s + LOAD_MARGIN_S, detection
                assert all(isinstance(r.failure, RankDead) for r in waiting)
            finally:
                slow.resume()
            rooms = iter(range(100, 10_000))

            def one_served() -> bool:
                receiver = manager.receiver(slow.addr, next(rooms), plan, prefill_dp_rank=0)
                return receiver.init(0) == KVPoll.WaitingForInput

            assert wait_for(one_served, 5.0)
    finally:
        transport.close()
        client.close_all()


def test_zmq24_a_replacement_behind_the_same_bootstrap_address_is_seen_as_a_restart(
    prefill: NetnsPrefill,
    watched: tuple[ZmqTransport, Verdicts, Verdicts],
) -> None:
    """SIGKILL of every process and a new instance at the same bootstrap address: the old
    ranks' sockets are judged dead (the kernel reset them), the health probe reports the new
    instance id, and the new ranks take a send at once. Last in this module: it replaces the
    module's prefill."""
    transport, verdicts, _ = watched
    restarts: list[tuple[str, str]] = []
    monitor = HealthMonitor(
        BootstrapPool(),
        on_restart=lambda addr, old, new: restarts.append((old, new)),
        **BOUND.health_options(),
    )
    old_endpoints, old_instance = prefill.rank_endpoints, prefill.instance_id
    monitor.watch(prefill.addr)
    with monitor:
        prefill.replace()
        replaced = time.monotonic()
        assert wait_for(lambda: verdicts.all_dead(old_endpoints), 5.0)
        assert wait_for(lambda: bool(restarts), 5.0)
    assert restarts[0] == (old_instance, prefill.instance_id) and old_instance != restarts[0][1]
    assert first_send_after(transport, prefill.rank_endpoints, replaced) <= RECOVERY_S + 1.0
