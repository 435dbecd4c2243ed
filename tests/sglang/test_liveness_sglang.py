"""The bound's liveness parts against SGLang 0.5.23's own code (ZMQ-25, HEALTH-5, HEALTH-6,
MGR-22): the ZMTP heartbeats need nothing from SGLang's prefill (its rank socket's libzmq answers
the PINGs, even with no thread of SGLang's reading it), and the derived health probes find
SGLang's bootstrap server alive (on loopback, a bound of 0.5 s: a peer that did not answer
within 0.4 s would be judged). Then SGLang's server and rank as a process in a network namespace
the test creates, stopped or cut off in front of a manager (root; skipped elsewhere)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from statemachine.decode.health import HealthMonitor
from statemachine.decode.liveness_bound import LivenessBound
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import DecodeLayout
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.pool import BootstrapPool
from statemachine.wire.reference import SimpleBackend
from tests.support.liveness_support import BOUND as NETNS_BOUND
from tests.support.liveness_support import silence_through_manager
from tests.support.netns_support import NetNamespace, SGLangNetnsPrefill, netns_unavailable
from tests.support.sglang_support import (
    requires_sglang,
    sglang_bootstrap_server,
    sglang_prefill_rank,
)
from tests.support.zmq_support import VerdictRecorder, wait_until

pytestmark = requires_sglang

BOUND = LivenessBound.from_timeout(0.5)  # PINGs every 125 ms, a silent connection 250 ms
HEARTBEAT_PERIODS = 8


def test_zmq25_sglang_prefill_answers_the_heartbeats_and_its_server_the_probes() -> None:
    deaths: list[str] = []
    with (
        sglang_bootstrap_server() as url,
        sglang_prefill_rank(url, tp_size=1, tp_rank=0) as rank,
        ZmqTransport(**BOUND.transport_options()) as transport,
    ):
        verdicts = VerdictRecorder()
        transport.subscribe(verdicts)
        endpoint = (rank.local_ip, rank.rank_port)
        transport.retain([endpoint])
        # A message nobody reads: SGLang's common manager binds the socket, a transfer
        # backend's thread would read it. libzmq answers PINGs all the same.
        transport.send(endpoint, [b"unread"])
        monitor = HealthMonitor(
            BootstrapPool(),
            on_dead=lambda addr, reason: deaths.append(reason),
            **BOUND.health_options(),
        )
        monitor.watch(url, baseline_now=False)
        with monitor:
            time.sleep(HEARTBEAT_PERIODS * BOUND.heartbeat_ivl_ms / 1000)
            assert wait_until(lambda: monitor.stats().probes >= 3, 5.0)
        assert verdicts.of(endpoint) == [], "SGLang's rank socket left a heartbeat unanswered"
        assert not transport.is_down(endpoint)
        assert deaths == [] and monitor.stats().failures == 0
        transport.send(endpoint, [b"still connected"])


# --- SGLang's bootstrap server and prefill rank in a network namespace (MGR-22, ZMQ-25) ---------


@pytest.fixture(scope="module")
def sglang_in_ns() -> Iterator[tuple[NetNamespace, SGLangNetnsPrefill]]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces: {reason}")
    with NetNamespace() as ns:
        prefill = SGLangNetnsPrefill(ns)
        try:
            yield ns, prefill
        finally:
            prefill.close()


@pytest.mark.parametrize("fault", ["hang", "partition", "rank-cut"])
def test_mgr22_sglang_prefill_silent_fails_requests_typed_and_heals_at_once(
    sglang_in_ns: tuple[NetNamespace, SGLangNetnsPrefill], fault: str
) -> None:
    """SGLang 0.5.23's bootstrap server and rank, stopped (SIGSTOP, SIGCONT), cut off without
    resets, or cut on the rank's port alone, in front of a manager built from
    ``liveness_timeout_s=1``: the requests waiting for their transfer fail typed within the
    bound, the next ones fail at once (``PrefillSilent`` while SGLang's server is silent; the
    rank refused while only its path is cut), and the first request after the heal is served
    within 0.5 s. SGLang's server has no instance id: the heartbeats and probes are all a
    decode has."""
    ns, prefill = sglang_in_ns
    faults: dict[str, tuple[Callable[[], None], Callable[[], None], bool]] = {
        "hang": (prefill.hang, prefill.resume, True),
        "partition": (ns.partition, ns.heal, True),
        "rank-cut": (lambda: ns.cut_ports([prefill.rank_port]), ns.heal, False),
    }
    start_fault, heal, server_silent = faults[fault]
    with DecodeManager(
        completion="external",  # SGLang's transfer engine would report; nothing does here
        backend=SimpleBackend(ns.host_ip, 1, "engine-session"),
        layout=DecodeLayout(tp_rank=0, tp_size=1),
        liveness_timeout_s=NETNS_BOUND.liveness_timeout_s,
    ) as manager:

        def receiver_for(room: int) -> BootstrapReceiver:
            return manager.receiver(prefill.addr, room)

        silence_through_manager(manager, receiver_for, start_fault, heal, server_silent)
