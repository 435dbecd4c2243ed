"""The live progress line on stderr: one rewritten line on a TTY, a plain line a second if not."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from statemachine.demo.loops import RequestLoops


class StatusLine:
    """Callable passed to :func:`~statemachine.demo.run.run_demo` as its ``status``.

    The run's phase is ``running``, ``prefill down`` (from the kill until the new instance is
    ready), ``recovering`` (until a request started after the kill succeeds) and ``stopping``.
    Once that first success arrives the line says ``recovered in X s`` (kill to that success, as
    the report's ``restart_to_first_success_s``) instead of ``recovering``.
    """

    def __init__(self, label: str, stream: IO[str] | None = None, *, quiet: bool = False) -> None:
        self._label = label
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._quiet = quiet
        self._last = 0.0
        self._interval = 0.25 if self._tty else 1.0
        self._width = 0
        # Recovery of the latest restart: outcomes already scanned, and kill -> first success.
        self._restarts_seen = 0
        self._scanned = 0
        self._recovered_s: float | None = None

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
            f"in-flight={loops.in_flight()} {self._state(loops, tracker)}"
        )
        if self._tty:
            pad = max(0, self._width - len(text))
            self._width = len(text)
            self._stream.write("\r" + text + " " * pad + ("\n" if final else ""))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def _state(self, loops: RequestLoops, tracker: Any) -> str:
        phase: str = tracker.phase
        restarts = tracker.restarts
        if len(restarts) != self._restarts_seen:  # a new kill: its recovery starts over
            self._restarts_seen = len(restarts)
            self._recovered_s = None
        if not restarts or phase not in ("recovering", "stopping"):
            return f"state={phase}"
        killed_at: float = restarts[-1].killed_at
        if self._recovered_s is None:
            # Only outcomes appended since the last call are new (the list only grows).
            outcomes = loops.outcomes
            end = len(outcomes)
            for outcome in outcomes[self._scanned : end]:
                if outcome.ok and outcome.start >= killed_at:
                    self._recovered_s = outcome.end - killed_at
                    break
            self._scanned = end
        if self._recovered_s is None:
            return f"state={phase}"
        shown = "running" if phase == "recovering" else phase
        return f"state={shown}, recovered in {self._recovered_s:.2f} s"


def loops_pool_stats(loops: RequestLoops) -> tuple[int, int]:
    stats = loops.pool_stats()
    return stats.hits, stats.misses
