"""One HTTP exchange, bounded by a wall-clock deadline, and the words for how it failed.

Shared by every HTTP caller of the package: the decode's bootstrap client
(:mod:`statemachine.decode.client`, HTTP-35), the prefill rank's registrar
(:mod:`statemachine.prefill.registration`) and the etcd gateway
(:mod:`statemachine.discovery.gateway`). The deadline is the one mechanism of
:mod:`statemachine.call_deadline`: urllib3's ``Timeout`` (public) bounds the connect and each
read, and an :class:`~statemachine.call_deadline.Exchange` whose socket the watchdog shuts down
bounds the whole exchange, whatever the peer trickles. What this module adds is the plumbing
that hands each exchange its socket, and the wording of every failure (:func:`transport_reason`,
:func:`cause_chain`), so that all callers fail alike.

urllib3's public API gives the socket only after a request went out (``HTTPConnection.sock``,
read in the public ``request()``); the one private hook kept is ``_new_conn``, the only point
between the TCP connect and a TLS wrap (so a trickled TLS handshake is bounded too) and where a
host name is resolved (bounded by the exchange's deadline on a worker thread: ``getaddrinfo``
cannot be interrupted).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from statemachine import call_deadline
from statemachine.call_deadline import WATCHDOG, Exchange
from statemachine.errors import (
    BootstrapHTTPError,
    MalformedReply,
    NotFound,
    NotReady,
    RequestRejected,
    TransportFailure,
)
from statemachine.validation import MAX_REPLY_BYTES

#: Default wall-clock bound on one exchange: connect + send + read of the whole reply (HTTP-35).
DEFAULT_DEADLINE = 5.0
#: Longest piece of a server's error text quoted in an exception message; a longer one loses
#: its middle (its end says what to do).
MAX_QUOTED_ERROR = 400

# --- the deadline of one exchange ----------------------------------------------------------------


class _NameLookupTimeout(TimeoutError):
    """A host name did not resolve within the time left to the exchange."""


class _Resolver:
    """Host-name lookups, bounded by the running exchange's deadline.

    ``getaddrinfo`` cannot be interrupted, so each lookup runs on a daemon thread (it never
    holds up interpreter exit) and the caller waits at most the time left; at most
    ``WORKERS`` lookups are in flight, so a resolver that stops answering can hold only that
    many threads. Answers are cached for ``TTL`` seconds (bounded), so it delays nothing whose
    name is cached.
    """

    TTL = 30.0
    WORKERS = 4
    MAX_CACHED = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, int], tuple[float, str]] = {}
        self._in_flight = 0

    def resolve(self, host: str, port: int) -> str:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get((host, port))
            if hit is not None and hit[0] > now:
                return hit[1]
            if self._in_flight >= self.WORKERS:
                raise _NameLookupTimeout(f"name {host!r}: {self.WORKERS} lookups already stuck")
            self._in_flight += 1
        exchange = call_deadline.running_exchange()
        left = None if exchange is None or exchange.at is None else max(0.0, exchange.at - now)
        done = threading.Event()
        answer: list[str | BaseException] = []

        def lookup() -> None:
            try:
                answer.append(_first_address(host, port))
            except BaseException as exc:  # handed to the waiting caller
                answer.append(exc)
            finally:
                with self._lock:
                    self._in_flight -= 1
                done.set()

        threading.Thread(target=lookup, name="http-resolver", daemon=True).start()
        if not done.wait(left):
            raise _NameLookupTimeout(f"name {host!r} did not resolve in time")
        result = answer[0]
        if isinstance(result, BaseException):
            raise result
        with self._lock:
            if len(self._cache) >= self.MAX_CACHED:
                self._cache.clear()
            self._cache[(host, port)] = (time.monotonic() + self.TTL, result)
        return result


def _first_address(host: str, port: int) -> str:
    """The name's first address, IPv4 before IPv6 (a dual-stack ``localhost`` must reach a
    server bound to 127.0.0.1)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(found[0][4][0])


_RESOLVER = _Resolver()


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _attach(sock: socket.socket | None) -> None:
    """Hand ``sock`` to the exchange the calling thread runs (if it runs one)."""
    exchange = call_deadline.running_exchange()
    if exchange is not None and sock is not None:
        exchange.attach(sock)


class _ExchangeConnection(HTTPConnection):
    """urllib3's connection, its socket handed to the running exchange: when connected (a
    name resolved within the deadline first), and again on each request of a kept-alive
    connection."""

    def _new_conn(self) -> socket.socket:
        host = self._dns_host
        if not _is_ip_literal(host):
            # Connect to the address; the Host header (and TLS's server name) keep the name.
            self._dns_host = _RESOLVER.resolve(host, self.port)
        try:
            sock = super()._new_conn()
        finally:
            self._dns_host = host
        _attach(sock)
        return sock

    def request(self, *args: Any, **kwargs: Any) -> None:
        _attach(self.sock)  # a kept-alive connection: connect() is not called again
        super().request(*args, **kwargs)


