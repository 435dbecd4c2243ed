"""The reference bootstrap server over real HTTP on 127.0.0.1 (spec/protocol.md, HTTP-n)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine.prefill.server import BootstrapServer
from statemachine.wire.http import INSTANCE_HEADER
from tests.support.bootstrap_support import AUTH, TOKEN, register_all
from tests.support.http_support import (
    FakeClock,
    free_port,
    rank_payload,
    running_server,
    wait_until,
)

TIMEOUT = 5


def url(srv: BootstrapServer, path: str) -> str:
    return f"http://{srv.address}{path}"


def route_query(srv: BootstrapServer, dp: Any, cp: Any, tp: Any, pp: Any) -> requests.Response:
    params = {
        "prefill_dp_rank": dp,
        "prefill_cp_rank": cp,
        "target_tp_rank": tp,
        "target_pp_rank": pp,
    }
    return requests.get(url(srv, "/route"), params=params, timeout=TIMEOUT)


def put_rank(srv: BootstrapServer, payload: Any, headers: Any = AUTH) -> requests.Response:
    return requests.put(url(srv, "/route"), json=payload, headers=headers, timeout=TIMEOUT)


# --- happy paths ----------------------------------------------------------------------------


def test_http12_rank_query_503_until_every_rank_registered_then_200(
    server: BootstrapServer,
) -> None:
    """HTTP-12: 503 while any of dp*cp*tp*pp ranks is missing, then the rank's ip and port."""
    assert route_query(server, 0, 0, 0, 0).status_code == 503
    assert put_rank(server, rank_payload(tp=0, tp_size=2, dp=0, dp_size=2)).status_code == 200
    assert put_rank(server, rank_payload(tp=1, tp_size=2, dp=0, dp_size=2)).status_code == 200
    assert put_rank(server, rank_payload(tp=0, tp_size=2, dp=1, dp_size=2)).status_code == 200
    assert route_query(server, 0, 0, 1, 0).status_code == 503
    assert route_query(server, -1, -1, -1, -1).status_code == 503
    payload = rank_payload(tp=1, tp_size=2, dp=1, dp_size=2, port=6011)
    assert put_rank(server, payload).status_code == 200
    reply = route_query(server, 1, 0, 1, 0)
    assert reply.status_code == 200
    assert reply.json() == {"rank_ip": "127.0.0.1", "rank_port": 6011}


def test_http11_topology_query(server: BootstrapServer) -> None:
    """HTTP-11: all four ranks -1 answer the topology once every rank registered."""
    register_all(server, tp_size=2, dp_size=1)
    reply = route_query(server, -1, -1, -1, -1)
    assert reply.status_code == 200
    assert reply.json() == {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "bfloat16",
        "follow_bootstrap_room": True,
        "enable_dsa_cache_layer_split": False,
        "prefill_http_port": None,
        "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False,
    }


@pytest.mark.parametrize(
    ("field", "first", "second", "named"),
    [
        ("decode_allocation_policy", "early", "prefill_complete", "allocation-policy"),
        ("dsv41_spec_layout", None, {"num_draft_tokens": 4}, "speculative-decoding"),
        ("dsv41_spec_layout", {"num_draft_tokens": 4}, {"num_draft_tokens": 8}, "same model"),
    ],
)
def test_http59_ranks_disagreeing_on_policy_or_layout_are_400(
    server: BootstrapServer, field: str, first: object, second: object, named: str
) -> None:
    """HTTP-59: as SGLang 0.5.23, a rank whose allocation policy or DSpark layout differs
    from the registered ranks' is refused with what to fix, and changes nothing."""
    assert put_rank(server, rank_payload(tp=0, **{field: first})).status_code == 200
    refused = put_rank(server, rank_payload(tp=1, port=6001, **{field: second}))
    assert refused.status_code == 400
    assert field in refused.json()["error"] and named in refused.json()["error"]
    assert route_query(server, -1, -1, -1, -1).status_code == 503  # rank 1 was not stored
    assert put_rank(server, rank_payload(tp=1, port=6001, **{field: first})).status_code == 200
    topology = route_query(server, -1, -1, -1, -1).json()
    assert topology.get(field, None) == first
    # Once pinned, the check still holds (the pinned topology keeps the values of record).
    assert put_rank(server, rank_payload(tp=1, port=6002, **{field: second})).status_code == 400
    assert route_query(server, 0, 0, 1, 0).json()["rank_port"] == 6001


