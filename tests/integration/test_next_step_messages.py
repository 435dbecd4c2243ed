"""Issue 20's six messages: each says what happened and what the user does next.

Every case is provoked for real (a ZMQ send to a port nobody binds, a bootstrap server whose
ranks have not registered, a dp rank past the prefill's dp size, a bad ``ack_ip``, a URL given as
a bootstrap address, an etcd endpoint nobody serves, a prefill rank started before its
bootstrap server) and its text is asserted: the words that
name the cause and the words that name the remedy, and the absence of the old misleading text.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from statemachine import DecodeManager
from statemachine.decode.client import BootstrapClient
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.discovery.gateway import EtcdGateway
from statemachine.errors import EtcdUnavailable, InvalidArgument, NotFound, NotReady, SendFailed
from statemachine.prefill.readiness import read_prefixed_line
from statemachine.prefill.registration import register_rank
from statemachine.validation import parse_addr
from tests.support.bootstrap_support import TOKEN
from tests.support.http_support import free_port, rank_payload, running_server


def test_send_to_a_dead_rank_says_the_library_dropped_it_and_to_retry() -> None:
    endpoint = ("127.0.0.1", free_port())
    with ZmqTransport(send_timeout_ms=300) as transport, pytest.raises(SendFailed) as caught:
        transport.send(endpoint, [b"metadata"])
    text = str(caught.value)
    assert f"tcp://127.0.0.1:{endpoint[1]}" in text
    # What already happened is stated as done, not handed to the caller as a chore ...
    assert "its cached ranks of this prefill were dropped" in text
    assert "invalidate the generation" not in text
    # ... the caller's step is a retry, and the source is named for both kinds of deployment.
    assert "retry the request" in text
    assert "from its bootstrap server, or from etcd" in text


def test_topology_503_says_the_ranks_have_not_registered_and_to_retry() -> None:
    with (
        running_server(host="127.0.0.1", port=0, token=TOKEN) as server,
        pytest.raises(NotReady) as caught,
    ):
        BootstrapClient().get_topology(server.address)
    text = str(caught.value)
    assert text.startswith(f"{server.address}: topology query answered HTTP 503: ")
    assert "not every rank of the prefill has registered with this bootstrap server" in text
    assert "retry shortly" in text
    assert "check that every prefill rank is running" in text


def test_route_404_names_the_prefills_dp_size() -> None:
    with running_server(host="127.0.0.1", port=0, token=TOKEN) as server:
        register_rank(server.address, TOKEN, rank_payload(tp=0, tp_size=1, dp_size=1))
        client = BootstrapClient()
        with pytest.raises(NotFound) as caught:
            client.get_rank(server.address, dp_rank=1, cp_rank=0, tp_rank=0, pp_rank=0)
    text = str(caught.value)
    assert "GET /route answered HTTP 404: no rank dp=1 cp=0 tp=0 pp=0" in text
    assert "dp_size 1, cp_size 1, tp_size 1, pp_size 1" in text
    assert "check the prefill dp rank the request was routed to" in text


def test_unspecified_ack_ip_is_named_as_the_users_argument() -> None:
    with pytest.raises(InvalidArgument) as caught:
        DecodeManager(ack_ip="0.0.0.0", health_probes=False)
    text = str(caught.value)
    assert text.startswith("ack_ip (DecodeManager(ack_ip=...), AckListener(ip)) '0.0.0.0' ")
    assert "is not usable: an unspecified address" in text
    assert "give an IP address of this decode host that the prefill ranks can reach" in text


def test_url_as_bootstrap_address_says_to_drop_the_scheme() -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_addr("http://127.0.0.1:18998")
    text = str(caught.value)
    assert text.startswith("bad bootstrap address 'http://127.0.0.1:18998': ")
    assert "give host:port without a scheme" in text
    assert "no scheme:" not in text


def test_etcd_down_names_the_cause_without_urllib3_text() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    gateway = EtcdGateway([endpoint])
    try:
        with pytest.raises(EtcdUnavailable) as caught:
            gateway.get(b"/pd-bootstrap/v1/ranks/x")
    finally:
        gateway.close()
    text = str(caught.value)
    assert f"no etcd endpoint answered ({endpoint}: connection refused" in text
    assert "check that etcd runs at these endpoints" in text
    assert "pd-bootstrap etcd" in text
    assert "HTTPConnectionPool" not in text and "Max retries" not in text


def test_rank_without_a_bootstrap_server_says_so_at_its_first_try() -> None:
    """Before: the rank was silent through all its retries (about 10 s by default)."""
    port = free_port()
    args = ["--bootstrap", f"127.0.0.1:{port}", "--token", TOKEN, "--register-attempts", "3"]
    rank = subprocess.Popen(
        [sys.executable, "-m", "statemachine.prefill.rank", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert rank.stderr is not None
        started = time.monotonic()
        line = read_prefixed_line(
            rank.stderr.fileno(), b"prefill_rank: ", started + 30, bytearray()
        )
        took = time.monotonic() - started
    finally:
        rank.kill()
        rank.wait(timeout=30)
        if rank.stderr is not None:
            rank.stderr.close()
    assert line is not None
    text = line.decode()
    assert f"registration with 127.0.0.1:{port} failed" in text
    assert "connection refused" in text
    assert f"is the bootstrap server running there ('pd-bootstrap serve --port {port}')?" in text
    assert "Retrying 2 more time(s)." in text
    assert took < 10.0  # at the first try (the interpreter's start-up is most of it)
