"""Every public call bounded per call, not per exchange (issue 17; spec/manager.md MGR-21).

A real HTTP server on 127.0.0.1 that answers slowly (or never, on ``/health``), and a real
``DecodeManager`` with its ``BootstrapClient``. What is asserted is what the server saw - how
many queries reached it, whether a health probe ran inside a request - with a generous time
bound only as a backstop (not a performance claim).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.errors import TransportFailure

RANKS = 4
PLAN = RankPlan(tp_ranks=tuple(range(RANKS)))


class SlowServer:
    """``GET /route`` answers a valid rank after ``route_delay`` s; ``GET /health`` never
    answers (it holds the connection until the test ends)."""

    def __init__(self, route_delay: float) -> None:
        self.paths: list[str] = []
        self.stop = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                owner.paths.append(self.path)
                if self.path.startswith("/health"):
                    owner.stop.wait(30)  # silent
                    return
                time.sleep(route_delay)
                body = json.dumps({"rank_ip": "127.0.0.1", "rank_port": 9}).encode()
                self.send_response(200)
                self.send_header("X-Bootstrap-Instance-Id", "slow-1")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.address = f"127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def routes(self) -> int:
        return sum(1 for path in self.paths if path.startswith("/route"))

    def close(self) -> None:
        self.stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def slow() -> Iterator[SlowServer]:
    server = SlowServer(route_delay=0.8)
    yield server
    server.close()


def test_init_ends_by_one_deadline_for_the_whole_call(slow: SlowServer) -> None:
    """4 ranks, each answered after 0.8 s, a 1 s deadline for the call: before, each query
    had its own 5 s deadline and init() asked all four (3.2 s; 16 s with 4 s answers and the
    default 5 s). Now the second query is cut at the call's deadline and the rest are never
    sent; the request fails with a retryable, typed TransportFailure saying so."""
    client = BootstrapClient()
    manager = DecodeManager(source=client, health_probes=False, fetch_deadline_s=1.0)
    try:
        receiver = manager.receiver(slow.address, 1, PLAN, prefill_dp_rank=0)
        started = time.monotonic()
        assert receiver.init() == KVPoll.Failed
        elapsed = time.monotonic() - started
        failure = receiver.failure
        assert isinstance(failure, TransportFailure), failure
        assert "deadline" in str(failure) and "retry" in str(failure)
        assert slow.routes() == 2, slow.paths  # the first answered, the second cut, no more
        assert elapsed < 2.5, elapsed  # backstop: 4 x 0.8 s before
    finally:
        manager.close()
        client.close()


def test_a_silent_health_endpoint_never_delays_a_request(slow: SlowServer) -> None:
    """The health monitor's baseline for a new address used to be one probe made inside the
    first init() for it: 3 s with a silent /health. Now the fetch's instance id is the
    baseline: no probe has reached the server when init() returns."""
    manager = DecodeManager(liveness_timeout_s=120.0, fetch_deadline_s=10.0)
    try:
        receiver = manager.receiver(slow.address, 1, RankPlan(tp_ranks=(0,)), prefill_dp_rank=0)
        receiver.init()  # fetched (0.8 s); registering with the fake rank port fails
        assert not any(path.startswith("/health") for path in slow.paths), slow.paths
        assert slow.routes() == 1
        assert manager.health is not None and manager.health.watched() == [slow.address]
    finally:
        manager.close()
