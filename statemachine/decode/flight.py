"""Single-flight fetches: one fetch per pool key at a time; the others wait for its result.

After an invalidation, N requests missing the same key would each ask the bootstrap server for
every rank and each register with every rank (a thundering herd: N x ranks queries). Instead the
first request to miss a key *leads* its flight: it fetches, registers and publishes; requests
missing the key while the flight is open *follow* it: they stay ``idle``, and when the leader
publishes they adopt the generation the leader's ``publish`` returned (``Hit``), or, when the
leader failed, fail with the leader's reason (``FetchFail`` from ``idle``). A follower waits at
most until its deadline and then fails with :class:`~statemachine.errors.FetchWaitTimeout`.
Identity semantics are unchanged: every follower records the one generation the pool held.

A request claims the flights of *all* its missing keys at once, or none: if any of its keys is
already in flight it follows those and claims nothing, then looks again. So a leader never waits
for another flight, and two requests can never wait for each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from statemachine.errors import BootstrapError, FetchWaitTimeout
from statemachine.pool import Generation, PoolKey


class Flight:
    """One key's fetch in progress. Resolved exactly once: a generation, or an error."""

    __slots__ = ("_done", "error", "followers", "generation", "key")

    def __init__(self, key: PoolKey) -> None:
        self.key = key
        self._done = threading.Event()
        self.generation: Generation | None = None
        self.error: BootstrapError | None = None
        self.followers = 0

    def wait(self, timeout: float) -> Generation:
        """The leader's published generation; its error; or FetchWaitTimeout after timeout."""
        if not self._done.wait(max(0.0, timeout)):
            raise FetchWaitTimeout(
                f"{self.key.addr}: waited {timeout:.3g} s for another request's fetch of "
                f"{tuple(self.key)}; the bootstrap server is slow or dying: retry the request"
            )
        if self.generation is not None:
            return self.generation
        assert self.error is not None
        raise self.error

    @property
    def done(self) -> bool:
        return self._done.is_set()


class Flights:
    """The open flights of one decode process, by pool key."""

    __slots__ = ("_flights", "_lock", "followed", "led")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[PoolKey, Flight] = {}
        self.led = 0  # flights opened (each one fetch)
        self.followed = 0  # requests that waited for another's fetch instead of fetching

    def claim(self, keys: Iterable[PoolKey]) -> tuple[dict[PoolKey, Flight], list[Flight]]:
        """Lead every key, or follow the ones already in flight: ``(led, followed)``.

        Exactly one of the two is non-empty (for a non-empty ``keys``).
        """
        with self._lock:
            followed = [f for k in keys if (f := self._flights.get(k)) is not None]
            if followed:
                for flight in followed:
                    flight.followers += 1
                self.followed += 1
                return {}, followed
            led = {key: Flight(key) for key in keys}
            self._flights.update(led)
            self.led += len(led)
            return led, []

    def resolve(
        self, led: Mapping[PoolKey, Flight], published: Mapping[PoolKey, Generation]
    ) -> None:
        """The leader published: each flight's followers adopt what the pool held."""
        with self._lock:
            for key, flight in led.items():
                if self._flights.get(key) is flight:
                    del self._flights[key]
        for key, flight in led.items():
            flight.generation = published[key]
            flight._done.set()

    def fail(self, led: Mapping[PoolKey, Flight], error: BootstrapError) -> None:
        """The leader failed: every follower fails with the same reason."""
        with self._lock:
            for key, flight in led.items():
                if self._flights.get(key) is flight:
                    del self._flights[key]
        for flight in led.values():
            if not flight.done:
                flight.error = error
                flight._done.set()

    def __len__(self) -> int:
        return len(self._flights)
