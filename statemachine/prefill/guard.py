"""The bootstrap server's connection guard (HTTP-70..74): each connection's phase, and the table
of open connections that deadlines and evictions act on.

Every connection goes through a :class:`Guard` protocol wrapped around aiohttp's own, which
knows what the connection is doing (idle, sending headers, sending a body, being answered) and
since when. :class:`Connections` holds every open guard in two recency orders: the sweeper
closes connections that stay in one phase too long (header, body and idle deadlines), and at
the connection cap it picks the one to evict for a newcomer: a stalled one, else the least
recently active idle one, so neither a slowloris nor a fleet of keep-alive clients can lock
newcomers out. A guard answers a whole ``GET /health`` itself (through the server's
``answer_health``) when aiohttp holds nothing of the connection (HTTP-74).

No aiohttp import: a guard forwards to whatever protocol it wraps. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Protocol

from statemachine.wire.http import HEALTH_PATH

#: fds kept free under the process limit for everything that is not a client connection.
FD_RESERVE = 64
#: Most connections the default cap allows, whatever the fd limit: an idle aiohttp connection
#: costs the server process about 10 KB, so this bounds that memory near 300 MB.
MAX_CONNECTIONS_CEILING = 32_768
#: Seconds: a connection this young, or whose request started this recently, is never evicted
#: at the cap; one mid-request or silent since connecting for longer is stalled (a legitimate
#: client sends its request within milliseconds) (HTTP-71).
EVICT_GRACE = 0.1
#: Seconds an answered connection must have stayed idle before it may be evicted for a
#: newcomer (HTTP-71): a client asking more often keeps its connection, even while attackers
#: churn through the cap with connections younger than EVICT_GRACE, so that it is never the
#: only one old enough to close; one asking once a second is evictable half of its time.
IDLE_BEFORE_EVICTION = 0.5
#: Connections one eviction looks at before it gives up (see ``Connections.oldest_settled``).
EVICT_LOOKS = 64
#: Bytes of a request the guard keeps to tell, once aiohttp answered it, that it was exactly
#: one request (see ``Guard.settle``); a longer one leaves the connection to aiohttp.
MAX_HANDED = 16 * 1024
#: Longest ``GET /health`` the guard answers itself, far inside aiohttp's limits (8,190 bytes a
#: header line), so that it never answers a request aiohttp would refuse.
MAX_HEALTH_REQUEST = 4096


class AnsweredRequest(Protocol):
    """What :meth:`Guard.settle` reads of a request aiohttp answered (``web.Request``)."""

    @property
    def keep_alive(self) -> bool: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content_length(self) -> int | None: ...


#: What a connection is doing; each phase has its own deadline (HTTP-70).
IDLE, HEADERS, BODY, BUSY = 0, 1, 2, 3

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
#: One whole ``GET /health`` HTTP/1.1 request the guard answers itself (HTTP-74): at most 63
#: well-formed header lines of printable ASCII, none that frames or encodes a body, asks for
#: something (``Expect``, ``Upgrade``), closes the connection, or that aiohttp refuses
#: (``Sec-WebSocket-Key1``); of ``Connection`` only ``keep-alive`` (what requests and SGLang's
#: decode send), which HTTP/1.1 means anyway. See ``is_plain_health_request``.
_HEALTH_REQUEST = re.compile(
    b"GET "
    + re.escape(HEALTH_PATH.encode("ascii"))
    + rb" HTTP/1\.1\r\n(?:(?!(?:content-length|content-encoding|transfer-encoding|expect"
    + rb"|upgrade|connection|sec-websocket-key1):)"
    + _TOKEN
    + rb":[\t\x20-\x7e]*\r\n|connection:[\t ]*keep-alive[\t ]*\r\n){0,63}\r\n",
    re.IGNORECASE,
)


def is_plain_health_request(data: bytes) -> bool:
    """``data`` is one whole ``GET /health`` that aiohttp would answer 200 with the connection
    kept alive: ``_HEALTH_REQUEST``, short, with a ``Host`` header (HTTP/1.1 requires one) and
    no header twice (aiohttp refuses some twice; a client repeats none)."""
    if len(data) > MAX_HEALTH_REQUEST or _HEALTH_REQUEST.fullmatch(data) is None:
        return False
    names = [line.partition(b":")[0].lower() for line in data[:-4].split(b"\r\n")[1:]]
    return b"host" in names and len(set(names)) == len(names)


def _one_header_block(raw: bytes) -> bool:
    """``raw`` ends with the first and only blank line, every line ends in CRLF, and no bare
    CR or LF hides a second one: it holds one request's headers, however a parser reads it."""
    return (
        raw.endswith(b"\r\n\r\n")
        and raw.count(b"\r\n\r\n") == 1
        and raw.count(b"\r") == raw.count(b"\n") == raw.count(b"\r\n")
    )


