"""The decode side's HTTP client for prefill bootstrap servers (spec/protocol.md).

Why pooled: SGLang used to call ``requests.get(url, timeout=5)`` per query, opening a TCP
connection each time. Under load that left ~10,000 sockets in TIME-WAIT towards the bootstrap
port and ended in ``[Errno 99] Cannot assign requested address``. Here every query - rank
route, topology, dp-rank lookup and health probe alike - goes over one keep-alive
``requests.Session`` per (thread, bootstrap address) whose adapter holds a single connection
(HTTP-30..33). A ``Session`` is not thread-safe, so sessions are never shared across threads.

Every failure is a typed :class:`~statemachine.errors.BootstrapHTTPError` carrying ``addr`` and
``status`` (HTTP-40..45); after a transport failure the thread's session for that address is
dropped so the next query starts on a fresh connection (HTTP-34).

Every exchange has a wall-clock deadline (HTTP-35): requests' timeouts bound one connect and
one socket read each, so a server trickling one byte per second would hold a query forever.
The sessions' connections therefore use :class:`_DeadlineSocket`, whose every receive and send
first sets the socket timeout to ``min(read_timeout, time left)`` and fails once no time is
left. The deadline is per thread (a ``threading.local``), like the sessions it applies to.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection
from urllib3.connectionpool import HTTPConnectionPool

from statemachine import call_deadline
from statemachine.decode.source import AnswersOnly
from statemachine.errors import (
    BootstrapHTTPError,
    MalformedReply,
    NotFound,
    NotReady,
    RequestRejected,
    TransportFailure,
    UnknownRoom,
)
from statemachine.validation import (
    MAX_REPLY_BYTES,
    InvalidArgument,
    RouteReply,
    Topology,
    dp_ranks_reply,
    parse_addr,
    parse_json_object,
    require_index,
    require_rank,
    route_reply,
    topology_reply,
)

__all__ = [
    "INSTANCE_HEADER",
    "BootstrapClient",
    "ClientStats",
    "InvalidArgument",
    "RouteReply",
    "Topology",
    "UnknownRoom",
    "register_rank",
]

INSTANCE_HEADER = "X-Bootstrap-Instance-Id"

_T = TypeVar("_T")

#: Error kinds counted by :meth:`BootstrapClient.stats` (a fixed set: the dict cannot grow).
ERROR_KINDS = ("NotReady", "NotFound", "RequestRejected", "MalformedReply", "TransportFailure")


@dataclass(frozen=True, slots=True)
class ClientStats:
    """Counters since the client was created, over all threads (a consistent snapshot)."""

    requests: int
    errors: Mapping[str, int]
    sessions_opened: int
    #: sessions dropped after a transport failure (a subset of the closed ones)
    sessions_dropped: int
    sessions_closed: int


#: Default wall-clock bound on one exchange: connect + send + read of the whole reply (HTTP-35).
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


class _Deadline:
    """Context manager: arm the calling thread's deadline for one exchange."""

    __slots__ = ("at", "read_timeout")

    def __init__(self, seconds: float, read_timeout: float) -> None:
        self.at = time.monotonic() + seconds
        self.read_timeout = read_timeout

    def __enter__(self) -> _Deadline:
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


def _causes(exc: BaseException) -> Iterator[BaseException]:
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
    exc: BaseException, deadline: _Deadline | None, timeouts: tuple[float, float, float]
) -> str:
    """What went wrong, in words a caller can act on (no urllib3 "Max retries" noise)."""
    connect_timeout, read_timeout, total = timeouts
    causes = list(_causes(exc))
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


def _quoted_error(body: bytes) -> str:
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


def _status_error(addr: str, status: int, what: str, body: bytes = b"") -> BootstrapHTTPError:
    """The typed error for a non-200 status (HTTP-40..44); a 4xx quotes the server's reason."""
    text = f"{addr}: {what} answered HTTP {status}"
    reason = _quoted_error(body) if 400 <= status < 500 else ""
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


def _read_body(response: requests.Response, addr: str) -> bytes:
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
_TRANSPORT_ERRORS = (requests.RequestException, http.client.HTTPException, OSError)


class _ThreadSessions:
    """One thread's sessions. When the thread exits, ``threading.local`` drops this holder and
    a finalizer closes and counts the sessions left in it (HTTP-33)."""

    __slots__ = ("__weakref__", "sessions")

    def __init__(self) -> None:
        self.sessions: dict[str, requests.Session] = {}


