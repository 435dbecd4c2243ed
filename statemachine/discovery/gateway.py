"""A small client for etcd's v3 HTTP/JSON gateway, over ``requests`` (docs/etcd.md).

Why our own and not ``etcd3gw``: both speak the same gateway at the same latency here (measured
in docs/etcd.md), but etcd3gw's watch drops the fields an informer needs - the response
header's revision, ``canceled`` and ``compact_revision`` (a compacted watch is ignored, not
reported) - runs its reader on an executor whose errors nobody sees, and reads the stream
without a timeout. The gateway API is small; owning these ~300 lines makes every call bounded
and every failure typed. ``etcd3`` (gRPC) does not import with protobuf >= 4.

Every call has a timeout (connect, read per ``recv``) and a total deadline (``call_deadline``,
enforced by :mod:`~statemachine.call_deadline`, as for every HTTP call of the package: a reply
trickled a byte at a time ends
there too). A transport failure, a missed deadline or a 5xx is :class:`EtcdUnavailable` and
moves on to the next endpoint; another non-200 status is :class:`EtcdRequestFailed`; a reply
etcd never sends (not JSON, no header, larger than ``max_reply_bytes``) is
:class:`EtcdBadReply`. Replies are decoded defensively: a key or watch event that does not
decode (bad base64, a non-integer revision) is counted and skipped, never fails the rest
(docs/etcd.md, "Limits"). Sessions are per thread (``requests.Session`` is not thread-safe),
like the bootstrap client's.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import json
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import requests
from urllib3.exceptions import ReadTimeoutError

from statemachine.call_deadline import WATCHDOG, Exchange, running
from statemachine.errors import (
    EtcdBadReply,
    EtcdReplyTooLarge,
    EtcdRequestFailed,
    EtcdUnavailable,
    InvalidArgument,
    WatchCompacted,
    WatchIdle,
)
from statemachine.http_exchange import ExchangeAdapter, transport_reason

__all__ = [
    "DEFAULT_CALL_DEADLINE",
    "DEFAULT_MAX_REPLY_BYTES",
    "DEFAULT_MAX_WATCH_MESSAGE_BYTES",
    "EtcdBadReply",
    "EtcdGateway",
    "EtcdReplyTooLarge",
    "KeyValue",
    "RangeReply",
    "TLSConfig",
    "WatchEvent",
    "WatchIdle",
    "WatchMessage",
    "WatchStream",
    "prefix_range_end",
]


# Where the user looks when no endpoint answers: not the raw urllib3 text ("HTTPConnectionPool
# (host=..., port=...): Max retries exceeded ..."), which names neither the cause nor a remedy.
NO_ETCD_HINT = (
    "check that etcd runs at these endpoints and that they are its client URLs "
    "(`pd-bootstrap etcd` starts a local one for trying); the call may be retried"
)


def why_unreachable(exc: BaseException, timeouts: tuple[float, float, float] | None = None) -> str:
    """One endpoint's failure in a few words (refused, timed out, not resolved, reset): the
    package's one wording of a failed exchange
    (:func:`~statemachine.http_exchange.transport_reason`), naming etcd as what should have
    answered."""
    return transport_reason(exc, None, timeouts, server="etcd")


#: Largest reply body read (a list of the prefix, mostly): about 20,000 rank keys of ~800
#: bytes each as the gateway encodes them. A longer reply is refused as soon as it is seen to
#: be longer (its Content-Length, or the bytes read so far), never read to its end.
DEFAULT_MAX_REPLY_BYTES = 16 << 20
#: Largest single watch message buffered (etcd's default request limit is 1.5 MiB, so one
#: transaction's events fit many times over).
DEFAULT_MAX_WATCH_MESSAGE_BYTES = 8 << 20
#: Total time one exchange with one endpoint may take, reply body included.
DEFAULT_CALL_DEADLINE = 10.0
#: Bytes asked of the socket per read: also the most a declared chunk size makes us buffer.
_READ_CHUNK = 64 << 10
#: etcd revisions are int64.
_MAX_INT64 = (1 << 63) - 1


def _read_capped(response: requests.Response, limit: int, what: str) -> bytes:
    """The whole body, or :class:`EtcdReplyTooLarge` as soon as it is seen to pass ``limit``."""
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise EtcdReplyTooLarge(
            f"{what}: reply of {int(declared)} bytes refused (cap {limit}: max_reply_bytes)"
        )
    body = bytearray()
    for chunk in response.iter_content(chunk_size=_READ_CHUNK):
        body += chunk
        if len(body) > limit:
            raise EtcdReplyTooLarge(
                f"{what}: reply longer than {limit} bytes refused (max_reply_bytes)"
            )
    return bytes(body)


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """Client TLS for an etcd cluster served over https (``--cert-file`` etc. on the server)."""

    #: CA bundle that signed the server certificates (``--trusted-ca-file``).
    ca_file: str | None = None
    #: client certificate and key, when the cluster requires them (``--client-cert-auth``).
    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    deleted: bool
    kv: KeyValue
    prev_kv: KeyValue | None


@dataclass(frozen=True, slots=True)
class WatchMessage:
    """One message of a watch stream. ``revision`` is the response header's revision;
    ``cluster_id`` names the etcd cluster that answered (it changes when etcd is replaced)."""

    revision: int
    cluster_id: int
    created: bool
    events: tuple[WatchEvent, ...]
    #: events of this message that did not decode (bad base64, ...): skipped
    malformed: int = 0


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that starts with ``prefix`` (etcd's convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object) -> bytes:
    """A bytes field: absent means empty (proto3 default); anything but base64 is refused."""
    if text is None:
        return b""
    if not isinstance(text, str):
        raise ValueError(f"not a base64 string: {type(text).__name__}")
    return base64.b64decode(text, validate=True)


def _int(value: object, *, unsigned: bool = False) -> int:
    """int64 (``unsigned``: uint64) fields arrive as JSON strings; absent means 0 (proto3
    default)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"not an integer: {value!r}")
    if isinstance(value, str) and not (value.isascii() and value.lstrip("-").isdigit()):
        raise ValueError(f"not an integer: {value[:40]!r}")
    number = int(value)
    low, high = (0, 2 * _MAX_INT64 + 1) if unsigned else (-_MAX_INT64 - 1, _MAX_INT64)
    if not low <= number <= high:
        raise ValueError(f"out of range: {number}")
    return number


