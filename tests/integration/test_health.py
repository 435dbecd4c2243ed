"""HealthMonitor against real bootstrap servers on 127.0.0.1, restarted, stopped and silent.

POOL-5 (exact-address node failure), POOL-6 (retiring a replaced instance id) and HEALTH-1..4
of ``spec/zmq.md``'s health section through the heartbeat.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from statemachine.decode.client import BootstrapClient
from statemachine.decode.health import HealthMonitor
from statemachine.errors import InvalidArgument
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.prefill.server import BootstrapServer


def generation(instance_id: str | None) -> Generation:
    return Generation((RankInfo("127.0.0.1", 40000, 0),), instance_id)


def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Calls:
    """Records on_dead / on_restart calls (they arrive on probe threads)."""

    def __init__(self) -> None:
        self.dead: list[tuple[str, str]] = []
        self.restarts: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def on_dead(self, addr: str, reason: str) -> None:
        with self.lock:
            self.dead.append((addr, reason))

    def on_restart(self, addr: str, old: str, new: str) -> None:
        with self.lock:
            self.restarts.append((addr, old, new))


pytestmark = pytest.mark.bootstrap_server(insecure=True)


def restart(server: BootstrapServer) -> BootstrapServer:
    """Stop ``server`` and start a new instance behind the same address."""
    port = server.port
    server.stop()
    return BootstrapServer("127.0.0.1", port, insecure=True).start()


@pytest.fixture
def silent_listeners() -> Iterator[list[socket.socket]]:
    """Four listeners that accept TCP connections (the kernel's backlog) and never answer.

    Closing one resets the connections waiting in its backlog, which ends their probes.
    """
    listeners = []
    for _ in range(4):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        listeners.append(sock)
    yield listeners
    for sock in listeners:
        sock.close()


def health_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("bootstrap-health"))


def test_pool_6_restart_behind_same_address_retires_the_replaced_instance_only(
    server: BootstrapServer,
) -> None:
    """POOL-6: the heartbeat sees the id change from its baseline and retires exactly the
    replaced id at exactly that address; on_restart follows the pool operation."""
    addr = server.address
    pool, calls = BootstrapPool(), Calls()
    old_id = server.instance_id
    old_key, other_addr_key = PoolKey(addr, 0, 0, 0), PoolKey(addr + "0", 0, 0, 0)
    pool.publish(old_key, generation(old_id))
    pool.publish(other_addr_key, generation(old_id))  # a prefix-sharing address: untouched
    monitor = HealthMonitor(pool, interval_s=60, on_restart=calls.on_restart)
    try:
        monitor.watch(addr)  # the baseline probe
        assert monitor.restarts_seen == 0 and pool.get(old_key) is not None
        server = restart(server)
        new_key = PoolKey(addr, 1, 0, 0)
        pool.publish(new_key, generation(server.instance_id))
        monitor.probe_once()
        assert monitor.restarts_seen == 1
        assert pool.get(old_key) is None
        assert pool.get(new_key) is not None
        assert pool.get(other_addr_key) is not None, "another address was touched"
        assert calls.restarts == [(addr, old_id, server.instance_id)]
    finally:
        server.stop()


def test_health_2_a_restart_right_after_watch_is_seen(server: BootstrapServer) -> None:
    """HEALTH-2: the baseline is taken at watch(), so a restart before the first periodic
    probe is still a restart (issue 8: restarts_seen stayed 0 across a real restart)."""
    pool, calls = BootstrapPool(), Calls()
    with HealthMonitor(pool, interval_s=0.05, on_restart=calls.on_restart) as monitor:
        monitor.watch(server.address)
        server = restart(server)
        try:
            assert wait_until(lambda: monitor.restarts_seen == 1)
        finally:
            server.stop()
    assert len(calls.restarts) == 1


def test_health_2_a_known_instance_id_is_the_baseline_without_a_probe(
    server: BootstrapServer,
) -> None:
    pool = BootstrapPool()
    pool.publish(PoolKey(server.address, 0, 0, 0), generation("a-replaced-instance"))
    monitor = HealthMonitor(pool, interval_s=60)
    monitor.watch(server.address, instance_id="a-replaced-instance")
    assert monitor.stats().probes == 0
    monitor.probe_once()
    assert monitor.restarts_seen == 1 and len(pool) == 0


def test_pool_5_consecutive_failures_drop_exactly_that_address() -> None:
    """POOL-5: ``failures_to_dead`` failed probes in a row (the baseline probe included) drop
    every entry of exactly the dead address; on_dead follows."""
    server = BootstrapServer("127.0.0.1", 0, insecure=True).start()
    addr = server.address
    server.stop()
    pool, calls = BootstrapPool(), Calls()
    dead_key, prefixed_key = PoolKey(addr, 0, 0, 0), PoolKey(addr + "0", 0, 0, 0)
    pool.publish(dead_key, generation(None))
    pool.publish(prefixed_key, generation(None))
    monitor = HealthMonitor(
        pool, interval_s=60, failures_to_dead=3, addresses=[addr], on_dead=calls.on_dead
    )
    monitor.probe_once()
    assert pool.get(dead_key) is not None, "two failed probes of three must not declare death"
    assert calls.dead == []
    monitor.probe_once()
    assert monitor.deaths_seen == 1
    assert pool.get(dead_key) is None
    assert pool.get(prefixed_key) is not None
    assert len(calls.dead) == 1 and calls.dead[0][0] == addr
    assert calls.dead[0][1].startswith("3 health probes in a row failed (last: ")
    monitor.probe_once()  # still dead: not a second death
    assert monitor.deaths_seen == 1


def test_health_1_silent_addresses_do_not_delay_a_restart(
    server: BootstrapServer, silent_listeners: list[socket.socket]
) -> None:
    """HEALTH-1, issue 8: four addresses that never answer (each probe waits out a 5 s read
    timeout) and one prefill restarted behind its address: the restart is noticed within
    about one interval. Probing in turn, it took 4 x 5 s; here the bound is 3 s."""
    pool, calls = BootstrapPool(), Calls()
    client = BootstrapClient(connect_timeout=2.0, read_timeout=5.0)
    monitor = HealthMonitor(pool, client=client, interval_s=0.1, on_restart=calls.on_restart)
    for listener in silent_listeners:
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        monitor.watch(addr, instance_id="silent")  # no baseline probe: it would wait 5 s
    monitor.watch(server.address)
    monitor.start()
    try:
        time.sleep(0.3)  # every silent address is now inside a 5 s probe
        server = restart(server)
        restarted = time.monotonic()
        assert wait_until(lambda: monitor.restarts_seen == 1, 3.0)
        noticed = time.monotonic() - restarted
        assert noticed < 3.0
        assert calls.restarts[0][0] == server.address
    finally:
        server.stop()
        for listener in silent_listeners:
            listener.close()  # resets the probes waiting there
        assert monitor.stop(timeout=10)


def test_health_2_bad_addresses_are_refused_at_watch() -> None:
    """Issue 8: ``watch("not an address")`` used to kill the probe thread of every address."""
    monitor = HealthMonitor(BootstrapPool(), interval_s=60)
    for bad in ("not an address", "127.0.0.1", "::1:80", "host:0", "host:99999", 42):
        with pytest.raises(InvalidArgument):
            monitor.watch(bad)  # type: ignore[arg-type]
    assert monitor.watched() == []
    with pytest.raises(InvalidArgument):
        HealthMonitor(BootstrapPool(), addresses=["nope"])


class _BuggyClient(BootstrapClient):
    """A real client whose probe of one address raises a bug (not a BootstrapHTTPError)."""

    def __init__(self, broken: str) -> None:
        super().__init__(connect_timeout=1.0, read_timeout=2.0)
        self.broken = broken

    def health(self, addr: str) -> str | None:
        if addr == self.broken:
            raise RuntimeError("a bug in the probe")
        return super().health(addr)


def test_health_3_a_probe_that_raises_and_a_raising_callback_stop_nothing(
    server: BootstrapServer,
) -> None:
    """HEALTH-3: any exception in a probe is a failed probe; callbacks that raise are counted;
    the other address keeps its heartbeat and its restart is still handled."""
    broken = "127.0.0.1:9"

    def explode(*args: str) -> None:
        raise RuntimeError("callback bug")

    pool = BootstrapPool()
    monitor = HealthMonitor(
        pool,
        client=_BuggyClient(broken),
        interval_s=0.05,
        failures_to_dead=2,
        on_dead=explode,
        on_restart=explode,
    )
    monitor.watch(broken)
    monitor.watch(server.address)
    with monitor:
        assert wait_until(lambda: monitor.deaths_seen == 1)
        server = restart(server)
        try:
            assert wait_until(lambda: monitor.restarts_seen == 1)
        finally:
            server.stop()
    stats = monitor.stats()
    assert stats.probe_errors >= 2 and stats.callback_errors == 2


def test_health_4_start_after_stop_and_unwatch(server: BootstrapServer) -> None:
    """HEALTH-4: stop() ends every thread; start() again probes again; unwatch() stops one."""
    pool = BootstrapPool()
    before = health_threads()
    monitor = HealthMonitor(pool, interval_s=0.05, addresses=[server.address])
    monitor.start()
    assert health_threads() == before + 1
    assert wait_until(lambda: monitor.stats().probes >= 3)
    assert monitor.stop(timeout=5)
    assert health_threads() == before
    probes = monitor.stats().probes
    time.sleep(0.2)
    assert monitor.stats().probes == probes
    server = restart(server)
    try:
        monitor.start()
        assert wait_until(lambda: monitor.restarts_seen == 1)
        assert health_threads() == before + 1
        assert monitor.unwatch(server.address) and not monitor.unwatch(server.address)
        assert wait_until(lambda: health_threads() == before)
        assert monitor.watched() == []
    finally:
        server.stop()
        monitor.stop()


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        HealthMonitor(BootstrapPool(), interval_s=0)
    with pytest.raises(ValueError):
        HealthMonitor(BootstrapPool(), failures_to_dead=0)


def test_health6_a_dead_address_is_rechecked_at_once_and_its_answer_reported() -> None:
    """HEALTH-6: an address judged dead is probed every ``recheck_s``, not every ``interval_s``
    (an hour here: only a recheck can have probed), and the first probe that answers calls
    ``on_alive`` before ``on_restart`` (what lifts a manager's hold-off, MGR-22)."""
    pool = BootstrapPool()
    calls = Calls()
    order: list[str] = []
    first = BootstrapServer("127.0.0.1", 0, insecure=True).start()
    port, old_id = first.port, first.instance_id
    monitor = HealthMonitor(
        pool,
        interval_s=3600,
        recheck_s=0.05,
        on_dead=calls.on_dead,
        on_restart=lambda addr, old, new: order.append("restart"),
        on_alive=lambda addr: order.append(f"alive {addr}"),
    )
    addr = first.address
    monitor.watch(addr)  # the baseline: first's instance id
    first.stop()
    monitor.probe_once()
    monitor.probe_once()  # two failures in a row: dead
    assert [a for a, _ in calls.dead] == [addr] and order == []
    second = BootstrapServer("127.0.0.1", port, insecure=True).start()
    try:
        with monitor:
            assert wait_until(lambda: len(order) == 2, timeout=10.0), order
        assert order == [f"alive {addr}", "restart"]
        assert second.instance_id != old_id
        assert monitor.stats().deaths_seen == 1 and monitor.stats().restarts_seen == 1
    finally:
        second.stop()


def recording_monitor(events: list[str]) -> HealthMonitor:
    """A monitor that only ``probe_once`` drives (its interval is an hour), each probe bounded
    by 0.2 s, appending its callbacks to ``events`` (``silent`` with its reason)."""
    return HealthMonitor(
        BootstrapPool(),
        interval_s=3600,
        probe_timeout_s=0.2,
        on_dead=lambda addr, reason: events.append("dead"),
        on_silent=lambda addr, reason: events.append(f"silent ({reason})"),
        on_heard=lambda addr: events.append("heard"),
        on_alive=lambda addr: events.append("alive"),
    )


def test_health7_silence_and_its_end_are_reported_refusals_are_not_silence() -> None:
    """HEALTH-7: a dead address whose probes go unanswered (a listener that never replies) is
    reported silent, before it is reported dead; a refused probe (the listener closed: the host
    answers at once) ends the silence, and a later answer calls ``on_alive`` alone. An address
    refused from the start (a server stopped outright) is judged dead and never silent."""
    events: list[str] = []
    monitor = recording_monitor(events)
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = listener.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    server = None
    try:
        monitor.watch(addr, instance_id="unknown")  # no baseline probe
        monitor.probe_once()
        monitor.probe_once()  # two unanswered: dead, and silent
        assert len(events) == 2 and events[1] == "dead", events
        assert events[0].startswith("silent (2 health probes in a row failed"), events
        assert "no complete reply within the 0.2 s" in events[0], events
        monitor.probe_once()  # unanswered again: still the same silence
        assert len(events) == 2
        listener.close()
        monitor.probe_once()  # refused: heard, still dead
        monitor.probe_once()
        assert events[2:] == ["heard"]
        server = BootstrapServer("127.0.0.1", port, insecure=True).start()
        monitor.probe_once()
        assert events[2:] == ["heard", "alive"]
        server.stop()
        events.clear()
        monitor.probe_once()
        monitor.probe_once()  # refused twice in a row: dead, never silent
        assert events == ["dead"]
    finally:
        listener.close()
        if server is not None:
            server.stop()


def test_health7_a_silent_address_that_answers_is_heard_then_alive() -> None:
    """A silence that ends with an answer (a stopped server continued; here a listener that
    starts replying on the same socket): ``on_heard`` then ``on_alive``."""
    events: list[str] = []
    monitor = recording_monitor(events)
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    stop = threading.Event()

    def answer_health() -> None:
        """Answers each connection's requests with 200 until the client closes it."""
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(5.0)
                try:
                    while conn.recv(4096):
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    replier = threading.Thread(target=answer_health, daemon=True)
    try:
        monitor.watch(addr, instance_id="unknown")  # no baseline probe
        monitor.probe_once()
        monitor.probe_once()
        assert events[0].startswith("silent (") and events[1:] == ["dead"], events
        replier.start()
        monitor.probe_once()
        assert events[1:] == ["dead", "heard", "alive"], events
    finally:
        stop.set()
        listener.close()
        if replier.is_alive():
            replier.join(10)
