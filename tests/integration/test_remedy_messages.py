"""Messages that say what happened and what to do (issue 27 item 5), one test per message.

Each was met by a new user with the remedy missing: the text here is the text they now read.
Real parts throughout: a real bootstrap server on 127.0.0.1, real sockets, the real CLIs.
"""

from __future__ import annotations

import importlib
import socket
import subprocess
import sys
import warnings
from typing import Any

import pytest

from statemachine.__main__ import main as cli_main
from statemachine.decode.plan import DecodeLayout, derive_plan
from statemachine.decode_on_etcd import manager_on_etcd
from statemachine.discovery import etcd_cli
from statemachine.discovery.layout import DEFAULT_PREFIX
from statemachine.errors import NotReady, RequestRejected, TopologyMismatch
from statemachine.model import check
from statemachine.prefill.registration import register_rank
from statemachine.wire.http import topology_reply
from tests.support.bootstrap_support import TOKEN
from tests.support.http_support import rank_payload, running_server

ADDR = "127.0.0.1:8998"


def test_a_long_server_error_keeps_its_remedy_through_the_client() -> None:
    """The client quotes a server's reason: a long one loses its middle, never its end."""
    with running_server(token=TOKEN) as server:
        register_rank(server.address, TOKEN, rank_payload(tp=0, tp_size=1, page_size=16))
        with pytest.raises(RequestRejected) as caught:
            register_rank(server.address, TOKEN, rank_payload(tp=0, tp_size=1, page_size=64))
    text = str(caught.value)
    assert "answered HTTP 400: registration claims" in text
    assert text.endswith(
        "start this rank with the registered settings, or restart the bootstrap server to "
        "register a new topology"
    )


def _topology(**fields: Any) -> Any:
    reply: dict[str, object] = {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "bfloat16",
        "follow_bootstrap_room": True,
    }
    reply.update(fields)
    return topology_reply(reply, addr=ADDR, status=200, instance_id="i")


def test_a_page_size_mismatch_says_the_server_keeps_the_first_topology() -> None:
    with pytest.raises(TopologyMismatch) as caught:
        derive_plan(ADDR, _topology(page_size=32), DecodeLayout(0, 2, page_size=16))
    text = str(caught.value)
    assert "prefill page_size is 32, this decode's is 16" in text
    assert "configure both sides with the same page_size" in text
    assert "keeps the first topology its ranks registered until it restarts" in text
    assert "restart its bootstrap server too" in text


def test_a_second_local_etcd_is_told_to_pick_free_ports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A taken client port (here a real listener, as a first etcd's would be) is reported
    before etcd starts, not after a first etcd's answer made the second look started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert etcd_cli.main(["--port", str(port), "--peer-port", "0"]) == 1
    out, err = capsys.readouterr()
    assert "etcd serving on" not in out
    assert err.strip().endswith("pass --port 0 --peer-port 0 to pick free ports")
    assert f"port {port} on 127.0.0.1 is in use (--port;" in err


def test_serve_without_a_token_warns_with_the_fix() -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "statemachine", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        warning = server.stderr.readline()
    finally:
        server.kill()
        server.communicate()
    assert warning.startswith("warning: no --token: registration routes answer 401;")
    assert "pass --token TOKEN (and the same token to every prefill rank)" in warning
    assert "--insecure on a trusted network" in warning


def test_a_rank_with_a_token_is_told_the_server_has_none() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the no-token warning, tested above
        server_cm = running_server()
        server = server_cm.__enter__()
    try:
        with pytest.raises(RequestRejected) as caught:
            register_rank(server.address, TOKEN, rank_payload())
    finally:
        server_cm.__exit__(None, None, None)
    text = str(caught.value)
    assert "HTTP 401: this bootstrap server has no token configured" in text
    assert "wrong" not in text
    assert "restart it with --token TOKEN" in text


def test_the_etcd_manager_with_etcd_down_names_the_cause() -> None:
    """No etcd at the endpoint (a port nobody listens on): the manager is returned once the
    first list failed, and a request's NotReady says why (refused) and what to check."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    manager = manager_on_etcd(endpoint, health_probes=False)
    try:
        receiver = manager.receiver("127.0.0.1:8998", 1, prefill_dp_rank=0)
        receiver.init()
        failure = receiver.failure
    finally:
        manager.close()
    assert isinstance(failure, NotReady), failure
    text = str(failure)
    assert f"etcd source not synced yet (first list of {DEFAULT_PREFIX!r} failed:" in text
    assert "refused" in text
    assert f"check that etcd serves at {endpoint}" in text


def test_a_bug_variant_check_says_violated_is_its_expected_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert check.main(["MCNoInvalidation", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATED" in out
    assert "expected: this cfg runs the bug variant 'NoInvalidation'" in out
    assert "VIOLATED is this cfg's expected result (exit 1)" in out


def test_ctrl_c_while_a_command_loads_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's imports take seconds (the prefill, the plotting); Ctrl-C then is a
    KeyboardInterrupt out of the import, which the CLI turns into exit 130 and one line."""

    def interrupted(name: str) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert cli_main(["demo"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "interrupted:" in err and "demo stopped before it started" in err
