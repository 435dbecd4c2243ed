"""``pd-bootstrap etcd``: a local etcd for trying, as a user starts it, and the TTL fact
docs/etcd.md states about it (a TTL below etcd's minimum is raised, not refused)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.local_server import find_etcd_binary
from statemachine.prefill.readiness import read_prefixed_line

pytestmark = pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary (etcd extra)")
REPO = Path(__file__).resolve().parents[2]


def test_serves_on_loopback_says_where_and_stops_cleanly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "statemachine", "etcd", "--port", "0", "--peer-port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = read_prefixed_line(
            proc.stdout.fileno(), b"etcd serving on ", time.monotonic() + 30, bytearray()
        )
        assert line is not None, proc.stderr.read() if proc.stderr else ""
        endpoint = line.decode().split()[-1]
        assert endpoint.startswith("http://127.0.0.1:")  # loopback only
        gateway = EtcdGateway([endpoint])
        try:
            gateway.put(b"/try/key", b"value")
            found = gateway.get(b"/try/key")
            assert found is not None and found.value == b"value"
            # docs/etcd.md: etcd 3.5 silently raises a TTL below its minimum to the minimum.
            _, granted = gateway.lease_grant(1)
            assert granted == 2
        finally:
            gateway.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_binary_that_is_not_there_is_named() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "statemachine", "etcd"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PD_ETCD_BINARY": "/nonexistent/etcd", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 2
    assert "PD_ETCD_BINARY='/nonexistent/etcd' is not an executable file" in done.stderr
