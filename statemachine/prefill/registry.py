"""The reference bootstrap server's registry: the ranks a prefill registered, and rooms' dp ranks.

No HTTP here (the server, :mod:`statemachine.prefill.server`, reads requests and writes
replies): a ``PUT /route`` body checked field by field (HTTP-60..66), the topology it claims
kept per claim until one is complete and then pinned (HTTP-51/54), one allocation policy and
DSpark layout per prefill (HTTP-59), and the ``room -> dp rank`` table of
``POST /register_dp_rank``, bounded by a TTL and a size cap. A request that fails a check
raises :class:`~statemachine.errors.BadRequest` and changes nothing; the server answers it 400
with the message. Loop thread only (the server's event loop), so nothing here locks.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from statemachine.errors import BadRequest
from statemachine.validation import (
    MAX_LABEL,
    MAX_LAYOUT_BYTES,
    MAX_PAGE_SIZE,
    MAX_PARALLEL_SIZE,
    MAX_WORLD,
    TOPOLOGY_KEYS,
    TopologyClaim,
    bounded_extra,
    is_valid_port,
    json_size,
    rank_ip_problem,
)
from statemachine.wire.http import RANK_PARAMS

#: Seconds a room's dp rank is remembered after ``POST /register_dp_rank``.
DEFAULT_DP_TTL = 120.0
#: Hard cap on remembered room -> dp rank entries, on top of the TTL.
DEFAULT_MAX_DP_ENTRIES = 100_000
#: Topologies claimed by registrations before one is complete (HTTP-54).
MAX_CANDIDATES = 4
#: SGLang's default ``load_balance_method``; it means ``follow_bootstrap_room`` is true.
FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"
#: SGLang's default ``decode_allocation_policy``, taken when a registration has none.
EARLY_ALLOCATION = "early"

_log = logging.getLogger(__name__)

#: Registration keys this server interprets (reference §1 and §7); any other key is carried
#: through to the topology reply, bounded. ``follow_bootstrap_room`` is read by nobody: SGLang
#: derives it from ``load_balance_method`` and never sends it.
REGISTRATION_KEYS = frozenset(
    (
        "attn_tp_size",
        "attn_tp_rank",
        "attn_cp_size",
        "attn_cp_rank",
        "attn_dp_size",
        "attn_dp_rank",
        "pp_size",
        "pp_rank",
        "system_dp_size",
        "system_dp_rank",
        "rank_ip",
        "rank_port",
        "page_size",
        "kv_cache_dtype",
        "load_balance_method",
        "enable_dsa_cache_layer_split",
        "prefill_http_port",
        "decode_allocation_policy",
        "dsv41_spec_layout",
        "follow_bootstrap_room",
        "kv_layout",
        "enable_kv_cache_sharding",
    )
)


@dataclass(frozen=True, slots=True)
class RegistrationInfo:
    """What the topology reply says besides the claim, taken from a topology's first
    registration as SGLang does. Of these only the allocation policy and the DSpark layout
    are compared between ranks (HTTP-59), as SGLang 0.5.23 compares them."""

    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool
    prefill_http_port: int | None
    decode_allocation_policy: str
    dsv41_spec_layout: dict[str, Any] | None
    kv_layout: str | None
    enable_kv_cache_sharding: bool
    extra: dict[str, Any]


@dataclass(slots=True)
class RegisteredTopology:
    """One claimed topology and the ranks registered under it (HTTP-54)."""

    claim: TopologyClaim
    info: RegistrationInfo
    ranks: dict[tuple[int, int, int, int], tuple[str, int]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.claim.world

    def as_reply(self) -> dict[str, object]:
        claim, info = self.claim, self.info
        reply: dict[str, object] = dict(info.extra)
        reply.update(claim.claim_items())
        reply.update(
            follow_bootstrap_room=info.follow_bootstrap_room,
            enable_dsa_cache_layer_split=info.enable_dsa_cache_layer_split,
            prefill_http_port=info.prefill_http_port,
            decode_allocation_policy=info.decode_allocation_policy,
            enable_kv_cache_sharding=info.enable_kv_cache_sharding,
        )
        # SGLang sends these two only when set.
        if info.dsv41_spec_layout is not None:
            reply["dsv41_spec_layout"] = info.dsv41_spec_layout
        if info.kv_layout is not None:
            reply["kv_layout"] = info.kv_layout
        return reply


# --- body validation --------------------------------------------------------------------------


def load_json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # bad UTF-8 is a ValueError too
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("body must be a JSON object")
    return value


def int_field(obj: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = obj.get(key)
    if type(value) is int and low <= value <= high:
        return value
    raise BadRequest(f"{key!r} must be an int in {low}..{high}")


#: How a 400 names the JSON type an optional field must have.
_JSON_KINDS = {int: "an integer", str: "a string", bool: "true or false", dict: "a JSON object"}


def _optional(
    obj: Mapping[str, Any], key: str, kind: type, check: Callable[[Any], bool], limits: str = ""
) -> Any:
    """``obj[key]``: absent or null, or a ``kind`` that passes ``check`` (``limits`` says how,
    for the 400). ``true``/``false`` are not integers here, although Python's bool is an int."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or not check(value):
        shown = json.dumps(value)
        if len(shown) > 40:
            shown = f"{shown[:37]}..."
        raise BadRequest(
            f"{key!r} must be null or {_JSON_KINDS.get(kind, kind.__name__)}{limits}, not "
            f"{shown}: correct this field of the rank's registration and register again"
        )
    return value


