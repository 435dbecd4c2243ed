"""The guard answers a whole ``GET /health`` itself, below aiohttp (spec/protocol.md HTTP-74).

Real servers on 127.0.0.1 and raw sockets. Which of the two answered is read from aiohttp's
own count of the requests it handled (``web.Server.requests_count``): the fast path leaves it
unchanged.
"""

from __future__ import annotations

import email.utils
import socket
import time

import pytest

from statemachine.prefill.registration import register_rank
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.http import INSTANCE_HEADER
from tests.support.bootstrap_support import TOKEN
from tests.support.http_support import running_server, wait_until

TIMEOUT = 5.0
HEALTH = b"GET /health HTTP/1.1\r\nHost: bootstrap\r\n\r\n"
# What requests (the decode's BootstrapClient) and SGLang's decode send.
HEALTH_REQUESTS = (
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:1\r\nUser-Agent: python-requests/2.34.2\r\n"
    b"Accept-Encoding: gzip, deflate\r\nAccept: */*\r\nConnection: keep-alive\r\n\r\n"
)
ROUTE = (
    b"GET /route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0 "
    b"HTTP/1.1\r\nHost: bootstrap\r\n\r\n"
)


def aiohttp_requests(srv: BootstrapServer) -> int:
    """Requests aiohttp itself handled since the server started."""
    handlers = srv._handlers
    assert handlers is not None
    return handlers.requests_count


