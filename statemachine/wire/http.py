"""The bootstrap server's HTTP wire, written once for both sides (``spec/protocol.md``).

The decode's client (:mod:`statemachine.decode.client`), the reference bootstrap server
(:mod:`statemachine.prefill.server`), the prefill rank's registrar
(:mod:`statemachine.prefill.registration`) and the etcd registrar (which stores the same
registration body) all read the paths, the instance header, the payloads and the replies from
here, so that neither side spells them on its own. Pure: no I/O, no third-party import.

* ``PUT /route``: :func:`register_url`, body :func:`route_payload` (and a bearer token);
  200 with the instance header;
* ``GET /route`` for one rank: :func:`route_url`; reply :func:`route_reply`;
* ``GET /route`` with all four ranks ``-1``: :func:`topology_url`; reply :func:`topology_reply`;
* ``POST /query_dp_ranks``: :func:`dp_ranks_url`, body :func:`dp_ranks_request`; reply
  :func:`dp_ranks_reply`;
* ``GET /health``: :func:`health_url`; 200 with the instance header.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from statemachine.errors import MalformedReply
from statemachine.validation import (
    MAX_LABEL,
    MAX_LAYOUT_BYTES,
    MAX_PAGE_SIZE,
    MAX_PARALLEL_SIZE,
    MAX_WORLD,
    PLAN_KEYS,
    TOPOLOGY_KEYS,
    RouteReply,
    Topology,
    bounded_extra,
    is_int,
    is_valid_port,
    json_size,
    rank_ip_problem,
)

__all__ = [
    "DP_RANKS_KEY",
    "HEALTH_PATH",
    "INSTANCE_HEADER",
    "QUERY_DP_RANKS_PATH",
    "RANK_PARAMS",
    "ROUTE_PATH",
    "dp_ranks_reply",
    "dp_ranks_request",
    "dp_ranks_url",
    "health_url",
    "parse_json_object",
    "register_url",
    "route_payload",
    "route_reply",
    "route_url",
    "topology_reply",
    "topology_url",
]

#: The header that carries the bootstrap server's instance id on every reply: a new id means a
#: restarted prefill (HTTP-14).
INSTANCE_HEADER = "X-Bootstrap-Instance-Id"
ROUTE_PATH = "/route"
QUERY_DP_RANKS_PATH = "/query_dp_ranks"
HEALTH_PATH = "/health"
#: The query parameters of ``GET /route``, in SGLang's order: dp, cp, tp, pp.
RANK_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
#: The key of ``POST /query_dp_ranks``'s body: the list of rooms asked about.
DP_RANKS_KEY = "bootstrap_rooms"


# --- requests ----------------------------------------------------------------------------------


def route_url(addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int) -> str:
    """``GET /route`` for one prefill rank (HTTP-10)."""
    ranks = (dp_rank, cp_rank, tp_rank, pp_rank)
    query = "&".join(f"{name}={value}" for name, value in zip(RANK_PARAMS, ranks, strict=True))
    return f"http://{addr}{ROUTE_PATH}?{query}"


def topology_url(addr: str) -> str:
    """``GET /route`` with all four ranks ``-1``: the prefill's parallel layout (HTTP-11)."""
    return route_url(addr, dp_rank=-1, cp_rank=-1, tp_rank=-1, pp_rank=-1)


def dp_ranks_request(rooms: Iterable[int]) -> bytes:
    """The body of ``POST /query_dp_ranks`` (HTTP-13)."""
    return json.dumps({DP_RANKS_KEY: list(rooms)}).encode()


def dp_ranks_url(addr: str) -> str:
    """``POST /query_dp_ranks`` (HTTP-13)."""
    return f"http://{addr}{QUERY_DP_RANKS_PATH}"


def health_url(addr: str) -> str:
    """``GET /health`` (HTTP-14)."""
    return f"http://{addr}{HEALTH_PATH}"


def register_url(addr: str) -> str:
    """``PUT /route``: a prefill rank registers itself (HTTP-15)."""
    return f"http://{addr}{ROUTE_PATH}"


