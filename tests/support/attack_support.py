"""Hostile HTTP clients for tests and benchmarks: slowloris and slow-body connections.

One thread drives every attacking connection with non-blocking sockets (600 connections do
not need 600 threads): each tick it sends one more byte on each, and replaces the ones the
server closed, so the attack keeps its size as the server sheds it. Loopback only; bounded in
connections, reconnects and time.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from dataclasses import dataclass

# A header block that never ends: one more header byte per tick.
_SLOWLORIS_HEAD = b"GET /health HTTP/1.1\r\nHost: bootstrap\r\n"
_SLOWLORIS_TRICKLE = b"X-Slow: " + b"a" * 4000
# A body that never ends: complete headers promising 60,000 bytes, then one byte per tick.
_SLOW_BODY_HEAD = (
    b"POST /query_dp_ranks HTTP/1.1\r\nHost: bootstrap\r\nContent-Type: application/json\r\n"
    b"Content-Length: 60000\r\n\r\n"
)
_SLOW_BODY_TRICKLE = b'{"bootstrap_rooms": [' + b"1," * 30000


@dataclass
class _Conn:
    sock: socket.socket
    kind: str
    sent: int = 0


@dataclass
class AttackStats:
    opened: int = 0
    closed_by_server: int = 0
    open_now: int = 0


class SlowAttack:
    """``slowloris`` header-trickling plus ``slow_body`` body-trickling connections to
    ``host:port``, one byte per connection every ``interval`` seconds, for at most
    ``max_seconds`` (or until ``stop()``)."""

    def __init__(
        self,
        address: str,
        *,
        slowloris: int,
        slow_body: int,
        interval: float = 1.0,
        max_seconds: float = 120.0,
        max_reconnects: int = 100_000,
    ) -> None:
        host, _, port = address.rpartition(":")
        assert host in ("127.0.0.1", "localhost"), "attacks stay on loopback"
        self._target = (host, int(port))
        self._want = {"slowloris": slowloris, "body": slow_body}
        self._interval = interval
        self._max_seconds = max_seconds
        self._reconnects_left = max_reconnects
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self.stats = AttackStats()
        self._thread = threading.Thread(target=self._run, name="slow-attack", daemon=True)

    def __enter__(self) -> SlowAttack:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for conn in list(self._conns.values()):
            self._close(conn)
        self._selector.close()

    def wait_open(self, count: int, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stats.opened >= count:
                return True
            time.sleep(0.05)
        return False

    # --- the attack thread ----------------------------------------------------------------

    def _open(self, kind: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex(self._target)
        conn = _Conn(sock, kind)
        self._conns[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self.stats.opened += 1

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0 and self._conns.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        conn.sock.close()

    def _send_next(self, conn: _Conn) -> bool:
        if conn.kind == "slowloris":
            head, trickle = _SLOWLORIS_HEAD, _SLOWLORIS_TRICKLE
        else:
            head, trickle = _SLOW_BODY_HEAD, _SLOW_BODY_TRICKLE
        data = head if conn.sent == 0 else trickle[(conn.sent - 1) % len(trickle) :][:1]
        try:
            conn.sock.send(data)
        except BlockingIOError:
            return True  # still connecting: try again next tick
        except OSError:
            return False
        conn.sent += 1
        return True

    def _refill(self) -> None:
        counts = {"slowloris": 0, "body": 0}
        for conn in self._conns.values():
            counts[conn.kind] += 1
        for kind, want in self._want.items():
            for _ in range(want - counts[kind]):
                if self._reconnects_left <= 0:
                    return
                self._reconnects_left -= 1
                try:
                    self._open(kind)
                except OSError:
                    return

    def _run(self) -> None:
        end = time.monotonic() + self._max_seconds
        next_tick = time.monotonic()
        while not self._stop.is_set() and time.monotonic() < end:
            timeout = max(0.0, next_tick - time.monotonic())
            for key, _ in self._selector.select(timeout):
                conn: _Conn = key.data
                try:
                    data = conn.sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the server closed it (or answered and closed)
                    self.stats.closed_by_server += 1
                    self._close(conn)
            if time.monotonic() >= next_tick:
                for conn in list(self._conns.values()):
                    if not self._send_next(conn):
                        self.stats.closed_by_server += 1
                        self._close(conn)
                self._refill()
                next_tick = time.monotonic() + self._interval
            self.stats.open_now = len(self._conns)


_SERVER_SCRIPT = r"""
import json, logging, resource, sys, dataclasses
nofile, kwargs = json.loads(sys.argv[1])
if nofile:  # soft and hard: the server raises its soft limit to the hard one at start
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(message)s")
from statemachine.prefill.server import BootstrapServer
server = BootstrapServer(**kwargs).start()
print("PORT", server.port, flush=True)
sys.stdin.read()  # until the parent closes our stdin
stats = server.stats()
server.stop()
print("STATS", json.dumps(dataclasses.asdict(stats)), flush=True)
"""


class ServerProcess:
    """A :class:`BootstrapServer` in a child process whose fd limit, soft and hard, is
    ``nofile`` (so the attack's own sockets, in this process, do not count against it, and the
    server cannot raise it). ``stop()`` returns the server's final stats and everything it
    logged."""

    def __init__(self, nofile: int | None = None, **kwargs: object) -> None:
        import json
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_SCRIPT, json.dumps([nofile, kwargs])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().decode()
        if not line.startswith("PORT "):
            self._proc.kill()
            _, err = self._proc.communicate(timeout=10)
            raise RuntimeError(f"server process did not start: {line!r} {err[-2000:]!r}")
        self.port = int(line.split()[1])
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> tuple[dict[str, object], str]:
        import json
        import subprocess

        try:
            out, err = self._proc.communicate(input=b"", timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, err = self._proc.communicate(timeout=10)
        stats: dict[str, object] = {}
        for line in out.decode().splitlines():
            if line.startswith("STATS "):
                stats = json.loads(line[len("STATS ") :])
        return stats, err.decode(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self.stop()


_RSS_SENDER = (
    "import sys, time, zmq\n"
    "c = zmq.Context(); s = c.socket(zmq.PUSH); s.setsockopt(zmq.LINGER, 2000)\n"
    's.connect("tcp://127.0.0.1:" + sys.argv[1])\n'
    's.send_multipart([b"x" * 200] * int(sys.argv[2])); time.sleep(1.0); s.close(); c.term()\n'
)

_RSS_SCRIPT = r"""
import json, subprocess, sys, time
import zmq
from statemachine.decode.ranks.acks import AckListener

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

