"""etcd as a DecodeManager's source: a real etcd, prefill rank processes registering in it, and the
manager built on them (fixtures ``etcd`` and ``cluster``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.decode_on_etcd import manager_on_etcd
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.errors import NotReady
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.validation import RouteReply
from tests.support.etcd_support import EtcdServer, free_port, running_etcd, wait_until

TP = 2


PLAN = RankPlan(tp_ranks=tuple(range(TP)))


BOUND = 15.0  # generous correctness bound (s): processes start on a loaded machine


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with running_etcd() as server:
        yield server


class Instance:
    """One prefill instance: TP rank processes registering in etcd under one instance id."""

    def __init__(
        self, etcd: EtcdServer, prefix: str, addr: str, *, ack_delay_ms: int = 0, ttl: int = 10
    ) -> None:
        self.instance_id = uuid.uuid4().hex
        args = [
            *("--discovery", "etcd", "--etcd-endpoints", etcd.endpoint),
            *("--etcd-prefix", prefix, "--etcd-ttl", str(ttl)),
            *("--instance-id", self.instance_id),
        ]
        self.ranks = [
            PrefillRankProcess(
                addr, "unused", tp_rank=tp, tp_size=TP, ack_delay_ms=ack_delay_ms, extra_args=args
            )
            for tp in range(TP)
        ]

    def start(self) -> Instance:
        for rank in self.ranks:
            rank.start()
        return self

    def expected(self) -> set[RouteReply]:
        return {RouteReply("127.0.0.1", rank.port, self.instance_id) for rank in self.ranks}

    def terminate(self) -> None:
        """Graceful: SIGTERM; each rank revokes its lease before it closes its port."""
        for rank in self.ranks:
            rank.terminate()

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()


@pytest.fixture
def cluster(etcd: EtcdServer) -> Iterator[tuple[str, str, list[Instance]]]:
    """(prefix, bootstrap addr, instances to clean up): every instance is killed at the end."""
    prefix = f"/test-{uuid.uuid4().hex[:12]}/ranks"
    addr = f"127.0.0.1:{free_port()}"  # a name only: nothing listens there
    instances: list[Instance] = []
    try:
        yield prefix, addr, instances
    finally:
        for instance in instances:
            instance.kill()


def launch(
    etcd: EtcdServer,
    cluster: tuple[str, str, list[Instance]],
    *,
    ack_delay_ms: int = 0,
    ttl: int = 10,
) -> Instance:
    prefix, addr, instances = cluster
    instance = Instance(etcd, prefix, addr, ack_delay_ms=ack_delay_ms, ttl=ttl)
    instances.append(instance)
    return instance.start()


def visible(source: EtcdBootstrapSource, addr: str) -> set[RouteReply] | None:
    """What a fetch would get now; None while the prefill is (re)registering."""
    try:
        return {
            source.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0) for tp in range(TP)
        }
    except NotReady:
        return None


def manager_for(
    etcd: EtcdServer,
    prefix: str,
    manager_class: type[DecodeManager] = DecodeManager,
    **kwargs: object,
) -> DecodeManager:
    manager = manager_on_etcd(
        etcd.endpoint,
        prefix=prefix,
        manager_class=manager_class,
        waiting_timeout_s=20.0,
        send_timeout_ms=500,
        **kwargs,
    )
    assert isinstance(manager.source, EtcdBootstrapSource) and manager.source.wait_synced(BOUND)
    assert manager.health is None  # etcd mode: no HTTP health monitor
    return manager


def start(manager: DecodeManager, addr: str, room: int) -> BootstrapReceiver:
    """init + send_metadata: the request is in flight (``waiting``) unless it failed."""
    receiver = manager.receiver(addr, room, PLAN, prefill_dp_rank=0)
    if receiver.init() == KVPoll.WaitingForInput:
        receiver.send_metadata((1, 2, 3), aux_index=0)
    return receiver


def finish(receiver: BootstrapReceiver) -> BootstrapReceiver:
    wait_until(lambda: receiver.poll() not in (KVPoll.Transferring, KVPoll.WaitingForInput), BOUND)
    return receiver


def run(manager: DecodeManager, addr: str, room: int) -> BootstrapReceiver:
    return finish(start(manager, addr, room))