def _size_and_rank(obj: Mapping[str, Any], size_key: str, rank_key: str) -> tuple[int, int]:
    size = int_field(obj, size_key, 1, MAX_PARALLEL_SIZE)
    return size, int_field(obj, rank_key, 0, size - 1)


def _layout(value: Any) -> bool:
    return json_size(value) <= MAX_LAYOUT_BYTES


def parse_registration(
    obj: Mapping[str, Any],
) -> tuple[tuple[int, int, int, int], tuple[str, int], TopologyClaim, RegistrationInfo]:
    """Check a ``PUT /route`` body: (rank key, (ip, port), the topology it claims, the rest)."""
    tp_size, tp_rank = _size_and_rank(obj, "attn_tp_size", "attn_tp_rank")
    cp_size, cp_rank = _size_and_rank(obj, "attn_cp_size", "attn_cp_rank")
    attn_dp_size, attn_dp_rank = _size_and_rank(obj, "attn_dp_size", "attn_dp_rank")
    pp_size, pp_rank = _size_and_rank(obj, "pp_size", "pp_rank")
    system_dp_size, system_dp_rank = _size_and_rank(obj, "system_dp_size", "system_dp_rank")
    rank_ip = obj.get("rank_ip")
    problem = rank_ip_problem(rank_ip)
    if problem is not None:
        raise BadRequest(f"'rank_ip' {problem}")
    rank_port = obj.get("rank_port")
    if not is_valid_port(rank_port):
        raise BadRequest("'rank_port' must be an int in 1..65535")
    # As in SGLang: with one system dp group the attention dp rank names the group.
    dp_size, dp_rank = (
        (attn_dp_size, attn_dp_rank) if system_dp_size == 1 else (system_dp_size, system_dp_rank)
    )
    claim = TopologyClaim(
        attn_tp_size=tp_size,
        attn_cp_size=cp_size,
        dp_size=dp_size,
        pp_size=pp_size,
        page_size=_optional(
            obj, "page_size", int, lambda v: 1 <= v <= MAX_PAGE_SIZE, f" in 1..{MAX_PAGE_SIZE}"
        ),
        kv_cache_dtype=_optional(obj, "kv_cache_dtype", str, lambda v: len(v) <= MAX_LABEL),
    )
    if claim.world > MAX_WORLD:
        raise BadRequest(f"a topology of {claim.world} ranks is more than {MAX_WORLD}")
    method = _optional(obj, "load_balance_method", str, lambda v: len(v) <= MAX_LABEL)
    info = RegistrationInfo(
        # SGLang: follow_bootstrap_room = (load_balance_method == "follow_bootstrap_room"),
        # and a registration without the key means the default method.
        follow_bootstrap_room=(method or FOLLOW_BOOTSTRAP_ROOM) == FOLLOW_BOOTSTRAP_ROOM,
        # Absent or null means SGLang's default for the four below, as its server reads them
        # (an SGLang decode compares the policy with its own, so null would fail every request).
        enable_dsa_cache_layer_split=bool(
            _optional(obj, "enable_dsa_cache_layer_split", bool, lambda v: True)
        ),
        prefill_http_port=_optional(obj, "prefill_http_port", int, is_valid_port, " in 1..65535"),
        decode_allocation_policy=_optional(
            obj, "decode_allocation_policy", str, lambda v: len(v) <= MAX_LABEL
        )
        or EARLY_ALLOCATION,
        dsv41_spec_layout=_optional(obj, "dsv41_spec_layout", dict, _layout),
        kv_layout=_optional(obj, "kv_layout", str, lambda v: len(v) <= MAX_LABEL),
        enable_kv_cache_sharding=bool(
            _optional(obj, "enable_kv_cache_sharding", bool, lambda v: True)
        ),
        extra=bounded_extra(obj, REGISTRATION_KEYS | TOPOLOGY_KEYS),
    )
    return (dp_rank, cp_rank, tp_rank, pp_rank), (rank_ip, rank_port), claim, info  # type: ignore[return-value]


class QueryParams(Protocol):
    """A query string's parameters, each name possibly repeated (aiohttp's ``request.query``)."""

    def getall(self, key: str, default: list[str]) -> list[str]: ...


# Optional sign, at most 18 digits: fits an int64, and never feeds int() a huge string.
_INT_PARAM = re.compile(r"-?[0-9]{1,18}", re.ASCII)


def rank_params(query: QueryParams) -> list[int]:
    """The four ``GET /route`` parameters, each present once and an integer (HTTP-12)."""
    values = []
    for name in RANK_PARAMS:
        found = query.getall(name, [])
        if len(found) != 1 or _INT_PARAM.fullmatch(found[0]) is None:
            raise BadRequest(f"parameter {name!r} must be given once, as an integer")
        values.append(int(found[0]))
    return values


# --- the registry -------------------------------------------------------------------------------


class Registry:
    """What one bootstrap server instance knows: the pinned topology and its ranks, the claims
    of registrations before one topology is complete, and rooms' dp ranks.

    In memory only: a new server instance starts with an empty one (the server makes a new one
    on every ``start()``). ``clock`` is the time source of dp-rank expiry.
    """

    def __init__(
        self,
        *,
        dp_ttl: float = DEFAULT_DP_TTL,
        max_dp_entries: int = DEFAULT_MAX_DP_ENTRIES,
        clock: Callable[[], float],
    ) -> None:
        self._dp_ttl = dp_ttl
        self._max_dp_entries = max_dp_entries
        self._clock = clock
        #: the topology whose every rank registered (HTTP-51), once there is one
        self.pinned: RegisteredTopology | None = None
        self._candidates: dict[TopologyClaim, RegisteredTopology] = {}
        self._dp_ranks: OrderedDict[int, tuple[int, float]] = OrderedDict()

    # --- PUT /route ----------------------------------------------------------------------------

    def register(self, body: Mapping[str, Any]) -> None:
        """Take one rank's ``PUT /route`` body; :class:`BadRequest`, changing nothing, when it
        fails a check or disagrees with the pinned topology."""
        key, endpoint, claim, info = parse_registration(body)
        self._check_consistent(info)
        pinned = self.pinned
        if pinned is not None:
            if claim != pinned.claim:
                # The topology is pinned once complete; a rank disagreeing with it is
                # misconfigured (HTTP-51).
                raise BadRequest(
                    f"registration claims {claim.describe()} but the registered topology is "
                    f"{pinned.claim.describe()}: start this rank with the registered "
                    "settings, or restart the bootstrap server to register a new topology"
                )
            # Last writer wins for ports: a restarted rank re-registers its new port (HTTP-52).
            pinned.ranks[key] = endpoint
            return
        self._register_candidate(key, endpoint, claim, info)

    def _check_consistent(self, info: RegistrationInfo) -> None:
        """HTTP-59: every rank of a prefill registers one allocation policy and one DSpark
        layout; a rank that differs from those already registered is refused, changing nothing.

        As SGLang 0.5.23 does. Every kept registration passed this check, so any one of them
        (the pinned topology or a candidate) holds the values of record.
        """
        held = self.pinned or next(iter(self._candidates.values()), None)
        if held is None:
            return
        record = held.info
        if info.dsv41_spec_layout != record.dsv41_spec_layout:
            raise BadRequest(
                "dsv41_spec_layout differs from the one the registered ranks sent: start every "
                "prefill rank with the same model and speculative-decoding settings"
            )
        if info.decode_allocation_policy != record.decode_allocation_policy:
            raise BadRequest(
                f"decode_allocation_policy {info.decode_allocation_policy!r} differs from the "
                f"registered ranks' {record.decode_allocation_policy!r}: start every prefill "
                "rank with the same --disaggregation-decode-allocation-policy"
            )

    def _register_candidate(
        self,
        key: tuple[int, int, int, int],
        endpoint: tuple[str, int],
        claim: TopologyClaim,
        info: RegistrationInfo,
    ) -> None:
        """Before any topology is complete, keep registrations per claimed topology (HTTP-54).

        The first claimed topology to have every one of its ranks registered is pinned and the
        others are dropped, so one bogus first registration cannot block the real topology.
        Bounded: at most MAX_CANDIDATES claims and MAX_WORLD ranks in all; past either bound
        the claim with the fewest ranks (the oldest of those) is dropped first.
        """
        candidates = self._candidates
        candidate = candidates.get(claim)
        if candidate is None:
            candidate = RegisteredTopology(claim, info)
            while len(candidates) >= MAX_CANDIDATES:
                self._drop_smallest_candidate()
            candidates[claim] = candidate
        if key not in candidate.ranks:
            while sum(len(c.ranks) for c in candidates.values()) >= MAX_WORLD:
                self._drop_smallest_candidate(keep=claim)
        candidate.ranks[key] = endpoint
        if candidate.complete:
            self.pinned = candidate
            others = [c for c in candidates.values() if c is not candidate]
            candidates.clear()
            if others:
                _log.warning(
                    "bootstrap topology pinned: %s; dropped %d registration(s) claiming "
                    "other topologies: %s",
                    claim.describe(),
                    sum(len(c.ranks) for c in others),
                    "; ".join(c.claim.describe() for c in others),
                )

    def _drop_smallest_candidate(self, keep: TopologyClaim | None = None) -> None:
        others = [c for c in self._candidates.values() if c.claim != keep]
        smallest = min(others, key=lambda c: len(c.ranks))  # min() keeps the oldest on ties
        del self._candidates[smallest.claim]
        _log.warning(
            "bootstrap server dropped %d registration(s) claiming %s: too many conflicting "
            "topologies claimed before one was complete",
            len(smallest.ranks),
            smallest.claim.describe(),
        )

    # --- POST /register_dp_rank and /query_dp_ranks --------------------------------------------

    def remember_dp_rank(self, room: int, dp_rank: int) -> None:
        """``room`` is served by ``dp_rank`` for the next ``dp_ttl`` seconds (the oldest entry
        is forgotten first past ``max_dp_entries``)."""
        now = self._clock()
        self._expire(now)
        entries = self._dp_ranks
        entries[room] = (dp_rank, now + self._dp_ttl)
        entries.move_to_end(room)  # keeps the dict ordered by expiry (constant TTL)
        while len(entries) > self._max_dp_entries:
            entries.popitem(last=False)

    def dp_ranks(self, rooms: list[int]) -> dict[str, int]:
        """The dp rank of each of ``rooms`` that has an unexpired one, keyed by the room as text
        (the reply's JSON keys)."""
        now = self._clock()
        self._expire(now)
        found: dict[str, int] = {}
        for room in rooms:
            entry = self._dp_ranks.get(room)
            if entry is not None and entry[1] > now:
                found[str(room)] = entry[0]
        return found

    def _expire(self, now: float) -> None:
        entries = self._dp_ranks
        while entries:
            room, (_, expires) = next(iter(entries.items()))
            if expires > now:
                break
            del entries[room]
