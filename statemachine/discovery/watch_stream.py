"""An open etcd watch, read as messages: :class:`WatchStream`.

The gateway streams a watch as JSON objects, one a line; each is decoded here into a
:class:`~statemachine.discovery.etcd_wire.WatchMessage`, or refused as a typed error (the
class doc lists them). Idle means no *complete* message: the call deadline's watchdog ends
the exchange when none arrived for the idle timeout, however many bytes trickled in.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable, Iterator

import requests
from urllib3.exceptions import ReadTimeoutError

from statemachine.call_deadline import WATCHDOG, Exchange
from statemachine.discovery.etcd_wire import (
    READ_CHUNK,
    UNDECODABLE,
    WatchEvent,
    WatchMessage,
    decode_int,
    decode_kv,
    reply_header,
    why_unreachable,
)
from statemachine.errors import (
    EtcdBadReply,
    EtcdReplyTooLarge,
    EtcdUnavailable,
    WatchCompacted,
    WatchIdle,
)

#: Largest single watch message buffered (etcd's default request limit is 1.5 MiB, so one
#: transaction's events fit many times over).
DEFAULT_MAX_WATCH_MESSAGE_BYTES = 8 << 20


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
            for chunk in self._response.iter_content(chunk_size=READ_CHUNK):
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
            compact = decode_int(result.get("compact_revision"))
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
        revision, cluster = reply_header(result, f"{self._endpoint}: watch")
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
                    kv=decode_kv(raw.get("kv")),
                    prev_kv=decode_kv(prev) if prev is not None else None,
                )
            except (*UNDECODABLE, AttributeError):
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
