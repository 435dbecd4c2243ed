"""etcd's v3 JSON gateway, as bytes: the messages its replies carry and their defensive decoding.

What :class:`~statemachine.discovery.gateway.EtcdGateway` and
:class:`~statemachine.discovery.watch_stream.WatchStream` read: key-values, watch events and
messages, a list's reply; every ``bytes`` field base64 and every int64 a JSON string, as the
gateway encodes them (proto3 JSON: an absent field is its default). Decoding refuses what etcd
would not send (``ValueError``, ``TypeError``, ``binascii.Error``: :data:`UNDECODABLE`), so a
caller can count one bad entry and skip it; a reply without etcd's header is
:class:`~statemachine.errors.EtcdBadReply`. Also here: a body read under a size cap, and the
one wording of an endpoint's failure.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import requests

from statemachine.errors import EtcdBadReply, EtcdReplyTooLarge
from statemachine.http_exchange import transport_reason

#: Bytes asked of the socket per read: also the most a declared chunk size makes us buffer.
READ_CHUNK = 64 << 10
#: etcd revisions are int64.
_MAX_INT64 = (1 << 63) - 1


def why_unreachable(exc: BaseException, timeouts: tuple[float, float, float] | None = None) -> str:
    """One endpoint's failure in a few words (refused, timed out, not resolved, reset): the
    package's one wording of a failed exchange
    (:func:`~statemachine.http_exchange.transport_reason`), naming etcd as what should have
    answered."""
    return transport_reason(exc, None, timeouts, server="etcd")


def read_capped(response: requests.Response, limit: int, what: str) -> bytes:
    """The whole body, or :class:`EtcdReplyTooLarge` as soon as it is seen to pass ``limit``."""
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise EtcdReplyTooLarge(
            f"{what}: reply of {int(declared)} bytes refused (cap {limit}: max_reply_bytes)"
        )
    body = bytearray()
    for chunk in response.iter_content(chunk_size=READ_CHUNK):
        body += chunk
        if len(body) > limit:
            raise EtcdReplyTooLarge(
                f"{what}: reply longer than {limit} bytes refused (max_reply_bytes)"
            )
    return bytes(body)


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


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object) -> bytes:
    """A bytes field: absent means empty (proto3 default); anything but base64 is refused."""
    if text is None:
        return b""
    if not isinstance(text, str):
        raise ValueError(f"not a base64 string: {type(text).__name__}")
    return base64.b64decode(text, validate=True)


def decode_int(value: object, *, unsigned: bool = False) -> int:
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
UNDECODABLE = (ValueError, TypeError, binascii.Error)


def decode_kv(obj: object) -> KeyValue:
    if not isinstance(obj, dict):
        raise ValueError("a key-value is not a JSON object")
    return KeyValue(
        key=unb64(obj.get("key")),
        value=unb64(obj.get("value")),
        create_revision=decode_int(obj.get("create_revision")),
        mod_revision=decode_int(obj.get("mod_revision")),
        version=decode_int(obj.get("version")),
        lease=decode_int(obj.get("lease")),
    )


def reply_header(obj: Mapping[str, Any], what: str) -> tuple[int, int]:
    """``(revision, cluster id)`` of a reply's header; :class:`EtcdBadReply` without one
    (etcd puts a header on every reply: a reply without it is not etcd's)."""
    header = obj.get("header")
    if not isinstance(header, dict):
        raise EtcdBadReply(f"{what}: reply header is not an object (not etcd's reply)")
    try:
        revision, cluster = (
            decode_int(header.get("revision")),
            decode_int(header.get("cluster_id"), unsigned=True),
        )
    except ValueError as exc:
        raise EtcdBadReply(f"{what}: reply header unreadable ({exc})") from None
    if revision < 1:
        raise EtcdBadReply(f"{what}: reply header revision {revision} (etcd's start at 1)")
    return revision, cluster


def header_revision(obj: Mapping[str, Any]) -> int:
    header = obj.get("header")
    return decode_int(header.get("revision")) if isinstance(header, Mapping) else 0


class RangeReply(NamedTuple):
    """A list of a prefix: the store revision it was read at, the cluster that answered, the
    keys, and how many entries did not decode (skipped, never served)."""

    revision: int
    cluster_id: int
    kvs: list[KeyValue]
    malformed: int = 0
