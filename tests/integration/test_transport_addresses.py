"""What ip a rank may name (ZMQ-17, ZMQ-18 of ``spec/zmq.md``), on real sockets.

Issue 10: a rank ip validation accepted crashed ``init()`` with a raw ``zmq.ZMQError`` and
leaked fds; a host name as rank ip let a silent resolver stall every socket of the context;
an IPv6 rank could not be reached at all.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from statemachine.decode.ranks.endpoints import endpoint_address
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.demo.baselines import UnmonitoredTransport
from statemachine.errors import SendFailed
from tests.support.zmq_support import (
    LOOPBACK,
    fd_count,
    pull_peer,
    recv_n,
    wait_until,
    with_deadline,
)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _leaves_loopback(ip: str) -> bool:
    """True if ``ip`` is a literal libzmq would connect to that is not this machine."""
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return False  # not a literal: refused before any socket exists
    return not (parsed.is_loopback or parsed.is_unspecified or parsed.is_multicast)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("monitor", [True, False])
def test_zmq18_connect_errors_are_send_failed_and_leak_nothing(monitor: bool) -> None:
    """ZMQ-18: scope ids that ``ipaddress`` accepts but libzmq's connect() rejects."""
    bad_ips = ["::1%a b", "::1%\n", "::1%中"]
    transport = ZmqTransport() if monitor else UnmonitoredTransport()
    try:
        with pytest.raises(SendFailed):  # the first socket starts libzmq's own threads
            transport.send(("::1%x y", 5555), [b"x"])
        baseline = fd_count()
        for _ in range(20):
            for ip in bad_ips:
                with pytest.raises(SendFailed) as caught:
                    transport.send((ip, 5555), [b"x"])
                assert isinstance(caught.value.__cause__, zmq.ZMQError)
                assert "cannot connect" in str(caught.value)
        stats = transport.stats()
        assert (stats.sockets_open, stats.sockets_created, stats.failures) == (0, 0, 61)
        assert wait_until(lambda: fd_count() <= baseline, 5)
    finally:
        with_deadline(transport.close, 10)  # used to hang on the leaked sockets


@pytest.mark.parametrize(
    "ip",
    [
        "localhost",
        "rank-0.prefill.svc",
        "unresolvable.invalid",
        "0.0.0.0",
        "::",
        "224.0.0.1",
        "255.255.255.255",
        "ff02::1",
        "01.2.3.4",
        "1.2.3",
    ],
)
def test_zmq17_names_and_non_peer_addresses_never_reach_libzmq(ip: str) -> None:
    """ZMQ-17: refused before any socket exists (so nothing is ever resolved)."""
    with ZmqTransport() as transport:
        started = time.monotonic()
        with pytest.raises(SendFailed) as caught:
            transport.send((ip, 5555), [b"x"])
        assert time.monotonic() - started < 1.0
        assert "IP literal" in str(caught.value) or "not a peer address" in str(caught.value)
        assert transport.stats().sockets_created == 0


def test_zmq17_a_healthy_rank_is_not_delayed_while_another_endpoint_is_a_name(
    context: zmq.Context,
) -> None:
    """Issue 10 item 2: names never reach the shared I/O thread, so one cannot delay another."""
    with pull_peer(context) as (peer, port), ZmqTransport() as transport:
        healthy = (LOOPBACK, port)
        transport.send(healthy, [b"warm"])
        recv_n(peer, 1)
        for i in range(20):
            with pytest.raises(SendFailed):
                transport.send((f"rank-{i}.does-not-resolve.invalid", 5555), [b"x"])
            started = time.monotonic()
            transport.send(healthy, [b"%d" % i])
            assert recv_n(peer, 1, timeout_ms=5000) == [[b"%d" % i]]
            assert time.monotonic() - started < 1.0


def test_zmq17_ipv6_endpoint_address_sets_the_option() -> None:
    assert endpoint_address(("::1", 80)) == ("tcp://[::1]:80", True)
    assert endpoint_address(("127.0.0.1", 80)) == ("tcp://127.0.0.1:80", False)
    assert endpoint_address(("fe80::1%lo", 80)) == ("tcp://[fe80::1%lo]:80", True)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("monitor", [True, False])
def test_zmq17_an_ipv6_rank_is_reached_over_real_loopback(
    context: zmq.Context, monitor: bool
) -> None:
    """Issue 10 item 10: SGLang sets IPV6=1 for an IPv6 rank ip; without it libzmq cannot
    connect to ``tcp://[::1]:port``."""
    peer = context.socket(zmq.PULL)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.IPV6, 1)
    try:
        port = peer.bind_to_random_port("tcp://[::1]")
        with ZmqTransport() if monitor else UnmonitoredTransport() as transport:
            transport.send(("::1", port), [b"over", b"ipv6"])
            assert recv_n(peer, 1) == [[b"over", b"ipv6"]]
    finally:
        peer.close(linger=0)


@settings(max_examples=60, deadline=None)
@given(
    ip=st.one_of(
        st.text(max_size=40),
        st.from_regex(r"\A::1%.{0,6}\Z"),
        st.ip_addresses(network="127.0.0.0/8").map(str),
        st.just("::1"),
        st.from_regex(r"\A[a-z0-9.-]{1,30}\Z"),
    )
)
def test_zmq18_any_rank_ip_fails_typed_or_is_a_valid_literal(ip: str) -> None:
    """Property: for any rank ip, a send either reaches libzmq with a peer literal or raises
    ``SendFailed`` (``ValueError`` only for an empty string, a caller's bug); never a raw
    ``ZMQError``, and nothing stays open. Generated literals that would reach a real address
    off this machine are skipped: tests send nothing beyond loopback."""
    assume(not _leaves_loopback(ip))
    with UnmonitoredTransport(send_timeout_ms=50) as transport:
        try:
            transport.send((ip, 9), [b"x"])  # port 9: nobody listens on loopback
        except SendFailed:
            pass
        except ValueError:
            assert ip == ""
        transport.close()
        assert transport.stats().sockets_open == 0
