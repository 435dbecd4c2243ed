"""The reference prefill-side bootstrap server (aiohttp), wire-compatible with SGLang's routes.

Runs its own event loop in a background thread, so tests, benchmarks and the demo can start a
real server on 127.0.0.1 with one call. State is in memory only: a restart forgets every rank
and gets a new ``X-Bootstrap-Instance-Id``, which is how decode tells a restarted prefill
behind a stable address from the old one (HTTP-50). Routes and status codes: spec/protocol.md.

Bad input never crashes a handler: every body and parameter is checked and rejected with a
4xx (HTTP-60..66); the generated-junk tests in ``tests/test_server.py`` hold this.

Standing under attack (HTTP-70..74): every connection goes through a :class:`_Guard` protocol
wrapped around aiohttp's own, which knows what the connection is doing (idle, sending headers,
sending a body, being answered) and since when. A sweeper closes connections that stay in one
phase too long (header, body and idle deadlines); at the connection cap a new connection
evicts a stalled one, else the least recently active idle one, instead of being refused, so
neither a slowloris nor a fleet of keep-alive clients can lock newcomers out; the fd limit is
raised to the hard limit at start; accept failures (fd exhaustion) are logged as one
rate-limited line. The guard answers a whole ``GET /health`` itself when aiohttp holds nothing
of the connection (HTTP-74): a fleet of decode ranks probing once a second costs a fraction of
the CPU aiohttp would spend on it.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import hmac
import json
import logging
import re
import resource
import secrets
import signal
import socket
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from statemachine import cli_help
from statemachine.errors import MissingExtra
from statemachine.progname import prog
from statemachine.validation import (
    INT64_MAX,
    MAX_LABEL,
    MAX_LAYOUT_BYTES,
    MAX_PAGE_SIZE,
    MAX_PARALLEL_SIZE,
    MAX_WORLD,
    TOPOLOGY_KEYS,
    TopologyClaim,
    bounded_extra,
    is_int,
    is_valid_port,
    json_size,
    rank_ip_problem,
)
from statemachine.wire.http import (
    DP_RANKS_KEY,
    HEALTH_PATH,
    INSTANCE_HEADER,
    QUERY_DP_RANKS_PATH,
    RANK_PARAMS,
    ROUTE_PATH,
)

try:
    from aiohttp import web
    from aiohttp.http import SERVER_SOFTWARE
    from multidict import MultiMapping
except ModuleNotFoundError as exc:  # the `server` extra is not installed: say which to install
    raise MissingExtra("server", "the bootstrap server", exc.name or "aiohttp") from exc

DEFAULT_MAX_BODY = 64 * 1024
DEFAULT_DP_TTL = 120.0
#: Hard cap on remembered room -> dp rank entries, on top of the TTL.
DEFAULT_MAX_DP_ENTRIES = 100_000
#: Seconds a connection may take from its first byte to the end of a request's headers.
DEFAULT_HEADER_TIMEOUT = 5.0
#: Seconds a request may take to deliver its body once its headers arrived.
DEFAULT_BODY_TIMEOUT = 10.0
#: Seconds a keep-alive connection may stay silent between requests.
DEFAULT_IDLE_TIMEOUT = 60.0
#: fds kept free under the process limit for everything that is not a client connection.
FD_RESERVE = 64
#: Most connections the default cap allows, whatever the fd limit: an idle aiohttp connection
#: costs the server process about 10 KB, so this bounds that memory near 300 MB.
MAX_CONNECTIONS_CEILING = 32_768
#: Topologies claimed by registrations before one is complete (HTTP-54).
MAX_CANDIDATES = 4
#: SGLang's default ``load_balance_method``; it means ``follow_bootstrap_room`` is true.
FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"
#: SGLang's default ``decode_allocation_policy``, taken when a registration has none.
EARLY_ALLOCATION = "early"
#: Seconds between two log lines about the connection cap or failed accepts.
LOG_INTERVAL = 10.0
#: Connections accepted per readiness event of the listening socket.
ACCEPT_BATCH = 16
#: Seconds accepting pauses after an accept failed for lack of fds, or at the cap with
#: nothing to evict (HTTP-71/72).
ACCEPT_PAUSE = 0.05
#: Seconds: a connection this young, or whose request started this recently, is never evicted
#: at the cap; one mid-request or silent since connecting for longer is stalled (a legitimate
#: client sends its request within milliseconds) (HTTP-71).
EVICT_GRACE = 0.1
#: Seconds an answered connection must have stayed idle before it may be evicted for a
#: newcomer (HTTP-71): a client asking more often keeps its connection, even while attackers
#: churn through the cap with connections younger than EVICT_GRACE, so that it is never the
#: only one old enough to close; one asking once a second is evictable half of its time.
IDLE_BEFORE_EVICTION = 0.5
#: Connections one eviction looks at before it gives up (see ``_oldest_settled``).
EVICT_LOOKS = 64
#: Seconds of aiohttp's own keep-alive timer. It cannot see the ``GET /health`` requests the
#: guard answers itself (HTTP-74), so at any shorter value it would close a connection that
#: only probes health as idle; the sweeper's ``idle_timeout`` is what closes idle connections.
AIOHTTP_KEEPALIVE = 86_400.0
#: Bytes of a request the guard keeps to tell, once aiohttp answered it, that it was exactly
#: one request (see ``_Guard.settled``); a longer one leaves the connection to aiohttp.
MAX_HANDED = 16 * 1024
#: Longest ``GET /health`` the guard answers itself, far inside aiohttp's limits (8,190 bytes a
#: header line), so that it never answers a request aiohttp would refuse.
MAX_HEALTH_REQUEST = 4096
#: The ``GET /health`` reply's body and content type, as the aiohttp handler sends them.
HEALTH_TEXT = "OK"
HEALTH_CONTENT_TYPE = "text/plain; charset=utf-8"

_log = logging.getLogger(__name__)

# Optional sign, at most 18 digits: fits an int64, and never feeds int() a huge string.
_INT_PARAM = re.compile(r"-?[0-9]{1,18}", re.ASCII)
# Route labels for the request counters; anything else is counted as "other" (bounded dict).
_ROUTE_LABELS = frozenset(
    f"{m} {p}"
    for m, p in (
        ("PUT", ROUTE_PATH),
        ("GET", ROUTE_PATH),
        ("POST", "/register_dp_rank"),
        ("POST", QUERY_DP_RANKS_PATH),
        ("GET", HEALTH_PATH),
    )
)
_HEALTH_LABEL = f"GET {HEALTH_PATH}"
#: Registration keys this server interprets (reference §1 and §7); any other key is carried
#: through to the topology reply, bounded. ``follow_bootstrap_room`` is read by nobody: SGLang
#: derives it from ``load_balance_method`` and never sends it.
REGISTRATION_KEYS = frozenset(
    (
        "attn_tp_size",
        "attn_tp_rank",
        "attn_cp_size",
        "attn_cp_rank",
        "attn_dp_size",
        "attn_dp_rank",
        "pp_size",
        "pp_rank",
        "system_dp_size",
        "system_dp_rank",
        "rank_ip",
        "rank_port",
        "page_size",
        "kv_cache_dtype",
        "load_balance_method",
        "enable_dsa_cache_layer_split",
        "prefill_http_port",
        "decode_allocation_policy",
        "dsv41_spec_layout",
        "follow_bootstrap_room",
        "kv_layout",
        "enable_kv_cache_sharding",
    )
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequest(Exception):
    """A request body or parameter failed validation: answered 400 with this message."""


class _ClientGone(Exception):
    """The connection closed while its body was read (deadline, eviction or the client)."""


@dataclass(frozen=True, slots=True)
class ServerStats:
    """Counters since the last ``start()`` (a consistent snapshot taken on the loop)."""

    connections_accepted: int
    connections_open: int
    connections_peak: int
    requests: Mapping[str, int]
    #: connections closed by the server: a phase deadline passed, or evicted at the cap
    connections_timed_out: int = 0
    connections_evicted: int = 0
    #: accept() calls that failed for lack of fds or memory (logged rate-limited)
    accept_failures: int = 0


@dataclass(frozen=True, slots=True)
class _Info:
    """What the topology reply says besides the claim, taken from a topology's first
    registration as SGLang does. Of these only the allocation policy and the DSpark layout
    are compared between ranks (HTTP-59), as SGLang 0.5.23 compares them."""

    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool
    prefill_http_port: int | None
    decode_allocation_policy: str
    dsv41_spec_layout: dict[str, Any] | None
    kv_layout: str | None
    enable_kv_cache_sharding: bool
    extra: dict[str, Any]


@dataclass(slots=True)
class _Topology:
    """One claimed topology and the ranks registered under it (HTTP-54)."""

    claim: TopologyClaim
    info: _Info
    ranks: dict[tuple[int, int, int, int], tuple[str, int]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.claim.world

    def as_reply(self) -> dict[str, object]:
        claim, info = self.claim, self.info
        reply: dict[str, object] = dict(info.extra)
        reply.update(claim.claim_items())
        reply.update(
            follow_bootstrap_room=info.follow_bootstrap_room,
            enable_dsa_cache_layer_split=info.enable_dsa_cache_layer_split,
            prefill_http_port=info.prefill_http_port,
            decode_allocation_policy=info.decode_allocation_policy,
            enable_kv_cache_sharding=info.enable_kv_cache_sharding,
        )
        # SGLang sends these two only when set.
        if info.dsv41_spec_layout is not None:
            reply["dsv41_spec_layout"] = info.dsv41_spec_layout
        if info.kv_layout is not None:
            reply["kv_layout"] = info.kv_layout
        return reply


# --- body validation --------------------------------------------------------------------------


def _load_json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # bad UTF-8 is a ValueError too
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("body must be a JSON object")
    return value


def _int_field(obj: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = obj.get(key)
    if type(value) is int and low <= value <= high:
        return value
    raise BadRequest(f"{key!r} must be an int in {low}..{high}")


#: How a 400 names the JSON type an optional field must have.
_JSON_KINDS = {int: "an integer", str: "a string", bool: "true or false", dict: "a JSON object"}


def _optional(
    obj: Mapping[str, Any], key: str, kind: type, check: Callable[[Any], bool], limits: str = ""
) -> Any:
    """``obj[key]``: absent or null, or a ``kind`` that passes ``check`` (``limits`` says how,
    for the 400). ``true``/``false`` are not integers here, although Python's bool is an int."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or not check(value):
        shown = json.dumps(value)
        if len(shown) > 40:
            shown = f"{shown[:37]}..."
        raise BadRequest(
            f"{key!r} must be null or {_JSON_KINDS.get(kind, kind.__name__)}{limits}, not "
            f"{shown}: correct this field of the rank's registration and register again"
        )
    return value


