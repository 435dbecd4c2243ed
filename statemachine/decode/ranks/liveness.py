"""The rule that turns one socket's ZMQ monitor events into *dead* / *alive* (ZMQ-16).

Pure bookkeeping, no sockets and no clock of its own (the caller passes ``now``), so the rule
is tested event by event; :mod:`statemachine.decode.ranks.monitor` feeds it from real monitor
sockets. A ``PUSH`` socket is connected to exactly one endpoint, so all of its events are
about that endpoint.

A disconnect is evidence, not proof: libzmq reconnects by itself, and a peer whose connection
dropped and came straight back is alive. The endpoint is judged **dead** when

* a connection attempt failed while no connection was up — libzmq closed the attempt's file
  descriptor (``EVENT_CLOSED``: refused, unreachable, or ``CONNECT_TIMEOUT``), after a
  disconnect or before the first connection ever came up; or
* a handshake failed (``EVENT_HANDSHAKE_FAILED_*``: something that is not a ZMQ peer of ours
  listens there); or
* it was disconnected and no handshake succeeded within ``grace_s`` (a peer host that went
  away answers no attempt at all); or
* a send found no live connection within ``SNDTIMEO`` (:meth:`Liveness.send_failed`) while no
  connection was up.

It is **alive** whenever a handshake succeeds (``EVENT_HANDSHAKE_SUCCEEDED``): ``ALIVE`` is
returned for every handshake (they are rare: one per connection), and the caller reports a
change only if it had reported the endpoint dead.

On loopback, a SIGKILLed peer's kernel closes its sockets: ``EVENT_DISCONNECTED`` arrives in
about 1 ms, the first reconnect attempt follows ``RECONNECT_IVL`` later and is refused at once,
so with ``RECONNECT_IVL=5`` ms the verdict comes about 6 ms after the kill.
"""

from __future__ import annotations

import zmq

#: The events the rule reads (the monitor subscribes to these only).
EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_MONITOR_STOPPED
)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

DEAD = False
ALIVE = True

#: The verdicts of a connection *attempt* that failed while no connection was up
#: (``EVENT_CLOSED``): on loopback and a LAN that is a refusal — nothing listens there, the
#: process exited — but libzmq gives no errno, and an attempt that timed out
#: (``CONNECT_TIMEOUT`` into a cut path) or met an unreachable route reports the same event.
#: The transport asks the kernel itself before it calls such a verdict an exit (ZMQ-26).
RECONNECT_REFUSED = "disconnected, reconnect refused"
CONNECT_REFUSED = "connect refused"
ATTEMPT_FAILED = frozenset({RECONNECT_REFUSED, CONNECT_REFUSED})


class Liveness:
    """Verdict state of one endpoint. ``dead_reason`` is ``None`` unless it is judged dead."""

    __slots__ = ("connected", "dead_reason", "disconnected_at", "ever_connected", "grace_s")

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.connected = False
        self.ever_connected = False
        self.disconnected_at: float | None = None
        self.dead_reason: str | None = None

    def on_event(self, event: int, now: float) -> bool | None:
        """Apply one monitor event: ``ALIVE`` on a handshake, ``DEAD`` when judged dead."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            self.ever_connected = True
            self.disconnected_at = None
            self.dead_reason = None
            return ALIVE
        if event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            if self.disconnected_at is None:
                self.disconnected_at = now
            return None
        if event == zmq.EVENT_CLOSED and not self.connected:
            if self.ever_connected:
                return self._die(RECONNECT_REFUSED)
            return self._die(CONNECT_REFUSED)
        if event & _HANDSHAKE_FAILED:
            self.connected = False
            return self._die("handshake failed: not a ZMQ peer of this protocol")
        return None

    def send_failed(self, reason: str) -> bool | None:
        """A send found no live connection in time: dead unless a connection is up by now.

        ``ALIVE`` if one is up (it came up meanwhile, or the peer is slow, not dead): the
        sender's provisional mark is lifted. ``None`` if it was already judged dead.
        """
        if self.connected:
            return ALIVE
        return self._die(reason)

    def deadline(self) -> float | None:
        """When :meth:`tick` may next give a verdict (``None``: not waiting for one)."""
        if self.disconnected_at is None or self.dead_reason is not None:
            return None
        return self.disconnected_at + self.grace_s

    def tick(self, now: float) -> bool | None:
        """Disconnected for ``grace_s`` without a new handshake: dead."""
        deadline = self.deadline()
        if deadline is not None and now >= deadline:
            return self._die(f"disconnected, not reconnected within {self.grace_s * 1000:.0f} ms")
        return None

    def _die(self, reason: str) -> bool | None:
        if self.dead_reason is not None:
            if reason in ATTEMPT_FAILED and self.dead_reason not in ATTEMPT_FAILED:
                # Judged silent, and now an attempt failed: maybe the silent process exited
                # (a stopped rank killed). Told again so the transport can ask (ZMQ-26).
                self.dead_reason = reason
                return DEAD
            return None
        self.dead_reason = reason
        return DEAD
