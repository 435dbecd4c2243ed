"""The live progress line on stderr: one rewritten line on a TTY, a plain line a second if not."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from statemachine.demo.loops import RequestLoops


class StatusLine:
    """Callable passed to :func:`~statemachine.demo.run.run_demo` as its ``status``."""

    def __init__(self, label: str, stream: IO[str] | None = None, *, quiet: bool = False) -> None:
        self._label = label
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._quiet = quiet
        self._last = 0.0
        self._interval = 0.25 if self._tty else 1.0
        self._width = 0

    def __call__(self, loops: RequestLoops, tracker: Any, elapsed: float) -> None:
        if self._quiet:
            return
        now = time.monotonic()
        final = tracker.phase == "stopping"
        if now - self._last < self._interval and not final:
            return
        self._last = now
        pool = loops_pool_stats(loops)
        text = (
            f"[{self._label}] {elapsed:5.1f}s ok={sum(loops.ok)} failed={sum(loops.failed)} "
            f"retries={sum(loops.retries)} hits={pool[0]} misses={pool[1]} "
            f"in-flight={loops.in_flight()} state={tracker.phase}"
        )
        if self._tty:
            pad = max(0, self._width - len(text))
            self._width = len(text)
            self._stream.write("\r" + text + " " * pad + ("\n" if final else ""))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()


def loops_pool_stats(loops: RequestLoops) -> tuple[int, int]:
    stats = loops.pool_stats()
    return stats.hits, stats.misses
