"""BootstrapClient against real servers on 127.0.0.1 (spec/protocol.md, HTTP-n)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine.decode.client import (
    BootstrapClient,
    InvalidArgument,
    RouteReply,
    Topology,
)
from statemachine.errors import (
    BootstrapHTTPError,
    MalformedReply,
    NotFound,
    NotReady,
    RequestRejected,
    TransportFailure,
)
from statemachine.http_exchange import new_session
from statemachine.prefill.registration import register_rank
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.http import INSTANCE_HEADER
from tests.support.bootstrap_support import TOKEN, register_all
from tests.support.http_support import (
    Reply,
    ScriptedServer,
    free_port,
    rank_payload,
    running_server,
    wait_until,
)

RANK = {"dp_rank": 0, "cp_rank": 0, "tp_rank": 0, "pp_rank": 0}


@pytest.fixture
def ready_server(server: BootstrapServer) -> BootstrapServer:
    register_all(server)
    return server


@pytest.fixture
def client() -> Iterator[BootstrapClient]:
    with BootstrapClient(connect_timeout=2.0, read_timeout=5.0) as c:
        yield c


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedServer]:
    with ScriptedServer() as srv:
        yield srv


# --- happy paths against the reference server -----------------------------------------------


def test_http10_get_rank(ready_server: BootstrapServer, client: BootstrapClient) -> None:
    reply = client.get_rank(ready_server.address, dp_rank=0, cp_rank=0, tp_rank=1, pp_rank=0)
    assert reply == RouteReply("127.0.0.1", 5001, ready_server.instance_id)


def test_http11_get_topology(ready_server: BootstrapServer, client: BootstrapClient) -> None:
    assert client.get_topology(ready_server.address) == Topology(
        attn_tp_size=2,
        attn_cp_size=1,
        dp_size=1,
        pp_size=1,
        page_size=16,
        kv_cache_dtype="bfloat16",
        follow_bootstrap_room=True,
        instance_id=ready_server.instance_id,
        enable_dsa_cache_layer_split=False,
        decode_allocation_policy="early",
        # A rank-plan key (spec/plans.md): a field, not `extra`.
        enable_kv_cache_sharding=False,
        extra=MappingProxyType({}),
    )


def test_http13_query_dp_ranks(server: BootstrapServer, client: BootstrapClient) -> None:
    for room, dp in ((101, 0), (102, 3)):
        reply = requests.post(
            f"http://{server.address}/register_dp_rank",
            json={"bootstrap_room": room, "dp_rank": dp},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )
        assert reply.status_code == 200
    assert client.query_dp_ranks(server.address, [101, 102, 103]) == {101: 0, 102: 3}
    before = client.stats().requests
    assert client.query_dp_ranks(server.address, []) == {}  # no round trip for no rooms
    assert client.stats().requests == before


def test_http14_health_returns_instance_id(
    server: BootstrapServer, client: BootstrapClient
) -> None:
    assert client.health(server.address) == server.instance_id


def test_http40_not_ready_then_ready(server: BootstrapServer, client: BootstrapClient) -> None:
    """HTTP-40: 503 -> NotReady (retryable) on both queries, and the same client then succeeds."""
    with pytest.raises(NotReady) as caught:
        client.get_rank(server.address, **RANK)
    assert (caught.value.addr, caught.value.status) == (server.address, 503)
    with pytest.raises(NotReady):
        client.get_topology(server.address)
    # The 503s were drained, not closed: both polls went over one connection.
    assert server.stats().connections_accepted == 1
    register_all(server)
    assert client.get_rank(server.address, **RANK).rank_port == 5000
    assert client.stats().sessions_opened == 1
    assert client.stats().errors["NotReady"] == 2


def test_http41_unknown_rank_is_not_found(
    ready_server: BootstrapServer, client: BootstrapClient
) -> None:
    with pytest.raises(NotFound) as caught:
        client.get_rank(ready_server.address, dp_rank=0, cp_rank=0, tp_rank=7, pp_rank=0)
    assert caught.value.status == 404


# --- status and reply mapping over a scripted server ----------------------------------------


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (503, NotReady),
        (404, NotFound),
        (400, RequestRejected),
        (401, RequestRejected),
        (413, RequestRejected),
        (429, RequestRejected),
        (500, TransportFailure),
        (502, TransportFailure),
        (201, MalformedReply),
        (302, MalformedReply),
    ],
)
def test_http40_status_mapping(
    scripted: ScriptedServer, client: BootstrapClient, status: int, error: type[Exception]
) -> None:
    """HTTP-40..44: each status maps to one typed error carrying addr and status."""
    scripted.set(status, b'{"rank_ip": "127.0.0.1", "rank_port": 1}')
    calls = [
        lambda: client.get_rank(scripted.address, **RANK),
        lambda: client.get_topology(scripted.address),
        lambda: client.query_dp_ranks(scripted.address, [1]),
        lambda: client.health(scripted.address),
    ]
    for call in calls:
        with pytest.raises(error) as caught:
            call()
        assert isinstance(caught.value, BootstrapHTTPError)
        assert caught.value.addr == scripted.address
        assert caught.value.status == status


_VALID_ROUTE = {"rank_ip": "10.0.0.7", "rank_port": 17000}
_VALID_TOPOLOGY = {"attn_tp_size": 8, "attn_cp_size": 1, "dp_size": 2, "pp_size": 1}


def test_http21_extra_keys_ignored_and_header_read(
    scripted: ScriptedServer, client: BootstrapClient
) -> None:
    """HTTP-21: unknown extra keys are ignored (old clients broke on them)."""
    body = {**_VALID_ROUTE, "new_field": [1, 2], "rank_ip": "fd00::7"}
    scripted.set(200, json.dumps(body).encode(), headers={INSTANCE_HEADER: "abc"})
    assert client.get_rank(scripted.address, **RANK) == RouteReply("fd00::7", 17000, "abc")
    scripted.set(200, json.dumps({**_VALID_TOPOLOGY, "extra": True}).encode())
    topology = client.get_topology(scripted.address)
    assert (topology.dp_size, topology.page_size, topology.instance_id) == (2, None, None)
    assert topology.extra == {"extra": True}  # carried through, not interpreted
    scripted.set(200, b'{"5": 1, "6": 2, "x": "junk"}')
    assert client.query_dp_ranks(scripted.address, [5, 7]) == {5: 1}


@pytest.mark.parametrize(
    "body",
    [
        {"rank_ip": "10.0.0.7", "rank_port": True},  # bool is not an int
        {"rank_ip": "10.0.0.7", "rank_port": 17000.0},
        {"rank_ip": "10.0.0.7", "rank_port": "17000"},
        {"rank_ip": "10.0.0.7", "rank_port": 0},
        {"rank_ip": "10.0.0.7", "rank_port": 65536},
        {"rank_ip": "10.0.0.7"},
        {"rank_port": 17000},
        {"rank_ip": "", "rank_port": 17000},
        {"rank_ip": "bad host", "rank_port": 17000},
        {"rank_ip": "01.2.3.4", "rank_port": 17000},
        {"rank_ip": "-x.example", "rank_port": 17000},
        {"rank_ip": "prefill-0.svc.cluster.local", "rank_port": 17000},  # names: HTTP-25
        {"rank_ip": "0.0.0.0", "rank_port": 17000},
        {"rank_ip": "::", "rank_port": 17000},
        {"rank_ip": "255.255.255.255", "rank_port": 17000},
        {"rank_ip": "224.0.0.1", "rank_port": 17000},
        {"rank_ip": "ff02::1", "rank_port": 17000},
        {"rank_ip": "::1%a b", "rank_port": 17000},
        {"rank_ip": "fe80::1%eth0", "rank_port": 17000},
        {"rank_ip": 167772167, "rank_port": 17000},
        {"rank_ip": None, "rank_port": 17000},
    ],
)
def test_http21_bad_route_replies_are_malformed(
    scripted: ScriptedServer, client: BootstrapClient, body: dict[str, Any]
) -> None:
    scripted.set(200, json.dumps(body).encode())
    with pytest.raises(MalformedReply) as caught:
        client.get_rank(scripted.address, **RANK)
    assert caught.value.status == 200


@pytest.mark.parametrize(
    "change",
    [
        {"attn_tp_size": True},
        {"dp_size": 0},
        {"pp_size": "1"},
        {"attn_cp_size": None},
        {"page_size": True},
        {"page_size": 0},
        {"kv_cache_dtype": 16},
        {"follow_bootstrap_room": 1},
    ],
)
def test_http22_bad_topology_replies_are_malformed(
    scripted: ScriptedServer, client: BootstrapClient, change: dict[str, Any]
) -> None:
    scripted.set(200, json.dumps({**_VALID_TOPOLOGY, **change}).encode())
    with pytest.raises(MalformedReply):
        client.get_topology(scripted.address)


@pytest.mark.parametrize("value", [True, -1, 1.0, "1", None, [1]])
def test_http23_bad_dp_rank_values_are_malformed(
    scripted: ScriptedServer, client: BootstrapClient, value: Any
) -> None:
    scripted.set(200, json.dumps({"5": value}).encode())
    with pytest.raises(MalformedReply):
        client.query_dp_ranks(scripted.address, [5])


def test_http24_oversized_reply_is_malformed(
    scripted: ScriptedServer, client: BootstrapClient
) -> None:
    scripted.set(200, b'{"pad": "' + b"x" * (2 << 20) + b'"}')
    with pytest.raises(MalformedReply):
        client.get_topology(scripted.address)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=10,
)
_route_like = st.fixed_dictionaries(
    {}, optional={"rank_ip": _json | st.just("127.0.0.1"), "rank_port": _json}
)
_topology_like = st.fixed_dictionaries(
    {}, optional={key: _json | st.integers(-1, 4) for key in [*_VALID_TOPOLOGY, "page_size"]}
)
_reply_bodies = st.one_of(
    st.binary(max_size=100),
    _json.map(lambda v: json.dumps(v).encode()),
    _route_like.map(lambda v: json.dumps(v).encode()),
    _topology_like.map(lambda v: json.dumps(v).encode()),
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(status=st.sampled_from([200, 200, 200, 400, 404, 500, 503]), body=_reply_bodies)
def test_http20_generated_replies_parse_or_raise_typed(
    scripted: ScriptedServer, client: BootstrapClient, status: int, body: bytes
) -> None:
    """HTTP-20: any reply yields a validated value or a typed BootstrapHTTPError, nothing else."""
    scripted.set(status, body)
    for call in (
        lambda: client.get_rank(scripted.address, **RANK),
        lambda: client.get_topology(scripted.address),
        lambda: client.query_dp_ranks(scripted.address, [1, 2]),
    ):
        try:
            result = call()
        except BootstrapHTTPError as exc:
            assert exc.addr == scripted.address
            if status == 200:
                assert isinstance(exc, MalformedReply)
            continue
        assert status == 200
        if isinstance(result, RouteReply):
            assert 1 <= result.rank_port <= 65535 and type(result.rank_port) is int
        elif isinstance(result, Topology):
            assert min(result.attn_tp_size, result.dp_size, result.pp_size) >= 1
        else:
            assert set(result) <= {1, 2}
            assert all(type(v) is int and v >= 0 for v in result.values())


# --- transport failures ---------------------------------------------------------------------


def test_http42_server_down_is_transport_failure(client: BootstrapClient) -> None:
    addr = f"127.0.0.1:{free_port()}"
    for call in (
        lambda: client.get_rank(addr, **RANK),
        lambda: client.get_topology(addr),
        lambda: client.health(addr),
    ):
        with pytest.raises(TransportFailure) as caught:
            call()
        assert caught.value.addr == addr and caught.value.status is None
    stats = client.stats()
    assert stats.errors["TransportFailure"] == 3
    assert stats.sessions_opened == stats.sessions_dropped == 3  # dropped after each failure


def test_http43_read_timeout_is_transport_failure(scripted: ScriptedServer) -> None:
    scripted.set(200, b"{}", delay=1.0)
    with BootstrapClient(read_timeout=0.1) as client, pytest.raises(TransportFailure):
        client.health(scripted.address)
    scripted.set(200, b"{}")


def test_http34_session_dropped_after_transport_failure_then_recovers(
    scripted: ScriptedServer, client: BootstrapClient
) -> None:
    """HTTP-34: after a failure the next query starts a fresh session and succeeds."""
    scripted.set(500, b"boom")
    with pytest.raises(TransportFailure):
        client.health(scripted.address)
    scripted.set(200, b"OK", headers={INSTANCE_HEADER: "after"})
    assert client.health(scripted.address) == "after"
    stats = client.stats()
    assert (stats.sessions_opened, stats.sessions_dropped) == (2, 1)


def test_http50_instance_id_changes_across_restart_and_client_recovers(
    client: BootstrapClient,
) -> None:
    """HTTP-50: the same address after a restart answers with a new id, over a new connection."""
    srv = BootstrapServer(token=TOKEN).start()
    try:
        first = client.health(srv.address)
    finally:
        srv.stop()
    with pytest.raises(TransportFailure):
        client.health(srv.address)  # down in between
    with running_server(token=TOKEN, port=srv.port) as again:
        second = client.health(again.address)
    assert first is not None and second is not None and first != second


# --- sessions -------------------------------------------------------------------------------


def test_http32_queries_from_t_threads_use_at_most_t_connections(
    ready_server: BootstrapServer,
) -> None:
    """HTTP-32: N queries (every route) from T threads reach the server over <= T connections."""
    threads_n, per_thread = 4, 50
    before = ready_server.stats().connections_accepted
    client = BootstrapClient()
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for i in range(per_thread):
                client.get_rank(
                    ready_server.address, dp_rank=0, cp_rank=0, tp_rank=i % 2, pp_rank=0
                )
                if i % 10 == 0:
                    client.get_topology(ready_server.address)
                    client.health(ready_server.address)
                    client.query_dp_ranks(ready_server.address, [i])
        except BaseException as exc:  # reported to the main thread below
            failures.append(exc)
        finally:
            client.close()

    workers = [threading.Thread(target=work) for _ in range(threads_n)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert failures == []
    stats = ready_server.stats()
    assert stats.connections_accepted - before <= threads_n
    assert stats.requests["GET /route"] == threads_n * (per_thread + 5)
    assert client.stats().sessions_opened == threads_n
    assert client.stats().requests == threads_n * (per_thread + 15)


def test_http33_close_drops_this_threads_sessions(ready_server: BootstrapServer) -> None:
    before = ready_server.stats().connections_accepted
    client = BootstrapClient()
    client.health(ready_server.address)
    # register_all closed its sessions; the server may not have seen those closes yet.
    assert wait_until(lambda: ready_server.stats().connections_open == 1)
    client.close()
    assert client.stats().sessions_closed == 1
    assert wait_until(lambda: ready_server.stats().connections_open == 0)
    client.health(ready_server.address)  # a fresh session, a fresh connection
    assert client.stats().sessions_opened == 2
    assert ready_server.stats().connections_accepted == before + 2
    client.close()


def test_session_count_per_thread_is_capped(scripted: ScriptedServer) -> None:
    """Nothing grows without bound: past the cap the oldest session is closed."""
    other = ScriptedServer()
    with other, BootstrapClient(max_sessions_per_thread=1) as client:
        client.health(scripted.address)
        client.health(other.address)
        client.health(scripted.address)
        stats = client.stats()
        assert (stats.sessions_opened, stats.sessions_closed) == (3, 2)


def test_http31_sessions_mount_http_only(ready_server: BootstrapServer) -> None:
    session = new_session()
    try:
        assert list(session.adapters) == ["http://"]
        adapter = session.adapters["http://"]
        assert adapter._pool_connections == 1 and adapter._pool_maxsize == 1  # type: ignore[attr-defined]
        assert session.trust_env is False
    finally:
        session.close()


# --- bad caller input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1",
        "127.0.0.1:",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "http://127.0.0.1:8998",
        "::1:8998",
        "[127.0.0.1]:8998",
        "host name:8998",
        "127.0.0.1:8998/path",
        ":8998",
        "",
    ],
)
def test_bad_address_is_rejected_before_sending(client: BootstrapClient, addr: str) -> None:
    with pytest.raises(InvalidArgument):
        client.health(addr)
    with pytest.raises(InvalidArgument):
        client.query_dp_ranks(addr, [])
    assert client.stats().sessions_opened == 0 and client.stats().requests == 0


@pytest.mark.parametrize("value", [-1, True, 1.0, "0", None])
def test_bad_rank_or_room_is_rejected(client: BootstrapClient, value: Any) -> None:
    with pytest.raises(InvalidArgument):
        client.get_rank("127.0.0.1:1", dp_rank=0, cp_rank=0, tp_rank=value, pp_rank=0)
    with pytest.raises(InvalidArgument):
        client.query_dp_ranks("127.0.0.1:1", [1, value])
    assert client.stats().requests == 0


def test_ipv6_literal_address_is_accepted(client: BootstrapClient) -> None:
    # Nobody listens on [::1]:port: a transport failure proves the address was accepted.
    with pytest.raises(TransportFailure):
        client.health(f"[::1]:{free_port()}")


def test_bad_timeouts_are_rejected() -> None:
    with pytest.raises(InvalidArgument):
        BootstrapClient(connect_timeout=0)
    with pytest.raises(InvalidArgument):
        BootstrapClient(read_timeout=True)


# --- register_rank --------------------------------------------------------------------------


def test_http15_register_rank_retries_transport_failures(scripted: ScriptedServer) -> None:
    scripted.queue = [Reply(500), Reply(503)]
    scripted.set(200, b"OK", headers={INSTANCE_HEADER: "prefill-1"})
    start = len(scripted.requests)
    sleeps: list[float] = []
    result = register_rank(
        scripted.address, TOKEN, rank_payload(), backoff_scale=0.001, sleep=sleeps.append
    )
    assert result == "prefill-1"
    put = scripted.requests[start:]
    assert [r[0] for r in put] == ["PUT"] * 3
    assert put[0][2]["Authorization"] == f"Bearer {TOKEN}"
    assert json.loads(put[0][3]) == rank_payload()
    assert len(sleeps) == 2 and 0.0005 <= sleeps[0] <= 0.001 and 0.001 <= sleeps[1] <= 0.002


def test_http15_register_rank_gives_up_after_attempts() -> None:
    addr = f"127.0.0.1:{free_port()}"
    sleeps: list[float] = []
    with pytest.raises(TransportFailure):
        register_rank(addr, TOKEN, rank_payload(), attempts=3, sleep=sleeps.append)
    # min(2**i, 30) with jitter in [0.5, 1): no sleep after the last attempt.
    assert len(sleeps) == 2 and 0.5 <= sleeps[0] < 1.0 and 1.0 <= sleeps[1] < 2.0


def test_http15_register_rank_does_not_retry_4xx(server: BootstrapServer) -> None:
    sleeps: list[float] = []
    with pytest.raises(RequestRejected) as caught:
        register_rank(server.address, "wrong", rank_payload(), sleep=sleeps.append)
    assert caught.value.status == 401 and sleeps == []
    assert server.stats().requests == {"PUT /route": 1}


def test_register_rank_rejects_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        register_rank("nope", TOKEN, rank_payload())
    with pytest.raises(InvalidArgument):
        register_rank("127.0.0.1:1", TOKEN, {"x": object()})
    with pytest.raises(InvalidArgument):
        register_rank("127.0.0.1:1", TOKEN, rank_payload(), attempts=0)
