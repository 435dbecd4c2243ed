"""HealthMonitor against a real bootstrap server on 127.0.0.1, restarted and stopped.

POOL-5 (exact-address node failure) and POOL-6 (instance-id retirement) through the heartbeat.
"""

from __future__ import annotations

import time

import pytest

from statemachine.decode.health import HealthMonitor
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.prefill.server import BootstrapServer


def generation(instance_id: str | None) -> Generation:
    return Generation((RankInfo("127.0.0.1", 40000, 0),), instance_id)


def test_pool_6_restart_behind_same_address_retires_old_instance_entries() -> None:
    """POOL-6: the heartbeat sees a new instance id and drops entries of the old instance only
    (and only of that address); entries fetched from the new instance survive."""
    server = BootstrapServer("127.0.0.1", 0, insecure=True).start()
    addr, port = server.address, server.port
    pool = BootstrapPool()
    old_key, other_addr_key = PoolKey(addr, 0, 0, 0), PoolKey(addr + "0", 0, 0, 0)
    pool.publish(old_key, generation(server.instance_id))
    pool.publish(other_addr_key, generation("someone-else"))
    monitor = HealthMonitor(pool, interval_s=60, addresses=[addr])
    try:
        monitor.probe_once()
        assert pool.get(old_key) is not None and monitor.restarts_seen == 0
        server.stop()
        server = BootstrapServer("127.0.0.1", port, insecure=True).start()
        new_key = PoolKey(addr, 1, 0, 0)
        pool.publish(new_key, generation(server.instance_id))
        monitor.probe_once()
        assert monitor.restarts_seen == 1
        assert pool.get(old_key) is None
        assert pool.get(new_key) is not None
        assert pool.get(other_addr_key) is not None, "another address was touched"
    finally:
        server.stop()


def test_pool_5_consecutive_failures_drop_exactly_that_address() -> None:
    """POOL-5: `failures_to_dead` failed probes in a row drop every entry of exactly the dead
    address — `host:P` never wipes `host:P0…` (the SGLang prefix bug)."""
    server = BootstrapServer("127.0.0.1", 0, insecure=True).start()
    addr = server.address
    server.stop()
    pool = BootstrapPool()
    dead_key, prefixed_key = PoolKey(addr, 0, 0, 0), PoolKey(addr + "0", 0, 0, 0)
    pool.publish(dead_key, generation(None))
    pool.publish(prefixed_key, generation(None))
    monitor = HealthMonitor(pool, interval_s=60, failures_to_dead=2, addresses=[addr])
    monitor.probe_once()
    assert pool.get(dead_key) is not None, "one failed probe must not declare death"
    monitor.probe_once()
    assert monitor.deaths_seen == 1
    assert pool.get(dead_key) is None
    assert pool.get(prefixed_key) is not None


def test_background_thread_probes_and_stops_promptly() -> None:
    server = BootstrapServer("127.0.0.1", 0, insecure=True).start()
    pool = BootstrapPool()
    key = PoolKey(server.address, 0, 0, 0)
    pool.publish(key, generation(server.instance_id))
    stopped = False
    try:
        with HealthMonitor(pool, interval_s=0.05) as monitor:
            monitor.watch(server.address)
            # The background thread must notice the death (an entry of an instance it never
            # saw replaced is not retired: POOL-6 retires only an id seen replaced).
            server.stop()
            stopped = True
            deadline = time.monotonic() + 10
            while pool.get(key) is not None:
                assert time.monotonic() < deadline, "the heartbeat never dropped the entry"
                time.sleep(0.01)
            started = time.monotonic()
        assert time.monotonic() - started < 5
    finally:
        if not stopped:
            server.stop()


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        HealthMonitor(BootstrapPool(), interval_s=0)
    with pytest.raises(ValueError):
        HealthMonitor(BootstrapPool(), failures_to_dead=0)
