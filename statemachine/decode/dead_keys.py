"""Pool keys whose ranks are known dead: the next requests fail in microseconds, not after a
refetch each (``spec/manager.md`` MGR-1, under ``dead_recheck_s``).

When the fan-out drops a generation because one of its endpoints is dead (a failed send or the
transport's verdict, MGR-1) and the source is asked over the network (``health_by_probes``: the
HTTP client; a watched local store such as etcd is asked in microseconds and sees a new
registration at once, so it is not held off), the bootstrap server usually still names that
rank: the prefill rank died, its registration did not. A request for the key would refetch over
HTTP (about a millisecond), get the dead port again, and fail on its first send there: a caller
stall per request for as long as the rank stays dead. :class:`DeadKeys` remembers, per key,
the endpoint found dead, and lets one request refetch the key per ``recheck_s``: the others that
miss it meanwhile fail at once with :class:`RanksUnreachable` (the one retry rule's typed, retryable
error, MGR-19), without
asking the source.

The request let through is the recheck: if the source names another endpoint (a new
registration), or the rank answers on its old port, it is served and the memory is gone; if
its fresh fetch meets the dead rank again, the fan-out remembers the key again, and the next
refetch waits for the next ``recheck_s``. Other requests still holding the old dead generation
that fail on it later (concurrent requests, stragglers) say nothing new and hold nothing off.
The transport's verdict that the endpoint is back (``alive=True``) and a restart of the address
(a new instance id) forget it at once. So while a rank stays dead, a request stalls for
microseconds and the source is asked once per ``recheck_s`` per key; the first request at
least ``recheck_s`` after the last refetch sees a new registration (the very first request
after a death always refetches).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from statemachine.errors import RanksUnreachable
from statemachine.pool import Generation, PoolKey

__all__ = ["DEFAULT_RECHECK_S", "DeadKeys"]

#: A suggested ``DecodeManager(dead_recheck_s=...)``: at most one refetch of a key known dead
#: per this many seconds (the others fail at once). The manager holds nothing off unless given
#: one: while a key is held off, the requests that miss it do not ask the source, so a rank (or
#: a whole prefill) that registers again within the window meets up to that long of failed,
#: retryable requests - the price of microsecond stalls during an outage.
DEFAULT_RECHECK_S = 0.05
#: Keys remembered at most (each is a pool key whose generation died: few per prefill).
MAX_KEYS = 4096


@dataclass(frozen=True, slots=True)
class _Dead:
    endpoint: str
    reason: str
    #: the generation that died with the endpoint: reported again, it is old news
    generation: Generation


class DeadKeys:
    """The keys known dead, and when each was last let through (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float], recheck_s: float = DEFAULT_RECHECK_S) -> None:
        self._clock = clock
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._dead: dict[PoolKey, _Dead] = {}
        #: when a request was last let through to refetch each key (kept across deaths)
        self._checked: dict[PoolKey, float] = {}
        #: the dead generation each key was let through with: another request that still held
        #: it and failed on it later says nothing new (only a fresh fetch naming the dead rank
        #: again holds the key off again)
        self._known: dict[PoolKey, Generation] = {}
        #: requests failed at once instead of refetching
        self.refused = 0

    def __len__(self) -> int:
        return len(self._dead)

    def record(self, items: Iterable[tuple[PoolKey, Generation]], url: str, reason: str) -> None:
        """The endpoint ``url`` of these (key, generation) pairs was found dead."""
        with self._lock:
            for key, generation in items:
                if self._known.get(key) is generation:
                    continue  # a straggler on the generation already let through: old news
                if key not in self._dead and len(self._dead) >= MAX_KEYS:
                    oldest = next(iter(self._dead))
                    del self._dead[oldest]
                    self._checked.pop(oldest, None)
                    self._known.pop(oldest, None)
                self._dead[key] = _Dead(url, reason, generation)

    def refusal(self, addr: str, keys: Iterable[PoolKey]) -> RanksUnreachable | None:
        """The error a request missing ``keys`` fails with at once, or ``None``: fetch (a key
        known dead is let through once per ``recheck_s``, and forgotten until it dies again)."""
        if not self._dead:  # the common case: one truth test
            return None
        now = self._clock()
        with self._lock:
            dead = [(key, d) for key in keys if (d := self._dead.get(key)) is not None]
            if not dead:
                return None
            if all(now - self._checked.get(key, -math.inf) >= self.recheck_s for key, _ in dead):
                for key, d in dead:  # this request is the recheck
                    del self._dead[key]
                    self._checked[key] = now
                    self._known[key] = d.generation
                return None
            self.refused += 1
        endpoint, reason = dead[0][1].endpoint, dead[0][1].reason
        return RanksUnreachable(
            f"{addr}: prefill rank {endpoint} is known dead ({reason}) and was still named by "
            f"its bootstrap source {now - self._checked.get(dead[0][0], now):.3f} s ago; nothing "
            "of this request was sent: retry shortly (the source is asked again every "
            f"{self.recheck_s:g} s, and the first request after the rank registers again gets "
            "through)",
            addr=addr,
            endpoint=endpoint,
        )

    def forget_endpoint(self, url: str) -> None:
        """The transport says ``url`` answers again: a later death of it is news (the first
        request after it asks the source)."""
        with self._lock:
            for key in [k for k, d in self._dead.items() if d.endpoint == url]:
                del self._dead[key]
                self._checked.pop(key, None)
                self._known.pop(key, None)

    def forget_address(self, addr: str) -> None:
        """A new instance answers at ``addr``: its registrations are all new."""
        with self._lock:
            for key in [k for k in self._dead if k.addr == addr]:
                del self._dead[key]
            for key in [k for k in self._checked if k.addr == addr]:
                del self._checked[key]
                self._known.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._dead.clear()
            self._checked.clear()
            self._known.clear()
