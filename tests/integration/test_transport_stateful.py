"""Random sequences of retain / release / send / evict against live and dead endpoints.

Properties (ZMQ-5, ZMQ-19, ZMQ-20 of ``spec/zmq.md``), checked after every step on real
sockets: a send to a live peer always succeeds and arrives; a send to a dead port always
raises ``SendFailed``; no unretained socket beyond ``max_sockets`` stays open; a retained
endpoint's count is what the steps say; at the end every socket is closed.
"""

from __future__ import annotations

import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.errors import SendFailed
from tests.support.zmq_support import LOOPBACK, dead_port, recv_n, wait_until

LIVE = 3
DEAD = 2
MAX_SOCKETS = 2


class TransportMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.context: zmq.Context = zmq.Context()
        self.peers: list[zmq.Socket] = []
        self.live: list[tuple[str, int]] = []
        for _ in range(LIVE):
            peer = self.context.socket(zmq.PULL)
            peer.setsockopt(zmq.LINGER, 0)
            self.live.append((LOOPBACK, peer.bind_to_random_port(f"tcp://{LOOPBACK}")))
            self.peers.append(peer)
        self.dead = [(LOOPBACK, dead_port()) for _ in range(DEAD)]
        self.transport = ZmqTransport(send_timeout_ms=5000, max_sockets=MAX_SOCKETS)
        self.refs: dict[tuple[str, int], int] = {}
        self.sent = 0

    def all_endpoints(self) -> list[tuple[str, int]]:
        return self.live + self.dead

    @rule(index=st.integers(0, LIVE + DEAD - 1))
    def retain(self, index: int) -> None:
        endpoint = self.all_endpoints()[index]
        self.transport.retain([endpoint])
        self.refs[endpoint] = self.refs.get(endpoint, 0) + 1

    @rule(index=st.integers(0, LIVE + DEAD - 1))
    def release(self, index: int) -> None:
        endpoint = self.all_endpoints()[index]
        self.transport.release([endpoint])
        if self.refs.get(endpoint, 0) > 1:
            self.refs[endpoint] -= 1
        else:
            self.refs.pop(endpoint, None)

    @rule(index=st.integers(0, LIVE - 1))
    def send_live(self, index: int) -> None:
        self.sent += 1
        self.transport.send(self.live[index], [b"%d" % self.sent])
        assert recv_n(self.peers[index], 1) == [[b"%d" % self.sent]]

    @rule(index=st.integers(0, DEAD - 1))
    def send_dead(self, index: int) -> None:
        try:
            self.transport.send(self.dead[index], [b"lost"])
        except SendFailed:
            return
        raise AssertionError("a send to a dead port succeeded")

    @rule(index=st.integers(0, LIVE + DEAD - 1))
    def evict(self, index: int) -> None:
        self.transport.evict(self.all_endpoints()[index])

    @invariant()
    def counts_match(self) -> None:
        stats = self.transport.stats()
        assert stats.retained == len(self.refs)
        unretained_open = [
            e
            for e, entry in self.transport._entries.items()
            if e not in self.refs and not entry.closed
        ]
        assert len(unretained_open) <= MAX_SOCKETS
        assert stats.sockets_open >= len(self.transport._entries)

    def teardown(self) -> None:
        self.transport.release([e for e, n in self.refs.items() for _ in range(n)])
        # Unretained dead sockets are closed by their verdict; everything at release.
        assert wait_until(lambda: all(e in self.live for e in self.transport._entries), 10), (
            self.transport.stats()
        )
        self.transport.close()
        assert self.transport.stats().sockets_open == 0
        for peer in self.peers:
            peer.close(linger=0)
        self.context.term()


TransportMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
test_transport_bookkeeping = TransportMachine.TestCase
