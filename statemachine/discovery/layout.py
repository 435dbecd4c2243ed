"""Where prefill ranks are written in etcd, and what is written (docs/etcd.md, "Key layout").

One key per prefill rank::

    <prefix>/<bootstrap addr>/<dp>/<cp>/<tp>/<pp>
    e.g. /pd-bootstrap/v1/ranks/10.0.0.7:8998/0/0/1/0

``<bootstrap addr>`` is the prefill's bootstrap address exactly as decode requests name it
(``host:port``, IPv6 bracketed); the four ranks are decimal without leading zeros, the dp rank
named as SGLang's bootstrap server names it (the system dp rank when there are several system
dp groups, else the attention dp rank). The value is the rank's ``PUT /route`` body as JSON plus
``"instance_id"`` and ``"registration_id"`` (see :func:`encode_value`), attached to its
registrar's lease. Both sides use only the functions here,
so the layout is defined once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from statemachine.errors import BootstrapError, InvalidArgument, MalformedValue
from statemachine.validation import (
    MAX_PARALLEL_SIZE,
    PLAN_KEYS,
    TOPOLOGY_KEYS,
    Topology,
    TopologyClaim,
    is_int,
    is_valid_port,
    parse_addr,
    rank_ip_problem,
)
from statemachine.wire.http import topology_reply

DEFAULT_PREFIX = "/pd-bootstrap/v1/ranks"
MAX_INSTANCE_ID = 128
MAX_VALUE_BYTES = 64 * 1024


class RankKey(NamedTuple):
    addr: str
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int


@dataclass(frozen=True, slots=True)
class RankRecord(TopologyClaim):
    """One rank's registration as the decode side keeps it (validated): the topology it claims
    (the fields of :class:`~statemachine.validation.TopologyClaim`), where it listens, and the
    etcd write it came from."""

    rank_ip: str
    rank_port: int
    instance_id: str
    follow_bootstrap_room: bool | None
    #: etcd ``mod_revision`` of the put that wrote this value
    mod_revision: int
    raw: bytes
    #: The topology this rank claims (every rank of one instance claims the same), with the
    #: dp-rank rule the decode follows: computed once, compared on every change of the prefill.
    layout: tuple[TopologyClaim, bool | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A frozen dataclass: set the derived field once, as __init__ itself sets the others.
        object.__setattr__(self, "layout", (self.claim(), self.follow_bootstrap_room))


def normalise_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
        raise InvalidArgument(f"prefix must start with '/' and not end with it, got {prefix!r}")
    return prefix


def address_prefix(prefix: str, addr: str) -> bytes:
    """Every key of one prefill: ``<prefix>/<addr>/``."""
    return f"{prefix}/{addr}/".encode()


def rank_key(prefix: str, key: RankKey) -> bytes:
    parse_addr(key.addr)
    return f"{prefix}/{key.addr}/{key.dp_rank}/{key.cp_rank}/{key.tp_rank}/{key.pp_rank}".encode()


def _decimal(text: str) -> int:
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        raise MalformedValue(f"rank {text!r} is not a canonical decimal")
    if len(text) > 9:
        raise MalformedValue(f"rank {text!r} out of range")
    return int(text)


def parse_key(prefix: str, key: bytes) -> RankKey:
    """The rank a key names; :class:`MalformedValue` when the key is not in the layout."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedValue("key is not UTF-8") from None
    head = prefix + "/"
    if not text.startswith(head):
        raise MalformedValue(f"key {text[:100]!r} is outside {head!r}")
    parts = text[len(head) :].rsplit("/", 4)
    if len(parts) != 5:
        raise MalformedValue(f"key {text[:100]!r} is not <addr>/<dp>/<cp>/<tp>/<pp>")
    addr = parts[0]
    try:
        parse_addr(addr)
    except InvalidArgument as exc:
        raise MalformedValue(str(exc)) from None
    dp, cp, tp, pp = (_decimal(part) for part in parts[1:])
    return RankKey(addr, dp, cp, tp, pp)