frames, mode, sender = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "ours":
    acks = AckListener()
    port = acks.port
    drain = lambda: None
else:  # the design before ACK-2: a PULL socket with MAXMSGSIZE, messages read whole
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.MAXMSGSIZE, 256)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    def drain():
        while pull.poll(0):
            pull.recv_multipart()
time.sleep(0.2)
base = peak = rss_mb()
child = subprocess.Popen([sys.executable, "-c", sender, str(port), str(frames)])
end = time.monotonic() + 60
while child.poll() is None and time.monotonic() < end:
    drain()
    peak = max(peak, rss_mb())
    time.sleep(0.005)
child.wait(10)
drain()
after = rss_mb()
malformed = acks.stats().malformed if mode == "ours" else 0
print(json.dumps({"base": base, "peak": peak, "after": after, "malformed": malformed}))
"""


def rss_after_one_message(frames: int, mode: str) -> dict[str, float]:
    """RSS (MB) of a fresh process listening for acks, before / peak / after one message of
    ``frames`` 200-byte frames sent by another process. ``mode``: ``"ours"`` (AckListener)
    or ``"pull"`` (a plain PULL socket with MAXMSGSIZE=256, the design before ACK-2)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(frames), mode, _RSS_SENDER],
        capture_output=True,
        timeout=120,
        check=True,
    ).stdout
    result: dict[str, float] = json.loads(out.decode().strip().splitlines()[-1])
    return result


