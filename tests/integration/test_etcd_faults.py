"""etcd discovery under faults, with real processes: a prefill restart, a SIGKILLed registrar
(lease expiry), etcd itself killed and restarted, a partition with compaction past the watch.

Times printed are indicative (the machine is shared); the asserted bounds are generous
correctness bounds. The figures themselves are measured in benchmarks/bench_etcd.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from statemachine.discovery.changes import RankChange
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.registrar import EtcdRegistrar
from statemachine.pool import BootstrapPool, PoolKey
from statemachine.prefill.readiness import read_ready
from tests.support.etcd_discovery_support import ADDR, BOUND, fetch, payload
from tests.support.etcd_support import EtcdServer, TcpForwarder, running_etcd, wait_until

KEY = PoolKey(ADDR, 0, 0, 0)


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with running_etcd() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:12]}/ranks"


def register_instance(endpoint: str, prefix: str, base_port: int, ttl: int = 10) -> EtcdRegistrar:
    registrar = EtcdRegistrar(EtcdGateway([endpoint]), ADDR, prefix=prefix, ttl=ttl)
    for tp in range(2):
        registrar.register(payload(base_port + tp, tp=tp, tp_size=2))
    return registrar


def ports(source: EtcdBootstrapSource) -> list[int]:
    return [
        source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0).rank_port
        for tp in range(2)
    ]


def test_graceful_restart_retires_the_old_generation(etcd: EtcdServer, prefix: str) -> None:
    pool = BootstrapPool()
    changes: list[RankChange] = []
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint]), prefix=prefix, pool=pool, on_change=changes.append
    ).start()
    try:
        assert source.wait_synced(BOUND)
        old_instance = register_instance(etcd.endpoint, prefix, 5000)
        assert wait_until(lambda: source.stats().changes == 2, BOUND)
        old = fetch(source, pool, ADDR, 2)
        started = time.perf_counter()
        old_instance.close()  # graceful: revoke the lease
        assert wait_until(lambda: pool.get(KEY) is None, BOUND, interval=0.0005)
        retired_after = time.perf_counter() - started
        print(f"graceful restart: pool retired {retired_after * 1e3:.1f} ms after revoke")
        retiring = [c for c in changes if c.retired]
        assert len(retiring) == 1 and retiring[0].deleted
        assert retiring[0].retired == {KEY: old}
        new_instance = register_instance(etcd.endpoint, prefix, 6000)
        assert wait_until(lambda: ports_or_none(source) == [6000, 6001], BOUND, interval=0.001)
        new = fetch(source, pool, ADDR, 2)
        assert new.instance_id == new_instance.instance_id != old.instance_id
        new_instance.close()
        assert wait_until(lambda: pool.get(KEY) is None, BOUND)
    finally:
        source.close()


def test_overlapping_restart_new_registration_first(etcd: EtcdServer, prefix: str) -> None:
    """The new instance registers before the old one revokes: its puts retire the old
    generation; the old lease's revoke deletes nothing of the new one's."""
    pool = BootstrapPool()
    source = EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix, pool=pool).start()
    try:
        assert source.wait_synced(BOUND)
        old_instance = register_instance(etcd.endpoint, prefix, 5000)
        assert wait_until(lambda: source.stats().changes == 2, BOUND)
        old = fetch(source, pool, ADDR, 2)
        new_instance = register_instance(etcd.endpoint, prefix, 6000)
        assert wait_until(lambda: pool.get(KEY) is None, BOUND)
        assert wait_until(lambda: source.stats().changes == 4, BOUND)
        new = fetch(source, pool, ADDR, 2)
        assert new is not old and [r.port for r in new.ranks] == [6000, 6001]
        old_instance.close()
        time.sleep(0.3)
        assert pool.get(KEY) is new and ports(source) == [6000, 6001]
        new_instance.close()
    finally:
        source.close()


def _start_registrar_process(endpoint: str, prefix: str, ttl: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "statemachine.discovery.registrar", "--endpoints", endpoint]
    argv += ["--bootstrap", ADDR, "--prefix", prefix, "--ttl", str(ttl)]
    argv += ["--rank-port", "7000", "--tp-size", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    words = read_ready(proc.stdout.fileno(), time.monotonic() + BOUND * 2)
    assert words is not None, "registrar process exited before READY"
    return proc


def test_sigkilled_registrar_keys_vanish_at_lease_expiry(etcd: EtcdServer, prefix: str) -> None:
    ttl = 2
    pool = BootstrapPool()
    changes: list[RankChange] = []
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint]), prefix=prefix, pool=pool, on_change=changes.append
    ).start()
    proc = None
    try:
        assert source.wait_synced(BOUND)
        proc = _start_registrar_process(etcd.endpoint, prefix, ttl)
        assert wait_until(lambda: source.stats().changes == 2, BOUND)
        old = fetch(source, pool, ADDR, 2)
        killed = time.perf_counter()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=BOUND)
        assert wait_until(lambda: pool.get(KEY) is None, ttl + BOUND, interval=0.001)
        retired_after = time.perf_counter() - killed
        print(f"SIGKILL: retired {retired_after:.3f} s after the kill (TTL {ttl} s)")
        # Lease expiry, not the kill itself, removed the keys: the last keep-alive, at most
        # about TTL/2 before the kill (later under load), leaves a good part of the TTL to go.
        assert retired_after >= 0.3
        deletes = [c for c in changes if c.deleted]
        assert {c.tp_rank for c in deletes} == {0, 1}
        assert any(c.retired == {KEY: old} for c in deletes)
        assert source.stats().synced
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        source.close()


def test_sigtermed_registrar_process_revokes_at_once(etcd: EtcdServer, prefix: str) -> None:
    ttl = 30
    source = EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix).start()
    proc = None
    try:
        assert source.wait_synced(BOUND)
        proc = _start_registrar_process(etcd.endpoint, prefix, ttl)
        assert wait_until(lambda: source.stats().changes == 2, BOUND)
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=BOUND)
        assert b"REVOKED" in out and proc.returncode == 0
        assert wait_until(lambda: source.stats().changes == 4, BOUND)
        assert time.perf_counter() - started < ttl / 2  # revoked, not expired
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        source.close()


def test_etcd_killed_and_restarted(etcd: EtcdServer, prefix: str) -> None:
    """While etcd is down the store keeps serving and callers never wait; after etcd comes
    back the watch resumes from revision + 1 and later changes retire as before."""
    pool = BootstrapPool()
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint], connect_timeout=0.5, timeout=1.0),
        prefix=prefix,
        pool=pool,
        backoff_initial=0.05,
        backoff_max=0.5,
    ).start()
    assert source.wait_synced(BOUND)
    old_instance = register_instance(etcd.endpoint, prefix, 5000, ttl=10)
    try:
        assert wait_until(lambda: source.stats().changes == 2, BOUND)
        old = fetch(source, pool, ADDR, 2)
        etcd.kill()
        assert wait_until(lambda: not source.stats().connected, BOUND)
        started = time.perf_counter()
        assert ports(source) == [5000, 5001]  # served from the store
        assert time.perf_counter() - started < 0.5
        assert pool.get(KEY) is old
        stats = source.stats()
        assert stats.last_error is not None and stats.reconnects >= 1
        etcd.start()
        assert wait_until(lambda: source.stats().connected, BOUND)
        # The lease survived the outage (etcd renews leases when it restarts).
        assert ports(source) == [5000, 5001] and pool.get(KEY) is old
        old_instance.close()
        assert wait_until(lambda: pool.get(KEY) is None, BOUND)
        new_instance = register_instance(etcd.endpoint, prefix, 6000)
        assert wait_until(lambda: ports_or_none(source) == [6000, 6001], BOUND)
        new_instance.close()
    finally:
        old_instance.close()
        source.close()


def ports_or_none(source: EtcdBootstrapSource) -> list[int] | None:
    try:
        return ports(source)
    except Exception:
        return None


def test_partition_with_compaction_relists_and_diffs(etcd: EtcdServer, prefix: str) -> None:
    """The source is cut off etcd; meanwhile the prefill restarts and the history is compacted
    past the source's revision. On heal the resumed watch is refused as compacted; the source
    re-lists, diffs, and retires exactly what changed."""
    relay = TcpForwarder(etcd.client_port)
    pool = BootstrapPool()
    changes: list[RankChange] = []
    source = EtcdBootstrapSource(
        EtcdGateway([relay.endpoint], connect_timeout=0.5, timeout=1.0),
        prefix=prefix,
        pool=pool,
        on_change=changes.append,
        backoff_initial=0.05,
        backoff_max=0.2,
    ).start()
    direct = EtcdGateway([etcd.endpoint])
    other = "127.0.0.1:9000"
    steady = EtcdRegistrar(EtcdGateway([etcd.endpoint]), other, prefix=prefix)
    try:
        assert source.wait_synced(BOUND)
        old_instance = register_instance(etcd.endpoint, prefix, 5000)
        steady.register(payload(8000))
        assert wait_until(lambda: source.stats().changes == 3, BOUND)
        old = fetch(source, pool, ADDR, 2)
        steady_generation = fetch(source, pool, other, 1)
        seen = len(changes)
        relay.cut()
        assert wait_until(lambda: not source.stats().connected, BOUND)
        old_instance.close()
        new_instance = register_instance(etcd.endpoint, prefix, 6000)
        for i in range(5):
            direct.put(f"/unrelated/{i}".encode(), b"x")
        direct.compact(direct.revision())
        # Still cut off: the store serves what it had.
        assert ports(source) == [5000, 5001]
        relay.heal()
        assert wait_until(lambda: source.stats().compactions >= 1, BOUND)
        assert wait_until(lambda: ports_or_none(source) == [6000, 6001], BOUND)
        stats = source.stats()
        assert stats.relists >= 1 and stats.connected
        assert pool.get(KEY) is None
        assert pool.get(PoolKey(other, 0, 0, 0)) is steady_generation  # untouched
        diff = changes[seen:]
        # The diff saw the two rank keys change value (not the intermediate deletes).
        assert {(c.addr, c.tp_rank, c.deleted) for c in diff} == {
            (ADDR, 0, False),
            (ADDR, 1, False),
        }
        assert any(c.retired == {KEY: old} for c in diff)
        new_instance.close()
    finally:
        steady.close()
        source.close()
        relay.close()


def test_keepalive_failures_are_retried_counted_and_recovered(
    etcd: EtcdServer, prefix: str
) -> None:
    """The registrar is cut off etcd for longer than its keep-alive interval (but less than the
    TTL): keep-alives fail, are retried with back-off and counted; after the heal the lease is
    still the same and the keys never went away."""
    relay = TcpForwarder(etcd.client_port)
    ttl = 4
    registrar = EtcdRegistrar(
        EtcdGateway([relay.endpoint], connect_timeout=0.3, timeout=0.5),
        ADDR,
        prefix=prefix,
        ttl=ttl,
        keepalive_interval=0.5,
        backoff=0.05,
    )
    source = EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix).start()
    try:
        assert source.wait_synced(BOUND)
        registrar.register(payload(5000))
        lease = registrar.stats().lease_id
        assert wait_until(lambda: registrar.stats().keepalives >= 1, BOUND)
        relay.cut()
        assert wait_until(lambda: registrar.stats().keepalive_failures >= 3, BOUND)
        relay.heal()
        healed_at = registrar.stats().keepalives
        assert wait_until(lambda: registrar.stats().keepalives > healed_at, BOUND)
        stats = registrar.stats()
        assert stats.lease_id == lease and stats.lease_regrants == 0
        assert stats.last_error is not None and "keep-alive" in stats.last_error
        assert source.stats().changes == 1  # the key never went away
    finally:
        registrar.close()
        source.close()
        relay.close()


def test_sources_and_registrars_release_their_threads_and_sockets(
    etcd: EtcdServer, prefix: str
) -> None:
    import threading

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def cycle() -> None:
        with (
            EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source,
            EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix, ttl=5) as registrar,
        ):
            assert source.wait_synced(BOUND)
            revision = registrar.register(payload(5000))
            assert wait_until(lambda: source.revision >= revision, BOUND)

    cycle()  # warm-up: imports, lazily created module state
    threads, files = threading.active_count(), fds()
    for _ in range(10):
        cycle()
    assert wait_until(lambda: threading.active_count() <= threads, BOUND)
    assert wait_until(lambda: fds() <= files, BOUND), (fds(), files)


def test_a_quiet_watch_is_reopened_from_its_revision(etcd: EtcdServer, prefix: str) -> None:
    """A watch silent past its idle timeout is re-opened from revision + 1 (how a half-open
    connection is found): no re-list, and no change is missed across the re-opens."""
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint]), prefix=prefix, watch_idle_timeout=0.2
    ).start()
    try:
        assert source.wait_synced(BOUND)
        assert wait_until(lambda: source.stats().idle_reopens >= 3, BOUND)
        with EtcdRegistrar(EtcdGateway([etcd.endpoint]), ADDR, prefix=prefix) as registrar:
            revision = registrar.register(payload(5000))
            assert wait_until(lambda: source.revision >= revision, BOUND)
            stats = source.stats()
            assert stats.lists == 1 and stats.reconnects == 0 and stats.connected
    finally:
        source.close()


def test_a_replaced_cluster_is_relisted(etcd: EtcdServer, prefix: str) -> None:
    """etcd comes back *empty* (data lost, or another cluster behind the same address): its
    revision is behind ours, so the source re-lists and deletes what the old cluster held."""
    import shutil

    pool = BootstrapPool()
    changes: list[RankChange] = []
    source = EtcdBootstrapSource(
        EtcdGateway([etcd.endpoint], connect_timeout=0.5, timeout=1.0),
        prefix=prefix,
        pool=pool,
        on_change=changes.append,
        backoff_max=0.2,
    ).start()
    try:
        assert source.wait_synced(BOUND)
        registrar = register_instance(etcd.endpoint, prefix, 5000)
        direct = EtcdGateway([etcd.endpoint])
        for i in range(20):  # push the old cluster's revision well ahead of a fresh one's
            direct.put(f"/unrelated/{i}".encode(), b"x")
        assert wait_until(lambda: source.stats().changes == 2, BOUND)
        old = fetch(source, pool, ADDR, 2)
        registrar.close(revoke=False)
        etcd.kill()
        shutil.rmtree(os.path.join(etcd.data_dir, "member-data"))
        etcd.start()
        assert wait_until(lambda: source.stats().relists >= 1, BOUND)
        assert wait_until(lambda: pool.get(KEY) is None, BOUND)
        assert ports_or_none(source) is None
        assert {(c.tp_rank, c.deleted) for c in changes[2:]} == {(0, True), (1, True)}
        assert any(c.retired == {KEY: old} for c in changes[2:])
        # And it follows the new cluster from there.
        new_instance = register_instance(etcd.endpoint, prefix, 6000)
        assert wait_until(lambda: ports_or_none(source) == [6000, 6001], BOUND)
        new_instance.close()
    finally:
        source.close()


def test_a_cluster_with_authentication(etcd: EtcdServer, prefix: str) -> None:
    """etcd users: the registrar and the source log in, renew an expired token by themselves,
    and a client without credentials gets a typed refusal."""
    from statemachine.errors import EtcdRequestFailed

    admin = EtcdGateway([etcd.endpoint])
    admin._post("auth/user/add", {"name": "root", "password": "root-pw"})
    admin._post("auth/role/add", {"name": "root"})
    admin._post("auth/user/grant", {"user": "root", "role": "root"})
    admin._post("auth/enable", {})

    def login() -> EtcdGateway:
        return EtcdGateway([etcd.endpoint], username="root", password="root-pw")

    with pytest.raises(EtcdRequestFailed, match="user name is empty"):
        EtcdGateway([etcd.endpoint]).put(f"{prefix}/x".encode(), b"x")
    with pytest.raises(EtcdRequestFailed):
        EtcdGateway([etcd.endpoint], username="root", password="wrong").put(b"/x", b"x")
    source_gateway = login()
    with (
        EtcdBootstrapSource(
            source_gateway, prefix=prefix, backoff_max=0.2, watch_idle_timeout=0.3
        ) as source,
        EtcdRegistrar(login(), ADDR, prefix=prefix, ttl=5) as registrar,
    ):
        assert source.wait_synced(BOUND)
        registrar.register(payload(5000, tp=0, tp_size=2))
        revision = registrar.register(payload(5001, tp=1, tp_size=2))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert ports(source) == [5000, 5001]
        # Tokens expire (etcd's --auth-token-ttl): both sides renew theirs on refusal.
        registrar.gateway._token = "expired"
        source_gateway._token = "expired"
        # The source's next idle re-open is refused (PermissionDenied), renews the token, and
        # the one after succeeds.
        assert wait_until(lambda: source.stats().reconnects >= 1, BOUND)
        assert "PermissionDenied" in (source.stats().last_error or "")
        revision = registrar.register(payload(5002, tp=1, tp_size=2))
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert ports(source) == [5000, 5002] and source.stats().connected
