"""The reference prefill-side bootstrap server (aiohttp), wire-compatible with SGLang's routes.

Runs its own event loop in a background thread, so tests, benchmarks and the demo can start a
real server on 127.0.0.1 with one call. State is in memory only: a restart forgets every rank
and gets a new ``X-Bootstrap-Instance-Id``, which is how decode tells a restarted prefill
behind a stable address from the old one (HTTP-50). Routes and status codes: spec/protocol.md.

Bad input never crashes a handler: every body and parameter is checked and rejected with a
4xx (HTTP-60..66); the generated-junk tests in ``tests/test_server.py`` hold this.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import re
import secrets
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from statemachine.errors import MissingExtra
from statemachine.progname import prog
from statemachine.validation import is_int, is_valid_host, is_valid_port

try:
    from aiohttp import web
    from multidict import MultiMapping
except ModuleNotFoundError as exc:  # the `server` extra is not installed: say which to install
    raise MissingExtra("server", "the bootstrap server", exc.name or "aiohttp") from exc

INSTANCE_HEADER = "X-Bootstrap-Instance-Id"
DEFAULT_MAX_BODY = 64 * 1024
DEFAULT_DP_TTL = 120.0
#: Hard cap on remembered room -> dp rank entries, on top of the TTL.
DEFAULT_MAX_DP_ENTRIES = 100_000

_RANK_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
# Optional sign, at most 18 digits: fits an int64, and never feeds int() a huge string.
_INT_PARAM = re.compile(r"-?[0-9]{1,18}", re.ASCII)
# Route labels for the request counters; anything else is counted as "other" (bounded dict).
_ROUTE_LABELS = frozenset(
    f"{m} {p}"
    for m, p in (
        ("PUT", "/route"),
        ("GET", "/route"),
        ("POST", "/register_dp_rank"),
        ("POST", "/query_dp_ranks"),
        ("GET", "/health"),
    )
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequest(Exception):
    """A request body or parameter failed validation: answered 400 with this message."""


@dataclass(frozen=True, slots=True)
class ServerStats:
    """Counters since the last ``start()`` (a consistent snapshot taken on the loop)."""

    connections_accepted: int
    connections_open: int
    connections_peak: int
    requests: Mapping[str, int]


@dataclass(slots=True)
class _TopologyState:
    """First-writer-wins topology of the prefill (HTTP-51)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool | None

    @property
    def world(self) -> int:
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    def as_reply(self) -> dict[str, object]:
        return {
            "attn_tp_size": self.attn_tp_size,
            "attn_cp_size": self.attn_cp_size,
            "dp_size": self.dp_size,
            "pp_size": self.pp_size,
            "page_size": self.page_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "follow_bootstrap_room": self.follow_bootstrap_room,
        }


# --- body validation --------------------------------------------------------------------------


def _load_json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # bad UTF-8 is a ValueError too
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("body must be a JSON object")
    return value