#: what decoding a key-value or an event can raise on a reply etcd would not send
_UNDECODABLE = (ValueError, TypeError, binascii.Error)


def _kv(obj: object) -> KeyValue:
    if not isinstance(obj, dict):
        raise ValueError("a key-value is not a JSON object")
    return KeyValue(
        key=_unb64(obj.get("key")),
        value=_unb64(obj.get("value")),
        create_revision=_int(obj.get("create_revision")),
        mod_revision=_int(obj.get("mod_revision")),
        version=_int(obj.get("version")),
        lease=_int(obj.get("lease")),
    )


def _header(obj: Mapping[str, Any], what: str) -> tuple[int, int]:
    """``(revision, cluster id)`` of a reply's header; :class:`EtcdBadReply` without one
    (etcd puts a header on every reply: a reply without it is not etcd's)."""
    header = obj.get("header")
    if not isinstance(header, dict):
        raise EtcdBadReply(f"{what}: reply header is not an object (not etcd's reply)")
    try:
        revision, cluster = (
            _int(header.get("revision")),
            _int(header.get("cluster_id"), unsigned=True),
        )
    except ValueError as exc:
        raise EtcdBadReply(f"{what}: reply header unreadable ({exc})") from None
    if revision < 1:
        raise EtcdBadReply(f"{what}: reply header revision {revision} (etcd's start at 1)")
    return revision, cluster


def _header_revision(obj: Mapping[str, Any]) -> int:
    header = obj.get("header")
    return _int(header.get("revision")) if isinstance(header, Mapping) else 0


