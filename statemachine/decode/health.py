"""``HealthMonitor``: notice a prefill restart or death without waiting for a request to fail.

Each watched bootstrap address has its own small probe thread that asks ``GET /health`` every
``interval_s`` seconds, so a silent address (a probe that waits out its timeouts) never delays
another address's probe (HEALTH-1). Two things it acts on, both through the pool's
exact-address operations:

* the ``X-Bootstrap-Instance-Id`` header changed from ``old`` to ``new``: the prefill restarted
  behind the same address (a stable Kubernetes Service address never stops answering, so a
  plain liveness heartbeat would miss this). ``old`` is known replaced — an instance id, once
  replaced, never answers again — so ``pool.retire_instance(addr, old)`` drops the entries
  fetched from it, and only those (POOL-6); then ``on_restart(addr, old, new)``;
* ``failures_to_dead`` probes in a row failed: the node is dead; ``pool.invalidate_address``
  drops every entry of exactly that address (POOL-5); then ``on_dead(addr, reason)``. From then
  on the address is probed every ``recheck_s`` (each connect bounded by as much), and its first
  answer calls ``on_alive(addr)`` (HEALTH-6).

A dead address is also *silent* while its probes fail other than by a refused connect: they
wait out their timeouts (the server is stopped, or the path drops packets), where a refused
one fails at once (nothing listens on the port, and its host says so).
``on_silent(addr, reason)`` reports the start of a silence (at the verdict, or at a later
recheck), ``on_heard(addr)`` its end: a probe answered, or was refused at once. A manager holds
requests off a silent address, where a fetch would wait, and not off a refused one, where a
fetch fails at once and is the first to find the server back (HEALTH-7).

``watch()`` validates the address (``InvalidArgument``) and takes a *baseline*: the instance
id the caller already knows (from the reply of a fetch), or one probe made there and then, so
a restart right after ``watch()`` is seen as a restart (HEALTH-2). A probe that raises anything
at all counts as a failed probe (and, if it is not a ``BootstrapHTTPError``, as a
``probe_error``); a callback that raises is logged and counted; neither stops the heartbeat
(HEALTH-3). ``stop()`` then ``start()`` resumes probing every address still watched (HEALTH-4).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from statemachine.decode.client import BootstrapClient
from statemachine.decode.liveness_bound import DEFAULT_LIVENESS_TIMEOUT_S, LivenessBound
from statemachine.errors import BootstrapHTTPError
from statemachine.http_exchange import connection_refused
from statemachine.pool import BootstrapPool
from statemachine.validation import parse_addr

_log = logging.getLogger(__name__)

OnDead = Callable[[str, str], None]
OnRestart = Callable[[str, str, str], None]
OnAlive = Callable[[str], None]
OnSilent = Callable[[str, str], None]
OnHeard = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class HealthStats:
    """Counters since the monitor was created (``watched``: now)."""

    watched: int
    probes: int
    failures: int  # failed probes, any cause
    restarts_seen: int
    deaths_seen: int
    probe_errors: int  # probes that raised something other than BootstrapHTTPError
    callback_errors: int  # callback calls (on_dead, on_restart, ...) that raised


class _Watch:
    """One watched address. ``failures``/``instance_id``/``dead``/``silent`` change under
    ``lock``."""

    __slots__ = ("addr", "dead", "failures", "instance_id", "lock", "silent", "stop", "thread")

    def __init__(self, addr: str, instance_id: str | None) -> None:
        self.addr = addr
        self.lock = threading.Lock()
        self.failures = 0
        self.dead = False
        #: dead, and its last probe went unanswered (not refused): see the module docstring
        self.silent = False
        self.instance_id = instance_id
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None


#: Without settings, the monitor probes as the default liveness bound says (ZMQ-25): no
#: interval or timeout of its own.
_DEFAULT = LivenessBound.from_timeout(DEFAULT_LIVENESS_TIMEOUT_S)


def _probe_client(probe_timeout_s: float, connect_timeout_s: float) -> BootstrapClient:
    """The probes' client: each probe bounded by ``probe_timeout_s`` as a whole (HEALTH-5),
    its connect by ``connect_timeout_s``."""
    return BootstrapClient(
        connect_timeout=connect_timeout_s, read_timeout=probe_timeout_s, deadline=probe_timeout_s
    )


class HealthMonitor:
    """Probe bootstrap addresses every ``interval_s`` seconds, one daemon thread per address.

    ``probe_timeout_s`` bounds each probe (connect, read and the whole exchange): a silent
    address is judged dead at most ``failures_to_dead × (interval_s + probe_timeout_s)`` after
    it last answered (HEALTH-5); a dead one is probed every ``recheck_s``, its connect bounded by
    as much (HEALTH-6). :class:`~statemachine.decode.liveness_bound.LivenessBound` derives all
    four from one bound (``health_options()``); the defaults are the default bound's.
    """

    def __init__(
        self,
        pool: BootstrapPool,
        *,
        client: BootstrapClient | None = None,
        interval_s: float = _DEFAULT.health_interval_s,
        failures_to_dead: int = _DEFAULT.failures_to_dead,
        addresses: Iterable[str] = (),
        on_dead: OnDead | None = None,
        on_restart: OnRestart | None = None,
        on_alive: OnAlive | None = None,
        on_silent: OnSilent | None = None,
        on_heard: OnHeard | None = None,
        probe_timeout_s: float | None = None,
        recheck_s: float = _DEFAULT.health_recheck_s,
    ) -> None:
        if not interval_s > 0 or not isinstance(failures_to_dead, int) or failures_to_dead < 1:
            raise ValueError("interval_s must be > 0 and failures_to_dead an int >= 1")
        if probe_timeout_s is not None and not probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s must be > 0 (seconds), not {probe_timeout_s!r}")
        if not recheck_s > 0:
            raise ValueError(f"recheck_s must be > 0 (seconds), not {recheck_s!r}")
        if probe_timeout_s is not None and client is not None:
            raise ValueError(
                "give probe_timeout_s or client, not both: the client's own timeouts bound its "
                "probes"
            )
        self._pool = pool
        # Each probe thread gets its own sessions (they are per thread inside the client).
        if client is None:
            timeout = _DEFAULT.probe_timeout_s if probe_timeout_s is None else probe_timeout_s
            client = _probe_client(timeout, timeout)
            # A recheck's connect into a cut path gives up after recheck_s and the next starts
            # recheck_s later; its read keeps the whole probe timeout: a loaded server that
            # accepted it still has that long to answer.
            recheck_client = _probe_client(timeout, min(timeout, recheck_s))
        else:
            recheck_client = client  # the caller's timeouts bound every probe
        self._client = client
        self._recheck_client = recheck_client
        self._interval_s = interval_s
        self._recheck_s = recheck_s
        self._failures_to_dead = failures_to_dead
        self._on_dead = on_dead
        self._on_restart = on_restart
        self._on_alive = on_alive
        self._on_silent = on_silent
        self._on_heard = on_heard
        self._lock = threading.Lock()  # guards _watches, _running and the counters
        self._watches: dict[str, _Watch] = {}
        self._running = False
        self._probes = 0
        self._failures = 0
        self._restarts = 0
        self._deaths = 0
        self._probe_errors = 0
        self._callback_errors = 0
        for addr in addresses:
            self.watch(addr)

    # --- watching -----------------------------------------------------------------------------

    def watch(
        self, addr: str, *, instance_id: str | None = None, baseline_now: bool = True
    ) -> None:
        """Watch ``addr`` (``"host:port"``); ``InvalidArgument`` if it is not an address.

        ``instance_id`` is the baseline if the caller knows it (the ``X-Bootstrap-Instance-Id``
        of a reply it just had); otherwise one probe is made now, bounded by the client's
        timeouts - unless ``baseline_now`` is False: then the watch thread's first probe takes
        it (a caller in a request's path must not wait for a probe). Watching an address
        already watched changes nothing.
        """
        parse_addr(addr)
        with self._lock:
            if addr in self._watches:
                return
            watch = _Watch(addr, instance_id)
            self._watches[addr] = watch
        if instance_id is None and baseline_now:
            self._baseline(watch)
        with self._lock:
            if self._running and self._watches.get(addr) is watch:
                self._ensure_thread(watch)  # start() may have started it meanwhile

    def unwatch(self, addr: str) -> bool:
        """Stop probing ``addr`` (its thread ends after the probe in progress, if any)."""
        with self._lock:
            watch = self._watches.pop(addr, None)
        if watch is None:
            return False
        watch.stop.set()
        return True

    def watched(self) -> list[str]:
        with self._lock:
            return list(self._watches)

    # --- running ------------------------------------------------------------------------------

    def start(self) -> HealthMonitor:
        """Start a probe thread per watched address (and for each one watched later)."""
        with self._lock:
            self._running = True
            for watch in self._watches.values():
                self._ensure_thread(watch)
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop every probe thread; wait up to ``timeout`` s in all. True if all ended.

        A probe in progress is not interrupted (it is bounded by the client's timeouts); its
        result is dropped. ``start()`` may be called again afterwards.
        """
        with self._lock:
            self._running = False
            threads = []
            for watch in self._watches.values():
                watch.stop.set()
                if watch.thread is not None:
                    threads.append(watch.thread)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def __enter__(self) -> HealthMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def probe_once(self) -> None:
        """One probe of every watched address, in turn (tests and tools; the threads probe
        each address on its own)."""
        with self._lock:
            watches = list(self._watches.values())
        for watch in watches:
            self._probe(watch)

    # --- counters -----------------------------------------------------------------------------

    @property
    def restarts_seen(self) -> int:
        return self._restarts

    @property
    def deaths_seen(self) -> int:
        return self._deaths

    def stats(self) -> HealthStats:
        with self._lock:
            return HealthStats(
                watched=len(self._watches),
                probes=self._probes,
                failures=self._failures,
                restarts_seen=self._restarts,
                deaths_seen=self._deaths,
                probe_errors=self._probe_errors,
                callback_errors=self._callback_errors,
            )

    # --- internals ----------------------------------------------------------------------------

    def _ensure_thread(self, watch: _Watch) -> None:
        """Called with ``_lock`` held: start ``watch``'s thread unless one is running for it.

        A thread still finishing its last probe after ``stop()`` has its stop event set and
        exits; the new one gets a fresh event, so ``start()`` after ``stop()`` works.
        """
        if watch.thread is not None and watch.thread.is_alive() and not watch.stop.is_set():
            return
        watch.stop = threading.Event()
        watch.thread = threading.Thread(
            target=self._run,
            args=(watch, watch.stop),
            name=f"bootstrap-health {watch.addr}",
            daemon=True,
        )
        watch.thread.start()

    def _baseline(self, watch: _Watch) -> None:
        """The baseline probe, on a helper thread joined here: the client's sessions are per
        thread, and the caller's thread must not keep one open to every address it watches."""

        def probe() -> None:
            try:
                self._probe(watch)
            finally:
                self._close_sessions()  # the helper thread's

        helper = threading.Thread(target=probe, name=f"bootstrap-health {watch.addr} baseline")
        helper.start()
        helper.join()  # bounded: the probe is bounded by the client's timeouts

    def _run(self, watch: _Watch, stop: threading.Event) -> None:
        try:
            # A dead address is probed every recheck_s: its first answer lifts the hold-off
            # (HEALTH-6), and must not wait for a whole interval.
            while not stop.wait(self._recheck_s if watch.dead else self._interval_s):
                self._probe(watch, stop)
        finally:
            self._close_sessions()  # this thread's

    def _close_sessions(self) -> None:
        self._client.close()
        if self._recheck_client is not self._client:
            self._recheck_client.close()

    def _probe(self, watch: _Watch, stop: threading.Event | None = None) -> None:
        addr = watch.addr
        client = self._recheck_client if watch.dead else self._client
        refused = False
        try:
            instance_id = client.health(addr)
            reason = None
        except BootstrapHTTPError as exc:
            instance_id, reason, refused = None, str(exc), connection_refused(exc)
        except Exception as exc:  # a bug must not silence the heartbeat of every address
            instance_id, reason = None, f"the probe raised {type(exc).__name__}: {exc}"
            with self._lock:
                self._probe_errors += 1
            _log.exception("health probe of %s raised; counted as a failed probe", addr)
        if stop is not None and stop.is_set():
            return  # stopped or unwatched meanwhile: drop the result
        with self._lock:
            self._probes += 1
            if reason is not None:
                self._failures += 1
        if reason is not None:
            self._probe_failed(watch, reason, refused)
            return
        with watch.lock:
            watch.failures = 0
            was_dead, watch.dead = watch.dead, False
            was_silent, watch.silent = watch.silent, False
            old = watch.instance_id
            if instance_id is not None:
                watch.instance_id = instance_id
        if was_silent and self._on_heard is not None:
            self._call(self._on_heard, addr)
        if was_dead and self._on_alive is not None:
            self._call(self._on_alive, addr)
        if old is None or instance_id is None or old == instance_id:
            return
        with self._lock:
            self._restarts += 1
        self._pool.retire_instance(addr, old)
        if self._on_restart is not None:
            self._call(self._on_restart, addr, old, instance_id)

    def _probe_failed(self, watch: _Watch, reason: str, refused: bool) -> None:
        with watch.lock:
            watch.failures += 1
            dies = watch.failures == self._failures_to_dead
            if dies:
                watch.dead = True
            # Silent while a dead address's probes go unanswered; a refusal ends the silence:
            # its host answers at once, so a request asking it would not wait (HEALTH-7).
            falls_silent = watch.dead and not refused and not watch.silent
            heard = watch.silent and refused
            watch.silent = watch.dead and not refused
        if dies:
            reason = f"{self._failures_to_dead} health probes in a row failed (last: {reason})"
        if falls_silent and self._on_silent is not None:
            # Before on_dead: a manager holds the address off before it fails the requests
            # in flight there, so none asks it in between.
            self._call(self._on_silent, watch.addr, reason)
        if heard and self._on_heard is not None:
            self._call(self._on_heard, watch.addr)
        if not dies:
            return
        with self._lock:
            self._deaths += 1
        self._pool.invalidate_address(watch.addr)
        if self._on_dead is not None:
            self._call(self._on_dead, watch.addr, reason)

    def _call(self, callback: Callable[..., None], *args: str) -> None:
        try:
            callback(*args)
        except Exception:
            with self._lock:
                self._callback_errors += 1
            _log.exception("health callback %r raised; the monitor keeps running", callback)