class Reply:
    """One HTTP/1.1 reply read off a raw socket (``Content-Length`` framed)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


class RawConnection:
    """A keep-alive connection that sends bytes and reads replies one at a time, in order."""

    def __init__(self, srv: BootstrapServer) -> None:
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
        self.buf = b""

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> Reply:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return Reply(int(status_line.split()[1]), headers, body)

    def ask(self, data: bytes) -> Reply:
        self.send(data)
        return self.reply()

    def closed_by_server(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True  # reset
        finally:
            self.sock.settimeout(TIMEOUT)

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection before a whole reply")
        self.buf += data


def test_http74_fast_reply_says_what_aiohttps_route_says(server: BootstrapServer) -> None:
    """The same status, headers and body as aiohttp's own ``GET /health`` reply (asked with a
    ``Connection`` header the fast path leaves to aiohttp); only Date may differ."""
    with RawConnection(server) as conn:
        fast = conn.ask(HEALTH)
        assert aiohttp_requests(server) == 0
        slow = conn.ask(
            b"GET /health HTTP/1.1\r\nHost: bootstrap\r\nConnection: keep-alive, x\r\n\r\n"
        )
        assert aiohttp_requests(server) == 1
    assert (fast.status, fast.body) == (slow.status, slow.body) == (200, b"OK")
    assert fast.headers.keys() == slow.headers.keys()
    assert {k: v for k, v in fast.headers.items() if k != "date"} == {
        k: v for k, v in slow.headers.items() if k != "date"
    }
    assert fast.headers[INSTANCE_HEADER.lower()] == server.instance_id
    sent = email.utils.parsedate_to_datetime(fast.headers["date"]).timestamp()
    assert abs(sent - time.time()) < 5


def test_http74_keep_alive_across_many_probes_and_counted(server: BootstrapServer) -> None:
    with RawConnection(server) as conn:
        for probe in range(200):
            reply = conn.ask(HEALTH if probe % 2 else HEALTH_REQUESTS)
            assert (reply.status, reply.body) == (200, b"OK")
    stats = server.stats()
    assert aiohttp_requests(server) == 0
    assert stats.requests == {"GET /health": 200}
    assert (stats.connections_accepted, stats.connections_peak) == (1, 1)


def test_http74_back_to_the_fast_path_once_aiohttp_answered_a_whole_request(
    server: BootstrapServer,
) -> None:
    """A decode asks /route, /query_dp_ranks and /health on one connection: once aiohttp
    answered a request that was all it was handed, the next /health is the guard's again."""
    register_rank(server.address, TOKEN, {**_REGISTRATION})
    before = aiohttp_requests(server)
    body = b'{"bootstrap_rooms": [7]}'
    with RawConnection(server) as conn:
        assert conn.ask(ROUTE).status == 200
        assert conn.ask(HEALTH).status == 200
        assert aiohttp_requests(server) == before + 1
        conn.send(
            b"POST /query_dp_ranks HTTP/1.1\r\nHost: b\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        time.sleep(0.05)  # the body in its own segment, as requests sends it
        reply = conn.ask(body)
        assert (reply.status, reply.body) == (200, b"{}")
        assert conn.ask(HEALTH).status == 200
        assert aiohttp_requests(server) == before + 2
        conn.send(HEALTH[:20])  # a partial request: aiohttp's, once whole
        time.sleep(0.05)
        assert conn.ask(HEALTH[20:]).status == 200
        assert conn.ask(HEALTH).status == 200
        assert aiohttp_requests(server) == before + 3


def test_http74_pipelined_requests_are_answered_in_order_by_aiohttp(
    server: BootstrapServer,
) -> None:
    """Two requests in one segment are aiohttp's, and so is that connection from then on: a
    reply of the guard's could otherwise overtake one aiohttp still owes."""
    with RawConnection(server) as conn:
        conn.send(ROUTE.replace(b"=0&", b"=x&", 1) + HEALTH + HEALTH)
        assert [conn.reply().status for _ in range(3)] == [400, 200, 200]
        assert conn.ask(HEALTH).status == 200
        assert aiohttp_requests(server) == 4


def test_http74_a_body_that_looks_like_a_probe_is_a_body(server: BootstrapServer) -> None:
    """A ``GET /health`` with a 41-byte body whose bytes are themselves a probe, sent after
    aiohttp answered: aiohttp reads them as the body, the guard does not answer them."""
    with RawConnection(server) as conn:
        conn.send(
            HEALTH.replace(b"\r\n\r\n", f"\r\nContent-Length: {len(HEALTH)}\r\n\r\n".encode())
        )
        assert conn.reply().status == 200
        time.sleep(0.05)
        conn.send(HEALTH)  # the body
        assert not conn.closed_by_server(0.3) and conn.buf == b""  # no second reply
        assert conn.ask(HEALTH).status == 200
    assert server.stats().requests == {"GET /health": 2}


@pytest.mark.parametrize(
    ("request_bytes", "statuses"),
    [
        (b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", {400}),
        (b"GET /health HTTP/1.1\r\nHost: b\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", {400, 431}),
        (b"GET /health HTTP/1.1\nHost: b\n\n", {200, 400}),
        (b"GET /health HTTP/1.1\r\n Host: folded\r\n\r\n", {400}),
        (b"GET /health HTTP/1.1\r\nHost: b\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", {200}),
        (b"GET /health HTTP/1.1\r\nHost: b\r\nContent-Length: zz\r\n\r\n", {400}),
        (b"GET /health HTTP/1.1\r\nHost: b\r\nExpect: 100-continue\r\n\r\n", {100, 417}),
        (b"GET /health HTTP/1.1\r\n\r\n", {400}),
        (b"GET /health HTTP/1.1\r\nHost: b\r\nHost: c\r\n\r\n", {400}),
        (b"GET /health HTTP/1.1\r\nHost: b\r\nSec-WebSocket-Key1: x\r\n\r\n", {400}),
        (b"GET /health HTTP/1.1\r\nHost: b\r\nX: \x00\r\n\r\n", {400}),
        (b"GET /health?x=1 HTTP/1.1\r\nHost: b\r\n\r\n", {200}),
        (b"HEAD /health HTTP/1.1\r\nHost: b\r\n\r\n", {200}),
        (b"GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n", {404}),
        (b"GET /health HTTP/9.9\r\n\r\n", {400, 505}),
    ],
)
def test_http74_what_the_fast_path_refuses_aiohttp_answers_never_500(
    server: BootstrapServer, request_bytes: bytes, statuses: set[int]
) -> None:
    with RawConnection(server) as conn:
        conn.send(request_bytes)
        status = int(conn.sock.recv(65536).split(b" ", 2)[1])
    assert status in statuses
    assert aiohttp_requests(server) == 1


def test_http74_connection_close_is_answered_then_closed(server: BootstrapServer) -> None:
    with RawConnection(server) as conn:
        reply = conn.ask(b"GET /health HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
        assert (reply.status, reply.body) == (200, b"OK")
        assert conn.closed_by_server(TIMEOUT)


def test_http74_fast_path_probes_keep_a_connection_from_its_idle_close() -> None:
    """The guard's probes restart the idle clock as aiohttp's do: probed every 0.1 s with an
    idle deadline of 0.4 s, a connection stays open; left silent, it is closed."""
    with running_server(token=TOKEN, idle_timeout=0.4) as srv, RawConnection(srv) as conn:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            assert conn.ask(HEALTH).status == 200
            time.sleep(0.1)
        assert srv.stats().connections_timed_out == 0
        assert conn.closed_by_server(TIMEOUT)
        assert wait_until(lambda: srv.stats().connections_timed_out == 1)
        assert aiohttp_requests(srv) == 0


def test_http74_past_the_cap_the_least_recently_probed_is_evicted() -> None:
    """Recency is kept for probes the guard answers (HTTP-71): at a cap of 4, the connection
    probed longest ago is closed for a newcomer, the others stay open."""
    with running_server(token=TOKEN, max_connections=4) as srv:
        fleet = [RawConnection(srv) for _ in range(4)]
        try:
            for _ in range(3):
                assert fleet[0].ask(HEALTH).status == 200
            for conn in fleet:
                assert conn.ask(HEALTH).status == 200
                time.sleep(0.02)
            time.sleep(0.6)  # each idle longer than IDLE_BEFORE_EVICTION
            with RawConnection(srv) as newcomer:
                assert newcomer.ask(HEALTH).status == 200
                assert fleet[0].closed_by_server(TIMEOUT)
                for conn in fleet[1:]:
                    assert not conn.closed_by_server(0.05)
            assert srv.stats().connections_evicted == 1
            assert aiohttp_requests(srv) == 0
        finally:
            for conn in fleet:
                conn.sock.close()


_REGISTRATION = {
    "attn_tp_size": 1,
    "attn_tp_rank": 0,
    "attn_cp_size": 1,
    "attn_cp_rank": 0,
    "attn_dp_size": 1,
    "attn_dp_rank": 0,
    "pp_size": 1,
    "pp_rank": 0,
    "system_dp_size": 1,
    "system_dp_rank": 0,
    "rank_ip": "127.0.0.1",
    "rank_port": 5000,
}
