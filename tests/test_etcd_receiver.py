"""The etcd source behind a real receiver: real prefill rank processes (ZMQ), real etcd.

The receiver fetches through whatever object it is given as its bootstrap source; here that is
:class:`EtcdBootstrapSource`, and the whole request (init, register, metadata, acks) runs as
with the HTTP client. A prefill restart on new ports is retired from the pool by the watch,
before any request is started on the stale generation.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from statemachine import lifecycle as life
from statemachine.decode.receiver import BootstrapReceiver, Decode
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.registrar import EtcdRegistrar
from statemachine.errors import NotReady
from statemachine.lifecycle import KVPoll
from statemachine.pool import BootstrapPool, PoolKey
from statemachine.validation import RouteReply
from tests.etcd_support import EtcdServer, running_etcd, wait_until
from tests.test_etcd_discovery import BOUND, payload
from tests.test_receiver import (
    PLAN,
    TP,
    DecodeSide,
    Prefill,
    make_decode,
    start_prefill,
    stop_prefill,
)


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with running_etcd() as server:
        yield server


@pytest.fixture
def http_side() -> Iterator[DecodeSide]:
    yield from make_decode()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    instance = start_prefill()
    yield instance
    stop_prefill(instance)


def register(etcd: EtcdServer, prefix: str, prefill: Prefill) -> EtcdRegistrar:
    """What ``prefill.rank --discovery etcd`` does, for every rank of the instance at once."""
    registrar = EtcdRegistrar(EtcdGateway([etcd.endpoint]), prefill.addr, prefix=prefix, ttl=10)
    for rank in prefill.ranks:
        registrar.register(payload(rank.port, tp=rank.tp_rank, tp_size=TP))
    return registrar


def visible(source: EtcdBootstrapSource, addr: str) -> set[RouteReply] | None:
    """What a fetch would get now; None while the prefill is (re)registering."""
    try:
        return {
            source.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0) for tp in range(TP)
        }
    except NotReady:
        return None


def run(side: DecodeSide, addr: str, room: int) -> BootstrapReceiver:
    receiver = BootstrapReceiver(side.decode, addr, room, PLAN)
    if receiver.init(0) == KVPoll.WaitingForInput:
        side.send(receiver)
        wait_until(lambda: receiver.poll() != KVPoll.Transferring, BOUND)
    return receiver


def test_receiver_bootstraps_through_etcd_and_a_restart_is_retired_by_the_watch(
    etcd: EtcdServer, prefill: Prefill, http_side: DecodeSide
) -> None:
    prefix = f"/test-{uuid.uuid4().hex[:12]}/ranks"
    pool: BootstrapPool = http_side.decode.pool
    source = EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix, pool=pool)
    fields: dict[str, Any] = {
        name: getattr(http_side.decode, name) for name in http_side.decode.__dataclass_fields__
    }
    fields["client"] = source  # the receiver does not know which source it talks to
    side = DecodeSide(Decode(**fields), http_side.acks)
    registrar = register(etcd, prefix, prefill)
    try:
        source.start()
        key = PoolKey(prefill.addr, 0, 0, 0)
        assert source.wait_synced(BOUND)
        first = run(side, prefill.addr, room=1)
        assert first.state == life.DONE, first.failure_exception
        generation = pool.get(key)
        assert generation is not None
        assert {rank.port for rank in generation.ranks} == prefill.ports()
        assert run(side, prefill.addr, room=2).entries[key] is generation  # a hit

        # The prefill's ranks crash and come back on new ports; the new instance registers.
        registrar.close(revoke=False)  # a crash: the old lease is left to expire
        prefill.restart_ranks()
        registrar = register(etcd, prefix, prefill)
        assert wait_until(lambda: pool.get(key) is not generation, BOUND)
        expected = {
            RouteReply("127.0.0.1", rank.port, registrar.instance_id) for rank in prefill.ranks
        }
        assert wait_until(lambda: visible(source, prefill.addr) == expected, BOUND)
        # Requests started now fetch the new registration: none fails.
        for room in range(3, 8):
            receiver = run(side, prefill.addr, room)
            assert receiver.state == life.DONE, receiver.failure_exception
        fresh = pool.get(key)
        assert fresh is not None and {r.port for r in fresh.ranks} == prefill.ports()
        assert source.stats().retired >= 1
    finally:
        registrar.close()
        source.close()
