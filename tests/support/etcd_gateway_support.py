"""A stand-in for etcd's v3 JSON gateway on 127.0.0.1, for replies a real etcd never sends.

Real etcd (``tests/support/etcd_support.py``) is what the etcd tests use; this serves only what it
cannot
show: bad base64, a header that is not an object, a compaction on every watch, a 150 MB reply,
a reply trickled a byte at a time, an event replayed or from the far future - what a broken
gateway or proxy in front of etcd may send.

A test gives one *script* per path: ``script(request_body) -> iterable of items``, where a
``bytes`` item is sent as one HTTP chunk and a ``float`` item is a pause of that many seconds.
The reply ends when the iterable does (or, for a watch, stays open until the server closes).
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "CLUSTER",
    "FakeGateway",
    "Script",
    "created",
    "event",
    "hold_open",
    "kv",
    "line",
    "range_reply",
]

#: the cluster id every reply of the stand-in carries
CLUSTER = 7

Item = bytes | float
Script = Callable[[dict[str, Any]], Iterable[Item]]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def header(revision: int) -> dict[str, str]:
    return {"cluster_id": str(CLUSTER), "member_id": "1", "revision": str(revision)}


def kv(
    key: bytes, value: bytes, mod_revision: int, *, sent: dict[str, str] | None = None
) -> dict[str, str]:
    """One key-value as the gateway encodes it; ``sent`` overrides fields as sent (bad base64)."""
    entry = {
        "key": _b64(key),
        "value": _b64(value),
        "create_revision": str(mod_revision),
        "mod_revision": str(mod_revision),
        "version": "1",
    }
    entry.update(sent or {})
    return entry


def range_reply(revision: int, kvs: list[dict[str, str]], **fields: object) -> bytes:
    body: dict[str, object] = {"header": header(revision), "kvs": kvs, "count": str(len(kvs))}
    body.update(fields)
    return json.dumps(body).encode()


def line(result: dict[str, object]) -> bytes:
    """One watch message, newline-terminated as the gateway streams it."""
    return json.dumps({"result": result}).encode() + b"\n"


def created(revision: int) -> bytes:
    return line({"header": header(revision), "created": True})


def event(revision: int, events: list[dict[str, object]]) -> bytes:
    return line({"header": header(revision), "events": events})


def hold_open(seconds: float = 3600.0) -> Iterator[Item]:
    """Keep a watch open, silent (the server's close ends it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield 0.05


class FakeGateway:
    """The stand-in server. ``calls`` counts requests per path (``"kv/range"``, ``"watch"``);
    ``sent`` holds the bytes each reply got onto the wire before it ended or broke."""

    def __init__(self, scripts: dict[str, Script]) -> None:
        self.scripts = scripts
        self.calls: Counter[str] = Counter()
        self.sent: list[int] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
                path = self.path.removeprefix("/v3/")
                script = outer.scripts.get(path)
                with outer._lock:
                    outer.calls[path] += 1
                if script is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = 0
                try:
                    for item in script(request):
                        if outer._closing.is_set():
                            break
                        if isinstance(item, float):
                            time.sleep(item)
                            continue
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(item), item))
                        self.wfile.flush()
                        sent += len(item)
                    else:
                        self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass  # the client went away (refused the reply, or closed)
                finally:
                    with outer._lock:
                        outer.sent.append(sent)
                self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> FakeGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self.close()
