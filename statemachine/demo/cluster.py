"""The prefill instance as real processes: one bootstrap server and tp × pp rank processes.

A *restart* is what happens when a prefill pod crashes and comes back: every process of the
instance is SIGKILLed (no goodbye on any socket), then the bootstrap server starts again on the
*same* port - so the decode's bootstrap address stays valid while the server has a new instance
id - and the ranks start again on *new* ephemeral ports, as SGLang's ranks do.

Python start-up and imports take about a second per process here, several under load; a real
prefill's downtime is dominated by other things anyway. So by default the replacement processes
are *warm*: spawned ahead of time, they import their module and wait for a go line on stdin,
which carries their arguments; the downtime then is what a restarted prefill does itself (bind,
listen, register). ``warm=False`` spawns them only at restart time.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from statemachine.errors import ClusterError
from statemachine.prefill.readiness import read_prefixed_line, read_ready

_T = TypeVar("_T")

HOST = "127.0.0.1"

# Imports the module, says WARM, waits for its argv as one JSON line, then runs it.
_LAUNCHER = (
    "import importlib, json, sys\n"
    "module = importlib.import_module(sys.argv[1])\n"
    "print('WARM', flush=True)\n"
    "line = sys.stdin.readline()\n"
    "if not line: raise SystemExit(0)\n"
    "raise SystemExit(module.main(json.loads(line)))\n"
)


#: How much of a failed child's stderr an error carries (its last lines: the traceback's end).
STDERR_TAIL_LINES = 5


class _Child:
    """One child process started through the launcher: spawn (warm), go(argv), kill."""

    def __init__(self, module: str) -> None:
        self.module = module
        # stderr goes to an unlinked file, not a pipe: nobody reads it while the child runs, so a
        # pipe could fill and stall the child; read only when the child failed, to say why.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill(), with the child)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self._buffer = bytearray()
        self._warm = False

    def go(self, argv: list[str], deadline: float, prefix: str) -> str:
        """Send ``argv``; return the first stdout line starting with ``prefix``."""
        self._send(argv, deadline)
        return self.read_line(prefix, deadline)

    def go_ready(self, argv: list[str], deadline: float) -> list[bytes]:
        """Send ``argv``; return the words of the child's ``READY`` line."""
        self._send(argv, deadline)
        fd = self._stdout()
        return self._expect("the READY line", lambda: read_ready(fd, deadline, self._buffer))

    def _send(self, argv: list[str], deadline: float) -> None:
        assert self.proc.stdin is not None
        if not self._warm:
            self.read_line("WARM", deadline)
            self._warm = True
        self.proc.stdin.write(json.dumps(argv).encode() + b"\n")
        self.proc.stdin.flush()

    def _stdout(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read_line(self, prefix: str, deadline: float) -> str:
        fd = self._stdout()
        raw = self._expect(
            prefix, lambda: read_prefixed_line(fd, prefix.encode(), deadline, self._buffer)
        )
        return raw.decode(errors="replace")

    def _expect(self, what: str, read: Callable[[], _T | None]) -> _T:
        """``read()``'s answer; ClusterError (with the child's stderr) on timeout or exit."""
        try:
            found = read()
        except TimeoutError:
            raise ClusterError(
                f"no {what!r} line from a prefill process ({self.module}) in time"
                + self.stderr_tail()
            ) from None
        if found is None:
            code = self.proc.wait(timeout=10.0)
            raise ClusterError(
                f"a prefill process ({self.module}) exited with {code} before {what!r}"
                + self.stderr_tail()
            )
        return found

    def stderr_tail(self) -> str:
        """The child's last stderr lines, as ``": line | line"``; empty if it wrote none."""
        try:
            self._stderr.seek(0)
            lines = self._stderr.read().decode(errors="replace").splitlines()
        except (OSError, ValueError):  # already closed
            return ""
        tail = [line.strip() for line in lines[-STDERR_TAIL_LINES:] if line.strip()]
        return (": " + " | ".join(tail)) if tail else ""

    def kill(self) -> None:
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10.0)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # a broken pipe to a dead child
                    stream.close()
        self._stderr.close()