class BootstrapClient(AnswersOnly):
    """Queries prefill bootstrap servers over per-thread, per-address keep-alive sessions.

    A :class:`~statemachine.decode.source.BootstrapSource` with nothing of its own to report
    (:class:`~statemachine.decode.source.AnswersOnly`): its owner probes each address's health.

    Safe to share between threads: each thread gets its own sessions. ``close()`` releases the
    *calling* thread's sessions; the sessions of a thread that exits without calling it are
    closed (and counted in :meth:`stats`) when the thread's locals are dropped.
    ``close_all()`` (what a :class:`~statemachine.decode.manager.DecodeManager` that made the
    client calls as it closes) closes every thread's sessions and refuses new ones.

    ``deadline`` bounds each exchange in wall-clock seconds, connect + send + whole reply
    (HTTP-35); ``connect_timeout`` bounds the connect and ``read_timeout`` one silence.
    """

    def __init__(
        self,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 5.0,
        deadline: float = DEFAULT_DEADLINE,
        max_sessions_per_thread: int = 64,
    ) -> None:
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("read_timeout", read_timeout),
            ("deadline", deadline),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(f"{name} must be a positive number, got {value!r}")
        if type(max_sessions_per_thread) is not int or max_sessions_per_thread < 1:
            raise InvalidArgument("max_sessions_per_thread must be an int >= 1")
        self._deadline = float(deadline)
        self._read_timeout = float(read_timeout)
        # The connect timeout never exceeds the deadline: the deadline is armed before connect.
        self._timeout = (min(float(connect_timeout), self._deadline), float(read_timeout))
        self._timeouts = (float(connect_timeout), float(read_timeout), self._deadline)
        self._max_sessions = max_sessions_per_thread
        self._local = threading.local()
        #: every thread's session holder (weak: a thread's exit still drops its own), for
        #: close_all(); changed under _stats_lock
        self._holders: weakref.WeakSet[_ThreadSessions] = weakref.WeakSet()
        self._shut = False
        # Counters are touched by every thread; one short uncontended lock per request costs
        # well under a microsecond against a ~100 us HTTP round trip, and keeps them exact.
        # Reentrant: a thread-exit finalizer may run on a thread that holds it.
        self._stats_lock = threading.RLock()
        self._requests = 0
        self._errors = dict.fromkeys(ERROR_KINDS, 0)
        self._opened = 0
        self._dropped = 0
        self._closed = 0

    # --- sessions ------------------------------------------------------------------------------

    def _sessions(self) -> dict[str, requests.Session]:
        try:
            holder: _ThreadSessions = self._local.holder
        except AttributeError:
            holder = self._local.holder = _ThreadSessions()
            # The finalizer holds the dict and a weak reference to the client, never the
            # holder (which would keep it alive) nor the client (which would leak it).
            weakref.finalize(holder, _close_orphans, holder.sessions, weakref.ref(self))
            with self._stats_lock:
                self._holders.add(holder)
        return holder.sessions

    def _count_orphans(self, count: int) -> None:
        with self._stats_lock:
            self._closed += count

    def _session(self, addr: str) -> requests.Session:
        sessions = self._sessions()
        session = sessions.get(addr)
        if session is not None:
            return session
        parse_addr(addr)  # validated once per (thread, address): off the hot path
        if self._shut:
            raise TransportFailure(
                f"{addr}: this BootstrapClient was closed (close_all(): its DecodeManager "
                "closed): create a new manager (or client) to query again",
                addr=addr,
            )
        if len(sessions) >= self._max_sessions:
            # Addresses are few in practice; the cap only stops unbounded growth. Evict the
            # oldest (dicts keep insertion order).
            oldest = next(iter(sessions))
            sessions.pop(oldest).close()
            with self._stats_lock:
                self._closed += 1
        session = sessions[addr] = new_session()
        with self._stats_lock:
            self._opened += 1
        return session

    def _drop(self, addr: str) -> None:
        session = self._sessions().pop(addr, None)
        if session is not None:
            session.close()
            with self._stats_lock:
                self._dropped += 1
                self._closed += 1

    def close(self) -> None:
        """Close the calling thread's sessions (other threads' sessions are theirs to close)."""
        count = _close_sessions(self._sessions())
        with self._stats_lock:
            self._closed += count

    def close_all(self) -> None:
        """Close every thread's sessions, and refuse new ones (``TransportFailure``): the
        owner is done with this client. A query in progress on another thread then fails
        with ``TransportFailure``, typed as any broken connection."""
        with self._stats_lock:
            self._shut = True
            holders = list(self._holders)
        count = sum(_close_sessions(holder.sessions) for holder in holders)
        with self._stats_lock:
            self._closed += count

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> ClientStats:
        with self._stats_lock:
            return ClientStats(
                requests=self._requests,
                errors=dict(self._errors),
                sessions_opened=self._opened,
                sessions_dropped=self._dropped,
                sessions_closed=self._closed,
            )

    # --- one exchange --------------------------------------------------------------------------

    def _exchange(
        self, addr: str, method: str, url: str, what: str, body: bytes | None = None
    ) -> tuple[bytes, str | None]:
        """Send one request; return (200 body, instance id) or raise the typed error."""
        session = self._session(addr)
        seconds, timeout, timeouts = self._deadline, self._timeout, self._timeouts
        cut = False  # the call's deadline is the nearer one
        call_at = call_deadline.current()
        if call_at is not None:  # inside a call's window (MGR-21): the smaller deadline wins
            left = call_at - time.monotonic()
            if left <= 0:
                error = TransportFailure(
                    f"{addr}: {what}: not sent, the request's bootstrap deadline passed (the "
                    "prefill answered too slowly); retry the request",
                    addr=addr,
                )
                self._count_error(error)
                raise error
            if left < seconds:
                seconds, cut = left, True
                timeout = (min(timeout[0], left), timeout[1])
                timeouts = (timeouts[0], timeouts[1], left)
        with self._stats_lock:
            self._requests += 1
        deadline = _Deadline(seconds, self._read_timeout)
        try:
            try:
                with deadline:
                    response = session.request(
                        method,
                        url,
                        data=body,
                        headers=_JSON_HEADERS if body is not None else None,
                        timeout=timeout,
                        allow_redirects=False,
                        stream=True,
                    )
                    # Drain the body even on an error status: a fully read reply leaves the
                    # connection reusable, so polling a 503 does not open a connection per poll.
                    payload = _read_body(response, addr)
                if response.status_code != 200:
                    raise _status_error(addr, response.status_code, what, payload)
            except requests.exceptions.ContentDecodingError as exc:
                raise MalformedReply(f"{addr}: {what}: {exc}", addr=addr, status=None) from exc
            except _TRANSPORT_ERRORS as exc:
                reason = transport_reason(exc, deadline, timeouts)
                if cut and deadline.passed():
                    reason = (
                        "no complete reply before the request's bootstrap deadline (one for the "
                        "whole init(): DecodeManager's fetch_deadline_s); the prefill answers "
                        "too slowly: retry the request"
                    )
                raise TransportFailure(f"{addr}: {what}: {reason}", addr=addr) from exc
        except BootstrapHTTPError as exc:
            self._count_error(exc)
            if isinstance(exc, TransportFailure):
                self._drop(addr)
            raise
        return payload, response.headers.get(INSTANCE_HEADER)

    def _count_error(self, exc: BootstrapHTTPError) -> None:
        kind = type(exc).__name__
        with self._stats_lock:
            if kind in self._errors:
                self._errors[kind] += 1

    def _json(
        self, addr: str, method: str, url: str, what: str, body: bytes | None = None
    ) -> tuple[dict[str, object], str | None]:
        payload, instance_id = self._exchange(addr, method, url, what, body)
        try:
            return parse_json_object(payload, addr=addr, status=200), instance_id
        except MalformedReply as exc:
            self._count_error(exc)
            raise

    # --- the routes ----------------------------------------------------------------------------

    def get_rank(
        self, addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int
    ) -> RouteReply:
        """Where one prefill rank listens: ``GET /route`` (HTTP-10)."""
        require_rank(dp_rank=dp_rank, cp_rank=cp_rank, tp_rank=tp_rank, pp_rank=pp_rank)
        url = (
            f"http://{addr}/route?prefill_dp_rank={dp_rank}&prefill_cp_rank={cp_rank}"
            f"&target_tp_rank={tp_rank}&target_pp_rank={pp_rank}"
        )
        obj, instance_id = self._json(addr, "GET", url, "GET /route")
        return self._checked(route_reply, obj, addr, instance_id)

    def get_topology(self, addr: str) -> Topology:
        """The prefill's parallel layout: ``GET /route`` with all four ranks ``-1`` (HTTP-11)."""
        url = (
            f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
            "&target_tp_rank=-1&target_pp_rank=-1"
        )
        obj, instance_id = self._json(addr, "GET", url, "topology query")
        return self._checked(topology_reply, obj, addr, instance_id)

    def query_dp_ranks(self, addr: str, rooms: Sequence[int]) -> dict[int, int]:
        """dp rank of each room the server knows: ``POST /query_dp_ranks`` (HTTP-13).

        Rooms the server does not know are absent from the result. No request for no rooms.
        """
        if isinstance(rooms, (str, bytes)) or not isinstance(rooms, Sequence):
            raise InvalidArgument(f"rooms must be a sequence of ints, got {type(rooms).__name__}")
        asked = {str(require_index("room", room)): room for room in rooms}
        if not asked:
            parse_addr(addr)
            return {}
        body = json.dumps({"bootstrap_rooms": list(asked.values())}).encode()
        obj, _ = self._json(addr, "POST", f"http://{addr}/query_dp_ranks", "query_dp_ranks", body)
        try:
            return dp_ranks_reply(obj, asked, addr=addr, status=200)
        except MalformedReply as exc:
            self._count_error(exc)
            raise

    def dp_rank_of(self, addr: str, room: int) -> int:
        """The dp rank serving ``room``; :class:`~statemachine.errors.UnknownRoom` (a
        ``NotFound``) when the server does not know the room yet (HTTP-13)."""
        found = self.query_dp_ranks(addr, [room])
        try:
            return found[room]
        except KeyError:
            raise UnknownRoom(
                f"{addr}: no dp rank registered for room {room} (yet): the prefill registers "
                "it when the request reaches it; ask again, or give the dp rank explicitly",
                addr=addr,
                room=room,
            ) from None

    def health(self, addr: str) -> str | None:
        """Probe ``GET /health``; return the server's instance id (HTTP-14). Raises on failure."""
        _, instance_id = self._exchange(addr, "GET", f"http://{addr}/health", "GET /health")
        return instance_id

    def _checked(
        self,
        parse: Callable[..., _T],
        obj: Mapping[str, object],
        addr: str,
        instance_id: str | None,
    ) -> _T:
        try:
            return parse(obj, addr=addr, status=200, instance_id=instance_id)
        except MalformedReply as exc:
            self._count_error(exc)
            raise


