"""One HTTP exchange with a bootstrap server, bounded by a wall-clock deadline (HTTP-35).

Shared by the decode's client (:mod:`statemachine.decode.client`) and the prefill rank's
registrar (:mod:`statemachine.prefill.registration`): the sessions, the deadline, the reading of
a reply and the wording of every failure, so that both sides fail alike.

requests' timeouts bound one connect and one socket read each, so a server trickling one byte
per second would hold an exchange forever. The sessions' connections therefore use
:class:`_DeadlineSocket`, whose every receive and send first sets the socket timeout to
``min(read_timeout, time left)`` and fails once no time is left. The deadline is per thread (a
``threading.local``), like the sessions it applies to.
"""

from __future__ import annotations

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
from urllib3.connection import HTTPConnection
from urllib3.connectionpool import HTTPConnectionPool

from statemachine.errors import (
    BootstrapHTTPError,
    MalformedReply,
    NotFound,
    NotReady,
    RequestRejected,
    TransportFailure,
)
from statemachine.validation import MAX_REPLY_BYTES

DEFAULT_DEADLINE = 5.0
#: Longest piece of a server's error text quoted in an exception message.
MAX_QUOTED_ERROR = 200

# --- the per-request deadline -----------------------------------------------------------------

_LIMITS = threading.local()  # .value: (deadline on time.monotonic(), read timeout) or None


class DeadlinePassed(TimeoutError):
    """Raised by a :class:`_DeadlineSocket` once the exchange's deadline has passed."""


class _DeadlineSocket(socket.socket):
    """A socket whose receives and sends never outlive the calling thread's deadline.

    ``http.client`` reads the status line and headers with ``readline`` on a buffered file
    over ``recv_into``, and the body with further ``recv_into`` calls; the request goes out
    with ``sendall``. Re-arming the timeout before each of them bounds the whole exchange
    however slowly the peer trickles (one settimeout per receive: ~1 us).
    """

    __slots__ = ()

    def _arm(self) -> None:
        limits: tuple[float, float] | None = getattr(_LIMITS, "value", None)
        if limits is None:
            return
        deadline, read_timeout = limits
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed("request deadline passed")
        self.settimeout(min(left, read_timeout))

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._arm()
        return super().recv(bufsize, flags)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._arm()
        super().sendall(data, flags)


class NameLookupTimeout(TimeoutError):
    """A bootstrap host name did not resolve within the time left to the request."""


class _Resolver:
    """Host-name lookups for bootstrap addresses, bounded by the request's deadline.

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
                raise NameLookupTimeout(f"name {host!r}: {self.WORKERS} lookups already stuck")
            self._in_flight += 1
        limits: tuple[float, float] | None = getattr(_LIMITS, "value", None)
        left = None if limits is None else max(0.0, limits[0] - now)
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

        threading.Thread(target=lookup, name="bootstrap-resolver", daemon=True).start()
        if not done.wait(left):
            raise NameLookupTimeout(f"name {host!r} did not resolve in time")
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


class _DeadlineConnection(HTTPConnection):
    """urllib3's connection: a host name is resolved within the deadline (:class:`_Resolver`),
    and the freshly connected socket is re-wrapped as a deadline one."""

    def _new_conn(self) -> socket.socket:
        host = self._dns_host
        if not _is_ip_literal(host):
            # Connect to the address; the Host header keeps the name.
            self._dns_host = _RESOLVER.resolve(host, self.port)
        try:
            sock = super()._new_conn()
        finally:
            self._dns_host = host
        timeout = sock.gettimeout()
        wrapped = _DeadlineSocket(sock.family, sock.type, sock.proto, fileno=sock.detach())
        wrapped.settimeout(timeout)
        return wrapped


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _DeadlinePool(HTTPConnectionPool):
    ConnectionCls = _DeadlineConnection


class _DeadlineAdapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _DeadlinePool}


class Deadline:
    """Context manager: arm the calling thread's deadline for one exchange."""

    __slots__ = ("at", "read_timeout")

    def __init__(self, seconds: float, read_timeout: float) -> None:
        self.at = time.monotonic() + seconds
        self.read_timeout = read_timeout

    def __enter__(self) -> Deadline:
        _LIMITS.value = (self.at, self.read_timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        _LIMITS.value = None

    def passed(self) -> bool:
        return time.monotonic() >= self.at


def new_session() -> requests.Session:
    """A keep-alive session holding at most one connection, for plain http only (HTTP-31).

    ``trust_env`` is off: bootstrap traffic is cluster-internal and must not go through an
    ``HTTP_PROXY`` from the environment (and the per-request proxy lookup is costly). Its
    connections honour the calling thread's deadline (HTTP-35).
    """
    session = requests.Session()
    session.trust_env = False
    session.adapters.clear()  # no https:// adapter: an https URL fails instead of pooling
    session.mount("http://", _DeadlineAdapter(pool_connections=1, pool_maxsize=1))
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


def transport_reason(
    exc: BaseException, deadline: Deadline | None, timeouts: tuple[float, float, float]
) -> str:
    """What went wrong, in words a caller can act on (no urllib3 "Max retries" noise)."""
    connect_timeout, read_timeout, total = timeouts
    causes = list(cause_chain(exc))
    kinds = tuple(type(c) for c in causes)
    if any(issubclass(k, NameLookupTimeout) for k in kinds):
        return f"host name did not resolve within the {total:g} s request deadline"
    if any(issubclass(k, DeadlinePassed) for k in kinds) or (
        deadline is not None
        and deadline.passed()
        and any(issubclass(k, TimeoutError) for k in kinds)
    ):
        return f"no complete reply within the {total:g} s request deadline"
    if any(issubclass(k, socket.gaierror) for k in kinds):
        gai = next(c for c in causes if isinstance(c, socket.gaierror))
        return f"host name did not resolve ({gai.strerror})"
    if any(issubclass(k, ConnectionRefusedError) for k in kinds):
        return "connection refused (is a bootstrap server listening there?)"
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
            return f"connect timed out after {connect_timeout:g} s"
        root = next((c for c in causes if isinstance(c, OSError) and c.errno), causes[-1])
        return f"could not connect ({root})"
    if timed_out or any(
        issubclass(k, (requests.exceptions.ReadTimeout, urllib3.exceptions.ReadTimeoutError))
        for k in kinds
    ):
        return f"read timed out after {read_timeout:g} s"
    if any(issubclass(k, ConnectionResetError) for k in kinds):
        return "connection reset by the server"
    if any(issubclass(k, http.client.RemoteDisconnected) for k in kinds):
        return "the server closed the connection without replying"
    root = causes[-1] if causes else exc
    return f"connection failed ({type(root).__name__}: {str(root)[:MAX_QUOTED_ERROR]})"


def quoted_error(body: bytes) -> str:
    """The server's reason from an error body: its JSON ``error`` text, else the text itself;
    bounded and printable."""
    text = body[: 4 * MAX_QUOTED_ERROR].decode("utf-8", "replace")
    try:
        obj = json.loads(body) if len(body) <= 4096 else None
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        text = obj["error"]
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    if len(text) > MAX_QUOTED_ERROR:
        text = text[:MAX_QUOTED_ERROR] + "..."
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
