"""The etcd source behind a real receiver: real prefill rank processes (ZMQ), real etcd.

The receiver fetches through whatever object it is given as its bootstrap source; here that is
:class:`EtcdBootstrapSource`, and the whole request (init, register, metadata, acks) runs as
with the HTTP client. A prefill restart on new ports is retired from the pool by the watch,
before any request is started on the stale generation.

The prefill rank processes still register with an HTTP bootstrap server (that is how they
start today); the test registers their ports in etcd as ``--discovery etcd`` would, and the
decode side never talks to the HTTP server.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from statemachine import lifecycle as life
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.registrar import EtcdRegistrar
from statemachine.errors import NotReady
from statemachine.lifecycle import KVPoll
from statemachine.pool import BootstrapPool, PoolKey
from statemachine.prefill.rank import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from statemachine.validation import RouteReply
from tests.etcd_support import EtcdServer, running_etcd, wait_until
from tests.test_etcd_discovery import BOUND, payload

TOKEN = "etcd-receiver-test"
TP = 2
PLAN = RankPlan(tp_ranks=tuple(range(TP)))


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with running_etcd() as server:
        yield server


@pytest.fixture
def prefill() -> Iterator[tuple[BootstrapServer, list[PrefillRankProcess]]]:
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    ranks = [PrefillRankProcess(server.address, TOKEN, tp_rank=tp, tp_size=TP) for tp in range(TP)]
    try:
        for rank in ranks:
            rank.start()
        yield server, ranks
    finally:
        for rank in ranks:
            rank.kill()
        server.stop()


def register(
    etcd: EtcdServer, prefix: str, addr: str, ranks: list[PrefillRankProcess], instance_id: str
) -> EtcdRegistrar:
    """What ``prefill.rank --discovery etcd`` does, for every rank of the instance at once.

    Under ``instance_id``, the instance the rank processes know they belong to (they registered
    with the bootstrap server, whose instance id they took): their frames name it (ZMQ-21).
    """
    registrar = EtcdRegistrar(
        EtcdGateway([etcd.endpoint]), addr, prefix=prefix, ttl=10, instance_id=instance_id
    )
    for rank in ranks:
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


def run(manager: DecodeManager, addr: str, room: int) -> BootstrapReceiver:
    """A whole request: init, send metadata (the manager expects the acks), poll to the end."""
    receiver = manager.receiver(addr, room, PLAN, prefill_dp_rank=0)
    if receiver.init() == KVPoll.WaitingForInput:
        receiver.send_metadata((1, 2, 3), aux_index=0)
        wait_until(lambda: receiver.poll() != KVPoll.Transferring, BOUND)
    return receiver


def test_receiver_bootstraps_through_etcd_and_a_restart_is_retired_by_the_watch(
    etcd: EtcdServer, prefill: tuple[BootstrapServer, list[PrefillRankProcess]]
) -> None:
    server, ranks = prefill
    addr = server.address
    prefix = f"/test-{uuid.uuid4().hex[:12]}/ranks"
    pool = BootstrapPool()
    source = EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix, pool=pool)
    # No HTTP health monitor: with etcd as the source there may be no server at the address.
    manager = DecodeManager(
        source=source,
        pool=pool,
        send_timeout_ms=500,
        waiting_timeout_s=5.0,
        health_interval_s=None,
    )
    registrar = register(etcd, prefix, addr, ranks, server.instance_id)
    try:
        source.start()
        key = PoolKey(addr, 0, 0, 0)
        assert source.wait_synced(BOUND)
        first = run(manager, addr, room=1)
        assert first.state == life.DONE, first.failure_exception
        generation = pool.get(key)
        assert generation is not None
        assert {rank.port for rank in generation.ranks} == {rank.port for rank in ranks}
        assert run(manager, addr, room=2).entries[key] is generation  # a hit

        # The prefill's ranks crash and come back on new ports; the new instance registers.
        registrar.close(revoke=False)  # a crash: the old lease is left to expire
        for rank in ranks:
            rank.kill()
        server.stop()  # the whole prefill instance restarts: a new instance id (ZMQ-21)
        server.start()
        for rank in ranks:
            rank.start(avoid_port=rank.port)
        registrar = register(etcd, prefix, addr, ranks, server.instance_id)
        assert wait_until(lambda: pool.get(key) is not generation, BOUND)
        expected = {RouteReply("127.0.0.1", rank.port, registrar.instance_id) for rank in ranks}
        assert wait_until(lambda: visible(source, addr) == expected, BOUND)
        # Requests started now fetch the new registration: none fails.
        for room in range(3, 8):
            receiver = run(manager, addr, room)
            assert receiver.state == life.DONE, receiver.failure_exception
        fresh = pool.get(key)
        assert fresh is not None and {r.port for r in fresh.ranks} == {r.port for r in ranks}
        assert source.stats().retired >= 1
    finally:
        registrar.close()
        manager.close()
        source.close()
