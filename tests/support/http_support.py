"""Test helpers: a scripted HTTP server on 127.0.0.1, rank payloads, bounded waits.

``ScriptedServer`` answers every request with whatever status/body/headers/delay the test set
last, so client tests can feed a *real* socket any reply (malformed JSON, wrong types, odd
statuses, slow answers) without mocking ``requests``.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from statemachine.prefill.server import BootstrapServer
from statemachine.wire.http import route_payload


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


class _QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-reply (oversized-reply and timeout tests) are expected.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class ScriptedServer:
    """A threaded ``http.server`` serving the current ``reply`` (or the next of ``queue``)."""

    def __init__(self) -> None:
        self.reply = Reply()
        self.queue: list[Reply] = []
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real bootstrap server
            # Headers and body go out in two writes: without TCP_NODELAY, Nagle plus the
            # client's delayed ACK stall every reply by ~40 ms.
            disable_nagle_algorithm = True

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with owner._lock:
                    if len(owner.requests) < 10_000:
                        owner.requests.append((self.command, self.path, dict(self.headers), body))
                    reply = owner.queue.pop(0) if owner.queue else owner.reply
                if reply.delay:
                    time.sleep(reply.delay)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            do_GET = do_POST = do_PUT = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = _QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def set(self, status: int = 200, body: bytes = b"{}", **kw: Any) -> None:
        with self._lock:
            self.reply = Reply(status, body, **kw)


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def wait_until(predicate: Callable[[], bool], *, timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll ``predicate`` at most ``timeout`` seconds; return its last value (never hangs)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def rank_payload(
    *, tp: int = 0, tp_size: int = 2, dp: int = 0, dp_size: int = 1, port: int = 5000, **extra: Any
) -> dict[str, Any]:
    """A ``PUT /route`` body as an SGLang prefill rank sends it (``extra`` overrides fields)."""
    payload = route_payload(
        rank_ip="127.0.0.1",
        rank_port=port,
        tp_rank=tp,
        tp_size=tp_size,
        dp_rank=dp,
        dp_size=dp_size,
        system_dp_rank=0,
        system_dp_size=1,
    )
    payload.update(extra)
    return payload


class FakeClock:
    """A settable monotonic clock for dp-rank expiry tests (no sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def running_server(**kw: Any) -> Iterator[BootstrapServer]:
    server = BootstrapServer(**kw).start()
    try:
        yield server
    finally:
        server.stop()


_Acceptor = TypeVar("_Acceptor", bound="_LoopbackAcceptor")


class _LoopbackAcceptor:
    """A raw TCP listener on 127.0.0.1 that serves each connection on its own daemon thread
    (``_serve``) and, on exit, stops accepting and joins every thread it started."""

    def __init__(self) -> None:
        self.accepted = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self: _Acceptor) -> _Acceptor:
        self._accept_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._accept_thread.join(5)
        for thread in self._threads:
            thread.join(5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError


class TrickleServer(_LoopbackAcceptor):
    """A raw TCP server on 127.0.0.1 that answers every request one byte per ``interval``.

    ``phase="headers"`` trickles from the first byte of the status line; ``phase="body"``
    sends the status line and headers at once, then trickles a body of ``body_size`` bytes.
    Each connection is served by a daemon thread that stops when the client hangs up, after
    ``max_seconds``, or at ``close()`` - never left running.
    """

    def __init__(
        self,
        *,
        interval: float = 1.0,
        phase: str = "headers",
        body_size: int = 1000,
        max_seconds: float = 30.0,
    ) -> None:
        self.interval = interval
        self.phase = phase
        self.body_size = body_size
        self.max_seconds = max_seconds
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        body = b'{"rank_ip": "127.0.0.1", "rank_port": 5000, "pad": "' + b"x" * self.body_size
        body += b'"}'
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        with conn:
            conn.settimeout(0.5)
            try:
                conn.recv(65536)  # the request (small: one segment on loopback)
                if self.phase == "body":
                    conn.sendall(head)
                    slow = body
                else:
                    slow = head + body
                end = time.monotonic() + self.max_seconds
                for i in range(len(slow)):
                    if self._stop.wait(self.interval) or time.monotonic() > end:
                        return
                    conn.sendall(slow[i : i + 1])
            except OSError:
                return  # the client gave up: what the tests want


def _read_http_message(conn: socket.socket, buffer: bytearray) -> bytes | None:
    """One HTTP/1.1 message (head and a Content-Length body) from ``conn``; None at EOF."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    head_end = buffer.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buffer[:head_end]).split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(buffer) < head_end + length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    message = bytes(buffer[: head_end + length])
    del buffer[: head_end + length]
    return message


class HoldingProxy(_LoopbackAcceptor):
    """A TCP proxy on 127.0.0.1 in front of a real HTTP server that holds every request it
    receives while ``hold`` is set - a prefill whose bootstrap server does not answer - and
    forwards it (then relays the real server's reply) once the test clears ``hold``.

    ``received`` counts requests by their first line. Every connection's thread ends when
    either side hangs up or at ``close()``; nothing is left running.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.hold = threading.Event()
        self.hold.set()
        self.received: dict[str, int] = {}
        self.got_request = threading.Event()
        self._lock = threading.Lock()
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        host, port = self.upstream.rsplit(":", 1)
        conn.settimeout(0.05)
        with conn, socket.create_connection((host, int(port)), timeout=5) as up:
            inbound, outbound = bytearray(), bytearray()
            while not self._stop.is_set():
                try:
                    request = _read_http_message(conn, inbound)
                except TimeoutError:
                    continue
                if request is None:
                    return
                first = request.split(b"\r\n", 1)[0].decode(errors="replace")
                with self._lock:
                    self.received[first] = self.received.get(first, 0) + 1
                self.got_request.set()
                while self.hold.is_set():
                    if self._stop.wait(0.01):
                        return
                up.sendall(request)
                reply = _read_http_message(up, outbound)
                if reply is None:
                    return
                conn.sendall(reply)

    def count(self, prefix: str) -> int:
        """Requests received whose first line starts with ``prefix`` (e.g. ``POST /query``)."""
        with self._lock:
            return sum(n for first, n in self.received.items() if first.startswith(prefix))
