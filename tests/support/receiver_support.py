"""Real parts for the receiver and manager tests: a prefill of rank processes behind a real
bootstrap server, and a decode side (shared by tests/integration/ and
tests/model/test_trace_validation.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.ranks.acks import AckListener
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.decode.receiver import BootstrapReceiver, RankPlan
from statemachine.pool import BootstrapPool, PoolKey
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.reference import SimpleBackend
from tests.support.bootstrap_support import TOKEN

TP = 2


PLAN = RankPlan(tp_ranks=tuple(range(TP)))


POLL_LIMIT_S = 10.0


@dataclass
class Prefill:
    """One prefill instance: its bootstrap server and its tp rank processes."""

    server: BootstrapServer
    ranks: list[PrefillRankProcess] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return self.server.address

    def restart_ranks(self) -> None:
        """Crash every rank and start it again on a new port (re-registers: last writer wins)."""
        for rank in self.ranks:
            rank.kill()
        for rank in self.ranks:
            rank.start(avoid_port=rank.port)

    def ports(self) -> set[int]:
        return {rank.port for rank in self.ranks}


def start_prefill(ack_delay_ms: int = 0, port: int = 0) -> Prefill:
    server = BootstrapServer("127.0.0.1", port, token=TOKEN).start()
    prefill = Prefill(server)
    try:
        for tp_rank in range(TP):
            rank = PrefillRankProcess(
                server.address, TOKEN, tp_rank=tp_rank, tp_size=TP, ack_delay_ms=ack_delay_ms
            )
            prefill.ranks.append(rank)
            rank.start()
    except BaseException:
        stop_prefill(prefill)
        raise
    return prefill


def stop_prefill(prefill: Prefill) -> None:
    for rank in prefill.ranks:
        rank.kill()
    prefill.server.stop()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    instance = start_prefill()
    yield instance
    stop_prefill(instance)


@dataclass
class DecodeSide:
    decode: DecodeManager

    @property
    def acks(self) -> AckListener:
        assert self.decode.acks is not None
        return self.decode.acks

    @property
    def pool(self) -> BootstrapPool:
        return self.decode.pool

    def receiver(self, prefill: Prefill, room: int) -> BootstrapReceiver:
        return self.decode.receiver(prefill.addr, room, PLAN)

    def run(self, prefill: Prefill, room: int) -> BootstrapReceiver:
        """A whole request: init, send metadata, poll to the end."""
        receiver = self.receiver(prefill, room)
        if receiver.init(0) == KVPoll.WaitingForInput:
            self.send(receiver)
            finish(receiver)
        return receiver

    def send(self, receiver: BootstrapReceiver) -> KVPoll:
        return receiver.send_metadata((1, 2, 3), aux_index=0)


def finish(receiver: BootstrapReceiver) -> KVPoll:
    deadline = time.monotonic() + POLL_LIMIT_S
    while (status := receiver.poll()) == KVPoll.Transferring:
        assert time.monotonic() < deadline, f"{receiver} still transferring"
        time.sleep(0.005)
    return status


def make_decode(
    waiting_timeout_s: float = 5.0,
    backend_for: Callable[[int], SimpleBackend] | None = None,
    pool: BootstrapPool | None = None,
    transport: ZmqTransport | None = None,
) -> Iterator[DecodeSide]:
    """A decode side; ``backend_for(ack_port)`` may supply a custom backend; ``transport``
    one the caller owns (say, one whose socket monitor is off, to script a stale hit)."""
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)

    def factory(ip: str, port: int) -> SimpleBackend:
        if backend_for is None:
            return SimpleBackend(ip, port, "decode-test")
        return backend_for(port)

    manager = DecodeManager(
        source=client,
        pool=pool,
        backend_factory=factory,
        transport=transport,
        send_timeout_ms=500,
        waiting_timeout_s=waiting_timeout_s,
        health_probes=False,
    )
    try:
        yield DecodeSide(manager)
    finally:
        manager.close()
        client.close()


KEY_TP0 = 0  # the pool key names the first target tp rank


def key_of(prefill: Prefill) -> PoolKey:
    return PoolKey(prefill.addr, 0, 0, KEY_TP0)


@dataclass(frozen=True)
class _TwoDpPlan(RankPlan):
    """A plan whose request needs the same ranks under two pool keys (dp 0 and a second key
    for dp 0 named by tp rank 1), so that one key can hit while the other misses."""

    def keys_for(self, addr: str, dp_rank: int) -> tuple[PoolKey, ...]:
        return (PoolKey(addr, dp_rank, 0, 0), PoolKey(addr, dp_rank, 0, 1))