class RangeReply(NamedTuple):
    """A list of a prefix: the store revision it was read at, the cluster that answered, the
    keys, and how many entries did not decode (skipped, never served)."""

    revision: int
    cluster_id: int
    kvs: list[KeyValue]
    malformed: int = 0


class WatchStream:
    """An open watch: iterate for messages; ``close()`` from any thread ends the iteration.

    Iteration raises :class:`WatchCompacted` when etcd cancels the watch because its start
    revision was compacted, :class:`WatchIdle` when no *complete* message arrived for the idle
    timeout (bytes trickling in do not count), :class:`EtcdReplyTooLarge` for a message over
    ``max_message_bytes``, :class:`EtcdBadReply` for a message etcd never sends,
    :class:`EtcdUnavailable` when the stream breaks, and stops after ``close()``. An event
    that does not decode is skipped and counted in its message's ``malformed``.
    """

    def __init__(
        self,
        response: requests.Response,
        session: requests.Session,
        endpoint: str,
        on_denied: Callable[[], object] | None = None,
        *,
        exchange: Exchange | None = None,
        idle_timeout: float = 10.0,
        max_message_bytes: int = DEFAULT_MAX_WATCH_MESSAGE_BYTES,
    ) -> None:
        self._response = response
        self._session = session
        self._endpoint = endpoint
        self._on_denied = on_denied
        self._exchange = exchange or Exchange()
        self._idle_timeout = idle_timeout
        self._max_message = max_message_bytes
        self._closed = False

    def close(self) -> None:
        self._closed = True
        # A reader blocked in recv() does not notice Response.close() from another thread;
        # shutting the socket down wakes it with EOF at once.
        self._exchange.end("closed")
        connection = getattr(self._response.raw, "_connection", None)
        sock = getattr(connection, "sock", None)
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._response.close()
        self._session.close()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[WatchMessage]:
        buffer = bytearray()
        scanned = 0  # bytes of buffer known to hold no newline
        # Idle means no complete message (not no byte): the watchdog ends the exchange when
        # none arrived for the idle timeout, however many bytes trickled in meanwhile.
        idle = WATCHDOG.arm(self._exchange, self._idle_timeout, "idle")
        try:
            for chunk in self._response.iter_content(chunk_size=_READ_CHUNK):
                if self._closed:
                    return
                buffer += chunk
                start = 0
                while (end := buffer.find(b"\n", max(start, scanned))) >= 0:
                    line = bytes(buffer[start:end])
                    start = scanned = end + 1
                    if line.strip():
                        message = self._message(line)
                        idle.push(self._idle_timeout)
                        yield message
                if start:
                    del buffer[:start]
                    scanned = 0
                scanned = max(scanned, len(buffer))
                if len(buffer) > self._max_message:
                    raise EtcdReplyTooLarge(
                        f"{self._endpoint}: watch message longer than {self._max_message} "
                        "bytes refused (max_watch_message_bytes)"
                    )
        except (requests.RequestException, OSError, ValueError) as exc:
            if self._closed:
                return
            if self._exchange.ended == "idle" or (
                exc.args and isinstance(exc.args[0], ReadTimeoutError)
            ):
                raise WatchIdle(
                    f"{self._endpoint}: no complete watch message for {self._idle_timeout:g} s"
                ) from None
            raise EtcdUnavailable(
                f"{self._endpoint}: watch stream broke ({why_unreachable(exc)}); the source "
                "resumes it from its revision on its own"
            ) from None
        finally:
            idle.cancel()
        if self._closed or self._exchange.ended == "closed":
            return
        if self._exchange.ended == "idle":  # the shutdown reads as an EOF
            raise WatchIdle(
                f"{self._endpoint}: no complete watch message for {self._idle_timeout:g} s"
            )
        if buffer.strip():
            yield self._message(bytes(buffer))
        raise EtcdUnavailable(f"{self._endpoint}: watch stream ended")

    def _message(self, line: bytes) -> WatchMessage:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            raise EtcdBadReply(f"{self._endpoint}: watch sent non-JSON") from None
        if not isinstance(obj, dict):
            raise EtcdBadReply(f"{self._endpoint}: watch sent a non-object")
        if "error" in obj:
            raise EtcdUnavailable(f"{self._endpoint}: watch error: {str(obj['error'])[:200]}")
        result = obj.get("result")
        if not isinstance(result, dict):
            raise EtcdBadReply(f"{self._endpoint}: watch message without result")
        try:
            compact = _int(result.get("compact_revision"))
        except ValueError:
            raise EtcdBadReply(f"{self._endpoint}: watch compact_revision unreadable") from None
        if result.get("canceled"):
            if compact:
                raise WatchCompacted(
                    f"{self._endpoint}: watch start revision compacted (at {compact})",
                    compact_revision=compact,
                )
            reason = str(result.get("cancel_reason", ""))[:200]
            if self._on_denied is not None and "PermissionDenied" in reason:
                # etcd checks the token when the watch is created and answers an expired one
                # this way: renew it, so the caller's next attempt can succeed.
                self._on_denied()
            raise EtcdUnavailable(f"{self._endpoint}: watch canceled: {reason}")
        revision, cluster = _header(result, f"{self._endpoint}: watch")
        raw_events = result.get("events") or []
        if not isinstance(raw_events, list):
            raise EtcdBadReply(f"{self._endpoint}: watch events are not a list")
        events = []
        malformed = 0
        for raw in raw_events:
            try:
                kind = raw.get("type", "PUT")  # the enum's default (PUT) is omitted
                if kind not in ("PUT", "DELETE"):
                    raise ValueError(f"event type {str(kind)[:20]!r}")
                prev = raw.get("prev_kv")
                event = WatchEvent(
                    deleted=kind == "DELETE",
                    kv=_kv(raw.get("kv")),
                    prev_kv=_kv(prev) if prev is not None else None,
                )
            except (*_UNDECODABLE, AttributeError):
                malformed += 1  # one bad event never blocks the ones after it
                continue
            events.append(event)
        return WatchMessage(
            revision=revision,
            cluster_id=cluster,
            created=bool(result.get("created")),
            events=tuple(events),
            malformed=malformed,
        )


