"""The reference prefill-side bootstrap server (aiohttp), wire-compatible with SGLang's routes.

Runs its own event loop in a background thread, so tests, benchmarks and the demo can start a
real server on 127.0.0.1 with one call. State is in memory only: a restart forgets every rank
and gets a new ``X-Bootstrap-Instance-Id``, which is how decode tells a restarted prefill
behind a stable address from the old one (HTTP-50). Routes and status codes: spec/protocol.md.

This module is the application: the server's lifecycle, its accept loop, the middleware and the
routes. What the routes store and how a body is checked is the registry's
(:mod:`statemachine.prefill.registry`): bad input never crashes a handler, every body and
parameter is checked and rejected with a 4xx (HTTP-60..66); the generated-junk tests in
``tests/integration/test_server.py`` hold this. How each connection is watched is the guard's
(:mod:`statemachine.prefill.guard`, HTTP-70..74). ``pd-bootstrap serve`` is
:mod:`statemachine.prefill.serve`.

Standing under attack (HTTP-70..74): the accept loop here applies the connection cap to each
accept (at the cap a new connection evicts a stalled one, else the least recently active idle
one, instead of being refused); the fd limit is raised to the hard limit at start; accept
failures (fd exhaustion) are logged as one rate-limited line. A whole ``GET /health`` is
answered below aiohttp when aiohttp holds nothing of the connection (HTTP-74): a fleet of
decode ranks probing once a second costs a fraction of the CPU aiohttp would spend on it.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import hmac
import logging
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from statemachine.errors import BadRequest, MissingExtra
from statemachine.prefill.guard import (
    BODY,
    BUSY,
    HEADERS,
    IDLE,
    Connections,
    Guard,
    RateLimitedLog,
    default_max_connections,
    is_plain_health_request,
    raise_fd_limit,
)
from statemachine.prefill.registry import (
    DEFAULT_DP_TTL,
    DEFAULT_MAX_DP_ENTRIES,
    Registry,
    int_field,
    load_json_object,
    rank_params,
)
from statemachine.validation import INT64_MAX, MAX_PARALLEL_SIZE, is_int
from statemachine.wire.http import (
    DP_RANKS_KEY,
    HEALTH_PATH,
    INSTANCE_HEADER,
    QUERY_DP_RANKS_PATH,
    ROUTE_PATH,
)

try:
    from aiohttp import web
    from aiohttp.http import SERVER_SOFTWARE
except ModuleNotFoundError as exc:  # the `server` extra is not installed: say which to install
    raise MissingExtra("server", "the bootstrap server", exc.name or "aiohttp") from exc

DEFAULT_MAX_BODY = 64 * 1024
#: Seconds a connection may take from its first byte to the end of a request's headers.
DEFAULT_HEADER_TIMEOUT = 5.0
#: Seconds a request may take to deliver its body once its headers arrived.
DEFAULT_BODY_TIMEOUT = 10.0
#: Seconds a keep-alive connection may stay silent between requests.
DEFAULT_IDLE_TIMEOUT = 60.0
#: Seconds between two log lines about the connection cap or failed accepts.
LOG_INTERVAL = 10.0
#: Connections accepted per readiness event of the listening socket.
ACCEPT_BATCH = 16
#: Seconds accepting pauses after an accept failed for lack of fds, or at the cap with
#: nothing to evict (HTTP-71/72).
ACCEPT_PAUSE = 0.05
#: Seconds of aiohttp's own keep-alive timer. It cannot see the ``GET /health`` requests the
#: guard answers itself (HTTP-74), so at any shorter value it would close a connection that
#: only probes health as idle; the sweeper's ``idle_timeout`` is what closes idle connections.
AIOHTTP_KEEPALIVE = 86_400.0
#: The ``GET /health`` reply's body and content type, as the aiohttp handler sends them.
HEALTH_TEXT = "OK"
HEALTH_CONTENT_TYPE = "text/plain; charset=utf-8"

_log = logging.getLogger(__name__)

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

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


def _guard_of(request: web.Request) -> Guard | None:
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    return guard if isinstance(guard, Guard) else None


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
    (:func:`~statemachine.prefill.guard.raise_fd_limit`; ``fd_limit`` holds before and after)
    and logs it at INFO.
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
        self._registry = Registry(
            dp_ttl=self._dp_ttl, max_dp_entries=self._max_dp_entries, clock=self._clock
        )
        self._connections = Connections(self._timeouts, self._answer_health)
        self._starting = 0  # accepted, transport not made yet
        self._accept_failures = 0
        self._requests: dict[str, int] = {}
        self._health_reply = (-1, b"")  # (the second of its Date, the reply), see _answer_health
        self._ratelog = RateLimitedLog(_log, LOG_INTERVAL, time.monotonic)

    @property
    def address(self) -> str:
        """``"host:port"`` as a client dials it."""
        return f"{self.host}:{self.port}"

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
        self._connections.close_all()

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
        self._sweeper = loop.create_task(self._connections.sweep())

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
                victim = self._connections.victim()
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
                self._connections.evict(victim)
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
            await loop.connect_accepted_socket(
                lambda: Guard(self._connections, handlers(), conn), sock=conn
            )
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
        victim = self._connections.victim()
        if victim is not None:
            self._connections.evict(victim)
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
        return self._connections.open()

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
        connections = self._connections
        return ServerStats(
            connections_accepted=connections.accepted,
            connections_open=connections.open(),
            connections_peak=connections.peak,
            requests=dict(self._requests),
            connections_timed_out=connections.timed_out,
            connections_evicted=connections.evicted,
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
            self._connections.progress(guard, BODY)
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
                self._connections.progress(guard, IDLE)

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
        return load_json_object(raw)

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
        self._registry.register(await self._json_body(request))
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.StreamResponse:
        dp, cp, tp, pp = rank_params(request.query)
        pinned = self._registry.pinned
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
        room = int_field(body, "bootstrap_room", 0, INT64_MAX)
        dp_rank = int_field(body, "dp_rank", 0, MAX_PARALLEL_SIZE - 1)
        self._registry.remember_dp_rank(room, dp_rank)
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        rooms = body.get(DP_RANKS_KEY)
        if not isinstance(rooms, list) or not all(is_int(r) and 0 <= r <= INT64_MAX for r in rooms):
            raise BadRequest(f"{DP_RANKS_KEY!r} must be a list of ints in 0..2**63-1")
        return web.json_response(self._registry.dp_ranks(rooms))

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=HEALTH_TEXT)

    def _answer_health(self, guard: Guard, data: bytes) -> bool:
        """Answer ``data`` below aiohttp if it is one whole ``GET /health`` (HTTP-74), with the
        reply aiohttp's route gives, counted and timed as the middleware does; False leaves it
        to aiohttp. About an eighth of aiohttp's server CPU per probe (19 µs against 143–160 µs
        at 10,000 probing clients, docs/performance.md (f′)): what a fleet of thousands of
        decode ranks probing once a second costs the server.
        The caller checked that aiohttp holds nothing of the connection (so this reply cannot
        overtake one of its own), and that it is not paused mid-reply.
        """
        transport = guard.transport
        if transport is None or transport.is_closing() or not is_plain_health_request(data):
            return False
        self._requests[_HEALTH_LABEL] = self._requests.get(_HEALTH_LABEL, 0) + 1
        guard.served = True
        self._connections.progress(guard, IDLE)
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