class _ExchangeHTTPSConnection(HTTPSConnection, _ExchangeConnection):
    """The same for https: the raw socket is handed over before the TLS handshake, whose
    reads the deadline then bounds too, and the TLS socket on each request."""


class _ExchangePool(HTTPConnectionPool):
    ConnectionCls = _ExchangeConnection


class _ExchangeHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _ExchangeHTTPSConnection


class ExchangeAdapter(HTTPAdapter):
    """A requests adapter whose connections hand their socket to the running exchange."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        # A new dict: the class-level default is shared by every PoolManager.
        self.poolmanager.pool_classes_by_scheme = {
            "http": _ExchangePool,
            "https": _ExchangeHTTPSPool,
        }


@contextlib.contextmanager
def bounded(seconds: float, exchange: Exchange | None = None) -> Iterator[Exchange]:
    """Run one exchange on the calling thread, ended ``seconds`` from now by the watchdog.
    ``exchange.ended`` then says why it was cut short ("deadline"; "closed" when its owner
    ended it from another thread), or "finished" once it is over."""
    exchange = Exchange() if exchange is None else exchange
    exchange.at = time.monotonic() + seconds
    timer = WATCHDOG.arm(exchange, seconds, "deadline")
    try:
        with call_deadline.running(exchange):
            yield exchange
    finally:
        timer.cancel()
        exchange.finish()


def new_session() -> requests.Session:
    """A keep-alive session holding at most one connection, for plain http only (HTTP-31).

    ``trust_env`` is off: bootstrap traffic is cluster-internal and must not go through an
    ``HTTP_PROXY`` from the environment (and the per-request proxy lookup is costly). Its
    connections hand their sockets to the running exchange (HTTP-35).
    """
    session = requests.Session()
    session.trust_env = False
    session.adapters.clear()  # no https:// adapter: an https URL fails instead of pooling
    session.mount("http://", ExchangeAdapter(pool_connections=1, pool_maxsize=1))
    return session


# --- error messages ---------------------------------------------------------------------------


def cause_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: causes, contexts, urllib3's ``reason``, exception args."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < 32:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        wrapped = [current.__cause__, current.__context__, getattr(current, "reason", None)]
        wrapped += list(current.args)
        todo.extend(e for e in wrapped if isinstance(e, BaseException))


def connection_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a connect the peer's host refused: nothing listens on that port, and
    the host said so at once (unlike a silent peer, which leaves a caller waiting out a
    timeout)."""
    return any(isinstance(c, ConnectionRefusedError) for c in cause_chain(exc))


def deadline_cut(exc: BaseException, exchange: Exchange | None) -> bool:
    """Whether ``exc`` ended ``exchange`` because its deadline passed: the watchdog shut it
    down, or a read timeout ran out with the deadline (a read timeout >= the time left)."""
    if exchange is None:
        return False
    if exchange.ended == "deadline":
        return True
    return (
        exchange.at is not None
        and time.monotonic() >= exchange.at
        and any(isinstance(c, TimeoutError) for c in cause_chain(exc))
    )


