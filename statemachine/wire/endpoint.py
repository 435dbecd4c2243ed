"""A ZMQ peer's address as both sides write it: ``(ip, port)`` and its ``tcp://`` URL.

The decode's transport connects to prefill ranks, and the reference prefill rank connects back
to the decode's ack endpoint, through the same two definitions. Which addresses are acceptable
peers is the decode's rule (:mod:`statemachine.decode.ranks.endpoints`).
"""

from __future__ import annotations

__all__ = ["Endpoint", "endpoint_url"]

#: ``(ip, port)`` of a ZMQ peer.
Endpoint = tuple[str, int]


def endpoint_url(endpoint: Endpoint) -> str:
    """``tcp://ip:port``; an IPv6 literal is bracketed (``tcp://[::1]:80``)."""
    ip, port = endpoint
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