def _size_and_rank(obj: Mapping[str, Any], size_key: str, rank_key: str) -> tuple[int, int]:
    size = _int_field(obj, size_key, 1, MAX_PARALLEL_SIZE)
    return size, _int_field(obj, rank_key, 0, size - 1)


def _layout(value: Any) -> bool:
    return json_size(value) <= MAX_LAYOUT_BYTES


def parse_registration(
    obj: Mapping[str, Any],
) -> tuple[tuple[int, int, int, int], tuple[str, int], TopologyClaim, _Info]:
    """Check a ``PUT /route`` body: (rank key, (ip, port), the topology it claims, the rest)."""
    tp_size, tp_rank = _size_and_rank(obj, "attn_tp_size", "attn_tp_rank")
    cp_size, cp_rank = _size_and_rank(obj, "attn_cp_size", "attn_cp_rank")
    attn_dp_size, attn_dp_rank = _size_and_rank(obj, "attn_dp_size", "attn_dp_rank")
    pp_size, pp_rank = _size_and_rank(obj, "pp_size", "pp_rank")
    system_dp_size, system_dp_rank = _size_and_rank(obj, "system_dp_size", "system_dp_rank")
    rank_ip = obj.get("rank_ip")
    problem = rank_ip_problem(rank_ip)
    if problem is not None:
        raise BadRequest(f"'rank_ip' {problem}")
    rank_port = obj.get("rank_port")
    if not is_valid_port(rank_port):
        raise BadRequest("'rank_port' must be an int in 1..65535")
    # As in SGLang: with one system dp group the attention dp rank names the group.
    dp_size, dp_rank = (
        (attn_dp_size, attn_dp_rank) if system_dp_size == 1 else (system_dp_size, system_dp_rank)
    )
    claim = TopologyClaim(
        attn_tp_size=tp_size,
        attn_cp_size=cp_size,
        dp_size=dp_size,
        pp_size=pp_size,
        page_size=_optional(
            obj, "page_size", int, lambda v: 1 <= v <= MAX_PAGE_SIZE, f" in 1..{MAX_PAGE_SIZE}"
        ),
        kv_cache_dtype=_optional(obj, "kv_cache_dtype", str, lambda v: len(v) <= MAX_LABEL),
    )
    if claim.world > MAX_WORLD:
        raise BadRequest(f"a topology of {claim.world} ranks is more than {MAX_WORLD}")
    method = _optional(obj, "load_balance_method", str, lambda v: len(v) <= MAX_LABEL)
    info = _Info(
        # SGLang: follow_bootstrap_room = (load_balance_method == "follow_bootstrap_room"),
        # and a registration without the key means the default method.
        follow_bootstrap_room=(method or FOLLOW_BOOTSTRAP_ROOM) == FOLLOW_BOOTSTRAP_ROOM,
        # Absent or null means SGLang's default for the four below, as its server reads them
        # (an SGLang decode compares the policy with its own, so null would fail every request).
        enable_dsa_cache_layer_split=bool(
            _optional(obj, "enable_dsa_cache_layer_split", bool, lambda v: True)
        ),
        prefill_http_port=_optional(obj, "prefill_http_port", int, is_valid_port, " in 1..65535"),
        decode_allocation_policy=_optional(
            obj, "decode_allocation_policy", str, lambda v: len(v) <= MAX_LABEL
        )
        or EARLY_ALLOCATION,
        dsv41_spec_layout=_optional(obj, "dsv41_spec_layout", dict, _layout),
        kv_layout=_optional(obj, "kv_layout", str, lambda v: len(v) <= MAX_LABEL),
        enable_kv_cache_sharding=bool(
            _optional(obj, "enable_kv_cache_sharding", bool, lambda v: True)
        ),
        extra=bounded_extra(obj, REGISTRATION_KEYS | TOPOLOGY_KEYS),
    )
    return (dp_rank, cp_rank, tp_rank, pp_rank), (rank_ip, rank_port), claim, info  # type: ignore[return-value]