def test_http56_missing_policy_means_sglangs_default(server: BootstrapServer) -> None:
    """A registration without the newer keys gets SGLang's defaults in the reply, not null:
    an SGLang decode compares the policy with its own and would fail on null."""
    for tp in (0, 1):
        payload = rank_payload(tp=tp, port=6000 + tp)
        del payload["decode_allocation_policy"], payload["enable_dsa_cache_layer_split"]
        assert put_rank(server, payload).status_code == 200
    topology = route_query(server, -1, -1, -1, -1).json()
    assert topology["decode_allocation_policy"] == "early"
    assert topology["enable_dsa_cache_layer_split"] is False
    assert topology["enable_kv_cache_sharding"] is False
    assert "kv_layout" not in topology


def test_http12_unknown_rank_is_404(server: BootstrapServer) -> None:
    register_all(server, tp_size=2)
    assert route_query(server, 0, 0, 2, 0).status_code == 404
    assert route_query(server, 1, 0, 0, 0).status_code == 404
    assert route_query(server, 0, 0, 0, 1).status_code == 404


@pytest.mark.parametrize(
    "query",
    [
        "",
        "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0",  # one missing
        "prefill_dp_rank=&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",  # empty
        "prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
        "prefill_dp_rank=1.0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
        "prefill_dp_rank=0&prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
        "prefill_dp_rank=-1&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",  # partial -1
        "prefill_dp_rank=99999999999999999999999&prefill_cp_rank=0&target_tp_rank=0"
        "&target_pp_rank=0",
    ],
)
def test_http12_bad_rank_parameters_are_400(server: BootstrapServer, query: str) -> None:
    register_all(server)
    reply = requests.get(url(server, f"/route?{query}"), timeout=TIMEOUT)
    assert reply.status_code == 400
    assert "error" in reply.json()


def test_http52_ports_last_writer_wins(server: BootstrapServer) -> None:
    """HTTP-52: a restarted rank re-registers its new port and the new one is served."""
    register_all(server)
    assert put_rank(server, rank_payload(tp=1, port=7777)).status_code == 200
    assert route_query(server, 0, 0, 1, 0).json()["rank_port"] == 7777


@pytest.mark.parametrize(
    "change",
    [{"attn_tp_size": 4}, {"page_size": 32}, {"kv_cache_dtype": "fp8"}, {"attn_dp_size": 2}],
)
def test_http51_topology_first_writer_wins_conflict_is_400(
    server: BootstrapServer, change: dict[str, Any]
) -> None:
    """HTTP-51: a registration disagreeing with the first topology is 400 and changes nothing."""
    register_all(server)
    before = route_query(server, -1, -1, -1, -1).json()
    reply = put_rank(server, rank_payload(tp=0, port=9999, **change))
    assert reply.status_code == 400
    assert route_query(server, -1, -1, -1, -1).json() == before
    assert route_query(server, 0, 0, 0, 0).json()["rank_port"] == 5000


def test_http13_register_and_query_dp_ranks_with_expiry() -> None:
    """HTTP-13: rooms are answered while fresh, forgotten after the TTL; unknown rooms absent."""
    clock = FakeClock()
    with running_server(token=TOKEN, dp_ttl=120.0, clock=clock) as srv:
        for room, dp in ((11, 0), (12, 1)):
            reply = requests.post(
                url(srv, "/register_dp_rank"),
                json={"bootstrap_room": room, "dp_rank": dp},
                headers=AUTH,
                timeout=TIMEOUT,
            )
            assert reply.status_code == 200

        def query() -> Any:
            body = {"bootstrap_rooms": [11, 12, 13]}
            reply = requests.post(url(srv, "/query_dp_ranks"), json=body, timeout=TIMEOUT)
            assert reply.status_code == 200
            return reply.json()

        assert query() == {"11": 0, "12": 1}
        clock.now += 119.0
        assert query() == {"11": 0, "12": 1}
        clock.now += 1.0
        assert query() == {}