def route_payload(
    *,
    rank_ip: str,
    rank_port: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    system_dp_rank: int | None = None,
    system_dp_size: int | None = None,
    page_size: int = 16,
    kv_cache_dtype: str = "bfloat16",
    load_balance_method: str = "follow_bootstrap_room",
    enable_dsa_cache_layer_split: bool = False,
    prefill_http_port: int | None = None,
    decode_allocation_policy: str = "early",
    dsv41_spec_layout: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """The ``PUT /route`` body an SGLang prefill rank sends (spec/protocol.md §2.1): the 14
    topology and endpoint fields plus the five layout/policy fields of current SGLang, with
    SGLang's defaults. The system dp rank/size default to the attention dp rank/size.
    """
    return {
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": cp_size,
        "attn_cp_rank": cp_rank,
        "attn_dp_size": dp_size,
        "attn_dp_rank": dp_rank,
        "pp_size": pp_size,
        "pp_rank": pp_rank,
        "system_dp_size": dp_size if system_dp_size is None else system_dp_size,
        "system_dp_rank": dp_rank if system_dp_rank is None else system_dp_rank,
        "rank_ip": rank_ip,
        "rank_port": rank_port,
        "page_size": page_size,
        "kv_cache_dtype": kv_cache_dtype,
        "load_balance_method": load_balance_method,
        "enable_dsa_cache_layer_split": enable_dsa_cache_layer_split,
        "prefill_http_port": prefill_http_port,
        "decode_allocation_policy": decode_allocation_policy,
        "dsv41_spec_layout": None if dsv41_spec_layout is None else dict(dsv41_spec_layout),
    }


# --- replies -----------------------------------------------------------------------------------

#: What a bootstrap server's replies are: JSON, or plain text for SGLang's own error replies
#: (``common/conn.py``'s ``web.Response(text=...)``) and health answers.
_BOOTSTRAP_MEDIA_TYPES = frozenset({"application/json", "text/plain", ""})
#: The route-not-found reply of a FastAPI server (SGLang's HTTP API port, the address most
#: often given by mistake); no bootstrap server answers this.
_API_ROUTE_NOT_FOUND = {"detail": "Not Found"}
_SHOWN_BYTES = 80


def _json_or_none(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def not_a_bootstrap_server(
    body: bytes, *, addr: str, what: str, status: int, content_type: str | None
) -> MalformedReply | None:
    """The typed error for a reply that no bootstrap server gives (an HTML page, an API
    server's route-not-found), saying what answered and what to check; None for any other."""
    media = (content_type or "").split(";")[0].strip().lower()
    api_404 = status == 404 and len(body) < 64 and _json_or_none(body) == _API_ROUTE_NOT_FOUND
    if media in _BOOTSTRAP_MEDIA_TYPES and not api_404:
        return None
    text = " ".join(body[: _SHOWN_BYTES * 4].decode("utf-8", "replace").split())
    text = "".join(c if c.isprintable() else "?" for c in text)
    shown = text if len(text) <= _SHOWN_BYTES else text[: _SHOWN_BYTES - 3] + "..."
    return MalformedReply(
        f"{addr}: {what}: this address answered HTTP {status} "
        f"({media or 'no content type'}, beginning {shown!r}), but not as a prefill bootstrap "
        "server: check the address and port. It must be the prefill's bootstrap server "
        "(SGLang's --disaggregation-bootstrap-port, 8998 by default; the reference server's "
        "--port), not the prefill's HTTP API port or another service",
        addr=addr,
        status=status,
    )


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


def route_reply(
    obj: Mapping[str, object], *, addr: str, status: int, instance_id: str | None
) -> RouteReply:
    """``{"rank_ip": ip literal, "rank_port": 1..65535}``; extra keys ignored (HTTP-21)."""
    ip = obj.get("rank_ip")
    problem = rank_ip_problem(ip)
    if problem is not None:
        raise _field(obj, "rank_ip", f"a peer IP literal ({problem})", addr=addr, status=status)
    port = obj.get("rank_port")
    if not is_valid_port(port):
        raise _field(obj, "rank_port", "an int in 1..65535", addr=addr, status=status)
    return RouteReply(ip, port, instance_id)  # type: ignore[arg-type]


def _bounded_int(
    obj: Mapping[str, object], key: str, low: int, high: int, *, addr: str, status: int
) -> int:
    value = obj.get(key)
    if not is_int(value) or not low <= value <= high:  # type: ignore[operator]
        raise _field(obj, key, f"an int in {low}..{high}", addr=addr, status=status)
    return value  # type: ignore[return-value]


def _optional_value(
    obj: Mapping[str, object], key: str, check: object, want: str, *, addr: str, status: int
) -> object:
    """``obj[key]`` when absent/null (None) or when ``check(value)`` holds; else malformed."""
    value = obj.get(key)
    if value is None:
        return None
    if not check(value):  # type: ignore[operator]
        raise _field(obj, key, f"null or {want}", addr=addr, status=status)
    return value


def _is_label(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_LABEL


def _is_layout(value: object) -> bool:
    try:
        return isinstance(value, dict) and json_size(value) <= MAX_LAYOUT_BYTES
    except (TypeError, ValueError, RecursionError):
        return False


def topology_reply(
    obj: Mapping[str, object], *, addr: str, status: int, instance_id: str | None
) -> Topology:
    """The four sizes are required ints in 1..MAX_PARALLEL_SIZE with a product of at most
    MAX_WORLD; the rest may be absent or null; unknown keys go to ``extra`` (HTTP-22)."""
    sizes = [
        _bounded_int(obj, key, 1, MAX_PARALLEL_SIZE, addr=addr, status=status)
        for key in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size")
    ]
    if sizes[0] * sizes[1] * sizes[2] * sizes[3] > MAX_WORLD:
        raise MalformedReply(
            f"{addr}: topology of {sizes[0] * sizes[1] * sizes[2] * sizes[3]} ranks is more "
            f"than {MAX_WORLD}",
            addr=addr,
            status=status,
        )
    a: dict[str, Any] = {"addr": addr, "status": status}
    page_size = _optional_value(
        obj, "page_size", lambda v: is_int(v) and 1 <= v <= MAX_PAGE_SIZE, "an int >= 1", **a
    )
    layout = _optional_value(obj, "dsv41_spec_layout", _is_layout, "a small JSON object", **a)
    return Topology(
        attn_tp_size=sizes[0],
        attn_cp_size=sizes[1],
        dp_size=sizes[2],
        pp_size=sizes[3],
        page_size=page_size,  # type: ignore[arg-type]
        kv_cache_dtype=_optional_value(obj, "kv_cache_dtype", _is_label, "a str", **a),  # type: ignore[arg-type]
        follow_bootstrap_room=_optional_value(  # type: ignore[arg-type]
            obj, "follow_bootstrap_room", lambda v: isinstance(v, bool), "a bool", **a
        ),
        instance_id=instance_id,
        enable_dsa_cache_layer_split=_optional_value(  # type: ignore[arg-type]
            obj, "enable_dsa_cache_layer_split", lambda v: isinstance(v, bool), "a bool", **a
        ),
        prefill_http_port=_optional_value(  # type: ignore[arg-type]
            obj, "prefill_http_port", is_valid_port, "an int in 1..65535", **a
        ),
        decode_allocation_policy=_optional_value(  # type: ignore[arg-type]
            obj, "decode_allocation_policy", _is_label, "a str", **a
        ),
        dsv41_spec_layout=None if layout is None else MappingProxyType(layout),  # type: ignore[arg-type]
        kv_layout=_optional_value(obj, "kv_layout", _is_label, "a str", **a),  # type: ignore[arg-type]
        enable_kv_cache_sharding=_optional_value(  # type: ignore[arg-type]
            obj, "enable_kv_cache_sharding", lambda v: isinstance(v, bool), "a bool", **a
        ),
        extra=MappingProxyType(bounded_extra(obj, TOPOLOGY_KEYS | PLAN_KEYS)),
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
