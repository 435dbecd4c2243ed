"""One retry rule on every source (issue 17, "A crash on etcd"; spec/manager.md MGR-19).

A prefill is SIGKILLed (real rank processes); the transport's socket monitor judges its ranks
dead within milliseconds. Its registration may still be listed for a while: by etcd until the
ranks' leases expire, by a bootstrap server that outlived its ranks until they register again.
A request started then never reaches a live prefill: on both sources it fails with the same
retryable, typed error (``RanksUnreachable``, ``retryable`` True) without sending anything, and the
first request after the prefill registers again succeeds. Before, on etcd every such request
took the dead ranks and failed with ``SendFailed`` after trying to send.
"""

from __future__ import annotations

import pytest

from statemachine import lifecycle as life
from statemachine.completion import KVPoll
from statemachine.decode.manager import DecodeManager
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.errors import BootstrapHTTPError, RanksUnreachable
from statemachine.pool import PoolKey
from tests.support.etcd_cluster_support import (
    BOUND,
    PLAN,
    Instance,
    launch,
    manager_for,
    run,
    visible,
)
from tests.support.etcd_support import EtcdServer
from tests.support.manager_support import FAIL_BOUND_S, wait_until
from tests.support.manager_support import manager_for as http_manager_for
from tests.support.receiver_support import Prefill, start_prefill, stop_prefill
from tests.support.zmq_support import VerdictRecorder


def _after_the_crash(manager: DecodeManager, addr: str, room: int) -> None:
    """A request started once the ranks are known dead: fails retryable, sends nothing."""
    sends = manager.transport.stats().sends
    receiver = manager.receiver(addr, room, PLAN, prefill_dp_rank=0)
    assert receiver.init() == KVPoll.Failed
    failure = receiver.failure
    assert isinstance(failure, RanksUnreachable) and failure.retryable, failure
    assert not isinstance(failure, BootstrapHTTPError), failure  # not the source's error
    text = str(failure)
    assert "no newer registration is visible yet" in text and "retry shortly" in text
    assert "nothing of this request was sent" in text
    assert manager.transport.stats().sends == sends
    assert receiver.state == life.INVALIDATED and manager.stats().in_flight == 0


def _kill_and_wait_for_the_verdict(
    manager: DecodeManager, ports: list[int], kill: object, key: PoolKey
) -> None:
    verdicts = VerdictRecorder()
    manager.transport.subscribe(verdicts)
    kill()  # type: ignore[operator]
    # One verdict suffices: its fan-out releases the generation, which closes the other
    # ranks' sockets before the monitor can judge them.
    dead = {("127.0.0.1", port) for port in ports}
    assert wait_until(
        lambda: any(ep in dead and not up for ep, up, _, _ in verdicts.calls), FAIL_BOUND_S
    )
    assert wait_until(lambda: manager.pool.get(key) is None, FAIL_BOUND_S)  # the fan-out


def test_on_etcd_a_request_after_a_crash_is_retryable_until_the_new_registration(
    etcd: EtcdServer, cluster: tuple[str, str, list[Instance]]
) -> None:
    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix)
    source = manager.source
    assert isinstance(source, EtcdBootstrapSource)
    key = PoolKey(addr, 0, 0, 0)
    try:
        old = launch(etcd, cluster, ttl=30)  # the store lists it long after the kill
        assert wait_until(lambda: visible(source, addr) == old.expected(), BOUND)
        assert run(manager, addr, 1).state == life.DONE
        _kill_and_wait_for_the_verdict(manager, [r.port for r in old.ranks], old.kill, key)
        assert visible(source, addr) == old.expected()  # etcd still lists the dead ranks
        for room in range(2, 6):
            _after_the_crash(manager, addr, room)
        assert manager.stats().failures.get("RanksUnreachable") == 4
        new = launch(etcd, cluster)
        assert wait_until(lambda: visible(source, addr) == new.expected(), BOUND)
        first = run(manager, addr, 10)  # the first request after the new registration
        assert first.state == life.DONE, first.failure
    finally:
        manager.close()


@pytest.fixture
def prefill() -> Prefill:
    instance = start_prefill()
    yield instance  # type: ignore[misc]
    stop_prefill(instance)


def test_on_http_the_same_request_fails_the_same_way(prefill: Prefill) -> None:
    """The bootstrap server outlives its killed ranks and still answers their dead ports."""
    key = PoolKey(prefill.addr, 0, 0, 0)
    with http_manager_for() as manager:
        first = manager.receiver(prefill.addr, 1, PLAN, prefill_dp_rank=0)
        assert first.init() == KVPoll.WaitingForInput
        first.abort()

        def kill() -> None:
            for rank in prefill.ranks:
                rank.kill()

        _kill_and_wait_for_the_verdict(manager, [r.port for r in prefill.ranks], kill, key)
        for room in range(2, 6):
            _after_the_crash(manager, prefill.addr, room)
        for rank in prefill.ranks:  # the ranks come back on new ports and re-register
            rank.start(avoid_port=rank.port)
        receiver = manager.receiver(prefill.addr, 10, PLAN, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput, receiver.failure
        receiver.abort()
