"""Whether a rank's process has exited: a TCP connect to its endpoint is *refused* (ZMQ-26).

The socket monitor (ZMQ-16) tells a failed connection attempt (``EVENT_CLOSED``) from a live
connection, but not why the attempt failed: refused (the port's kernel answered with a reset:
nothing listens there, the process is gone), timed out (``CONNECT_TIMEOUT`` into a cut path),
or unreachable (a route that went away) all look alike, and libzmq passes no errno. Only the
first proves the process can no longer write a room's KV pages; the others are silence (a
stopped or cut-off process may come back and write). So when the monitor reports a failed
attempt, the transport asks the kernel once more, with a plain non-blocking connect whose errno
it reads: ``ECONNREFUSED`` is proof, anything else (connected, no answer within the timeout,
unreachable) is not.

A connect that succeeds is closed at once; the rank's ZMQ socket sees a connection that ends
before its greeting, which libzmq drops without a word.
"""

from __future__ import annotations

import errno
import select
import socket

from statemachine.decode.ranks.liveness import ATTEMPT_FAILED
from statemachine.wire.endpoint import Endpoint

__all__ = ["EXIT_PROBE_TIMEOUT_S", "connect_refused", "proves_exit"]

#: How long the probe waits for the kernel's answer. A refusal takes one round trip (well under
#: a millisecond on loopback and in a data centre); a path that answers nothing within this is
#: silence, and the probe must not hold the monitor thread long (it runs there, once per dead
#: verdict of a failed attempt).
EXIT_PROBE_TIMEOUT_S = 0.05


def connect_refused(endpoint: Endpoint, timeout_s: float = EXIT_PROBE_TIMEOUT_S) -> bool:
    """True when a TCP connect to ``endpoint`` is refused within ``timeout_s``."""
    host, port = endpoint
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return False  # no socket to ask with (fd limit): no proof
    with probe:
        probe.setblocking(False)
        code = probe.connect_ex((host, port))
        if code in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            poller = select.poll()
            poller.register(probe, select.POLLOUT)
            if not poller.poll(int(timeout_s * 1000)):
                return False  # no answer: silence, not proof
            code = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        return code == errno.ECONNREFUSED


def proves_exit(reason: str, endpoint: Endpoint) -> bool:
    """Whether a dead verdict for ``reason`` is the rank's process exiting (ZMQ-26): only a
    failed connection attempt can be, and only if a connect to its port is refused now."""
    return reason in ATTEMPT_FAILED and connect_refused(endpoint)