_ATTACK_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from tests.support.attack_support import SlowAttack
address, seconds = sys.argv[2], float(sys.argv[5])
slowloris, slow_body = int(sys.argv[3]), int(sys.argv[4])
with SlowAttack(address, slowloris=slowloris, slow_body=slow_body, interval=1.0,
                max_seconds=seconds + 60) as attack:
    ok = attack.wait_open(slowloris + slow_body, timeout=30.0)
    print(f"READY {int(ok)}", flush=True)  # 1: every connection is open
    end = time.monotonic() + seconds
    while time.monotonic() < end and not sys.stdin.closed:
        time.sleep(0.1)
    print("STATS", json.dumps(attack.stats.__dict__), flush=True)
"""


class AttackProcess:
    """A :class:`SlowAttack` in its own process, so that the attacker's Python work does not
    compete with the measuring client for one interpreter's GIL (benchmarks)."""

    def __init__(self, address: str, *, slowloris: int, slow_body: int, seconds: float) -> None:
        import subprocess
        import sys
        import time
        from pathlib import Path

        from statemachine.prefill.readiness import read_ready

        here = str(Path(__file__).resolve().parents[2])  # the repository: tests.support
        args = [address, str(slowloris), str(slow_body), str(seconds)]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _ATTACK_SCRIPT, here, *args],
            stdout=subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        try:
            words = read_ready(self._proc.stdout.fileno(), time.monotonic() + 60)
        except TimeoutError:
            words = None
        self.ready = words == [b"1"]

    def stop(self) -> dict[str, int]:
        import json

        out, _ = self._proc.communicate(timeout=120)
        for line in out.decode().splitlines():
            if line.startswith("STATS "):
                stats: dict[str, int] = json.loads(line[len("STATS ") :])
                return stats
        return {}


_HEALTH_FLOOD_SCRIPT = r"""
import selectors, socket, sys, time
host, port, clients, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
assert host in ("127.0.0.1", "localhost"), "attacks stay on loopback"
request = b"GET /health HTTP/1.1\r\nHost: bootstrap\r\n\r\n"
sel = selectors.DefaultSelector()
stats = {"requests": 0, "reconnects": 0}

def open_one():
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.connect((host, port))
    except BlockingIOError:
        pass
    sel.register(sock, selectors.EVENT_WRITE, bytearray())

for _ in range(clients):
    open_one()
print("READY", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for key, events in sel.select(0.1):
        sock, buf = key.fileobj, key.data
        if events & selectors.EVENT_WRITE:  # connected, or a reply was read: ask again
            try:
                sock.send(request)
            except OSError:
                data = b""
            else:
                sel.modify(sock, selectors.EVENT_READ, buf)
                continue
        else:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
        if not data:  # closed by the server: reconnect at once (bounded by the run's time)
            sel.unregister(sock)
            sock.close()
            stats["reconnects"] += 1
            open_one()
            continue
        buf += data
        head, sep, body = bytes(buf).partition(b"\r\n\r\n")
        if sep:
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if len(body) >= length:  # one whole reply: send the next request at once
                del buf[:]
                stats["requests"] += 1
                sel.modify(sock, selectors.EVENT_WRITE, buf)
print("STATS", stats["requests"], stats["reconnects"], flush=True)
"""


class HealthFlood:
    """``clients`` keep-alive connections that re-request ``/health`` as fast as they are
    answered, without a token, from a child process for at most ``seconds``; a connection the
    server closes is replaced at once. Loopback only."""

    def __init__(self, address: str, clients: int, seconds: float) -> None:
        import subprocess
        import sys
        import time

        from statemachine.prefill.readiness import read_ready

        host, _, port = address.rpartition(":")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _HEALTH_FLOOD_SCRIPT, host, port, str(clients), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        try:
            words = read_ready(self._proc.stdout.fileno(), time.monotonic() + 60)
        except TimeoutError:
            words = None
        self.ready = words == []
        self.requests = self.reconnects = 0

    def wait(self) -> None:
        """Until the flood ends by itself; then ``requests`` and ``reconnects`` are set."""
        import subprocess

        try:
            out, _ = self._proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate(timeout=10)
        for line in out.splitlines():
            if line.startswith("STATS "):
                self.requests, self.reconnects = (int(v) for v in line.split()[1:])

    def __enter__(self) -> HealthFlood:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate(timeout=10)
