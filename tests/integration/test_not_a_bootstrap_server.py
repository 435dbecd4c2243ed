"""A decode pointed at an HTTP server that is not a bootstrap server is told so (HTTP-46).

Real servers on 127.0.0.1: Python's own file server (its 404 is an HTML page, as most web
servers' are) and a server answering as a FastAPI app does for a route it does not have
(SGLang's HTTP API port, the port most often given instead of the bootstrap port). Both must
fail typed, naming the status, the content type and the first bytes, and saying what to check;
never quote the page whole.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator

import pytest

from statemachine.decode.client import BootstrapClient
from statemachine.errors import MalformedReply, NotFound

NEXT_STEP = "but not as a prefill bootstrap server: check the address and port"


class ApiRouteNotFound(http.server.BaseHTTPRequestHandler):
    """What a FastAPI server answers for a path it has no route for."""

    def do_GET(self) -> None:
        body = b'{"detail":"Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads the client's error, not the server's log."""


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads the client's error, not the server's log."""


@pytest.fixture
def serve(tmp_path: object) -> Iterator[Callable[[type], str]]:
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(handler: type) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_an_html_404_page_is_named_not_quoted(serve: Callable[[type], str]) -> None:
    addr = serve(QuietFiles)
    with BootstrapClient() as client:
        for call in (client.get_topology, client.health):
            with pytest.raises(MalformedReply) as caught:
                call(addr)
            message = str(caught.value)
            assert caught.value.status == 404 and caught.value.addr == addr
            assert f"{addr}: " in message and "answered HTTP 404 (text/html, beginning '" in message
            assert NEXT_STEP in message and "--disaggregation-bootstrap-port" in message
            assert "Error code explanation" not in message  # the page is trimmed, not quoted
        assert client.stats().errors["MalformedReply"] == 2


def test_an_api_servers_route_not_found_is_not_a_missing_rank(
    serve: Callable[[type], str],
) -> None:
    addr = serve(ApiRouteNotFound)
    with BootstrapClient() as client, pytest.raises(MalformedReply) as caught:
        client.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
    assert not isinstance(caught.value, NotFound)
    message = str(caught.value)
    assert 'answered HTTP 404 (application/json, beginning \'{"detail":"Not Found"}\')' in message
    assert NEXT_STEP in message