def test_http13_dp_entries_are_capped() -> None:
    """Nothing grows without bound: past max_dp_entries the oldest rooms are dropped."""
    with running_server(token=TOKEN, max_dp_entries=3) as srv:
        for room in range(5):
            body = {"bootstrap_room": room, "dp_rank": 0}
            requests.post(url(srv, "/register_dp_rank"), json=body, headers=AUTH, timeout=TIMEOUT)
        body2 = {"bootstrap_rooms": list(range(5))}
        reply = requests.post(url(srv, "/query_dp_ranks"), json=body2, timeout=TIMEOUT)
        assert reply.json() == {"2": 0, "3": 0, "4": 0}


def test_http14_health(server: BootstrapServer) -> None:
    reply = requests.get(url(server, "/health"), timeout=TIMEOUT)
    assert reply.status_code == 200
    assert reply.headers[INSTANCE_HEADER] == server.instance_id


# --- authorisation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": "Bearer "},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": "Bearer s3cr\u00e9t".encode()},
    ],
)
def test_http53_registration_needs_the_bearer_token(
    server: BootstrapServer, headers: dict[str, Any]
) -> None:
    """HTTP-53: missing or wrong token -> 401 on both registration routes; nothing stored."""
    reply = put_rank(server, rank_payload(tp=0, tp_size=1), headers=headers)
    assert reply.status_code == 401
    assert reply.headers["WWW-Authenticate"] == "Bearer"
    reply = requests.post(
        url(server, "/register_dp_rank"),
        json={"bootstrap_room": 1, "dp_rank": 0},
        headers=headers,
        timeout=TIMEOUT,
    )
    assert reply.status_code == 401
    assert route_query(server, -1, -1, -1, -1).status_code == 503
    body = {"bootstrap_rooms": [1]}
    reply = requests.post(url(server, "/query_dp_ranks"), json=body, timeout=TIMEOUT)
    assert reply.json() == {}


def test_http53_without_token_registration_fails_closed() -> None:
    with (
        pytest.warns(RuntimeWarning, match="BootstrapServer without a token: every registration"),
        running_server() as srv,
    ):
        assert put_rank(srv, rank_payload(tp=0, tp_size=1), headers={}).status_code == 401
        assert put_rank(srv, rank_payload(tp=0, tp_size=1)).status_code == 401
        # Reads stay open.
        assert requests.get(url(srv, "/health"), timeout=TIMEOUT).status_code == 200


def test_http53_insecure_without_token_accepts_registration() -> None:
    with running_server(insecure=True) as srv:
        assert put_rank(srv, rank_payload(tp=0, tp_size=1), headers={}).status_code == 200
        assert route_query(srv, 0, 0, 0, 0).json()["rank_port"] == 5000


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError):
        BootstrapServer(token="")


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b"\xff\xfe",
        b"[" * 20000,
        json.dumps(rank_payload(rank_port=True)).encode(),
        json.dumps(rank_payload(rank_port=0)).encode(),
        json.dumps(rank_payload(rank_port="5000")).encode(),
        json.dumps(rank_payload(attn_tp_size=True)).encode(),
        json.dumps(rank_payload(tp=2, tp_size=2)).encode(),
        json.dumps(rank_payload(rank_ip="not a host")).encode(),
        json.dumps(rank_payload(rank_ip="01.2.3.4")).encode(),
        json.dumps(rank_payload(page_size=0)).encode(),
        json.dumps({k: v for k, v in rank_payload().items() if k != "rank_ip"}).encode(),
    ],
)
def test_http60_bad_registration_bodies_are_400_and_change_nothing(
    server: BootstrapServer, body: bytes
) -> None:
    reply = requests.put(url(server, "/route"), data=body, headers=AUTH, timeout=TIMEOUT)
    assert reply.status_code == 400
    assert reply.headers[INSTANCE_HEADER] == server.instance_id
    register_all(server, tp_size=2)  # the bad body did not pin a topology
    assert route_query(server, -1, -1, -1, -1).json()["attn_tp_size"] == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("page_size", True), ("page_size", False), ("prefill_http_port", True)],
)
def test_http63_json_true_is_not_an_integer_field(
    server: BootstrapServer, field: str, value: bool
) -> None:
    """HTTP-63: ``"page_size": true`` is refused with a 400 that names the field, says what it
    must be and what to do, and pins no topology. Python's ``bool`` is an ``int``, so a check
    written as ``isinstance(value, int)`` takes ``true`` as page size 1 and the prefill's first
    writer would pin it for the address (HTTP-51). Catches the seeded bug that drops the bool
    test from the registry's ``_optional`` (a 200 then)."""
    reply = put_rank(server, rank_payload(**{field: value}))
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]
    assert f"{field!r} must be null or an integer in 1.." in message, message
    assert f"not {json.dumps(value)}" in message and "register again" in message, message
    register_all(server, tp_size=2)  # the refused body did not pin a topology
    assert route_query(server, -1, -1, -1, -1).json()["page_size"] == 16