def _int_field(obj: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int:
    value = obj.get(key)
    if type(value) is int and value >= low and (high is None or value <= high):
        return value
    bound = f"{low}..{high}" if high is not None else f">= {low}"
    raise BadRequest(f"{key!r} must be an int {bound}")


def _optional(obj: Mapping[str, Any], key: str, kind: type, check: Callable[[Any], bool]) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or not check(value):
        raise BadRequest(f"{key!r} has a bad value")
    return value


def parse_registration(
    obj: Mapping[str, Any],
) -> tuple[tuple[int, int, int, int], tuple[str, int], _TopologyState]:
    """Check a ``PUT /route`` body: (rank key, (ip, port), the topology it claims)."""
    tp_size = _int_field(obj, "attn_tp_size", 1)
    tp_rank = _int_field(obj, "attn_tp_rank", 0, tp_size - 1)
    cp_size = _int_field(obj, "attn_cp_size", 1)
    cp_rank = _int_field(obj, "attn_cp_rank", 0, cp_size - 1)
    attn_dp_size = _int_field(obj, "attn_dp_size", 1)
    attn_dp_rank = _int_field(obj, "attn_dp_rank", 0, attn_dp_size - 1)
    pp_size = _int_field(obj, "pp_size", 1)
    pp_rank = _int_field(obj, "pp_rank", 0, pp_size - 1)
    system_dp_size = _int_field(obj, "system_dp_size", 1)
    system_dp_rank = _int_field(obj, "system_dp_rank", 0, system_dp_size - 1)
    rank_ip = obj.get("rank_ip")
    if not isinstance(rank_ip, str) or not is_valid_host(rank_ip):
        raise BadRequest("'rank_ip' must be an IP literal or a host name")
    rank_port = obj.get("rank_port")
    if not is_valid_port(rank_port):
        raise BadRequest("'rank_port' must be an int in 1..65535")
    # As in SGLang: with one system dp group the attention dp rank names the group.
    dp_size, dp_rank = (
        (attn_dp_size, attn_dp_rank) if system_dp_size == 1 else (system_dp_size, system_dp_rank)
    )
    topology = _TopologyState(
        attn_tp_size=tp_size,
        attn_cp_size=cp_size,
        dp_size=dp_size,
        pp_size=pp_size,
        page_size=_optional(obj, "page_size", int, lambda v: v >= 1),
        kv_cache_dtype=_optional(obj, "kv_cache_dtype", str, lambda v: len(v) <= 64),
        follow_bootstrap_room=_optional(obj, "follow_bootstrap_room", bool, lambda v: True),
    )
    return (dp_rank, cp_rank, tp_rank, pp_rank), (rank_ip, rank_port), topology  # type: ignore[return-value]


def _rank_params(query: MultiMapping[str]) -> list[int]:
    """The four ``GET /route`` parameters, each present once and an integer (HTTP-12)."""
    values = []
    for name in _RANK_PARAMS:
        found = query.getall(name, [])
        if len(found) != 1 or _INT_PARAM.fullmatch(found[0]) is None:
            raise BadRequest(f"parameter {name!r} must be given once, as an integer")
        values.append(int(found[0]))
    return values


# --- the server -------------------------------------------------------------------------------


class BootstrapServer:
    """A bootstrap server on ``host:port`` in a background thread. ``port=0`` picks a free port.

    ``token`` guards the registration routes (``Authorization: Bearer <token>``). Without a
    token they answer 401 (fail closed) unless ``insecure=True`` (HTTP-53). ``clock`` is the
    time source for dp-rank expiry (tests pass a fake one).
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty str (or None)")
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not dp_ttl > 0 or not max_body > 0 or not max_dp_entries > 0:
            raise ValueError("dp_ttl, max_body and max_dp_entries must be positive")
        self.host = host
        self._wanted_port = port
        self._token = token.encode() if token is not None else None
        self._insecure = insecure
        self._dp_ttl = dp_ttl
        self._max_body = max_body
        self._max_dp_entries = max_dp_entries
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.instance_id = ""
        self._reset_state()

    def _reset_state(self) -> None:
        # Everything below lives on the event loop thread once started.
        self._topology: _TopologyState | None = None
        self._ranks: dict[tuple[int, int, int, int], dict[str, object]] = {}
        self._dp_ranks: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self._accepted = 0
        self._open = 0
        self._peak = 0
        self._requests: dict[str, int] = {}

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
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection and the listening socket; idempotent."""
        thread, loop, runner = self._thread, self._loop, self._runner
        if thread is None or loop is None:
            return
        if runner is not None:
            future = asyncio.run_coroutine_threadsafe(runner.cleanup(), loop)
            future.result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = self._loop = self._runner = None

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
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
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        self._count_connections(runner)
        site = web.TCPSite(runner, self.host, self._wanted_port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    def _count_connections(self, runner: web.AppRunner) -> None:
        """Count connections where aiohttp's Server learns of them (HTTP-55).

        ``web.Server.connection_made/connection_lost`` are called by every connection's
        protocol, exactly once each; aiohttp offers no signal for them, so wrap the instance's
        methods. Runs on the loop thread only, so plain ints need no lock.
        """
        server = runner.server
        assert server is not None
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            self._accepted += 1
            self._open += 1
            self._peak = max(self._peak, self._open)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._open -= 1
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def stats(self, timeout: float = 5.0) -> ServerStats:
        """Connection and request counters, snapshotted on the loop thread."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return self._snapshot()

        async def snap() -> ServerStats:
            return self._snapshot()

        return asyncio.run_coroutine_threadsafe(snap(), loop).result(timeout)

    def _snapshot(self) -> ServerStats:
        return ServerStats(self._accepted, self._open, self._peak, dict(self._requests))

    # --- middleware ----------------------------------------------------------------------------

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[INSTANCE_HEADER] = self.instance_id

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        label = f"{request.method} {request.path}"
        if label not in _ROUTE_LABELS:
            label = "other"
        self._requests[label] = self._requests.get(label, 0) + 1
        try:
            return await handler(request)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)

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
        return _load_json_object(await request.read())

    @staticmethod
    def _unauthorised() -> web.Response:
        return web.json_response(
            {"error": "missing or wrong bearer token"},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    # --- routes --------------------------------------------------------------------------------

    async def _put_route(self, request: web.Request) -> web.StreamResponse:
        if not self._authorised(request):
            return self._unauthorised()
        key, (ip, port), claimed = parse_registration(await self._json_body(request))
        topology = self._topology
        if topology is None:
            self._topology = topology = claimed
        elif claimed != topology:
            # First writer wins; a rank disagreeing with it is misconfigured (HTTP-51).
            raise BadRequest("registration conflicts with the registered topology")
        # Last writer wins for ports: a restarted rank re-registers its new port (HTTP-52).
        self._ranks[key] = {"rank_ip": ip, "rank_port": port}
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.StreamResponse:
        dp, cp, tp, pp = _rank_params(request.query)
        topology = self._topology
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            if topology is None or len(self._ranks) < topology.world:
                return web.json_response({"error": "not every rank registered"}, status=503)
            return web.json_response(topology.as_reply())
        if min(dp, cp, tp, pp) < 0:
            raise BadRequest("ranks must be >= 0 (or all -1 for the topology)")
        if topology is not None and (
            dp >= topology.dp_size
            or cp >= topology.attn_cp_size
            or tp >= topology.attn_tp_size
            or pp >= topology.pp_size
        ):
            return web.json_response({"error": "no such rank"}, status=404)
        if topology is None or len(self._ranks) < topology.world:
            return web.json_response({"error": "not every rank registered"}, status=503)
        return web.json_response(self._ranks[(dp, cp, tp, pp)])

    async def _register_dp_rank(self, request: web.Request) -> web.StreamResponse:
        if not self._authorised(request):
            return self._unauthorised()
        body = await self._json_body(request)
        room = _int_field(body, "bootstrap_room", 0, 2**63 - 1)
        dp_rank = _int_field(body, "dp_rank", 0, 2**31 - 1)
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
        rooms = body.get("bootstrap_rooms")
        if not isinstance(rooms, list) or not all(is_int(r) for r in rooms):
            raise BadRequest("'bootstrap_rooms' must be a list of ints")
        now = self._clock()
        self._expire(now)
        found: dict[str, int] = {}
        for room in rooms:
            entry = self._dp_ranks.get(room)
            if entry is not None and entry[1] > now:
                found[str(room)] = entry[0]
        return web.json_response(found)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="OK")


# --- CLI --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m statemachine serve``: serve until SIGINT/SIGTERM, then exit 0."""
    parser = argparse.ArgumentParser(prog=prog("serve"), description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8998, help="0 picks a free port")
    parser.add_argument("--token", default=None, help="bearer token for registration routes")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="with no --token, accept registrations without one (otherwise they get 401)",
    )
    parser.add_argument("--dp-ttl", type=float, default=DEFAULT_DP_TTL, help="seconds")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.token is None and not args.insecure:
        print("warning: no --token: registration routes answer 401", file=sys.stderr)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
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
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