def _rank_params(query: MultiMapping[str]) -> list[int]:
    """The four ``GET /route`` parameters, each present once and an integer (HTTP-12)."""
    values = []
    for name in RANK_PARAMS:
        found = query.getall(name, [])
        if len(found) != 1 or _INT_PARAM.fullmatch(found[0]) is None:
            raise BadRequest(f"parameter {name!r} must be given once, as an integer")
        values.append(int(found[0]))
    return values


# --- connection guard -------------------------------------------------------------------------

#: What a connection is doing; each phase has its own deadline (HTTP-70).
IDLE, HEADERS, BODY, BUSY = 0, 1, 2, 3

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
#: One whole ``GET /health`` HTTP/1.1 request the guard answers itself (HTTP-74): at most 63
#: well-formed header lines of printable ASCII, none that frames or encodes a body, asks for
#: something (``Expect``, ``Upgrade``), closes the connection, or that aiohttp refuses
#: (``Sec-WebSocket-Key1``); of ``Connection`` only ``keep-alive`` (what requests and SGLang's
#: decode send), which HTTP/1.1 means anyway. See ``_is_plain_health_request``.
_HEALTH_REQUEST = re.compile(
    b"GET "
    + re.escape(HEALTH_PATH.encode("ascii"))
    + rb" HTTP/1\.1\r\n(?:(?!(?:content-length|content-encoding|transfer-encoding|expect"
    + rb"|upgrade|connection|sec-websocket-key1):)"
    + _TOKEN
    + rb":[\t\x20-\x7e]*\r\n|connection:[\t ]*keep-alive[\t ]*\r\n){0,63}\r\n",
    re.IGNORECASE,
)


def _is_plain_health_request(data: bytes) -> bool:
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


