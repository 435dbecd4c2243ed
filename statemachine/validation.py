"""Strict checks of bootstrap-server replies and of caller input (spec/protocol.md, HTTP-20..29).

Shared by the client (which must never cache a half-valid reply) and the server (which must
answer bad input with a 4xx, never a crash). Everything here is pure: no I/O, no state.

Type rules: an integer field must be a JSON integer, and ``True``/``False`` are *not*
integers here even though ``bool`` subclasses ``int`` in Python. Unknown extra keys in a reply
are ignored, because old SGLang clients broke when servers added fields.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from statemachine.errors import BootstrapError, MalformedReply

#: Largest reply body the client reads; anything larger is a malformed reply (HTTP-24).
MAX_REPLY_BYTES = 1 << 20

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens, 1-63 chars
# each, 253 in all, optional trailing dot. ASCII only: IDNA names arrive already encoded.
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?", re.ASCII)
_ALL_DIGITS = re.compile(r"[0-9]+", re.ASCII)


class InvalidArgument(BootstrapError, ValueError):
    """The caller passed a bad address, rank or room: rejected before anything is sent."""


class RouteReply(NamedTuple):
    """Where one prefill rank listens, as answered by ``GET /route``."""

    rank_ip: str
    rank_port: int
    #: ``X-Bootstrap-Instance-Id`` of the answering server, None when it sent none.
    instance_id: str | None


@dataclass(frozen=True, slots=True)
class Topology:
    """The prefill's parallel layout, as answered by the ``-1`` topology query."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool | None
    instance_id: str | None


# --- scalar checks ----------------------------------------------------------------------------


def is_int(value: object) -> bool:
    """A JSON integer: ``int`` but not ``bool``."""
    return type(value) is int


def is_valid_host(host: object) -> bool:
    """An IPv4/IPv6 literal or an RFC 1123 host name (no all-numeric last label)."""
    if not isinstance(host, str) or not host or len(host) > 253:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    if _HOSTNAME.fullmatch(host) is None:
        return False
    # "01.2.3.4" is not an IP literal (leading zeros) and must not pass as a name either.
    return _ALL_DIGITS.fullmatch(host.rstrip(".").rsplit(".", 1)[-1]) is None


def is_valid_port(port: object) -> bool:
    return type(port) is int and 1 <= port <= 65535


def parse_addr(addr: object) -> tuple[str, int]:
    """Split a ``"host:port"`` bootstrap address (IPv6 as ``"[::1]:8998"``); raise on junk."""
    if not isinstance(addr, str):
        raise InvalidArgument(f"bootstrap address must be a str, got {type(addr).__name__}")
    host, sep, port_text = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise InvalidArgument(f"bad bootstrap address {addr!r}: brackets are for IPv6")
    elif ":" in host:
        raise InvalidArgument(f"bad bootstrap address {addr!r}: IPv6 needs [brackets]")
    if not sep or _ALL_DIGITS.fullmatch(port_text) is None or not is_valid_host(host):
        raise InvalidArgument(f"bad bootstrap address {addr!r}: expected 'host:port'")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise InvalidArgument(f"bad bootstrap address {addr!r}: port out of range")
    return host, port


def require_index(name: str, value: object) -> int:
    """A non-negative integer argument (rank, room)."""
    if not is_int(value) or value < 0:  # type: ignore[operator]
        raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
    return value  # type: ignore[return-value]


# --- reply parsing ----------------------------------------------------------------------------


def parse_json_object(body: bytes, *, addr: str, status: int) -> dict[str, object]:
    """Decode a reply body that must be a JSON object."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MalformedReply(
            f"{addr}: reply is not JSON ({exc})", addr=addr, status=status
        ) from None
    if not isinstance(value, dict):
        raise MalformedReply(
            f"{addr}: reply is a JSON {type(value).__name__}, not an object",
            addr=addr,
            status=status,
        )
    return value


def _field(
    obj: Mapping[str, object], key: str, want: str, *, addr: str, status: int
) -> MalformedReply:
    shown = repr(obj[key])[:80] if key in obj else "missing"
    return MalformedReply(
        f"{addr}: reply field {key!r} must be {want}, got {shown}", addr=addr, status=status
    )


def _positive_int(obj: Mapping[str, object], key: str, *, addr: str, status: int) -> int:
    value = obj.get(key)
    if not is_int(value) or value < 1:  # type: ignore[operator]
        raise _field(obj, key, "an int >= 1", addr=addr, status=status)
    return value  # type: ignore[return-value]


def route_reply(
    obj: Mapping[str, object], *, addr: str, status: int, instance_id: str | None
) -> RouteReply:
    """``{"rank_ip": host, "rank_port": 1..65535}``; extra keys ignored (HTTP-21)."""
    ip = obj.get("rank_ip")
    if not is_valid_host(ip):
        raise _field(obj, "rank_ip", "an IP literal or host name", addr=addr, status=status)
    port = obj.get("rank_port")
    if not is_valid_port(port):
        raise _field(obj, "rank_port", "an int in 1..65535", addr=addr, status=status)
    return RouteReply(ip, port, instance_id)  # type: ignore[arg-type]


def topology_reply(
    obj: Mapping[str, object], *, addr: str, status: int, instance_id: str | None
) -> Topology:
    """The four sizes are required ints >= 1; the rest may be absent or null (HTTP-22)."""
    page_size = obj.get("page_size")
    if page_size is not None and (not is_int(page_size) or page_size < 1):  # type: ignore[operator]
        raise _field(obj, "page_size", "null or an int >= 1", addr=addr, status=status)
    dtype = obj.get("kv_cache_dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise _field(obj, "kv_cache_dtype", "null or a str", addr=addr, status=status)
    follow = obj.get("follow_bootstrap_room")
    if follow is not None and not isinstance(follow, bool):
        raise _field(obj, "follow_bootstrap_room", "null or a bool", addr=addr, status=status)
    return Topology(
        attn_tp_size=_positive_int(obj, "attn_tp_size", addr=addr, status=status),
        attn_cp_size=_positive_int(obj, "attn_cp_size", addr=addr, status=status),
        dp_size=_positive_int(obj, "dp_size", addr=addr, status=status),
        pp_size=_positive_int(obj, "pp_size", addr=addr, status=status),
        page_size=page_size,  # type: ignore[arg-type]
        kv_cache_dtype=dtype,
        follow_bootstrap_room=follow,
        instance_id=instance_id,
    )


def dp_ranks_reply(
    obj: Mapping[str, object], rooms: Mapping[str, int], *, addr: str, status: int
) -> dict[int, int]:
    """``{"<room>": dp_rank}`` for the asked rooms the server knows; other keys ignored (HTTP-23).

    ``rooms`` maps each asked room's decimal text to the room, so a reply key is matched
    exactly (no ``int()`` leniency for ``" 7"`` or ``"0x7"``).
    """
    result: dict[int, int] = {}
    for text, room in rooms.items():
        if text not in obj:
            continue
        dp_rank = obj[text]
        if not is_int(dp_rank) or dp_rank < 0:  # type: ignore[operator]
            raise _field(obj, text, "a non-negative int", addr=addr, status=status)
        result[room] = dp_rank  # type: ignore[assignment]
    return result