def test_http61_oversized_body_is_413(server: BootstrapServer) -> None:
    big = b'{"bootstrap_rooms": [' + b"1," * 40000 + b"1]}"
    reply = requests.post(url(server, "/query_dp_ranks"), data=big, timeout=TIMEOUT)
    assert reply.status_code == 413
    assert reply.headers[INSTANCE_HEADER] == server.instance_id
    reply = requests.put(url(server, "/route"), data=big, headers=AUTH, timeout=TIMEOUT)
    assert reply.status_code == 413


@pytest.mark.parametrize(
    ("method", "path"),
    [("DELETE", "/route"), ("POST", "/route"), ("GET", "/query_dp_ranks"), ("POST", "/health")],
)
def test_http62_wrong_method_is_405(server: BootstrapServer, method: str, path: str) -> None:
    reply = requests.request(method, url(server, path), timeout=TIMEOUT)
    assert reply.status_code == 405
    assert reply.headers[INSTANCE_HEADER] == server.instance_id


def test_http62_unknown_path_is_404_with_instance_header(server: BootstrapServer) -> None:
    reply = requests.get(url(server, "/nope"), timeout=TIMEOUT)
    assert reply.status_code == 404
    assert reply.headers[INSTANCE_HEADER] == server.instance_id


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /route HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{",  # truncated body
    ],
)
def test_http60_broken_framing_does_not_hurt_the_server(
    server: BootstrapServer, raw: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as conn:
        conn.sendall(raw)
        conn.shutdown(socket.SHUT_WR)
        head = conn.recv(4096)
    # Either a 4xx from the parser or a plain close; never a 5xx.
    status_line = head.split(b"\r\n", 1)[0].split()
    assert head == b"" or status_line[1].startswith(b"4")
    assert requests.get(url(server, "/health"), timeout=TIMEOUT).status_code == 200


@pytest.fixture(scope="module")
def shared_server() -> Iterator[BootstrapServer]:
    with running_server(token=TOKEN) as srv:
        register_all(srv)
        yield srv


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_near_valid = st.fixed_dictionaries(
    {},
    optional={
        key: _json_values | st.integers(-2, 3)
        for key in [*rank_payload(), "bootstrap_room", "dp_rank", "bootstrap_rooms"]
    },
)
_bodies = st.one_of(
    st.binary(max_size=200),
    _json_values.map(lambda v: json.dumps(v).encode()),
    _near_valid.map(lambda v: json.dumps(v).encode()),
)
_routes = st.sampled_from(
    [("PUT", "/route"), ("POST", "/register_dp_rank"), ("POST", "/query_dp_ranks")]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=_routes, body=_bodies, authorised=st.booleans())
def test_http60_junk_bodies_never_5xx(
    shared_server: BootstrapServer, route: tuple[str, str], body: bytes, authorised: bool
) -> None:
    """HTTP-60: generated junk bodies get 200/400/401, never 5xx, always the instance header."""
    method, path = route
    reply = requests.request(
        method,
        url(shared_server, path),
        data=body,
        headers=AUTH if authorised else {},
        timeout=TIMEOUT,
    )
    assert reply.status_code in (200, 400, 401)
    assert reply.headers[INSTANCE_HEADER] == shared_server.instance_id


_param_names = st.sampled_from(
    ["prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank", "x"]
)
_param_values = st.one_of(st.integers(-3, 3).map(str), st.text(max_size=12))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=st.lists(st.tuples(_param_names, _param_values), max_size=6))
def test_http60_junk_query_strings_never_5xx(
    shared_server: BootstrapServer, params: list[tuple[str, str]]
) -> None:
    reply = requests.get(url(shared_server, "/route"), params=params, timeout=TIMEOUT)
    assert reply.status_code in (200, 400, 404)
    assert reply.headers[INSTANCE_HEADER] == shared_server.instance_id
    if reply.status_code == 200:
        assert set(reply.json()) >= {"rank_ip", "rank_port"} or "attn_tp_size" in reply.json()