class Guard(asyncio.Protocol):
    """Wraps aiohttp's per-connection protocol to know each connection's phase and its start.

    The transport talks to this object; every call is forwarded to aiohttp's handler, with
    extra steps on ``data_received``: the first byte after an idle spell starts the header
    clock, and a whole ``GET /health`` that arrives while aiohttp holds nothing of this
    connection is answered through ``owner.answer_health`` (HTTP-74). The server's middleware
    moves it on too (headers parsed -> ``BODY``; body read -> ``BUSY``; answered -> ``IDLE``);
    each move that restarts ``since`` goes through ``owner.progress``, which keeps its recency
    order for eviction. Loop thread only.
    """

    __slots__ = (
        "born",
        "handed",
        "inner",
        "owner",
        "paused",
        "phase",
        "served",
        "since",
        "sock",
        "transport",
    )

    def __init__(
        self, owner: Connections, inner: asyncio.Protocol, sock: socket.socket | None = None
    ) -> None:
        self.owner = owner
        self.inner = inner
        self.sock = sock  # the accepted socket (its transport owns it): peeked at eviction
        self.phase = IDLE
        self.since = self.born = 0.0
        # Completed a request: once idle it is evicted by recency, not as stalled (HTTP-71).
        self.served = False
        self.transport: asyncio.Transport | None = None
        # The bytes handed to aiohttp since it last held nothing of this connection: b"" when
        # it holds nothing (every request it was handed is answered and no byte is left over),
        # None when that is no longer known (pipelined, too long, or a body cut short).
        self.handed: bytes | None = b""
        self.paused = False  # the transport's buffer is full: aiohttp may be mid-reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.since = self.born = self.owner.now()
        self.inner.connection_made(transport)
        self.owner.admit(self)

    def data_received(self, data: bytes) -> None:
        if self.phase == IDLE:
            if self.handed == b"" and not self.paused and self.owner.answer_health(self, data):
                return
            self.owner.progress(self, HEADERS)
        handed = self.handed
        if handed is not None:
            self.handed = handed + data if len(handed) + len(data) <= MAX_HANDED else None
        self.inner.data_received(data)

    def settle(self, request: AnsweredRequest) -> None:
        """aiohttp answered ``request``: if the bytes it was handed were exactly that request
        (one header block, then exactly its ``Content-Length`` of body, the connection kept
        alive), it holds nothing of this connection any more. Otherwise (pipelined requests, a
        chunked or unread body) it may, and the connection stays with aiohttp."""
        handed, self.handed = self.handed, None
        if not handed or not request.keep_alive or "Transfer-Encoding" in request.headers:
            return
        head = handed.find(b"\r\n\r\n") + 4
        body = len(handed) - head
        if head >= 4 and _one_header_block(handed[:head]) and body == (request.content_length or 0):
            self.handed = b""

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.release(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.paused = True
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.paused = False
        self.inner.resume_writing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def has_unread_bytes(self) -> bool:
        """Bytes of a next request already wait in the kernel (the loop has not read them yet):
        the client is active, whatever ``since`` says."""
        if self.sock is None:
            return False
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK))
        except OSError:  # nothing to read (BlockingIOError), or the connection broke
            return False


