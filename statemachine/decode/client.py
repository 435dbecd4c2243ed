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

import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import requests

from statemachine import call_deadline
from statemachine.decode.source import NothingToReport
from statemachine.errors import (
    BootstrapHTTPError,
    InvalidArgument,
    MalformedReply,
    TransportFailure,
    UnknownRoom,
)
from statemachine.http_exchange import (
    DEFAULT_DEADLINE,
    JSON_HEADERS,
    TRANSPORT_ERRORS,
    bounded,
    deadline_cut,
    new_session,
    read_body,
    status_error,
    transport_reason,
)
from statemachine.validation import (
    RouteReply,
    Topology,
    parse_addr,
    require_index,
    require_rank,
)
from statemachine.wire.http import (
    INSTANCE_HEADER,
    dp_ranks_reply,
    dp_ranks_request,
    dp_ranks_url,
    health_url,
    not_a_bootstrap_server,
    parse_json_object,
    route_reply,
    route_url,
    topology_reply,
    topology_url,
)

__all__ = [
    "BootstrapClient",
    "ClientStats",
    "InvalidArgument",
    "RouteReply",
    "Topology",
    "UnknownRoom",
]

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


class _ThreadSessions:
    """One thread's sessions. When the thread exits, ``threading.local`` drops this holder and
    a finalizer closes and counts the sessions left in it (HTTP-33)."""

    __slots__ = ("__weakref__", "sessions")

    def __init__(self) -> None:
        self.sessions: dict[str, requests.Session] = {}


class BootstrapClient(NothingToReport):
    """Queries prefill bootstrap servers over per-thread, per-address keep-alive sessions.

    A :class:`~statemachine.decode.source.BootstrapSource` with nothing of its own to report
    (:class:`~statemachine.decode.source.NothingToReport`): its owner probes each address's health.

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
        try:
            try:
                with bounded(seconds) as exchange:
                    response = session.request(
                        method,
                        url,
                        data=body,
                        headers=JSON_HEADERS if body is not None else None,
                        timeout=timeout,
                        allow_redirects=False,
                        stream=True,
                    )
                    # Drain the body even on an error status: a fully read reply leaves the
                    # connection reusable, so polling a 503 does not open a connection per poll.
                    payload = read_body(response, addr)
                    if exchange.ended is not None:
                        # Shut down mid-reply: the EOF it caused can read as a short reply.
                        raise OSError(f"exchange ended ({exchange.ended})")
                stranger = not_a_bootstrap_server(
                    payload,
                    addr=addr,
                    what=what,
                    status=response.status_code,
                    content_type=response.headers.get("Content-Type"),
                )
                if stranger is not None:
                    raise stranger
                if response.status_code != 200:
                    raise status_error(addr, response.status_code, what, payload)
            except requests.exceptions.ContentDecodingError as exc:
                raise MalformedReply(f"{addr}: {what}: {exc}", addr=addr, status=None) from exc
            except TRANSPORT_ERRORS as exc:
                reason = transport_reason(exc, exchange, timeouts)
                if cut and deadline_cut(exc, exchange):
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
        url = route_url(addr, dp_rank=dp_rank, cp_rank=cp_rank, tp_rank=tp_rank, pp_rank=pp_rank)
        obj, instance_id = self._json(addr, "GET", url, "GET /route")
        return self._checked(route_reply, obj, addr, instance_id)

    def get_topology(self, addr: str) -> Topology:
        """The prefill's parallel layout: ``GET /route`` with all four ranks ``-1`` (HTTP-11)."""
        obj, instance_id = self._json(addr, "GET", topology_url(addr), "topology query")
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
        body = dp_ranks_request(asked.values())
        obj, _ = self._json(addr, "POST", dp_ranks_url(addr), "query_dp_ranks", body)
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
        _, instance_id = self._exchange(addr, "GET", health_url(addr), "GET /health")
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