class _Guard(asyncio.Protocol):
    """Wraps aiohttp's per-connection protocol to know each connection's phase and its start.

    The transport talks to this object; every call is forwarded to aiohttp's handler, with
    extra steps on ``data_received``: the first byte after an idle spell starts the header
    clock, and a whole ``GET /health`` that arrives while aiohttp holds nothing of this
    connection is answered here (HTTP-74). The server's middleware moves it on too (headers
    parsed -> ``BODY``; body read -> ``BUSY``; answered -> ``IDLE``); each move that restarts
    ``since`` goes through the server's ``_progress``, which keeps its recency order for
    eviction. Loop thread only.
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
        self, owner: BootstrapServer, inner: asyncio.Protocol, sock: socket.socket | None = None
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
        self.since = self.born = self.owner._now()
        self.inner.connection_made(transport)
        self.owner._admit(self)

    def data_received(self, data: bytes) -> None:
        if self.phase == IDLE:
            if self.handed == b"" and not self.paused and self.owner._answer_health(self, data):
                return
            self.owner._progress(self, HEADERS)
        handed = self.handed
        if handed is not None:
            self.handed = handed + data if len(handed) + len(data) <= MAX_HANDED else None
        self.inner.data_received(data)

    def settle(self, request: web.Request) -> None:
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
        self.owner._release(self)
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


def _guard_of(request: web.Request) -> _Guard | None:
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    return guard if isinstance(guard, _Guard) else None


class _RateLimitedLog:
    """At most one log line per ``interval`` per topic, saying how many events it stands for."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
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
            _log.warning("%s (%d more since the last such line)", message, count - 1)
        else:
            _log.warning("%s", message)


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


# --- the server -------------------------------------------------------------------------------


class BootstrapServer:
    """A bootstrap server on ``host:port`` in a background thread. ``port=0`` picks a free port
    on the first ``start()``; later starts of the same object bind that port again.

    ``token`` guards the registration routes (``Authorization: Bearer <token>``). Without a
    token they answer 401 (fail closed, with a warning at construction) unless
    ``insecure=True`` (HTTP-53). ``clock`` is the time source for dp-rank expiry (tests pass a
    fake one). ``header_timeout``, ``body_timeout``, ``idle_timeout`` and ``max_connections``
    (default: the fd limit less 64, up to 32,768) bound what a client can hold (HTTP-70..72).
    ``start()`` first raises the process's soft fd limit to its hard limit
    (:func:`raise_fd_limit`; ``fd_limit`` holds before and after) and logs it at INFO.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        insecure: bool = False,
        dp_ttl: float = DEFAULT_DP_TTL,
        max_body: int = DEFAULT_MAX_BODY,
        max_dp_entries: int = DEFAULT_MAX_DP_ENTRIES,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_connections: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if token is not None:
            if not isinstance(token, str) or not token:
                raise ValueError("token must be a non-empty str (or None)")
            if token != token.strip() or not token.isprintable() or not token.isascii():
                # HTTP strips header whitespace, so such a token could never authenticate.
                raise ValueError(
                    "token has leading/trailing whitespace or non-printable characters: "
                    "no Authorization header could ever match it"
                )
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not dp_ttl > 0 or not max_body > 0 or not max_dp_entries > 0:
            raise ValueError("dp_ttl, max_body and max_dp_entries must be positive")
        if not min(header_timeout, body_timeout, idle_timeout) > 0:
            raise ValueError("header_timeout, body_timeout and idle_timeout must be positive")
        if max_connections is not None and (
            type(max_connections) is not int or max_connections < 1
        ):
            raise ValueError("max_connections must be an int >= 1 (or None)")
        if token is None and not insecure:
            warnings.warn(
                "BootstrapServer without a token: every registration (PUT /route, "
                "POST /register_dp_rank) will be answered 401; pass token=... "
                "(or insecure=True on a trusted network)",
                RuntimeWarning,
                stacklevel=2,
            )
        self.host = host
        self._wanted_port = port
        self._token = token.encode() if token is not None else None
        self._insecure = insecure
        self._dp_ttl = dp_ttl
        self._max_body = max_body
        self._max_dp_entries = max_dp_entries
        self._timeouts = {IDLE: idle_timeout, HEADERS: header_timeout, BODY: body_timeout}
        self._wanted_connections = max_connections
        self._max_connections = max_connections or 0
        self.fd_limit = (0, 0)
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._listener: socket.socket | None = None
        self._handlers: web.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.port = 0
        self.instance_id = ""
        self._reset_state()

    def _reset_state(self) -> None:
        # Everything below lives on the event loop thread once started.
        self._pinned: _Topology | None = None
        self._candidates: dict[TopologyClaim, _Topology] = {}
        self._dp_ranks: OrderedDict[int, tuple[int, float]] = OrderedDict()
        # Every open connection is in exactly one of these, each ordered by ``since`` (oldest
        # first), so eviction looks at the fronts instead of scanning every connection:
        # connected, mid-request or being answered (a stalled one is first here) ...
        self._pending: OrderedDict[_Guard, None] = OrderedDict()
        # ... or idle after answering a request (the least recently active is first here).
        self._answered: OrderedDict[_Guard, None] = OrderedDict()
        self._starting = 0  # accepted, transport not made yet
        self._accepted = 0
        self._peak = 0
        self._timed_out = 0
        self._evicted = 0
        self._accept_failures = 0
        self._requests: dict[str, int] = {}
        self._health_reply = (-1, b"")  # (the second of its Date, the reply), see _answer_health
        self._ratelog = _RateLimitedLog(LOG_INTERVAL, time.monotonic)

    @property
    def address(self) -> str:
        """``"host:port"`` as a client dials it."""
        return f"{self.host}:{self.port}"

    def _now(self) -> float:
        return time.monotonic()

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> BootstrapServer:
        """Bind and serve; return once the socket listens. A new instance id each time."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._reset_state()
        self.fd_limit = raise_fd_limit()
        self._max_connections = self._wanted_connections or default_max_connections()
        self.instance_id = secrets.token_hex(16)
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, failure), name=f"bootstrap-server-{id(self):x}"
        )
        self._thread.daemon = True
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError("bootstrap server did not start in time")
        if failure:
            self._thread.join(timeout)
            self._thread = None
            raise failure[0]
        # A restart of this object keeps its address (a stable endpoint for its clients).
        self._wanted_port = self.port
        _log.info("bootstrap server listening on %s: %s", self.address, self.limits())
        return self

    @property
    def max_connections(self) -> int:
        """The connection cap in force (HTTP-71); 0 before the first ``start()``."""
        return self._max_connections

    def limits(self) -> str:
        """The fd limit (raised or not) and the connection cap, in words, for a log line."""
        before, after = self.fd_limit
        if after > before:
            fds = f"fd limit raised from {before:,} to the hard limit {after:,}"
        else:
            fds = f"fd limit {after:,} (the hard limit, or not raisable)"
        return f"{fds}; at most {self._max_connections:,} connections at once"

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection and the listening socket; idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        future.result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = self._loop = self._runner = self._listener = self._sweeper = None

    async def _shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        listener = self._listener
        if listener is not None:
            asyncio.get_running_loop().remove_reader(listener.fileno())
            listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
        for guard in [*self._pending, *self._answered]:
            guard.close()

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self._on_loop_error)
        try:
            loop.run_until_complete(self._serve())
            self._loop = loop
        except BaseException as exc:  # reported to start(), e.g. address in use
            failure.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=self._max_body, middlewares=[self._middleware])
        app.on_response_prepare.append(self._stamp)
        app.router.add_put(ROUTE_PATH, self._put_route, expect_handler=self._expect_auth)
        app.router.add_get(ROUTE_PATH, self._get_route)
        app.router.add_post(
            "/register_dp_rank", self._register_dp_rank, expect_handler=self._expect_auth
        )
        app.router.add_post(QUERY_DP_RANKS_PATH, self._query_dp_ranks, expect_handler=self._expect)
        app.router.add_get(HEALTH_PATH, self._health)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            # Our sweeper closes idle connections (and counts them).
            keepalive_timeout=AIOHTTP_KEEPALIVE,
            max_headers=64,
            lingering_time=min(1.0, self._timeouts[BODY]),
        )
        await runner.setup()
        handlers = runner.server
        assert handlers is not None
        self._handlers = handlers
        try:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.create_server(
                (self.host, self._wanted_port), family=family, backlog=1024
            )
        except BaseException:
            await runner.cleanup()
            raise
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        self._runner = runner
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        loop.add_reader(listener.fileno(), self._on_accept)
        self._sweeper = loop.create_task(self._sweep())

    # --- connections ---------------------------------------------------------------------------

    def _on_accept(self) -> None:
        """Accept a few connections per readiness event, each only after making room.

        Our own accept loop rather than asyncio's ``create_server``: asyncio accepts up to
        ``backlog`` connections per event before any protocol sees one (so a burst passes any
        cap), and on EMFILE it keeps looping, logging a traceback and scheduling a retry per
        failed accept (41,352 of them in 12 s in the issue). Here the cap is applied to each
        accept: at the cap a victim is chosen first and closed only once a newcomer was
        accepted (the FD_RESERVE under the fd limit holds that one extra fd for a moment), so
        an empty backlog costs no connection. A failed accept evicts one, logs one
        rate-limited line and pauses accepting for ``ACCEPT_PAUSE`` seconds.
        """
        listener = self._listener
        loop = self._loop_or_running()
        if listener is None:
            return
        for _ in range(ACCEPT_BATCH):
            victim = None
            if self._open() + self._starting >= self._max_connections:
                victim = self._victim()
                if victim is None:
                    # Every connection is being answered, starting or active within
                    # EVICT_GRACE: wait a moment (the backlog holds the newcomers) rather
                    # than pass the cap.
                    self._pause_accepting(loop, listener, ACCEPT_PAUSE)
                    return
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._accept_failed(exc, loop, listener)
                return
            if victim is not None:
                self._evict(victim)
                self._ratelog.warning(
                    "cap",
                    f"bootstrap server at its cap of {self._max_connections} connections: "
                    "closed a stalled or the least recently active one to admit a new one "
                    "(raise the fd limit's hard value or max_connections if these are "
                    "legitimate clients)",
                )
            conn.setblocking(False)
            self._starting += 1
            loop.create_task(self._start_connection(conn))

    async def _start_connection(self, conn: socket.socket) -> None:
        handlers = self._handlers
        assert handlers is not None
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(lambda: _Guard(self, handlers(), conn), sock=conn)
        except OSError:
            conn.close()  # the client went away before its transport existed
        finally:
            self._starting -= 1

    def _accept_failed(
        self, exc: OSError, loop: asyncio.AbstractEventLoop, listener: socket.socket
    ) -> None:
        self._accept_failures += 1
        self._ratelog.warning(
            "accept",
            f"bootstrap server cannot accept a connection: {exc.strerror} "
            f"({self._open()} open, cap {self._max_connections}); closing a stalled or idle one "
            f"and pausing accepts for {ACCEPT_PAUSE:g} s (raise the fd limit or lower "
            "max_connections)",
        )
        victim = self._victim()
        if victim is not None:
            self._evict(victim)
        self._pause_accepting(loop, listener, ACCEPT_PAUSE)

    def _pause_accepting(
        self, loop: asyncio.AbstractEventLoop, listener: socket.socket, seconds: float
    ) -> None:
        loop.remove_reader(listener.fileno())

        def resume() -> None:
            if self._listener is listener:
                loop.add_reader(listener.fileno(), self._on_accept)

        loop.call_later(seconds, resume)

    def _loop_or_running(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def _open(self) -> int:
        return len(self._pending) + len(self._answered)

    def _victim(self) -> _Guard | None:
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
        now = self._now()
        return self._oldest_settled(self._pending, now - EVICT_GRACE) or self._oldest_settled(
            self._answered, now - IDLE_BEFORE_EVICTION
        )

    def _evict(self, victim: _Guard) -> None:
        self._evicted += 1
        victim.phase = BUSY  # closed once
        victim.close()
        self._release(victim)  # its fd is freed on the next loop iteration

    @staticmethod
    def _oldest_settled(conns: OrderedDict[_Guard, None], settled: float) -> _Guard | None:
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

    def _admit(self, guard: _Guard) -> None:
        self._pending[guard] = None
        self._accepted += 1
        self._peak = max(self._peak, self._open())

    def _progress(self, guard: _Guard, phase: int) -> None:
        """``guard`` enters ``phase`` now: restart its clock and move it to the recent end of
        its recency order (one that never completed a request keeps its place by ``born``)."""
        guard.phase = phase
        guard.since = self._now()
        if guard not in self._pending and guard not in self._answered:
            return  # closed already (a deadline or an eviction): it stays out
        if not guard.served:
            return  # still in _pending, where it stays until its first answer
        self._release(guard)
        if phase == IDLE and guard.served:
            self._answered[guard] = None
        else:
            self._pending[guard] = None

    def _release(self, guard: _Guard) -> None:
        self._pending.pop(guard, None)
        self._answered.pop(guard, None)

    async def _sweep(self) -> None:
        """Close connections that stayed in one phase past its deadline (HTTP-70)."""
        timeouts = self._timeouts
        tick = max(0.05, min(1.0, min(timeouts.values()) / 4))
        while True:
            await asyncio.sleep(tick)
            now = self._now()
            for guard in [*self._pending, *self._answered]:
                limit = timeouts.get(guard.phase)
                if limit is not None and now - guard.since > limit:
                    self._timed_out += 1
                    guard.phase = BUSY  # closed once
                    guard.close()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Loop errors as one rate-limited line each, never a traceback per accept (HTTP-72)."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (
            errno.EMFILE,
            errno.ENFILE,
            errno.ENOBUFS,
            errno.ENOMEM,
        ):
            self._accept_failures += 1
            self._ratelog.warning(
                "accept",
                f"bootstrap server cannot accept connections: {exc.strerror} "
                f"({self._open()} open, cap {self._max_connections}); asyncio retries in "
                "1 s (raise the fd limit or lower max_connections)",
            )
            return
        self._ratelog.warning(
            "loop", f"bootstrap server event loop: {context.get('message')}: {exc!r}"
        )

    def stats(self, timeout: float = 5.0) -> ServerStats:
        """Connection and request counters, snapshotted on the loop thread."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return self._snapshot()

        async def snap() -> ServerStats:
            return self._snapshot()

        return asyncio.run_coroutine_threadsafe(snap(), loop).result(timeout)

    def _snapshot(self) -> ServerStats:
        return ServerStats(
            connections_accepted=self._accepted,
            connections_open=self._open(),
            connections_peak=self._peak,
            requests=dict(self._requests),
            connections_timed_out=self._timed_out,
            connections_evicted=self._evicted,
            accept_failures=self._accept_failures,
        )

    # --- middleware ----------------------------------------------------------------------------

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[INSTANCE_HEADER] = self.instance_id

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        label = f"{request.method} {request.path}"
        if label not in _ROUTE_LABELS:
            label = "other"
        self._requests[label] = self._requests.get(label, 0) + 1
        guard = _guard_of(request)
        if guard is not None:
            self._progress(guard, BODY)
        try:
            return await handler(request)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except _ClientGone:
            # Nobody to answer; a reply keeps aiohttp from logging a traceback per closed body.
            return web.json_response({"error": "request body not received in time"}, status=408)
        finally:
            if guard is not None:
                guard.served = True
                guard.settle(request)
                self._progress(guard, IDLE)

    def _authorised(self, request: web.Request) -> bool:
        """Bearer token check in constant time; no token configured -> closed unless insecure."""
        if self._token is None:
            return self._insecure
        header = request.headers.get("Authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # Header text may hold any code point: compare bytes (compare_digest rejects non-ASCII
        # str), with surrogateescape so undecodable bytes cannot raise.
        return hmac.compare_digest(
            credentials.strip().encode("utf-8", "surrogateescape"), self._token
        )

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        # read() raises HTTPRequestEntityTooLarge (413) past client_max_size.
        try:
            raw = await request.read()
        except ConnectionError:
            raise _ClientGone from None
        except RuntimeError:
            # aiohttp raises RuntimeError("Connection closed.") when the transport was closed
            # (deadline or eviction) before the read began.
            transport = request.transport
            if transport is None or transport.is_closing():
                raise _ClientGone from None
            raise
        guard = _guard_of(request)
        if guard is not None:
            guard.phase = BUSY
        return _load_json_object(raw)

    def _unauthorised(self) -> web.Response:
        if self._token is None:
            # Not the rank's fault: no token would do. Say so, or its owner hunts a typo.
            reason = (
                "this bootstrap server has no token configured, so it accepts no registration: "
                "restart it with --token TOKEN (the token the prefill ranks send), or with "
                "--insecure on a trusted network"
            )
        else:
            reason = (
                "missing or wrong bearer token: start the prefill rank with the token this "
                "bootstrap server was started with (--token)"
            )
        return web.json_response(
            {"error": reason},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: answer 100 only for a body this server will read (HTTP-73).

        A body past ``max_body`` gets its 413 before it is sent; so does a registration
        without the token its 401 (``_expect_auth``). The connection is then closed, as the
        client may send the body anyway.
        """
        if request.headers.get("Expect", "").lower() != "100-continue":
            return self._early(
                web.json_response({"error": "only 'Expect: 100-continue' is known"}, status=417)
            )
        length = request.content_length
        if length is not None and length > self._max_body:
            error = f"body of {length} bytes is larger than {self._max_body}"
            return self._early(web.json_response({"error": error}, status=413))
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        return None

    async def _expect_auth(self, request: web.Request) -> web.StreamResponse | None:
        if not self._authorised(request):
            return self._early(self._unauthorised())
        return await self._expect(request)

    @staticmethod
    def _early(response: web.StreamResponse) -> web.StreamResponse:
        response.force_close()
        return response

    # --- routes --------------------------------------------------------------------------------

    async def _put_route(self, request: web.Request) -> web.StreamResponse:
        if not self._authorised(request):
            return self._unauthorised()
        key, endpoint, claim, info = parse_registration(await self._json_body(request))
        self._check_consistent(info)
        pinned = self._pinned
        if pinned is not None:
            if claim != pinned.claim:
                # The topology is pinned once complete; a rank disagreeing with it is
                # misconfigured (HTTP-51).
                raise BadRequest(
                    f"registration claims {claim.describe()} but the registered topology is "
                    f"{pinned.claim.describe()}: start this rank with the registered "
                    "settings, or restart the bootstrap server to register a new topology"
                )
            # Last writer wins for ports: a restarted rank re-registers its new port (HTTP-52).
            pinned.ranks[key] = endpoint
            return web.Response(text="OK")
        self._register_candidate(key, endpoint, claim, info)
        return web.Response(text="OK")

    def _check_consistent(self, info: _Info) -> None:
        """HTTP-59: every rank of a prefill registers one allocation policy and one DSpark
        layout; a rank that differs from those already registered is refused, changing nothing.

        As SGLang 0.5.23 does. Every kept registration passed this check, so any one of them
        (the pinned topology or a candidate) holds the values of record.
        """
        held = self._pinned or next(iter(self._candidates.values()), None)
        if held is None:
            return
        record = held.info
        if info.dsv41_spec_layout != record.dsv41_spec_layout:
            raise BadRequest(
                "dsv41_spec_layout differs from the one the registered ranks sent: start every "
                "prefill rank with the same model and speculative-decoding settings"
            )
        if info.decode_allocation_policy != record.decode_allocation_policy:
            raise BadRequest(
                f"decode_allocation_policy {info.decode_allocation_policy!r} differs from the "
                f"registered ranks' {record.decode_allocation_policy!r}: start every prefill "
                "rank with the same --disaggregation-decode-allocation-policy"
            )

    def _register_candidate(
        self,
        key: tuple[int, int, int, int],
        endpoint: tuple[str, int],
        claim: TopologyClaim,
        info: _Info,
    ) -> None:
        """Before any topology is complete, keep registrations per claimed topology (HTTP-54).

        The first claimed topology to have every one of its ranks registered is pinned and the
        others are dropped, so one bogus first registration cannot block the real topology.
        Bounded: at most MAX_CANDIDATES claims and MAX_WORLD ranks in all; past either bound
        the claim with the fewest ranks (the oldest of those) is dropped first.
        """
        candidates = self._candidates
        candidate = candidates.get(claim)
        if candidate is None:
            candidate = _Topology(claim, info)
            while len(candidates) >= MAX_CANDIDATES:
                self._drop_smallest_candidate()
            candidates[claim] = candidate
        if key not in candidate.ranks:
            while sum(len(c.ranks) for c in candidates.values()) >= MAX_WORLD:
                self._drop_smallest_candidate(keep=claim)
        candidate.ranks[key] = endpoint
        if candidate.complete:
            self._pinned = candidate
            others = [c for c in candidates.values() if c is not candidate]
            candidates.clear()
            if others:
                _log.warning(
                    "bootstrap topology pinned: %s; dropped %d registration(s) claiming "
                    "other topologies: %s",
                    claim.describe(),
                    sum(len(c.ranks) for c in others),
                    "; ".join(c.claim.describe() for c in others),
                )

    def _drop_smallest_candidate(self, keep: TopologyClaim | None = None) -> None:
        others = [c for c in self._candidates.values() if c.claim != keep]
        smallest = min(others, key=lambda c: len(c.ranks))  # min() keeps the oldest on ties
        del self._candidates[smallest.claim]
        _log.warning(
            "bootstrap server dropped %d registration(s) claiming %s: too many conflicting "
            "topologies claimed before one was complete",
            len(smallest.ranks),
            smallest.claim.describe(),
        )

    async def _get_route(self, request: web.Request) -> web.StreamResponse:
        dp, cp, tp, pp = _rank_params(request.query)
        pinned = self._pinned
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            if pinned is None:
                return web.json_response({"error": "not every rank registered"}, status=503)
            return web.json_response(pinned.as_reply())
        if min(dp, cp, tp, pp) < 0:
            raise BadRequest("ranks must be >= 0 (or all -1 for the topology)")
        if pinned is None:
            return web.json_response({"error": "not every rank registered"}, status=503)
        claim = pinned.claim
        if (
            dp >= claim.dp_size
            or cp >= claim.attn_cp_size
            or tp >= claim.attn_tp_size
            or pp >= claim.pp_size
        ):
            # Name the sizes: a dp rank past the prefill's dp size is the usual cause.
            return web.json_response(
                {
                    "error": f"no rank dp={dp} cp={cp} tp={tp} pp={pp} in this prefill of "
                    f"dp_size {claim.dp_size}, cp_size {claim.attn_cp_size}, tp_size "
                    f"{claim.attn_tp_size}, pp_size {claim.pp_size} (ranks count from 0)"
                },
                status=404,
            )
        ip, port = pinned.ranks[(dp, cp, tp, pp)]
        return web.json_response({"rank_ip": ip, "rank_port": port})

    async def _register_dp_rank(self, request: web.Request) -> web.StreamResponse:
        if not self._authorised(request):
            return self._unauthorised()
        body = await self._json_body(request)
        room = _int_field(body, "bootstrap_room", 0, INT64_MAX)
        dp_rank = _int_field(body, "dp_rank", 0, MAX_PARALLEL_SIZE - 1)
        now = self._clock()
        self._expire(now)
        entries = self._dp_ranks
        entries[room] = (dp_rank, now + self._dp_ttl)
        entries.move_to_end(room)  # keeps the dict ordered by expiry (constant TTL)
        while len(entries) > self._max_dp_entries:
            entries.popitem(last=False)
        return web.Response(text="OK")

    def _expire(self, now: float) -> None:
        entries = self._dp_ranks
        while entries:
            room, (_, expires) = next(iter(entries.items()))
            if expires > now:
                break
            del entries[room]

    async def _query_dp_ranks(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        rooms = body.get(DP_RANKS_KEY)
        if not isinstance(rooms, list) or not all(is_int(r) and 0 <= r <= INT64_MAX for r in rooms):
            raise BadRequest(f"{DP_RANKS_KEY!r} must be a list of ints in 0..2**63-1")
        now = self._clock()
        self._expire(now)
        found: dict[str, int] = {}
        for room in rooms:
            entry = self._dp_ranks.get(room)
            if entry is not None and entry[1] > now:
                found[str(room)] = entry[0]
        return web.json_response(found)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=HEALTH_TEXT)

    def _answer_health(self, guard: _Guard, data: bytes) -> bool:
        """Answer ``data`` below aiohttp if it is one whole ``GET /health`` (HTTP-74), with the
        reply aiohttp's route gives, counted and timed as the middleware does; False leaves it
        to aiohttp. About an eighth of aiohttp's server CPU per probe (19 µs against 143–160 µs
        at 10,000 probing clients, docs/performance.md (f′)): what a fleet of thousands of
        decode ranks probing once a second costs the server.
        The caller checked that aiohttp holds nothing of the connection (so this reply cannot
        overtake one of its own), and that it is not paused mid-reply.
        """
        transport = guard.transport
        if transport is None or transport.is_closing() or not _is_plain_health_request(data):
            return False
        self._requests[_HEALTH_LABEL] = self._requests.get(_HEALTH_LABEL, 0) + 1
        guard.served = True
        self._progress(guard, IDLE)
        second = int(time.time())
        if self._health_reply[0] != second:  # the Date header changes once a second
            head = (
                f"HTTP/1.1 200 OK\r\nContent-Type: {HEALTH_CONTENT_TYPE}\r\n"
                f"Content-Length: {len(HEALTH_TEXT)}\r\n"
                f"Date: {email.utils.formatdate(second, usegmt=True)}\r\n"
                f"Server: {SERVER_SOFTWARE}\r\n{INSTANCE_HEADER}: {self.instance_id}\r\n\r\n"
            )
            self._health_reply = (second, (head + HEALTH_TEXT).encode("ascii"))
        transport.write(self._health_reply[1])
        return True


# --- CLI --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m statemachine serve``: serve until SIGINT/SIGTERM, then exit 0."""
    parser = cli_help.parser(
        prog("serve"),
        "Run the reference prefill bootstrap server (SGLang's routes) until Ctrl-C or SIGTERM.\n\n"
        "Prefill ranks register with PUT /route (python -m statemachine.prefill.rank starts\n"
        "one); decodes ask GET /route. Prints 'listening on HOST:PORT instance ID' once it\n"
        "listens, and on stderr its fd limit (raised to the hard limit) and connection cap.\n"
        "State is in memory only: a restart forgets every rank. Needs the server\n"
        "extra (aiohttp).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8998, help="port to listen on; 0 picks one")
    parser.add_argument(
        "--token", default=None, help="bearer token the ranks must send to register"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="with no --token, accept registrations without one (otherwise they get 401)",
    )
    parser.add_argument(
        "--dp-ttl", type=float, default=DEFAULT_DP_TTL, help="seconds a room's dp rank is kept"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.token is None and not args.insecure:
        print(
            "warning: no --token: registration routes answer 401; pass --token TOKEN (and the "
            "same token to every prefill rank), or --insecure on a trusted network",
            file=sys.stderr,
        )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the CLI printed its own warning
            server = BootstrapServer(
                args.host, args.port, token=args.token, insecure=args.insecure, dp_ttl=args.dp_ttl
            )
        server.start()
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        # One parseable line, so a parent process started with --port 0 learns the port.
        print(f"listening on {server.address} instance {server.instance_id}", flush=True)
        # On stderr: the line above is what parents parse.
        print(f"bootstrap server: {server.limits()}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