class EtcdGateway:
    """Calls etcd's JSON gateway (``/v3/...``) on ``endpoints``, failing over between them."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        connect_timeout: float = 1.0,
        timeout: float = 2.0,
        tls: TLSConfig | None = None,
        username: str | None = None,
        password: str | None = None,
        call_deadline: float = DEFAULT_CALL_DEADLINE,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        max_watch_message_bytes: int = DEFAULT_MAX_WATCH_MESSAGE_BYTES,
    ) -> None:
        if (username is None) != (password is None):
            raise InvalidArgument("give both username and password, or neither")
        if isinstance(endpoints, str) or not endpoints:
            raise InvalidArgument("endpoints must be a non-empty sequence of URLs")
        for url in endpoints:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise InvalidArgument(f"etcd endpoint must be an http(s) URL, got {url!r}")
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("timeout", timeout),
            ("call_deadline", call_deadline),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(f"{name} must be a positive number, got {value!r}")
        for name, size in (
            ("max_reply_bytes", max_reply_bytes),
            ("max_watch_message_bytes", max_watch_message_bytes),
        ):
            if type(size) is not int or size < 1024:
                raise InvalidArgument(f"{name} must be an int >= 1024, got {size!r}")
        self.endpoints = tuple(url.rstrip("/") for url in endpoints)
        self.timeout = (float(connect_timeout), float(timeout))
        #: total time one exchange with one endpoint may take (reply included)
        self.call_deadline = float(call_deadline)
        # (connect, read, whole exchange) seconds, as a failure's wording quotes them
        self._timeouts = (*self.timeout, self.call_deadline)
        self.max_reply_bytes = max_reply_bytes
        self.max_watch_message_bytes = max_watch_message_bytes
        self._tls = tls
        self._credentials = None if username is None else {"name": username, "password": password}
        self._auth_lock = threading.Lock()
        self._token: str | None = None
        self._local = threading.local()
        self._current = 0  # index of the endpoint that last answered

    # --- plumbing ------------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self._new_session()
        return session

    def _new_session(self) -> requests.Session:
        session = requests.Session()
        session.trust_env = False  # never through an HTTP(S)_PROXY from the environment
        # etcd never compresses; asking for identity keeps a proxy from sending a bomb.
        session.headers["Accept-Encoding"] = "identity"
        adapter = ExchangeAdapter(pool_connections=len(self.endpoints), pool_maxsize=1)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        if self._tls is not None:
            if self._tls.ca_file:
                session.verify = self._tls.ca_file
            if self._tls.cert_file:
                session.cert = (
                    (self._tls.cert_file, self._tls.key_file)
                    if self._tls.key_file
                    else self._tls.cert_file
                )
        return session

    def close(self) -> None:
        """Close the calling thread's session."""
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
            self._local.session = None

    # --- authentication (etcd users; client certificates need none of this) -----------------

    def _auth_headers(self) -> dict[str, str] | None:
        if self._credentials is None:
            return None
        with self._auth_lock:
            token = self._token
        if token is None:
            token = self._authenticate(None)
        return {"Authorization": token}

    def _authenticate(self, stale: str | None) -> str:
        """A fresh token, unless another thread already replaced ``stale``."""
        assert self._credentials is not None
        with self._auth_lock:
            if self._token is not None and self._token != stale:
                return self._token
            obj = self._post_once("auth/authenticate", self._credentials, None, None)
            token = obj.get("token")
            if not isinstance(token, str) or not token:
                raise EtcdRequestFailed("etcd authenticate: no token in the reply", status=200)
            self._token = token
            return token

    @staticmethod
    def _is_auth_error(exc: EtcdRequestFailed) -> bool:
        # An expired or unknown token is Unauthenticated (gRPC 16, HTTP 401); a request with no
        # token at all says the user name is empty.
        text = str(exc)
        return exc.status == 401 or exc.code == 16 or "token" in text or "user name" in text

    def _post(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        timeout: tuple[float, float] | None = None,
        on_exchange: Callable[[Exchange], object] | None = None,
    ) -> dict[str, Any]:
        """POST to the first endpoint that answers; return the reply object.

        With credentials, a rejected token (simple tokens expire after etcd's
        ``--auth-token-ttl``, 5 minutes by default) is renewed once and the call retried.
        """
        headers = self._auth_headers()
        try:
            return self._post_once(path, body, headers, timeout, on_exchange)
        except EtcdRequestFailed as exc:
            if headers is None or not self._is_auth_error(exc):
                raise
        headers = {"Authorization": self._authenticate(headers["Authorization"])}
        return self._post_once(path, body, headers, timeout, on_exchange)

    def _post_once(
        self,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str] | None,
        timeout: tuple[float, float] | None,
        on_exchange: Callable[[Exchange], object] | None = None,
    ) -> dict[str, Any]:
        session = self._session()
        errors: list[str] = []
        count = len(self.endpoints)
        start = self._current
        for step in range(count):
            index = (start + step) % count
            url = f"{self.endpoints[index]}/v3/{path}"
            # One exchange per attempt: its deadline covers connect, headers and the whole
            # body; ``on_exchange`` lets the caller's owner end it from another thread.
            exchange = Exchange()
            if on_exchange is not None:
                on_exchange(exchange)
            deadline = WATCHDOG.arm(exchange, self.call_deadline, "deadline")
            try:
                with running(exchange):
                    response = session.post(
                        url,
                        json=body,
                        headers=headers,
                        timeout=timeout or self.timeout,
                        allow_redirects=False,
                        stream=True,
                    )
                    try:
                        payload = _read_capped(response, self.max_reply_bytes, url)
                    finally:
                        response.close()
                    if exchange.ended is not None:
                        # Shut down mid-reply: the EOF it caused can read as a short reply.
                        raise OSError(f"exchange ended ({exchange.ended})")
            except EtcdReplyTooLarge:
                session.close()  # the rest of the reply is never read
                raise
            except (requests.RequestException, OSError) as exc:
                session.close()  # a broken connection must not be reused
                if exchange.ended == "closed":
                    raise EtcdUnavailable(f"{url}: call ended: its owner closed") from None
                if exchange.ended == "deadline":
                    errors.append(
                        f"{self.endpoints[index]}: no complete reply within "
                        f"{self.call_deadline:g} s (call_deadline)"
                    )
                else:
                    errors.append(
                        f"{self.endpoints[index]}: {why_unreachable(exc, self._timeouts)}"
                    )
                continue
            finally:
                deadline.cancel()
                exchange.finish()
            if response.status_code >= 500 and response.status_code != 501:
                errors.append(f"{self.endpoints[index]}: HTTP {response.status_code}")
                continue
            self._current = index
            try:
                obj = json.loads(payload) if payload else {}
            except (ValueError, RecursionError):
                raise EtcdBadReply(f"{url}: reply is not JSON") from None
            if not isinstance(obj, dict):
                raise EtcdBadReply(f"{url}: reply is not a JSON object")
            if response.status_code != 200:
                message = str(obj.get("message") or obj.get("error") or "")[:200]
                code = obj.get("code")
                raise EtcdRequestFailed(
                    f"{url}: HTTP {response.status_code}: {message}",
                    status=response.status_code,
                    code=code if isinstance(code, int) else None,
                )
            return obj
        raise EtcdUnavailable(f"no etcd endpoint answered ({'; '.join(errors)}): {NO_ETCD_HINT}")

    # --- KV ------------------------------------------------------------------------------------

    def get_prefix(
        self, prefix: bytes, *, on_exchange: Callable[[Exchange], object] | None = None
    ) -> RangeReply:
        """Every key under ``prefix``, the store revision the read was taken at and the
        cluster that answered. An entry that does not decode (bad base64, a revision that is
        not an int64 or lies beyond the reply's own revision) is skipped and counted in
        ``malformed``; a reply without a header is :class:`EtcdBadReply`."""
        obj = self._post(
            "kv/range",
            {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))},
            on_exchange=on_exchange,
        )
        revision, cluster = _header(obj, "etcd list")
        raw_kvs = obj.get("kvs") or []
        if not isinstance(raw_kvs, list):
            raise EtcdBadReply("etcd list: kvs is not a list (not etcd's reply)")
        kvs: list[KeyValue] = []
        malformed = 0
        for raw in raw_kvs:
            try:
                kv = _kv(raw)
            except _UNDECODABLE:
                malformed += 1
                continue
            if not 0 < kv.mod_revision <= revision:
                malformed += 1  # written after the read it is part of: not etcd's
                continue
            kvs.append(kv)
        return RangeReply(revision, cluster, kvs, malformed)

    def get(self, key: bytes) -> KeyValue | None:
        obj = self._post("kv/range", {"key": _b64(key)})
        kvs = obj.get("kvs") or ()
        try:
            return _kv(kvs[0]) if kvs else None
        except (*_UNDECODABLE, KeyError, AttributeError) as exc:
            raise EtcdBadReply(f"etcd get: reply does not decode ({exc})") from None

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Store ``value``; return the revision of the put."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _header_revision(self._post("kv/put", body))

    def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key under ``prefix``; return how many."""
        obj = self._post(
            "kv/deleterange",
            {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))},
        )
        return _int(obj.get("deleted"))

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (physical: done when the call returns)."""
        self._post("kv/compaction", {"revision": str(revision), "physical": True})

    def revision(self) -> int:
        """The store's current revision (one cheap range call)."""
        return _header_revision(self._post("kv/range", {"key": _b64(b"\0"), "limit": "1"}))

    # --- leases --------------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> tuple[int, int]:
        """A new lease; return ``(id, granted TTL in seconds)``."""
        obj = self._post("lease/grant", {"TTL": str(ttl)})
        if obj.get("error"):
            raise EtcdRequestFailed(f"lease grant: {obj['error']}", status=200)
        return _int(obj.get("ID")), _int(obj.get("TTL"))

    def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease``; return its TTL, 0 when it no longer exists (expired or revoked)."""
        obj = self._post("lease/keepalive", {"ID": str(lease)})
        result = obj.get("result")
        if not isinstance(result, dict):
            error = obj.get("error")
            if error:
                raise EtcdUnavailable(f"lease keep-alive: {str(error)[:200]}")
            return 0
        return _int(result.get("TTL"))

    def lease_revoke(self, lease: int) -> None:
        """Revoke ``lease``: etcd deletes every key attached to it, at once."""
        self._post("lease/revoke", {"ID": str(lease)})

    # --- watch ---------------------------------------------------------------------------------

    def watch_prefix(
        self,
        prefix: bytes,
        *,
        start_revision: int,
        read_timeout: float,
        on_exchange: Callable[[Exchange], object] | None = None,
    ) -> WatchStream:
        """Open a watch on ``prefix`` from ``start_revision`` (with the previous values).

        The open itself is bounded by ``call_deadline``; afterwards a stream that completes no
        message for ``read_timeout`` seconds raises :class:`WatchIdle` from the iteration (a
        half-open connection or a trickling proxy is found that way; the caller re-opens from
        its revision + 1). ``on_exchange`` gets each attempt's exchange, which its owner may
        end from another thread (``close()``).
        """
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_range_end(prefix)),
                "start_revision": str(start_revision),
                "prev_kv": True,
            }
        }
        headers = self._auth_headers()
        errors: list[str] = []
        count = len(self.endpoints)
        for step in range(count):
            index = (self._current + step) % count
            endpoint = self.endpoints[index]
            # Its own session: a watch holds its connection for as long as it runs.
            session = self._new_session()
            exchange = Exchange()
            if on_exchange is not None:
                on_exchange(exchange)
            deadline = WATCHDOG.arm(exchange, self.call_deadline, "deadline")
            try:
                with running(exchange):
                    response = session.post(
                        f"{endpoint}/v3/watch",
                        json=body,
                        headers=headers,
                        stream=True,
                        timeout=(self.timeout[0], read_timeout),
                        allow_redirects=False,
                    )
                    if exchange.ended is not None:
                        response.close()  # shut down mid-headers: not a real acceptance
                        raise OSError(f"exchange ended ({exchange.ended})")
            except (requests.RequestException, OSError) as exc:
                session.close()
                if exchange.ended == "closed":
                    raise EtcdUnavailable(f"{endpoint}: watch open ended: owner closed") from None
                why = why_unreachable(exc, self._timeouts)
                if exchange.ended == "deadline":
                    why = f"not accepted within {self.call_deadline:g} s (call_deadline)"
                errors.append(f"{endpoint}: {why}")
                continue
            finally:
                deadline.cancel()
            if response.status_code != 200:
                status = response.status_code
                response.close()
                session.close()
                if status == 401 and headers is not None:
                    # The token expired: renew it; the caller's next attempt uses it.
                    self._authenticate(headers["Authorization"])
                errors.append(f"{endpoint}: watch answered HTTP {status}")
                continue
            self._current = index
            denied = None
            if headers is not None:
                denied = functools.partial(self._authenticate, headers["Authorization"])
            return WatchStream(
                response,
                session,
                endpoint,
                denied,
                exchange=exchange,
                idle_timeout=read_timeout,
                max_message_bytes=self.max_watch_message_bytes,
            )
        raise EtcdUnavailable(
            f"no etcd endpoint accepted the watch ({'; '.join(errors)}): {NO_ETCD_HINT}"
        )
