"""The reference prefill rank (:mod:`statemachine.prefill.rank`) as a subprocess that tests, the
demo and the benchmarks can crash (SIGKILL), terminate and restart: :class:`PrefillRankProcess`.
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from statemachine.errors import PrefillRankStartFailed
from statemachine.prefill.readiness import read_ready

__all__ = ["PrefillRankProcess"]

#: stderr lines of a failed start attached to :class:`PrefillRankStartFailed`.
STDERR_TAIL_LINES = 20


class PrefillRankProcess:
    """A prefill rank subprocess that tests and the demo can crash and restart.

    ``start()`` returns once the child printed ``READY <port>`` (registered with the bootstrap
    server), or raises :class:`PrefillRankStartFailed` within ``ready_timeout`` seconds.
    """

    def __init__(
        self,
        bootstrap: str,
        token: str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        ack_delay_ms: int = 0,
        ready_timeout: float = 20.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.bootstrap = bootstrap
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.ready_timeout = ready_timeout
        self._token = token
        self._args = [
            "--bootstrap",
            bootstrap,
            *("--tp-rank", str(tp_rank), "--tp-size", str(tp_size)),
            *("--pp-rank", str(pp_rank), "--pp-size", str(pp_size)),
            *("--dp-rank", str(dp_rank), "--dp-size", str(dp_size)),
            *("--cp-rank", str(cp_rank), "--cp-size", str(cp_size)),
            *("--ack-delay-ms", str(ack_delay_ms)),
            *extra_args,
        ]
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self.starts = 0

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("prefill rank not started")
        return self._port

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, avoid_port: int = 0, port: int = 0) -> int:
        """Start the child (on ``port`` if given, else an ephemeral one other than
        ``avoid_port``) and return its port once it is READY."""
        if self.alive():
            raise RuntimeError("prefill rank already running")
        # The token travels in argv: acceptable for a loopback test process, not for production.
        argv = [sys.executable, "-m", "statemachine.prefill.rank", "--token", self._token]
        argv += self._args
        if avoid_port:
            argv += ["--avoid-port", str(avoid_port)]
        if port:
            argv += ["--port", str(port)]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        assert proc.stderr is not None
        tail = _StderrTail(proc.stderr)
        self._proc = proc
        try:
            self._port = _wait_ready(proc, self.ready_timeout)
        except PrefillRankStartFailed as exc:
            _reap(proc, signal.SIGKILL, 5.0)
            self._proc = None
            raise PrefillRankStartFailed(str(exc), tail.text(5.0)) from None
        except BaseException:
            _reap(proc, signal.SIGKILL, 5.0)
            self._proc = None
            raise
        self.starts += 1
        return self._port

    def kill(self) -> None:
        """SIGKILL: a crash. Sockets vanish without a goodbye; the port becomes free."""
        if self._proc is not None:
            _reap(self._proc, signal.SIGKILL, 5.0)

    def terminate(self, timeout: float = 5.0) -> dict[str, int] | None:
        """SIGTERM and wait; return the child's ``STATS`` counters (None if it printed none)."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        out = _reap(self._proc, signal.SIGTERM, timeout)
        for line in out.decode(errors="replace").splitlines():
            if line.startswith("STATS "):
                stats: dict[str, int] = json.loads(line[len("STATS ") :])
                return stats
        return None

    def restart(self) -> int:
        """Crash (SIGKILL) if running, then start again on a different port; return it."""
        old = self._port or 0
        self.kill()
        return self.start(avoid_port=old)

    def __enter__(self) -> PrefillRankProcess:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class _StderrTail:
    """Drains a child's stderr on a daemon thread: echoes it to ours (so it stays visible) and
    keeps the last STDERR_TAIL_LINES lines (so a failed start can say why). Ends at EOF."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self._thread.start()

    def _drain(self, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in pipe:
                line = raw.decode(errors="replace").rstrip("\n")
                self._lines.append(line[:500])
                print(line, file=sys.stderr, flush=True)

    def text(self, timeout: float) -> str:
        """The kept lines, once the child's stderr closed (or after ``timeout`` seconds)."""
        self._thread.join(timeout)
        return "\n".join(self._lines)


def _wait_ready(proc: subprocess.Popen[bytes], timeout: float) -> int:
    assert proc.stdout is not None
    try:
        words = read_ready(proc.stdout.fileno(), time.monotonic() + timeout)
    except TimeoutError:
        raise PrefillRankStartFailed(f"no READY within {timeout} s") from None
    if words is None:
        code = proc.wait(timeout=5.0)
        raise PrefillRankStartFailed(f"prefill rank exited with {code} before READY")
    return int(words[0])


def _reap(proc: subprocess.Popen[bytes], sig: signal.Signals, timeout: float) -> bytes:
    """Send ``sig`` (SIGKILL after ``timeout`` if still alive), wait, return remaining stdout.

    stderr is drained by the process's :class:`_StderrTail` thread, not here.
    """
    if proc.poll() is None:
        proc.send_signal(sig)
    assert proc.stdout is not None
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
    if proc.stdout.closed:  # reaped before
        return b""
    with proc.stdout:
        out = proc.stdout.read()
    return out or b""
