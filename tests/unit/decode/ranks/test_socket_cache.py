"""``SocketCache`` (statemachine/decode/ranks/socket_cache.py, spec/zmq.md ZMQ-1, ZMQ-17,
ZMQ-19, ZMQ-20): one socket per endpoint, sockets that follow the generations retaining them,
bounded, refused while a remembered verdict holds.

The sockets are real ZMQ sockets in a context of the test's own (connect is asynchronous: a
socket pointed at a loopback port nothing listens on is made without any peer); the monitor
thread is a fake that takes each monitor socket and closes it on ``unwatch``, as the real one
does, reading no event (liveness is ``ranks/liveness.py``'s and the transport tests')."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from statemachine.decode.ranks.breaker import RememberedVerdicts
from statemachine.decode.ranks.socket_cache import SocketCache, SocketOptions
from statemachine.decode.ranks.sockets import MONITORED
from statemachine.decode.tally import Tally
from statemachine.errors import SendFailed

from ..fakes import FakeSocketMonitor


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@dataclass
class Setup:
    cache: SocketCache
    monitor: FakeSocketMonitor
    remembered: RememberedVerdicts
    failures: Tally
    circuit_failures: Tally


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def make(context: zmq.Context[zmq.Socket[bytes]], max_sockets: int = 8) -> Setup:
    monitor, remembered = FakeSocketMonitor(), RememberedVerdicts(3600.0, 64)
    failures, circuit_failures = Tally(), Tally()
    options = SocketOptions(
        policy=MONITORED,
        send_timeout_ms=100,
        reconnect_ivl_ms=100,
        reconnect_ivl_max_ms=100,
        connect_timeout_ms=100,
        heartbeat=(),
        grace_s=1.0,
    )
    cache = SocketCache(
        context=context,
        options=options,
        max_sockets=max_sockets,
        monitor=monitor,  # type: ignore[arg-type]
        remembered=remembered,
        failures=failures,
        circuit_failures=circuit_failures,
    )
    return Setup(cache, monitor, remembered, failures, circuit_failures)


@pytest.fixture
def endpoints() -> tuple[tuple[str, int], ...]:
    return tuple(("127.0.0.1", closed_port()) for _ in range(3))


def test_zmq_1_one_socket_per_endpoint(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    s = make(context)
    a = ("127.0.0.1", closed_port())
    entry = s.cache.open(a)
    assert s.cache.open(a) is entry
    assert (s.cache.created, s.cache.open_sockets) == (1, 1)
    assert list(s.monitor.watched) == [entry]  # its monitor handed over before any event
    s.cache.close_all()
    s.monitor.close()


def test_zmq_20_a_socket_lives_while_a_generation_retains_it(
    context: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[tuple[str, int], ...]
) -> None:
    s = make(context)
    a = endpoints[0]
    s.cache.retain([a])
    s.cache.retain([a])
    entry = s.cache.open(a)
    s.cache.release([a])
    assert not entry.closed and s.cache.entries[a] is entry  # one generation still uses it
    s.cache.release([a])
    assert entry.closed and a not in s.cache.entries and s.cache.open_sockets == 0
    assert s.monitor.unwatched == [entry]
    s.cache.release([a])  # more than was retained: ignored
    assert s.cache.refs == {}
    s.monitor.close()


def test_zmq_19_a_remembered_verdict_refuses_without_making_a_socket(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    s = make(context)
    a = ("127.0.0.1", closed_port())
    s.remembered.remember(a, "judged dead: reconnect refused")
    with pytest.raises(SendFailed, match="judged dead"):
        s.cache.open(a)
    assert s.cache.created == 0
    assert (s.failures.value(), s.circuit_failures.value()) == (1, 1)


@pytest.mark.parametrize("host", ["localhost", "0.0.0.0", "255.255.255.255"])
def test_zmq_17_only_peer_ip_literals_get_a_socket(
    context: zmq.Context[zmq.Socket[bytes]], host: str
) -> None:
    s = make(context)
    with pytest.raises(SendFailed):
        s.cache.open((host, 5000))
    assert s.cache.created == 0 and s.failures.value() == 1


def test_zmq_20_the_bound_evicts_the_least_recently_used_unretained_socket(
    context: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[tuple[str, int], ...]
) -> None:
    s = make(context, max_sockets=2)
    a, b, c = endpoints
    s.cache.retain([a])
    first = s.cache.open(a)
    second = s.cache.open(b)
    s.cache.open(c)
    assert not first.closed and second.closed  # the retained one is never the victim
    assert set(s.cache.entries) == {a, c} and s.cache.lru_evictions == 1
    s.cache.close_all()
    s.monitor.close()


def test_close_all_closes_every_socket_and_makes_no_more(
    context: zmq.Context[zmq.Socket[bytes]], endpoints: tuple[tuple[str, int], ...]
) -> None:
    s = make(context)
    opened = [s.cache.open(e) for e in endpoints[:2]]
    s.cache.close_all()
    assert all(entry.closed for entry in opened) and s.cache.entries == {}
    with pytest.raises(SendFailed, match="closed"):
        s.cache.open(endpoints[2])
    s.monitor.close()
