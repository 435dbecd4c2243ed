"""Where a prefill rank listens, as the transport gives it to libzmq (ZMQ-17, ZMQ-18).

An endpoint is ``(ip, port)``. Its ip must be an IP *literal*: libzmq resolves a host name on
the context's I/O thread, which every socket of the context shares, so one name whose resolver
never answers delays the messages of every other rank (measured before this rule: a healthy
rank's message arrived 6.71 s late). Checking with :mod:`ipaddress` does no I/O at all.

Addresses that are not a peer are refused too: the unspecified address (``0.0.0.0``/``::``
makes the decode connect to itself), multicast, and the IPv4 limited broadcast address.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, NamedTuple

from statemachine.wire.endpoint import Endpoint, endpoint_url

if TYPE_CHECKING:
    from statemachine.pool import Generation

_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


class EndpointAddress(NamedTuple):
    """What :func:`endpoint_address` found: the ZMQ URL, and whether the socket needs IPV6."""

    url: str
    ipv6: bool


def generation_endpoints(generation: Generation) -> tuple[Endpoint, ...]:
    """The endpoints of every rank of ``generation`` (dummy ranks included), in rank order:
    what ``ZmqTransport.retain`` / ``release`` take for one generation."""
    return tuple((rank.ip, rank.port) for rank in generation.ranks)


def check_endpoint_shape(endpoint: object) -> None:
    """``ValueError`` unless ``endpoint`` is ``(non-empty str, int 1..65535)``: a caller's bug."""
    if (
        not isinstance(endpoint, tuple)
        or len(endpoint) != 2
        or not isinstance(endpoint[0], str)
        or not endpoint[0]
        or not isinstance(endpoint[1], int)
        or isinstance(endpoint[1], bool)
        or not 1 <= endpoint[1] <= 65535
    ):
        raise ValueError(f"endpoint must be (ip: str, port: 1..65535), not {endpoint!r}")


def endpoint_address(endpoint: Endpoint) -> EndpointAddress:
    """The URL to connect to; ``ValueError`` (with the reason) if the ip is not a peer literal.

    The caller turns the ``ValueError`` into ``SendFailed``: the peer that named this ip is the
    one at fault, and the request that depends on it fails like any unreachable rank.
    """
    ip = endpoint[0]
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        raise ValueError(
            f"rank ip {ip!r} is not an IP literal; host names are never resolved on the "
            "transport's I/O thread (a slow resolver would delay every rank)"
        ) from None
    if parsed.is_unspecified or parsed.is_multicast or parsed == _BROADCAST:
        raise ValueError(f"rank ip {ip!r} is not a peer address (unspecified/multicast/broadcast)")
    ipv6 = isinstance(parsed, ipaddress.IPv6Address)
    return EndpointAddress(endpoint_url(endpoint), ipv6)