def registration_key(payload: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(dp, cp, tp, pp) of a ``PUT /route`` body, dp named as the bootstrap server names it."""
    sizes: dict[str, tuple[int, int]] = {}
    for size_field, rank_field in (
        ("attn_tp_size", "attn_tp_rank"),
        ("attn_cp_size", "attn_cp_rank"),
        ("attn_dp_size", "attn_dp_rank"),
        ("pp_size", "pp_rank"),
        ("system_dp_size", "system_dp_rank"),
    ):
        size, rank = payload.get(size_field), payload.get(rank_field)
        if (
            not is_int(size)
            or not 1 <= size <= MAX_PARALLEL_SIZE  # type: ignore[operator]
            or not is_int(rank)
            or not 0 <= rank < size  # type: ignore[operator]
        ):
            raise MalformedValue(
                f"{rank_field!r}/{size_field!r} must be ints, 0 <= rank < size <= "
                f"{MAX_PARALLEL_SIZE}"
            )
        sizes[rank_field] = (rank, size)  # type: ignore[assignment]
    system_rank, system_size = sizes["system_dp_rank"]
    dp_rank = sizes["attn_dp_rank"][0] if system_size == 1 else system_rank
    return dp_rank, sizes["attn_cp_rank"][0], sizes["attn_tp_rank"][0], sizes["pp_rank"][0]


def encode_value(payload: Mapping[str, Any], instance_id: str, registration_id: str) -> bytes:
    """The value a registrar writes: the route payload, the instance id and the registrar's
    own id, as JSON.

    ``registration_id`` is new for every registrar (every process start): a rank restarted on
    the same port under the same instance id still writes different bytes, so decode sides
    retire what they cached from its previous life. A registrar re-putting its own values
    (after its lease expired) writes identical bytes, which retires nothing.
    """
    value = dict(payload)
    value["instance_id"] = instance_id
    value["registration_id"] = registration_id
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _optional(obj: Mapping[str, Any], key: str, kind: type) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is not kind:
        raise MalformedValue(f"{key!r} must be null or a {kind.__name__}")
    return value


def parse_value(key: RankKey, raw: bytes, *, mod_revision: int) -> RankRecord:
    """Validate a rank's value against its key; :class:`MalformedValue` if it does not fit."""
    if len(raw) > MAX_VALUE_BYTES:
        raise MalformedValue("value too large")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        raise MalformedValue("value is not JSON") from None
    if not isinstance(obj, dict):
        raise MalformedValue("value is not a JSON object")
    if registration_key(obj) != (key.dp_rank, key.cp_rank, key.tp_rank, key.pp_rank):
        raise MalformedValue("the value's ranks differ from the key's")
    rank_ip, rank_port = obj.get("rank_ip"), obj.get("rank_port")
    # The rank reply's rule (HTTP-25): an IP literal, never a name libzmq would resolve on its
    # I/O thread; so a value etcd serves is held to what a bootstrap server may answer.
    problem = rank_ip_problem(rank_ip)
    if problem is not None:
        raise MalformedValue(f"'rank_ip' {problem} (HTTP-25)")
    if not is_valid_port(rank_port):
        raise MalformedValue("'rank_port' must be an int in 1..65535")
    instance_id = obj.get("instance_id")
    if not isinstance(instance_id, str) or not 0 < len(instance_id) <= MAX_INSTANCE_ID:
        raise MalformedValue(f"'instance_id' must be a str of 1..{MAX_INSTANCE_ID} chars")
    page_size = _optional(obj, "page_size", int)
    if page_size is not None and page_size < 1:
        raise MalformedValue("'page_size' must be >= 1")
    follow = _optional(obj, "follow_bootstrap_room", bool)
    if follow is None and isinstance(obj.get("load_balance_method"), str):
        # SGLang's server derives the flag from the first registration's method (reference §7).
        follow = obj["load_balance_method"] == "follow_bootstrap_room"
    system_dp_size = obj["system_dp_size"]
    dp_size = obj["attn_dp_size"] if system_dp_size == 1 else system_dp_size
    record = RankRecord(
        rank_ip=rank_ip,  # type: ignore[arg-type]
        rank_port=rank_port,  # type: ignore[arg-type]
        instance_id=instance_id,
        attn_tp_size=obj["attn_tp_size"],
        attn_cp_size=obj["attn_cp_size"],
        dp_size=dp_size,
        pp_size=obj["pp_size"],
        page_size=page_size,
        kv_cache_dtype=_optional(obj, "kv_cache_dtype", str),
        follow_bootstrap_room=follow,
        mod_revision=mod_revision,
        raw=raw,
    )
    try:
        # The topology this value would answer passes the bootstrap server's reply rules
        # (HTTP-22): a value that cannot is never stored, so get_topology never fails on it.
        topology_of(obj, record, key.addr)
    except BootstrapError as exc:
        raise MalformedValue(f"its topology is not a valid reply: {exc}") from None
    return record


def topology_of(registration: Mapping[str, Any], record: RankRecord, addr: str) -> Topology:
    """The topology reply a rank's registration stands for, through the HTTP reply parser:
    the optional keys (the rank-plan switches of spec/plans.md PLAN-1, the allocation policy,
    DSpark) from the registration, as a bootstrap server takes them from its first one."""
    reply = {k: v for k, v in registration.items() if k in TOPOLOGY_KEYS | PLAN_KEYS}
    reply.update(record.claim_items(), follow_bootstrap_room=record.follow_bootstrap_room)
    return topology_reply(reply, addr=addr, status=200, instance_id=record.instance_id)