class Connections:
    """Every open connection's :class:`Guard`, and what the server counts of them.

    Each open connection is in exactly one of two dicts, each ordered by ``since`` (oldest
    first), so eviction looks at the fronts instead of scanning every connection: connected,
    mid-request or being answered (a stalled one is first there), or idle after answering a
    request (the least recently active is first there). ``timeouts`` maps a phase to its
    deadline in seconds (``BUSY`` has none); ``answer_health`` answers a whole ``GET /health``
    below aiohttp, or returns False to leave it to aiohttp. Loop thread only.
    """

    def __init__(
        self, timeouts: Mapping[int, float], answer_health: Callable[[Guard, bytes], bool]
    ) -> None:
        self.timeouts = dict(timeouts)
        self.answer_health = answer_health
        self._pending: OrderedDict[Guard, None] = OrderedDict()
        self._answered: OrderedDict[Guard, None] = OrderedDict()
        self.accepted = 0
        self.peak = 0
        #: closed by the sweeper (a phase deadline passed) / to make room at the cap
        self.timed_out = 0
        self.evicted = 0

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def open(self) -> int:
        return len(self._pending) + len(self._answered)

    def every(self) -> list[Guard]:
        return [*self._pending, *self._answered]

    def admit(self, guard: Guard) -> None:
        self._pending[guard] = None
        self.accepted += 1
        self.peak = max(self.peak, self.open())

    def progress(self, guard: Guard, phase: int) -> None:
        """``guard`` enters ``phase`` now: restart its clock and move it to the recent end of
        its recency order (one that never completed a request keeps its place by ``born``)."""
        guard.phase = phase
        guard.since = self.now()
        if guard not in self._pending and guard not in self._answered:
            return  # closed already (a deadline or an eviction): it stays out
        if not guard.served:
            return  # still in _pending, where it stays until its first answer
        self.release(guard)
        if phase == IDLE and guard.served:
            self._answered[guard] = None
        else:
            self._pending[guard] = None

    def release(self, guard: Guard) -> None:
        self._pending.pop(guard, None)
        self._answered.pop(guard, None)

    def victim(self) -> Guard | None:
        """The connection to close to make room, never one being answered (HTTP-71).

        First a stalled one: open for longer than EVICT_GRACE without completing its first
        request, or mid-request (headers or body) for that long after an answered one (a
        legitimate client sends its request within milliseconds), the oldest first. Else the
        least recently active idle one, whatever how many requests it made: a client that asks
        once a second has no better claim to a connection than a newcomer, and one that was
        closed reconnects on its next request. An idle one answered
        within the last IDLE_BEFORE_EVICTION is spared: closing it would swap one client in
        mid-conversation for another (its reconnect would evict the next), and under a churn
        of young attackers it would be the only one old enough to close; so while every
        connection is that busy, newcomers wait in the backlog instead. None when nothing may
        be closed now (the accept loop pauses instead).
        """
        now = self.now()
        return self.oldest_settled(self._pending, now - EVICT_GRACE) or self.oldest_settled(
            self._answered, now - IDLE_BEFORE_EVICTION
        )

    def evict(self, victim: Guard) -> None:
        self.evicted += 1
        victim.phase = BUSY  # closed once
        victim.close()
        self.release(victim)  # its fd is freed on the next loop iteration

    @staticmethod
    def oldest_settled(conns: OrderedDict[Guard, None], settled: float) -> Guard | None:
        """The first connection of ``conns`` that may be evicted, in their recency order: by
        ``born`` until a connection's first answer (a connection open for EVICT_GRACE without
        completing a request is stalled, whatever bytes it trickles), by ``since`` after.

        One whose next request already waits unread is passed over: on a busy loop that client
        is active though ``since`` is old, and closing it would fail the request it sent. At
        most EVICT_LOOKS are looked at: past that the server is behind on reading, and pausing
        accepts (the caller's fallback) is the right answer to overload.
        """
        for looked, guard in enumerate(conns):
            if (guard.since if guard.served else guard.born) > settled or looked >= EVICT_LOOKS:
                return None  # every later one is more recent still
            if guard.phase != BUSY and not guard.has_unread_bytes():
                return guard
        return None

    async def sweep(self) -> None:
        """Close connections that stayed in one phase past its deadline (HTTP-70)."""
        timeouts = self.timeouts
        tick = max(0.05, min(1.0, min(timeouts.values()) / 4))
        while True:
            await asyncio.sleep(tick)
            now = self.now()
            for guard in self.every():
                limit = timeouts.get(guard.phase)
                if limit is not None and now - guard.since > limit:
                    self.timed_out += 1
                    guard.phase = BUSY  # closed once
                    guard.close()

    def close_all(self) -> None:
        for guard in self.every():
            guard.close()


class RateLimitedLog:
    """At most one log line per ``interval`` per topic, saying how many events it stands for."""

    def __init__(self, log: logging.Logger, interval: float, clock: Callable[[], float]) -> None:
        self._log = log
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def warning(self, topic: str, message: str) -> None:
        count = self._count.get(topic, 0) + 1
        now = self._clock()
        last = self._last.get(topic)
        if last is not None and now - last < self._interval:
            self._count[topic] = count
            return
        self._last[topic] = now
        self._count[topic] = 0
        if count > 1:
            self._log.warning("%s (%d more since the last such line)", message, count - 1)
        else:
            self._log.warning("%s", message)


def default_max_connections() -> int:
    """The connection cap: the fd limit less a reserve for everything else, in
    16..MAX_CONNECTIONS_CEILING."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    return max(16, min(MAX_CONNECTIONS_CEILING, soft - FD_RESERVE))


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft fd limit to its hard limit; ``(before, after)``.

    Distributions start processes at a soft limit of 1,024 with a far higher hard limit; the
    connection cap follows the soft limit, so without this a fleet of 1,100 decode ranks
    would not fit. Where the kernel refuses the hard value (macOS caps it at OPEN_MAX, and an
    unlimited hard limit is not a valid soft one), the limit stays as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, hard
