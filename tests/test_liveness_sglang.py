"""The bound's liveness parts against SGLang 0.5.23's own code (ZMQ-25, HEALTH-5): the ZMTP
heartbeats need nothing from SGLang's prefill (its rank socket's libzmq answers the PINGs, even
with no thread of SGLang's reading it), and the derived health probes find SGLang's bootstrap
server alive. A bound this short would judge a peer that does not answer within 0.4 s."""

from __future__ import annotations

import time

from sglang_support import requires_sglang, sglang_bootstrap_server, sglang_prefill_rank
from zmq_support import VerdictRecorder, wait_until

from statemachine.decode.health import HealthMonitor
from statemachine.decode.liveness_bound import LivenessBound
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.pool import BootstrapPool

pytestmark = requires_sglang

BOUND = LivenessBound.from_timeout(0.5)  # PINGs every 125 ms, a silent connection 250 ms
HEARTBEAT_PERIODS = 8


def test_zmq24_sglang_prefill_answers_the_heartbeats_and_its_server_the_probes() -> None:
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
