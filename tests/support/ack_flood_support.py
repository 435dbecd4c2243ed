"""An ack listener in a child process with a low fd limit, and a flood of silent ZMTP senders.

Used by tests/integration/test_hostile_acks.py and benchmarks/bench_hostile.py (issue 17, "Ports a
peer can
reach"): the listener's process has ``RLIMIT_NOFILE`` lowered (so a few hundred connections can
exhaust it cheaply), the flood runs in its own process with its own limit, and the live sender
is the caller's. Loopback only; every child ends when its stdin closes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from statemachine.prefill.readiness import read_ready

_LISTENER_SCRIPT = r"""
import json, resource, socket, sys, time
nofile, kwargs = json.loads(sys.argv[1])
if nofile:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
from statemachine.decode.ranks.acks import AckListener
completed = []
acks = AckListener(**kwargs)
print("PORT", acks.port, flush=True)
start_cpu = time.process_time()
start_wall = time.monotonic()
for line in sys.stdin:
    words = line.split()
    if not words:
        continue
    if words[0] == "expect":
        for room in range(int(words[1]), int(words[2])):
            acks.expect(room, 1, completed.append)
        print("OK", flush=True)
    elif words[0] == "probe":
        # Can this process still open what it needs (a socket, a file)? errno name if not.
        try:
            probe = socket.socket()
            probe.close()
            with open("/dev/null", "rb"):
                pass
            print("PROBE ok", flush=True)
        except OSError as exc:
            print("PROBE", exc.errno, flush=True)
    elif words[0] == "cpu":  # restart the CPU clock
        start_cpu, start_wall = time.process_time(), time.monotonic()
        print("OK", flush=True)
    elif words[0] == "stats":
        stats = {k: getattr(acks.stats(), k) for k in acks.stats().__slots__}
        stats["completed_rooms"] = sorted(completed)
        stats["max_peers"] = acks.max_peers
        wall = max(1e-9, time.monotonic() - start_wall)
        stats["cpu_share"] = (time.process_time() - start_cpu) / wall
        print("STATS", json.dumps(stats), flush=True)
acks.close()
"""


class ListenerProcess:
    """An :class:`~statemachine.decode.ranks.acks.AckListener` in a child process whose fd
    limit is ``nofile`` (None: inherited); ``kwargs`` go to its constructor."""

    def __init__(self, nofile: int | None, **kwargs: object) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _LISTENER_SCRIPT, json.dumps([nofile, kwargs])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self._readline()
        if not line.startswith("PORT "):
            self._proc.kill()
            _, err = self._proc.communicate(timeout=10)
            raise RuntimeError(f"listener process did not start: {line!r} {err[-2000:]!r}")
        self.port = int(line.split()[1])

    def _readline(self) -> str:
        assert self._proc.stdout is not None
        return self._proc.stdout.readline()

    def _ask(self, command: str) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return self._readline().strip()

    def expect(self, first: int, end: int) -> None:
        assert self._ask(f"expect {first} {end}") == "OK"

    def probe(self) -> str:
        """``"ok"`` when the process can still open a socket and a file, else the errno."""
        return self._ask("probe").removeprefix("PROBE ")

    def restart_cpu_clock(self) -> None:
        assert self._ask("cpu") == "OK"

    def stats(self) -> dict[str, object]:
        """The listener's stats, ``completed_rooms`` and ``cpu_share`` (CPU seconds of the
        whole process per wall second since the start or the last ``restart_cpu_clock``)."""
        line = self._ask("stats")
        if not line.startswith("STATS "):
            raise RuntimeError(f"listener process answered {line!r}")
        result: dict[str, object] = json.loads(line[len("STATS ") :])
        return result

    def close(self) -> str:
        """End the process; its stderr."""
        try:
            _, err = self._proc.communicate(input="", timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate(timeout=10)
        return err

    def __enter__(self) -> ListenerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self.close()


_FLOOD_SCRIPT = r"""
import resource, socket, sys, time
import zmq
port, count, mode, heartbeat_ms = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
# ZMTP 3.0 greeting (NULL mechanism) and a READY command for a PUSH socket.
greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
prop = b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH"
body = b"\x05READY" + prop
ready = bytes((0x04, len(body))) + body
held = []
if mode == "zmq":  # libzmq PUSH sockets: handshake, then silence; libzmq reconnects when cut
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, count + 16)
    for _ in range(count):
        s = context.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        if heartbeat_ms:
            s.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
        s.connect(f"tcp://127.0.0.1:{port}")
        held.append(s)
else:  # raw TCP: greeting + READY, then silence; no reconnect once cut
    for _ in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(greeting + ready)
            held.append(s)
        except OSError:
            pass
print("READY", len(held), flush=True)
sys.stdin.read()  # until the parent closes our stdin
for s in held:
    s.close()
"""


class SilentHandshakes:
    """``count`` connections to ``127.0.0.1:port`` that complete the ZMTP handshake and never
    send a message, from a child process. ``mode="zmq"``: libzmq ``PUSH`` sockets (they
    reconnect when cut; ``heartbeat_ms`` sets ``ZMQ_HEARTBEAT_IVL``); ``mode="raw"``: plain
    TCP sockets sending a greeting and READY themselves."""

    def __init__(self, port: int, count: int, mode: str = "zmq", heartbeat_ms: int = 0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _FLOOD_SCRIPT, str(port), str(count), mode, str(heartbeat_ms)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        assert self._proc.stdout is not None
        try:
            words = read_ready(self._proc.stdout.fileno(), time.monotonic() + 60)
        except TimeoutError:
            words = None
        self.opened = int(words[0]) if words is not None and len(words) == 1 else 0

    def close(self) -> None:
        try:
            self._proc.communicate(input="", timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate(timeout=10)

    def __enter__(self) -> SilentHandshakes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self.close()
