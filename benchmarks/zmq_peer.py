"""A minimal prefill-rank stand-in for the transport benchmarks: a PULL socket in its own
process that prints ``READY <port>`` and drains what it receives, so a benchmark can SIGKILL
a real peer. ``python -m benchmarks.zmq_peer`` runs it (bounded to 10 minutes).

``python -m benchmarks.zmq_peer --sink`` is the hot-path benchmarks' peer: its PULL socket is
drained by libzmq itself (``zmq.proxy`` into a PUB socket nobody subscribes to, which drops every
message in C), so it keeps up with a sender measured in microseconds per message and its
sender's queue never fills. Also bounded to 10 minutes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import zmq

from statemachine.prefill.readiness import read_ready

LOOPBACK = "127.0.0.1"


class PeerProcess:
    """Start the peer; ``port`` once it is ready; ``kill()`` is SIGKILL and reap."""

    def __init__(self, timeout: float = 20.0, *, sink: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.zmq_peer", *(["--sink"] if sink else [])],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        self.port = self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> int:
        assert self.proc.stdout is not None
        try:
            words = read_ready(self.proc.stdout.fileno(), time.monotonic() + timeout)
        except TimeoutError:
            self.kill()
            raise RuntimeError("peer did not get ready") from None
        if words is None:
            raise RuntimeError("peer exited before READY")
        return int(words[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=10)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _sink() -> int:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, 0)
    port = pull.bind_to_random_port(f"tcp://{LOOPBACK}")
    drop = context.socket(zmq.PUB)  # no subscriber: every message is dropped, in C
    drop.setsockopt(zmq.LINGER, 0)
    drop.bind("inproc://sink")
    print(f"READY {port}", flush=True)
    signal.alarm(600)  # the bound: zmq.proxy never returns, SIGALRM's default ends the process
    zmq.proxy(pull, drop)
    return 0


def _main() -> int:
    if sys.argv[1:] == ["--sink"]:
        return _sink()
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
    print(f"READY {port}", flush=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if sock.poll(1000, zmq.POLLIN):
            sock.recv_multipart()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
