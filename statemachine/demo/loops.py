"""Decode request loops: N threads, each issuing requests at a steady pace, one receiver each.

Every request is one :class:`~statemachine.decode.receiver.BootstrapReceiver` made by the
:class:`~statemachine.decode.manager.DecodeManager` and driven through SGLang's steps: ``init``
(pool hit, or fetch + register + publish), ``send_metadata`` (the manager expects the acks),
then ``poll`` until the prefill ranks' acks arrive, the manager's fan-out fails it (a rank or
the prefill it depends on is gone) or the waiting timeout does. The receiver's ``on_change``
wakes the loop at once in the first two cases.

A bootstrap (``init``) that fails with a retryable error sent nothing of the request: the
prefill is down or between instances (a bootstrap server refusing or not ready, ranks the
transport already judged dead that the source still lists, a fetch answered by two instances).
No cache design can help, so such a bootstrap is retried with a new receiver for the same room
until the request's deadline (like a router retrying), and counted as a retry rather than a
failure: the one kill-window rule, the same on every source (``spec/manager.md`` MGR-24).
Every failure after the bootstrap - a send to a dead rank, a waiting timeout - fails the
request: those are the cost of a stale cache that the demo measures.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.receiver import BootstrapReceiver, RankPlan
from statemachine.pool import PoolStats

#: Pause before retrying a bootstrap against a server that is down or not ready.
RETRY_BACKOFF_S = 0.05
#: Longest single wait for acks, so a stopping run is noticed quickly.
_WAIT_SLICE_S = 0.1


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended. Times are ``time.monotonic()`` seconds."""

    start: float
    end: float
    ok: bool
    #: the failure's type name (``SendFailed``, ``WaitingTimeout``, ...), None on success
    error: str | None
    #: request start to bootstrapped (``init`` succeeded), retries included; None if it never was
    bootstrap_s: float | None
    retries: int


class RequestLoops:
    """``n_loops`` daemon threads sharing one :class:`DecodeManager`."""

    def __init__(
        self,
        manager: DecodeManager,
        client: BootstrapClient | None,
        addr: str,
        plan: RankPlan,
        *,
        n_loops: int,
        rate: float,
        on_failure: Callable[[float], None] = lambda at: None,
        max_requests: int | None = None,
        catch_up: bool = False,
    ) -> None:
        if n_loops < 1 or not rate > 0:
            raise ValueError("n_loops must be >= 1 and rate > 0")
        self._manager = manager
        self._client = client  # its per-thread sessions are closed by each loop thread
        self._addr = addr
        self._plan = plan
        self._n_loops = n_loops
        self._period = n_loops / rate  # each loop's pace, so that all together make ``rate``
        self._on_failure = on_failure
        self._rooms = itertools.count(1)
        self._budget = max_requests
        self._catch_up = catch_up
        self._budget_lock = threading.Lock()
        self.stop_event = threading.Event()
        # One slot per loop, written only by that loop: no lock, exact sums for the status.
        self.ok = [0] * n_loops
        self.failed = [0] * n_loops
        self.retries = [0] * n_loops
        #: start time of each loop's request in progress, or None between requests
        self.busy_since: list[float | None] = [None] * n_loops
        self.outcomes: list[Outcome] = []  # list.append is atomic
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"decode-loop-{i}", daemon=True)
            for i in range(n_loops)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop issuing requests; a request still waiting is aborted (and not counted)."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def pool_stats(self) -> PoolStats:
        return self._manager.pool.stats()

    def in_flight(self) -> int:
        return sum(1 for since in self.busy_since if since is not None)

    def _take_budget(self) -> bool:
        if self._budget is None:
            return True
        with self._budget_lock:
            if self._budget <= 0:
                return False
            self._budget -= 1
            return True

    def _run(self, index: int) -> None:
        stop = self.stop_event
        clock = time.monotonic
        # Stagger the loops over one period so their requests interleave evenly.
        next_at = clock() + self._period * index / self._n_loops
        done = threading.Event()
        try:
            while not stop.is_set():
                delay = next_at - clock()
                if delay > 0 and stop.wait(delay):
                    break
                # By default a request that overran its slot causes no burst of catch-up
                # requests; a load run (``catch_up``) keeps the schedule, so that a slow moment
                # of the machine does not lower the total it sends.
                next_at += self._period
                if not self._catch_up:
                    next_at = max(next_at, clock())
                if not self._take_budget():
                    break
                self._request(index, done)
        finally:
            if self._client is not None:
                self._client.close()  # this thread's HTTP sessions

    def _request(self, index: int, done: threading.Event) -> None:
        manager = self._manager
        clock = manager.clock
        room = next(self._rooms)
        start = clock()
        self.busy_since[index] = start
        deadline = start + manager.config.waiting_timeout_s
        retries = 0
        try:
            while True:
                done.clear()
                receiver = manager.receiver(self._addr, room, self._plan, prefill_dp_rank=0)
                receiver.on_change = done.set
                if receiver.init() != KVPoll.Failed:
                    break
                failure = receiver.failure
                # MGR-24: the same test on every source (the error's own ``retryable``); a
                # failed init() sent nothing, so the retry is safe
                if failure is not None and failure.retryable and clock() < deadline:
                    if self.stop_event.wait(RETRY_BACKOFF_S):
                        return  # the run is over; not a failure of the prefill (not counted)
                    retries += 1
                    continue
                self._finish(index, start, receiver, None, retries)
                return
            bootstrapped = clock() - start
            state = receiver.send_metadata((room & 0xFFFF,), aux_index=index)
            while state == KVPoll.Transferring:
                if self.stop_event.is_set():
                    receiver.abort()  # the run is over; not a failure of the prefill
                    return
                done.wait(_WAIT_SLICE_S)
                done.clear()
                state = receiver.poll()
            self._finish(index, start, receiver, bootstrapped, retries)
        finally:
            self.busy_since[index] = None

    def _finish(
        self,
        index: int,
        start: float,
        receiver: BootstrapReceiver,
        bootstrapped: float | None,
        retries: int,
    ) -> None:
        end = self._manager.clock()
        failure = receiver.failure
        ok = receiver.poll() == KVPoll.Success
        self.retries[index] += retries
        if ok:
            self.ok[index] += 1
        else:
            self.failed[index] += 1
            self._on_failure(end)
        error = None if ok or failure is None else type(failure).__name__
        self.outcomes.append(Outcome(start, end, ok, error, bootstrapped, retries))