_JSON_HEADERS = {"Content-Type": "application/json"}


def _close_sessions(sessions: dict[str, requests.Session]) -> int:
    """Close and remove every session of one thread's dict; how many. ``popitem`` is atomic,
    so a session closed by ``close_all`` on another thread is never closed (or counted) twice
    by its own thread's ``close``."""
    count = 0
    while True:
        try:
            _, session = sessions.popitem()
        except KeyError:
            return count
        session.close()
        count += 1


def _close_orphans(
    sessions: dict[str, requests.Session], client: weakref.ref[BootstrapClient]
) -> None:
    """Finalizer of an exited thread's sessions: close them and count them as closed."""
    count = _close_sessions(sessions)
    owner = client()
    if owner is not None and count:
        owner._count_orphans(count)


# --- registration (prefill side) ---------------------------------------------------------------


def register_rank(
    addr: str,
    token: str | None,
    payload: Mapping[str, object],
    *,
    attempts: int = 5,
    backoff_scale: float = 1.0,
    connect_timeout: float = 2.0,
    read_timeout: float = 5.0,
    deadline: float = DEFAULT_DEADLINE,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Register one prefill rank with ``PUT /route``, SGLang-style (HTTP-15).

    Retries transport failures and 503 up to ``attempts`` times in all, sleeping
    ``min(2**i, 30) * backoff_scale`` seconds times a jitter in [0.5, 1) between tries so that
    ranks restarted together do not retry in lock-step. A 4xx (wrong token, bad payload,
    topology conflict) is permanent and raised at once. Each attempt is bounded by ``deadline``
    seconds (HTTP-35). Returns the server's instance id.
    """
    parse_addr(addr)
    if type(attempts) is not int or attempts < 1:
        raise InvalidArgument(f"attempts must be an int >= 1, got {attempts!r}")
    if not isinstance(payload, Mapping):
        raise InvalidArgument(f"payload must be a mapping, got {type(payload).__name__}")
    try:
        body = json.dumps(dict(payload)).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"payload is not JSON-serialisable: {exc}") from None
    headers = dict(_JSON_HEADERS)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    url = f"http://{addr}/route"
    timeouts = (connect_timeout, read_timeout, deadline)
    with new_session() as session:
        for attempt in range(attempts):
            limit = _Deadline(deadline, read_timeout)
            try:
                with limit:
                    response = session.put(
                        url,
                        data=body,
                        headers=headers,
                        timeout=(min(connect_timeout, deadline), read_timeout),
                        allow_redirects=False,
                        stream=True,
                    )
                    reply = _read_body(response, addr)
                if response.status_code == 200:
                    instance_id: str | None = response.headers.get(INSTANCE_HEADER)
                    return instance_id
                error: BootstrapHTTPError = _status_error(
                    addr, response.status_code, "PUT /route", reply
                )
            except MalformedReply as exc:
                error = exc
            except _TRANSPORT_ERRORS as exc:
                reason = transport_reason(exc, limit, timeouts)
                error = TransportFailure(f"{addr}: PUT /route: {reason}", addr=addr)
                error.__cause__ = exc
            if not isinstance(error, (TransportFailure, NotReady)) or attempt + 1 == attempts:
                raise error
            delay = min(2.0**attempt, 30.0) * backoff_scale
            sleep(delay * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover
