"""Helpers for the ZMQ tests: real sockets and real processes on 127.0.0.1, always bounded.

Run as a script (``python tests/zmq_support.py sink``) it is a minimal PULL peer process that
prints ``READY <port>`` and counts what it receives, so tests can SIGKILL a real peer.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import zmq

LOOPBACK = "127.0.0.1"
T = TypeVar("T")


class AckRecorder:
    """An ``AckListener`` callback that records the rooms it completed; ``wait`` is bounded."""

    def __init__(self) -> None:
        self.rooms: list[int] = []
        self.event = threading.Event()

    def __call__(self, room: int) -> None:
        self.rooms.append(room)
        self.event.set()

    def wait(self, timeout: float = 10.0) -> bool:
        return self.event.wait(timeout)


@contextmanager
def pull_peer(context: zmq.Context, port: int | None = None) -> Iterator[tuple[zmq.Socket, int]]:
    """A PULL socket bound on 127.0.0.1 (a random port, or ``port``); closed on exit."""
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if port is None:
            port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
        else:
            sock.bind(f"tcp://{LOOPBACK}:{port}")
        yield sock, port
    finally:
        sock.close(linger=0)


def dead_port() -> int:
    """A loopback port nothing listens on.

    Taken with a plain OS socket that binds and closes synchronously: closing a ZMQ socket is
    asynchronous (its I/O thread closes the listener a moment later), and a connect in that
    moment was measured to succeed 7 times in 300.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
    return port


def recv_all(sock: zmq.Socket, *, quiet_ms: int, limit: int = 100_000) -> list[list[bytes]]:
    """Receive until nothing arrives for ``quiet_ms`` (or ``limit`` messages)."""
    messages: list[list[bytes]] = []
    while len(messages) < limit and sock.poll(quiet_ms, zmq.POLLIN):
        messages.append(sock.recv_multipart())
    return messages


def recv_n(sock: zmq.Socket, n: int, *, timeout_ms: int = 5000) -> list[list[bytes]]:
    """Receive exactly ``n`` messages; fail if any does not arrive within ``timeout_ms``."""
    messages = []
    for _ in range(n):
        if not sock.poll(timeout_ms, zmq.POLLIN):
            raise AssertionError(f"only {len(messages)} of {n} messages arrived")
        messages.append(sock.recv_multipart())
    return messages


def with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it has not returned."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"did not return within {seconds} s")
    if error:
        raise error[0]
    return result[0]


class SinkProcess:
    """A PULL peer in its own process (this file run as a script), to SIGKILL for real."""

    def __init__(self) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "sink"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.port = self._wait_ready(10.0)

    def _wait_ready(self, timeout: float) -> int:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self.kill()
                    raise AssertionError("sink did not get ready")
                chunk = os.read(self.proc.stdout.fileno(), 1024)
                if not chunk:
                    raise AssertionError("sink exited before READY")
                buffer += chunk
        line = buffer.split(b"\n", 1)[0]
        assert line.startswith(b"READY "), line
        return int(line.split()[1])

    def kill(self) -> None:
        """SIGKILL and reap: once this returns the kernel has closed the peer's sockets."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=10)

    def __enter__(self) -> SinkProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _sink_main() -> int:
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
    print(f"READY {port}", flush=True)
    # Runs until killed (tests SIGKILL it); bounded anyway, so an orphan cannot live forever.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if sock.poll(1000, zmq.POLLIN):
            sock.recv_multipart()
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["sink"]:
        raise SystemExit(_sink_main())
    raise SystemExit("usage: zmq_support.py sink")
