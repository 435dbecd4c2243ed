"""What the transport tells about an endpoint, and to whom: :class:`Verdict` and :class:`Listeners`.

A verdict is dead or alive (ZMQ-16); a dead one is *proven an exit* only when the rank's port
refused a connect (ZMQ-26, :func:`~statemachine.decode.ranks.exit_probe.proves_exit`): a typed
flag, never a phrase to search the reason for. Listeners run on the transport's monitor thread;
an exception in one is logged and counted, and the others still run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from statemachine.wire.endpoint import Endpoint

__all__ = ["EXIT_PROVEN", "EndpointListener", "ExitListener", "Listeners", "Verdict"]

#: ``(endpoint, alive, reason)``, called on the transport's monitor thread.
EndpointListener = Callable[[Endpoint, bool, str], None]
#: ``(endpoint, reason)``: the rank's process at ``endpoint`` is proven exited (ZMQ-26).
ExitListener = Callable[[Endpoint, str], None]
#: Ends the reason of a dead verdict proven to be an exit, for the people who read it.
EXIT_PROVEN = "the port refuses connections: the process exited"

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One change of an endpoint's standing, as the transport judged it."""

    endpoint: Endpoint
    alive: bool
    #: why, in words (a proven exit's ends with :data:`EXIT_PROVEN`)
    reason: str
    #: a dead verdict proven to be the rank's process exiting (its port refused a connect)
    exit_proven: bool = False


class Listeners:
    """The listeners of one transport: ``subscribe``'s and ``subscribe_exits``'s."""

    __slots__ = ("_exits", "_lock", "_verdicts", "errors")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verdicts: tuple[Callable[[Verdict], None], ...] = ()
        self._exits: tuple[ExitListener, ...] = ()
        #: exceptions raised by listeners (contained)
        self.errors = 0

    def subscribe(self, listener: EndpointListener) -> None:
        """``listener(endpoint, alive, reason)`` at each verdict."""
        if not callable(listener):
            raise TypeError("listener must be callable")

        def hear(verdict: Verdict) -> None:
            listener(verdict.endpoint, verdict.alive, verdict.reason)

        self.subscribe_verdicts(hear)

    def subscribe_verdicts(self, listener: Callable[[Verdict], None]) -> None:
        """``listener(verdict)`` at each verdict, the typed value whole."""
        if not callable(listener):
            raise TypeError("listener must be callable")
        with self._lock:
            self._verdicts = (*self._verdicts, listener)

    def subscribe_exits(self, listener: ExitListener) -> None:
        """``listener(endpoint, reason)`` when a dead verdict is proven an exit, before the
        verdict itself is told."""
        if not callable(listener):
            raise TypeError("listener must be callable")
        with self._lock:
            self._exits = (*self._exits, listener)

    def tell(self, verdict: Verdict) -> None:
        for listener in self._verdicts:
            try:
                listener(verdict)
            except Exception:
                self._raised()
                _log.exception("endpoint listener raised; other listeners still run")

    def tell_exit(self, endpoint: Endpoint, reason: str) -> None:
        for listener in self._exits:
            try:
                listener(endpoint, reason)
            except Exception:
                self._raised()
                _log.exception("exit listener raised; other listeners still run")

    def _raised(self) -> None:
        with self._lock:
            self.errors += 1