def transport_reason(
    exc: BaseException,
    exchange: Exchange | None,
    timeouts: tuple[float, float, float] | None,
    *,
    server: str = "a bootstrap server",
) -> str:
    """What went wrong, in words a caller can act on (no urllib3 "Max retries" noise): the one
    wording of a failed exchange for every HTTP caller. ``exchange`` says whether the deadline
    cut it; ``timeouts`` are (connect, read, deadline) seconds; ``server`` names what should
    have answered. Without ``timeouts`` the seconds are left out."""
    connect_after, read_after = (
        ("", "") if timeouts is None else (f" after {t:g} s" for t in timeouts[:2])
    )
    within = "" if timeouts is None else f" within the {timeouts[2]:g} s request deadline"
    causes = list(cause_chain(exc))
    kinds = tuple(type(c) for c in causes)
    if any(issubclass(k, _NameLookupTimeout) for k in kinds):
        return f"host name did not resolve{within}"
    if deadline_cut(exc, exchange):
        return f"no complete reply{within}"
    if any(issubclass(k, socket.gaierror) for k in kinds):
        gai = next(c for c in causes if isinstance(c, socket.gaierror))
        return f"host name did not resolve ({gai.strerror})"
    if connection_refused(exc):
        return f"connection refused (is {server} listening there?)"
    if any(issubclass(k, requests.exceptions.SSLError) for k in kinds):
        return "TLS handshake failed (check the CA file and the URL's scheme)"
    timed_out = any(issubclass(k, TimeoutError) for k in kinds)
    # urllib3's NewConnectionError subclasses ConnectTimeoutError: a connect that failed for
    # another reason (no route, unreachable network) must not read "timed out".
    if any(
        issubclass(k, (requests.exceptions.ConnectTimeout, urllib3.exceptions.ConnectTimeoutError))
        for k in kinds
    ):
        if timed_out or not any(
            issubclass(k, urllib3.exceptions.NewConnectionError) for k in kinds
        ):
            return f"connect timed out{connect_after}"
        root = next((c for c in causes if isinstance(c, OSError) and c.errno), causes[-1])
        return f"could not connect ({root})"
    if timed_out or any(
        issubclass(k, (requests.exceptions.ReadTimeout, urllib3.exceptions.ReadTimeoutError))
        for k in kinds
    ):
        return f"read timed out{read_after}"
    if any(issubclass(k, ConnectionResetError) for k in kinds):
        return "connection reset by the server"
    if any(issubclass(k, http.client.RemoteDisconnected) for k in kinds):
        return "the server closed the connection without replying"
    root = causes[-1] if causes else exc
    return f"connection failed ({type(root).__name__}: {str(root)[:MAX_QUOTED_ERROR]})"


def quoted_error(body: bytes) -> str:
    """The server's reason from an error body: its JSON ``error`` text, else the text itself;
    bounded and printable. A reason longer than the bound loses its middle, not its end: a
    server's message ends with what to do, which is the part the reader needs."""
    text = body[: 4 * MAX_QUOTED_ERROR].decode("utf-8", "replace")
    try:
        obj = json.loads(body) if len(body) <= 4096 else None
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        text = obj["error"]
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    if len(text) > MAX_QUOTED_ERROR:
        head = MAX_QUOTED_ERROR // 2 - 3
        text = f"{text[:head]} ... {text[len(text) - (MAX_QUOTED_ERROR - head - 5) :]}"
    return text


# What to do after a 503 or a 404 from a route the decode asks for: these two statuses are the
# ones a new deployment meets first (ranks still starting; a dp rank the prefill does not have).
_NOT_READY_NEXT = (
    "not every rank of the prefill has registered with this bootstrap server yet (it is "
    "starting or restarting): retry shortly; if it lasts, check that every prefill rank is "
    "running and registers at this address"
)
_NO_RANK_NEXT = (
    "the prefill has no rank at these indices: check the prefill dp rank the request was "
    "routed to against the prefill's dp size, and the decode's layout against its topology"
)


def status_error(addr: str, status: int, what: str, body: bytes = b"") -> BootstrapHTTPError:
    """The typed error for a non-200 status (HTTP-40..44); a 4xx quotes the server's reason."""
    text = f"{addr}: {what} answered HTTP {status}"
    reason = quoted_error(body) if 400 <= status < 500 else ""
    if reason:
        text = f"{text}: {reason}"
    if status == 503:
        asked_for_ranks = what in ("GET /route", "topology query")
        next_step = _NOT_READY_NEXT if asked_for_ranks else "the server is not ready: retry shortly"
        return NotReady(f"{text}: {next_step}", addr=addr, status=status)
    if status == 404:
        if what == "GET /route":
            text = f"{text}; {_NO_RANK_NEXT}"
        return NotFound(text, addr=addr, status=status)
    if 400 <= status < 500:
        return RequestRejected(text, addr=addr, status=status)
    if status >= 500:
        return TransportFailure(text, addr=addr, status=status)
    # 1xx/2xx/3xx other than 200: the server does not speak this protocol.
    return MalformedReply(text, addr=addr, status=status)


def read_body(response: requests.Response, addr: str) -> bytes:
    """Read at most MAX_REPLY_BYTES; a longer reply is malformed, never buffered whole."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_content(chunk_size=65536):
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            response.close()
            raise MalformedReply(
                f"{addr}: reply larger than {MAX_REPLY_BYTES} bytes",
                addr=addr,
                status=response.status_code,
            )
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# Exceptions that mean "no usable HTTP exchange happened": connection refused or reset,
# timeouts, broken framing. ContentDecodingError is handled first (the exchange worked but the
# body's encoding is bad: a malformed reply).
TRANSPORT_ERRORS = (requests.RequestException, http.client.HTTPException, OSError)


#: The headers of a request with a JSON body.
JSON_HEADERS = {"Content-Type": "application/json"}
