"""Strict checks of bootstrap-server replies and of caller input (spec/protocol.md, HTTP-20..29).

Shared by the client (which must never cache a half-valid reply) and the server (which must
answer bad input with a 4xx, never a crash). Everything here is pure: no I/O, no state.

Type rules: an integer field must be a JSON integer, and ``True``/``False`` are *not*
integers here even though ``bool`` subclasses ``int`` in Python. Unknown extra keys in a
topology reply are carried in ``Topology.extra`` (bounded), never rejected, because old SGLang
clients broke when servers added fields.

Rank ips are IP literals only (HTTP-25): a host name would be resolved by libzmq on the
context's single I/O thread, where one resolver that never answers delays every socket of the
process. :func:`rank_ip_problem` is the one rule, used by the server on registration, by the
client on every route reply and by the ack listener on its bind address.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import NamedTuple

from statemachine.errors import InvalidArgument

#: Largest reply body the client reads; anything larger is a malformed reply (HTTP-24).
MAX_REPLY_BYTES = 1 << 20

# Bounds on topology fields (HTTP-63), shared by the server (registration) and the client
# (topology reply). Generous for any real deployment, small enough that a bogus claim cannot
# make the server wait for billions of ranks or overflow an int64 anywhere.
#: Largest tp, cp, dp or pp size.
MAX_PARALLEL_SIZE = 4096
#: Largest number of ranks (dp x cp x tp x pp) in one topology.
MAX_WORLD = 65536
MAX_PAGE_SIZE = 1 << 20
#: Longest short string field (kv_cache_dtype, load_balance_method, decode_allocation_policy).
MAX_LABEL = 64
#: Carried-through fields we do not interpret: at most this many, key and JSON value bounded.
MAX_EXTRA_FIELDS = 16
MAX_EXTRA_KEY = 64
MAX_EXTRA_VALUE_BYTES = 1024
#: ``dsv41_spec_layout`` (a JSON object) serialised.
MAX_LAYOUT_BYTES = 4096
INT64_MAX = 2**63 - 1

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens, 1-63 chars
# each, 253 in all, optional trailing dot. ASCII only: IDNA names arrive already encoded.
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?", re.ASCII)
_ALL_DIGITS = re.compile(r"[0-9]+", re.ASCII)


class RouteReply(NamedTuple):
    """Where one prefill rank listens, as answered by ``GET /route``."""

    rank_ip: str
    rank_port: int
    #: ``X-Bootstrap-Instance-Id`` of the answering server, None when it sent none.
    instance_id: str | None


_EMPTY: Mapping[str, object] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TopologyClaim:
    """What every rank of one prefill claims and must agree on: its parallel sizes, page size and
    KV dtype. The one definition of the topology's fields: the bootstrap server keys its
    candidate topologies by it (HTTP-54), the etcd layout's rank records extend it, and the
    decode's :class:`Topology` reply extends it with what is taken from the first registration.
    """

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None

    @property
    def world(self) -> int:
        """How many ranks the claim names (dp x cp x tp x pp)."""
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    def claim(self) -> TopologyClaim:
        """The claim alone (a subclass's object reduced to the fields two ranks compare)."""
        if type(self) is TopologyClaim:
            return self
        return TopologyClaim(*(getattr(self, name) for name in CLAIM_FIELDS))

    def claim_items(self) -> dict[str, object]:
        """The claim as reply keys (each field is sent under its own name)."""
        return {name: getattr(self, name) for name in CLAIM_FIELDS}

    def describe(self) -> str:
        return (
            f"dp={self.dp_size} cp={self.attn_cp_size} tp={self.attn_tp_size} "
            f"pp={self.pp_size} page_size={self.page_size} kv_cache_dtype={self.kv_cache_dtype}"
        )


#: The claim's field names, read from the class (never spelled out again).
CLAIM_FIELDS = tuple(f.name for f in fields(TopologyClaim))


@dataclass(frozen=True, slots=True)
class Topology(TopologyClaim):
    """The prefill's parallel layout, as answered by the ``-1`` topology query (HTTP-22): the
    claim, plus what the server takes from the topology's first registration."""

    follow_bootstrap_room: bool | None
    instance_id: str | None
    enable_dsa_cache_layer_split: bool | None = None
    #: The prefill's HTTP API port (SGLang re-triggers a prefill through it).
    prefill_http_port: int | None = None
    decode_allocation_policy: str | None = None
    dsv41_spec_layout: Mapping[str, object] | None = field(default=None, hash=False)
    #: The prefill's KV layout name (SGLang: attention backend / SGLANG_DSV4_KV_LAYOUT).
    kv_layout: str | None = None
    #: Each prefill tp (MLA) or cp rank owns only some KV pages: pull from all (PLAN-6/7).
    enable_kv_cache_sharding: bool | None = None
    #: Reply keys this version does not interpret, carried through (read-only, bounded).
    extra: Mapping[str, object] = field(default_factory=lambda: _EMPTY, hash=False)


#: Topology keys the client parses (rank-plan switches of SGLang 0.5.23, spec/plans.md) that
#: the reference server does not interpret: it carries them through from the first
#: registration, as SGLang's server does, so they stay out of its known-key set.
PLAN_KEYS = frozenset(("kv_layout", "enable_kv_cache_sharding"))
#: Keys of the topology reply (reference: SGLang's decode reads these): every field of
#: :class:`Topology` but the instance id (a header), the carried-through extras and PLAN_KEYS.
TOPOLOGY_KEYS = frozenset(
    f.name for f in fields(Topology) if f.name not in {"instance_id", "extra"} | PLAN_KEYS
)


# --- scalar checks ----------------------------------------------------------------------------


def is_int(value: object) -> bool:
    """A JSON integer: ``int`` but not ``bool``."""
    return type(value) is int


def _literal_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an IP literal is not a peer one can connect to, or None."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _literal_problem(address.ipv4_mapped)
    if address.is_unspecified or (
        isinstance(address, ipaddress.IPv4Address) and address.packed[0] == 0
    ):
        return "an unspecified address (0.0.0.0/8 or ::) names no peer"
    if address.is_multicast:
        return "a multicast address names no single peer"
    if address == _BROADCAST:
        return "the broadcast address names no single peer"
    return None


_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def rank_ip_problem(ip: object) -> str | None:
    """Why ``ip`` cannot be a ZMQ peer address, or None if it can (HTTP-25).

    Accepted: an IPv4 or IPv6 literal (ASCII, no IPv6 scope id) that is not unspecified,
    multicast or the broadcast address. Host names are refused so that nothing is ever resolved
    on libzmq's shared I/O thread; scope ids are refused because ``connect()`` resolves them to
    an interface and fails on an unknown one.
    """
    if not isinstance(ip, str):
        return f"must be a str, got {type(ip).__name__}"
    if not ip or len(ip) > 45 or not ip.isascii():
        return "must be an IPv4 or IPv6 literal"
    if "%" in ip:
        return "must not carry an IPv6 scope id (%...)"
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return "must be an IPv4 or IPv6 literal (host names are not resolved)"
    return _literal_problem(address)


def is_rank_ip(ip: object) -> bool:
    """True when :func:`rank_ip_problem` finds nothing wrong with ``ip``."""
    return rank_ip_problem(ip) is None


def require_rank_ip(name: str, ip: object, *, next_step: str = "") -> str:
    """``ip`` if it is a peer IP literal, else :class:`InvalidArgument` saying why (and, given
    ``next_step``, what to pass instead)."""
    problem = rank_ip_problem(ip)
    if problem is not None:
        text = f"{name} {ip!r} is not usable: {problem}"
        raise InvalidArgument(f"{text}; {next_step}" if next_step else text)
    return ip  # type: ignore[return-value]


def is_valid_host(host: object) -> bool:
    """A bootstrap address host: a peer IP literal (see :func:`rank_ip_problem`) or an
    RFC 1123 host name (no all-numeric last label)."""
    if not isinstance(host, str) or not host or len(host) > 253 or not host.isascii():
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return rank_ip_problem(host) is None
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
    if "://" in addr:
        # "no scheme" alone reads as "you gave no scheme": say what to write instead.
        raise InvalidArgument(
            f"bad bootstrap address {addr!r}: give host:port without a scheme "
            "(e.g. '10.0.0.7:8998', '[fd00::7]:8998')"
        )
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
    """A non-negative integer argument (rank, room) that fits an int64."""
    if not is_int(value) or not 0 <= value <= INT64_MAX:  # type: ignore[operator]
        raise InvalidArgument(f"{name} must be an int in 0..2**63-1, got {value!r}")
    return value  # type: ignore[return-value]


def require_rank(*, dp_rank: object, cp_rank: object, tp_rank: object, pp_rank: object) -> None:
    """The four ranks of a rank query, each a :func:`require_index`: the one check every
    source's ``get_rank`` makes before it asks anything."""
    require_index("dp_rank", dp_rank)
    require_index("cp_rank", cp_rank)
    require_index("tp_rank", tp_rank)
    require_index("pp_rank", pp_rank)


def json_size(value: object) -> int:
    """Bytes of ``value`` as compact JSON (what a bound on a carried value measures)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def bounded_extra(items: Mapping[str, object], known: frozenset[str]) -> dict[str, object]:
    """The keys of ``items`` not in ``known``, bounded: at most MAX_EXTRA_FIELDS keys of at most
    MAX_EXTRA_KEY chars whose JSON value is at most MAX_EXTRA_VALUE_BYTES; the rest is dropped
    (a field we do not interpret is carried when it fits, never a reason to fail)."""
    extra: dict[str, object] = {}
    for key, value in items.items():
        if key in known or len(key) > MAX_EXTRA_KEY:
            continue
        try:
            if json_size(value) > MAX_EXTRA_VALUE_BYTES:
                continue
        except (TypeError, ValueError, RecursionError):
            continue
        extra[key] = value
        if len(extra) == MAX_EXTRA_FIELDS:
            break
    return extra
