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

The replies' messages and their decoding are :mod:`statemachine.discovery.etcd_wire`'s, an open
watch's reader :mod:`statemachine.discovery.watch_stream`'s; their public names are importable
from here too (``__all__``), as before the split.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from statemachine.call_deadline import WATCHDOG, Exchange, running
from statemachine.discovery.etcd_wire import (
    UNDECODABLE,
    KeyValue,
    RangeReply,
    WatchEvent,
    WatchMessage,
    b64,
    decode_int,
    decode_kv,
    header_revision,
    prefix_range_end,
    read_capped,
    reply_header,
    why_unreachable,
)
from statemachine.discovery.watch_stream import DEFAULT_MAX_WATCH_MESSAGE_BYTES, WatchStream
from statemachine.errors import (
    EtcdBadReply,
    EtcdReplyTooLarge,
    EtcdRequestFailed,
    EtcdUnavailable,
    InvalidArgument,
    WatchIdle,
)
from statemachine.http_exchange import ExchangeAdapter

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


#: Largest reply body read (a list of the prefix, mostly): about 20,000 rank keys of ~800
#: bytes each as the gateway encodes them. A longer reply is refused as soon as it is seen to
#: be longer (its Content-Length, or the bytes read so far), never read to its end.
DEFAULT_MAX_REPLY_BYTES = 16 << 20
#: Total time one exchange with one endpoint may take, reply body included.
DEFAULT_CALL_DEADLINE = 10.0


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """Client TLS for an etcd cluster served over https (``--cert-file`` etc. on the server)."""

    #: CA bundle that signed the server certificates (``--trusted-ca-file``).
    ca_file: str | None = None
    #: client certificate and key, when the cluster requires them (``--client-cert-auth``).
    cert_file: str | None = None
    key_file: str | None = None


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
                        payload = read_capped(response, self.max_reply_bytes, url)
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
            {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix))},
            on_exchange=on_exchange,
        )
        revision, cluster = reply_header(obj, "etcd list")
        raw_kvs = obj.get("kvs") or []
        if not isinstance(raw_kvs, list):
            raise EtcdBadReply("etcd list: kvs is not a list (not etcd's reply)")
        kvs: list[KeyValue] = []
        malformed = 0
        for raw in raw_kvs:
            try:
                kv = decode_kv(raw)
            except UNDECODABLE:
                malformed += 1
                continue
            if not 0 < kv.mod_revision <= revision:
                malformed += 1  # written after the read it is part of: not etcd's
                continue
            kvs.append(kv)
        return RangeReply(revision, cluster, kvs, malformed)

    def get(self, key: bytes) -> KeyValue | None:
        obj = self._post("kv/range", {"key": b64(key)})
        kvs = obj.get("kvs") or ()
        try:
            return decode_kv(kvs[0]) if kvs else None
        except (*UNDECODABLE, KeyError, AttributeError) as exc:
            raise EtcdBadReply(f"etcd get: reply does not decode ({exc})") from None

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Store ``value``; return the revision of the put."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return header_revision(self._post("kv/put", body))

    def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key under ``prefix``; return how many."""
        obj = self._post(
            "kv/deleterange",
            {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix))},
        )
        return decode_int(obj.get("deleted"))

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (physical: done when the call returns)."""
        self._post("kv/compaction", {"revision": str(revision), "physical": True})

    def revision(self) -> int:
        """The store's current revision (one cheap range call)."""
        return header_revision(self._post("kv/range", {"key": b64(b"\0"), "limit": "1"}))

    # --- leases --------------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> tuple[int, int]:
        """A new lease; return ``(id, granted TTL in seconds)``."""
        obj = self._post("lease/grant", {"TTL": str(ttl)})
        if obj.get("error"):
            raise EtcdRequestFailed(f"lease grant: {obj['error']}", status=200)
        return decode_int(obj.get("ID")), decode_int(obj.get("TTL"))

    def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease``; return its TTL, 0 when it no longer exists (expired or revoked)."""
        obj = self._post("lease/keepalive", {"ID": str(lease)})
        result = obj.get("result")
        if not isinstance(result, dict):
            error = obj.get("error")
            if error:
                raise EtcdUnavailable(f"lease keep-alive: {str(error)[:200]}")
            return 0
        return decode_int(result.get("TTL"))

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
                "key": b64(prefix),
                "range_end": b64(prefix_range_end(prefix)),
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
