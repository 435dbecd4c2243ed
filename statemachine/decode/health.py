"""``HealthMonitor``: notice a prefill restart or death without waiting for a request to fail.

A background thread probes ``GET /health`` of every watched bootstrap address. Two things
it acts on, both through the pool's exact-address operations:

* the ``X-Bootstrap-Instance-Id`` header changed: the prefill restarted behind the same
  address (a stable Kubernetes Service address never stops answering, so a plain liveness
  heartbeat would miss this); entries fetched from the old instance are retired (POOL-6);
* ``failures_to_dead`` probes in a row failed: the node is dead; every entry of exactly that
  address is dropped (POOL-5).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from statemachine.decode.client import BootstrapClient
from statemachine.errors import BootstrapHTTPError
from statemachine.pool import BootstrapPool


class HealthMonitor:
    """Probe bootstrap addresses every ``interval_s`` seconds in one daemon thread."""

    def __init__(
        self,
        pool: BootstrapPool,
        *,
        client: BootstrapClient | None = None,
        interval_s: float = 5.0,
        failures_to_dead: int = 2,
        addresses: Iterable[str] = (),
    ) -> None:
        if interval_s <= 0 or failures_to_dead < 1:
            raise ValueError("interval_s must be > 0 and failures_to_dead >= 1")
        self._pool = pool
        # The probe thread gets its own sessions (they are per thread inside the client).
        self._client = (
            client if client is not None else BootstrapClient(connect_timeout=2.0, read_timeout=3.0)
        )
        self._interval_s = interval_s
        self._failures_to_dead = failures_to_dead
        self._lock = threading.Lock()
        self._addresses: dict[str, _Watch] = {addr: _Watch() for addr in addresses}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts_seen = 0
        self.deaths_seen = 0

    def watch(self, addr: str) -> None:
        with self._lock:
            self._addresses.setdefault(addr, _Watch())

    def start(self) -> HealthMonitor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bootstrap-health", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> HealthMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def probe_once(self) -> None:
        """One round over every watched address (the thread calls this; tests may too)."""
        with self._lock:
            watched = list(self._addresses.items())
        for addr, watch in watched:
            try:
                instance_id = self._client.health(addr)
            except BootstrapHTTPError:
                watch.failures += 1
                if watch.failures == self._failures_to_dead:
                    self.deaths_seen += 1
                    self._pool.invalidate_address(addr)
                continue
            watch.failures = 0
            if instance_id is None:
                continue
            if watch.instance_id is not None and watch.instance_id != instance_id:
                self.restarts_seen += 1
                # The id seen on the previous probe was replaced: retire exactly its entries.
                self._pool.retire_instance(addr, watch.instance_id)
            watch.instance_id = instance_id

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval_s):
                self.probe_once()
        finally:
            self._client.close()


class _Watch:
    __slots__ = ("failures", "instance_id")

    def __init__(self) -> None:
        self.failures = 0
        self.instance_id: str | None = None