class PrefillInstance:
    """A bootstrap server plus ``tp_size × pp_size`` prefill rank processes on loopback."""

    def __init__(
        self,
        *,
        tp_size: int = 2,
        pp_size: int = 1,
        warm: bool = True,
        ready_timeout: float = 30.0,
        etcd: tuple[str, str] | None = None,
    ) -> None:
        """``etcd``: (endpoint, prefix) - the ranks register there (``--discovery etcd``,
        under the server's instance id) instead of with the bootstrap server, whose address
        is then only the prefill's name."""
        if tp_size < 1 or pp_size < 1:
            raise ValueError("tp_size and pp_size must be >= 1")
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.warm = warm
        self.etcd = etcd
        self._ready_timeout = ready_timeout
        # Fresh per run; it only guards PUT /route on loopback.
        self._token = secrets.token_hex(16)
        self.port = 0
        self.instance_id = ""
        self.rank_ports: list[int] = []
        self._running: list[_Child] = []
        self._spares: list[_Child] = []
        self.starts = 0
        #: every process ever spawned for this instance (to check that none survives)
        self.spawned_pids: list[int] = []

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def rank_count(self) -> int:
        return self.tp_size * self.pp_size

    def pids(self) -> list[int]:
        return [child.proc.pid for child in self._running + self._spares]

    def start(self) -> None:
        """Start the server (on the same port as before, if any), then every rank in parallel."""
        children = self._spares or self._spawn()
        self._spares = []
        self._running = children
        deadline = time.monotonic() + self._ready_timeout
        server, ranks = children[0], children[1:]
        line = server.go(
            ["--host", HOST, "--port", str(self.port), "--token", self._token],
            deadline,
            "listening on ",
        )
        # "listening on 127.0.0.1:PORT instance ID"
        parts = line.split()
        self.port = int(parts[2].rpartition(":")[2])
        self.instance_id = parts[4]
        olds = self.rank_ports or [0] * len(ranks)
        plans = [(tp, pp) for tp in range(self.tp_size) for pp in range(self.pp_size)]
        with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
            futures = [
                pool.submit(child.go_ready, self._rank_argv(tp, pp, old), deadline)
                for child, (tp, pp), old in zip(ranks, plans, olds, strict=True)
            ]
            readies = [f.result() for f in futures]
        self.rank_ports = [int(words[0]) for words in readies]
        self.starts += 1
        if self.warm:
            self._spares = self._spawn()

    def _rank_argv(self, tp: int, pp: int, avoid_port: int) -> list[str]:
        argv = ["--bootstrap", self.addr, "--token", self._token, "--host", HOST]
        argv += ["--tp-rank", str(tp), "--tp-size", str(self.tp_size)]
        argv += ["--pp-rank", str(pp), "--pp-size", str(self.pp_size)]
        # Registration retries stay short: the server is already listening.
        argv += ["--register-backoff-scale", "0.05"]
        if avoid_port:
            argv += ["--avoid-port", str(avoid_port)]
        if self.etcd is not None:
            endpoint, prefix = self.etcd
            argv += ["--discovery", "etcd", "--etcd-endpoints", endpoint]
            argv += ["--etcd-prefix", prefix, "--instance-id", self.instance_id]
        return argv

    def _spawn(self) -> list[_Child]:
        children = [_Child("statemachine.prefill.serve")]
        children += [_Child("statemachine.prefill.rank") for _ in range(self.rank_count)]
        self.spawned_pids += [child.proc.pid for child in children]
        return children

    def kill(self) -> None:
        """SIGKILL every running process of the instance: ranks first, then the server."""
        for child in reversed(self._running):
            child.kill()
        self._running = []

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        """Kill and reap everything, spares included."""
        self.kill()
        for child in self._spares:
            child.kill()
        self._spares = []

    def __enter__(self) -> PrefillInstance:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