# --- instance id, counters, lifecycle -------------------------------------------------------


def test_http50_instance_id_changes_across_restart() -> None:
    """HTTP-50: a restart at the same address answers with a new instance id."""
    srv = BootstrapServer(token=TOKEN).start()
    try:
        first = requests.get(url(srv, "/health"), timeout=TIMEOUT).headers[INSTANCE_HEADER]
        port = srv.port
    finally:
        srv.stop()
    with running_server(token=TOKEN, port=port) as again:
        second = requests.get(url(again, "/health"), timeout=TIMEOUT).headers[INSTANCE_HEADER]
        # State is in memory only: the restarted server knows no ranks.
        assert route_query(again, 0, 0, 0, 0).status_code == 503
    srv.start()  # the same object restarted: also a new id
    try:
        third = requests.get(url(srv, "/health"), timeout=TIMEOUT).headers[INSTANCE_HEADER]
    finally:
        srv.stop()
    assert len({first, second, third}) == 3


def test_port_in_use_fails_start() -> None:
    with running_server(token=TOKEN) as srv, pytest.raises(OSError):
        BootstrapServer(token=TOKEN, port=srv.port).start()


def test_http55_counters_count_connections_and_routes(server: BootstrapServer) -> None:
    """HTTP-55: distinct connections accepted, open and peak; requests per route label."""
    with requests.Session() as one, requests.Session() as two:
        for _ in range(3):
            assert one.get(url(server, "/health"), timeout=TIMEOUT).status_code == 200
        assert two.get(url(server, "/route"), timeout=TIMEOUT).status_code == 400
        assert two.get(url(server, "/nope"), timeout=TIMEOUT).status_code == 404
        stats = server.stats()
        assert stats.connections_accepted == 2
        assert stats.connections_open == 2
        assert stats.connections_peak == 2
        assert stats.requests == {"GET /health": 3, "GET /route": 1, "other": 1}
    assert wait_until(lambda: server.stats().connections_open == 0)
    assert server.stats().connections_peak == 2


def test_concurrent_registrations_all_land(server: BootstrapServer) -> None:
    tp_size = 16
    errors: list[int] = []

    def register(tp: int) -> None:
        reply = put_rank(server, rank_payload(tp=tp, tp_size=tp_size, port=6000 + tp))
        if reply.status_code != 200:
            errors.append(reply.status_code)

    threads = [threading.Thread(target=register, args=(tp,)) for tp in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert errors == []
    assert route_query(server, 0, 0, 15, 0).json()["rank_port"] == 6015


# --- CLI ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_serve_runs_until_signal_and_exits_0(sig: signal.Signals) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "statemachine", "serve", "--port", str(port), "--token", TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the socket listens
        assert line.startswith(f"listening on 127.0.0.1:{port} instance ")
        instance = line.split()[-1]
        reply = requests.get(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT)
        assert reply.headers[INSTANCE_HEADER] == instance
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
