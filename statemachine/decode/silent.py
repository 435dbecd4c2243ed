"""Bootstrap addresses judged silent: a request for one fails at once instead of waiting on a
fetch from it (``spec/manager.md`` MGR-22).

When the health monitor judges an address dead (``failures_to_dead`` probes in a row failed),
every request in flight there fails through the fan-out, and the pool forgets the address's
ranks. If those probes went unanswered (the server is stopped or cut off: each waited out its
timeout), each later request would miss, ask the same server, and wait out the fetch timeout
before failing with a ``TransportFailure``: a stall per request for as long as the server stays
silent. :class:`SilentAddresses` holds such an address off: a request that would ask it fails at
once with :class:`~statemachine.errors.PrefillSilent` (retryable), asking nothing and sending
nothing. The monitor keeps probing a dead address every ``health_recheck_s`` (HEALTH-6); a
probe that is answered, or refused at once, lifts the hold-off (HEALTH-7).

An address whose connects are refused (the process is gone, its host up) is not held off: a
fetch from it fails as fast as the hold-off would, and it is the request itself that finds the
replacement listening, the moment it does. Holding it off until the next probe would fail
requests sent to a server already back (up to one recheck interval of them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from statemachine.errors import PrefillSilent

__all__ = ["SilentAddresses"]


class SilentAddresses:
    """The bootstrap addresses held off until their next answered health probe."""

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: address → (when it was judged silent, why)
        self._silent: dict[str, tuple[float, str]] = {}
        #: requests failed at once on a silent address
        self.refused = 0

    def __len__(self) -> int:
        return len(self._silent)

    def judged_silent(self, addr: str, reason: str) -> None:
        """``addr`` is dead and its probes go unanswered: hold it off until one is heard."""
        with self._lock:
            self._silent[addr] = (self._clock(), reason)

    def heard(self, addr: str) -> None:
        """A probe of ``addr`` was answered or refused at once: asking it no longer waits."""
        with self._lock:
            self._silent.pop(addr, None)

    def refusal(self, addr: str) -> PrefillSilent | None:
        """The error a request that would ask ``addr`` fails with at once, or ``None``."""
        if not self._silent:  # the common case: one truth test
            return None
        with self._lock:
            silent = self._silent.get(addr)
            if silent is None:
                return None
            self.refused += 1
        since, reason = silent
        return PrefillSilent(
            f"the bootstrap server at {addr} is not answering: its health probes have gone "
            f"unanswered for {self._clock() - since:.2f} s ({reason}). Nothing of this request "
            "was asked or sent; retry it shortly (the server is probed again every 200 ms or "
            "less, and the first request after a probe is answered gets through), or route it to "
            "another prefill",
            addr=addr,
        )

    def clear(self) -> None:
        with self._lock:
            self._silent.clear()
