"""What is cached can be corrected (issue 17, "A fixed deployment stays broken"; MGR-20).

Real processes: a bootstrap server and prefill rank processes (or ranks registering in a real
etcd), stopped and started again behind the same address with corrected settings. The decode's
manager caches the prefill's topology and the plan derived from it; before, both were kept per
address until a health probe saw a restart, and a ``TopologyMismatch`` was never followed by
one (the request fails before any fetch or probe), so a fixed prefill stayed refused for good
("page_size is 16" for 3.5 s of tries, HTTP and etcd alike). Now a mismatch is not remembered
and a fetch answered by another instance forgets the old topology and its plan. The health
monitor is off in every test: nothing but the rule under test can refresh the cache.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.plan import DecodeLayout
from statemachine.errors import TopologyMismatch
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from tests.support.etcd_cluster_support import BOUND, manager_for
from tests.support.etcd_support import EtcdServer, free_port
from tests.support.manager_support import FAIL_BOUND_S, wait_until
from tests.support.manager_support import manager_for as http_manager_for
from tests.support.receiver_support import TOKEN, Prefill, finish, stop_prefill


def _prefill(port: int, *, tp_size: int, page_size: int) -> Prefill:
    server = BootstrapServer("127.0.0.1", port, token=TOKEN).start()
    prefill = Prefill(server)
    try:
        for tp_rank in range(tp_size):
            rank = PrefillRankProcess(
                server.address,
                TOKEN,
                tp_rank=tp_rank,
                tp_size=tp_size,
                extra_args=("--page-size", str(page_size)),
            )
            prefill.ranks.append(rank)
            rank.start()
    except BaseException:
        stop_prefill(prefill)
        raise
    return prefill


@pytest.fixture
def prefills() -> Iterator[list[Prefill]]:
    started: list[Prefill] = []
    yield started
    for prefill in started:
        stop_prefill(prefill)


def _request(manager: object, addr: str, room: int) -> tuple[KVPoll, object]:
    receiver = manager.receiver(addr, room, prefill_dp_rank=0)  # type: ignore[attr-defined]
    if receiver.init() == KVPoll.WaitingForInput:
        receiver.send_metadata((room,))
        return finish(receiver), receiver.failure
    return receiver.poll(), receiver.failure


def test_http_a_mismatch_is_not_remembered_past_the_deployment(prefills: list[Prefill]) -> None:
    port = free_port()
    prefills.append(_prefill(port, tp_size=1, page_size=16))
    addr = prefills[0].addr
    with http_manager_for(layout=DecodeLayout(0, 1, page_size=32)) as manager:
        for room in (1, 2):
            state, failure = _request(manager, addr, room)
            assert state == KVPoll.Failed and isinstance(failure, TopologyMismatch), failure
            assert "page_size" in str(failure)
        stop_prefill(prefills.pop())
        prefills.append(_prefill(port, tp_size=1, page_size=32))  # fixed, same address
        state, failure = _request(manager, addr, 3)  # the first request after the fix
        assert state == KVPoll.Success, failure


def test_http_a_fetch_from_a_new_instance_replans(prefills: list[Prefill]) -> None:
    """tp 2 -> tp 1 behind the same address: the plan (both ranks) is derived anew once a fetch
    is answered by the new instance. Before: every request asked for rank 1 of a one-rank
    prefill (404) until a health probe noticed the restart - never, with probes off."""
    port = free_port()
    prefills.append(_prefill(port, tp_size=2, page_size=1))
    addr = prefills[0].addr
    with http_manager_for(layout=DecodeLayout(0, 1, page_size=1)) as manager:
        assert _request(manager, addr, 1)[0] == KVPoll.Success
        stop_prefill(prefills.pop())
        assert wait_until(lambda: not manager.pool.snapshot(), FAIL_BOUND_S)  # the fan-out
        prefills.append(_prefill(port, tp_size=1, page_size=1))
        outcomes = [_request(manager, addr, room) for room in (2, 3)]
        # The first fetch meets the new instance at its rank 0 and forgets the old plan (it
        # may still fail on the rank the old plan named); the next request is planned anew.
        assert outcomes[-1][0] == KVPoll.Success, outcomes


def _etcd_ranks(etcd: EtcdServer, prefix: str, addr: str, page_size: int) -> PrefillRankProcess:
    args = [
        *("--discovery", "etcd", "--etcd-endpoints", etcd.endpoint),
        *("--etcd-prefix", prefix, "--etcd-ttl", "10"),
        *("--instance-id", uuid.uuid4().hex, "--page-size", str(page_size)),
    ]
    rank = PrefillRankProcess(addr, "unused", tp_rank=0, tp_size=1, extra_args=args)
    rank.start()
    return rank


def test_etcd_a_mismatch_is_not_remembered_past_the_deployment(
    etcd: EtcdServer, cluster: tuple[str, str, list[object]]
) -> None:
    prefix, addr, _ = cluster
    manager = manager_for(etcd, prefix, layout=DecodeLayout(0, 1, page_size=32))
    ranks: list[PrefillRankProcess] = []
    try:
        ranks.append(_etcd_ranks(etcd, prefix, addr, page_size=16))
        source = manager.source
        assert wait_until(lambda: visible_one(source, addr, ranks[0].port), BOUND)
        state, failure = _request(manager, addr, 1)
        assert state == KVPoll.Failed and isinstance(failure, TopologyMismatch), failure
        ranks[0].terminate()  # graceful: its lease is revoked
        ranks.append(_etcd_ranks(etcd, prefix, addr, page_size=32))
        assert wait_until(lambda: visible_one(source, addr, ranks[1].port), BOUND)
        state, failure = _request(manager, addr, 2)
        assert state == KVPoll.Success, failure
    finally:
        for rank in ranks:
            rank.kill()
        manager.close()


def visible_one(source: object, addr: str, port: int) -> bool:
    try:
        reply = source.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)  # type: ignore[attr-defined]
    except Exception:
        return False
    return bool(reply.rank_port == port)


def test_the_server_refusing_a_changed_topology_says_to_restart_it() -> None:
    """The reference server keeps the first complete topology until it restarts (HTTP-51): its
    400 to a rank claiming another says exactly that, and what to do (the behaviour chosen for
    issue 17: a restart of the bootstrap server, not a change of this rank's settings only)."""
    import requests

    from statemachine.prefill.registration import register_rank
    from tests.support.http_support import rank_payload, running_server

    with running_server(host="127.0.0.1", port=0, token=TOKEN) as server:
        register_rank(server.address, TOKEN, rank_payload(tp=0, tp_size=1, page_size=16))
        reply = requests.put(
            f"http://{server.address}/route",
            json=rank_payload(tp=0, tp_size=1, page_size=32),
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )
        assert reply.status_code == 400
        text = reply.json()["error"]
        assert "page_size=32" in text and "page_size=16" in text
        assert "start this rank with the registered settings" in text
        assert "restart the bootstrap server to register a new topology" in text
