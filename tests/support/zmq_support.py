"""Helpers for the ZMQ tests: real sockets and real processes on 127.0.0.1, always bounded.

Run as a script (``python tests/support/zmq_support.py sink``) it is a minimal PULL peer process
that
prints ``READY <port>`` and counts what it receives, so tests can SIGKILL a real peer.
"""

from __future__ import annotations

import os
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

from statemachine.errors import SendFailed
from statemachine.prefill.readiness import read_ready

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


def first_send_failure(send: Callable[[int], None], seconds: float = 5.0) -> SendFailed:
    """Call ``send(0)``, ``send(1)``, ... until one raises ``SendFailed``, and return it.

    After a peer is killed, libzmq sees the reset on its I/O thread a moment later; sends in
    that window are queued on the dying connection and dropped with it. The window is a time,
    not a number of sends (a send takes microseconds: 1,000 of them once ran out before the
    reset was seen), so the wait is bounded by ``seconds`` (then AssertionError)."""
    deadline = time.monotonic() + seconds
    attempt = 0
    while True:
        try:
            send(attempt)
        except SendFailed as exc:
            return exc
        assert time.monotonic() < deadline, f"libzmq did not see the peer's exit in {seconds:g} s"
        attempt += 1
        time.sleep(0.001)


def fd_count() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` every millisecond until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class VerdictRecorder:
    """A ``ZmqTransport.subscribe`` listener that records ``(endpoint, alive, reason, t)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, int], bool, str, float]] = []
        self._cond = threading.Condition()

    def __call__(self, endpoint: tuple[str, int], alive: bool, reason: str) -> None:
        with self._cond:
            self.calls.append((endpoint, alive, reason, time.monotonic()))
            self._cond.notify_all()

    def mark(self) -> int:
        """How many calls so far: pass as ``since`` to wait for a later one only."""
        with self._cond:
            return len(self.calls)

    def wait_for(
        self, endpoint: tuple[str, int], alive: bool, timeout: float = 10.0, since: int = 0
    ) -> tuple[str, float]:
        """``(reason, time)`` of the first such call after ``since``; AssertionError on timeout.

        Ports are reused by the OS, so a test that restarts peers passes ``since=mark()``.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ep, up, reason, at in self.calls[since:]:
                    if ep == endpoint and up is alive:
                        return reason, at
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no alive={alive} for {endpoint}: {self.calls}")
                self._cond.wait(left)

    def of(self, endpoint: tuple[str, int]) -> list[bool]:
        with self._cond:
            return [up for ep, up, _, _ in self.calls if ep == endpoint]


class SinkProcess:
    """A PULL peer in its own process (this file run as a script), to SIGKILL for real.

    ``port`` binds a given port (a restart behind the same endpoint); by default a random one.
    """

    def __init__(self, port: int = 0) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "sink", str(port)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.port = self._wait_ready(10.0)

    def _wait_ready(self, timeout: float) -> int:
        assert self.proc.stdout is not None
        try:
            words = read_ready(self.proc.stdout.fileno(), time.monotonic() + timeout)
        except TimeoutError:
            self.kill()
            raise AssertionError("sink did not get ready") from None
        if words is None:
            raise AssertionError("sink exited before READY")
        return int(words[0])

    def kill(self) -> None:
        """SIGKILL and reap: once this returns the kernel has closed the peer's sockets."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=10)

    def __enter__(self) -> SinkProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _sink_main(port: int) -> int:
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    if port:
        sock.bind(f"tcp://{LOOPBACK}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
    print(f"READY {port}", flush=True)
    # Runs until killed (tests SIGKILL it); bounded anyway, so an orphan cannot live forever.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if sock.poll(1000, zmq.POLLIN):
            sock.recv_multipart()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["sink"]:
        raise SystemExit(_sink_main(int(sys.argv[2]) if len(sys.argv) > 2 else 0))
    raise SystemExit("usage: zmq_support.py sink [PORT]")
