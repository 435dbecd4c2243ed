"""SGLang 0.5.23's own HTTP side against ours, in both directions (issue 15, items 3 and 4).

1. **SGLang's registrations into our reference server, answered as SGLang's own server
   answers.** Both servers run side by side and get the same ``PUT /route`` bodies, built by
   SGLang's real ``register_to_bootstrap()``, then the same queries. Compared: the status of
   every PUT, the topology reply, every rank reply, the 503 before the last rank and the 404
   outside the topology, and what SGLang's own decode code makes of each server's answers
   (``try_ensure_parallel_info``, its rank query, its dp-rank registration and query).
2. **Our ``BootstrapClient`` and ``DecodeManager`` against SGLang's real server**, after real
   SGLang prefill ranks registered there (their constructors' own ``PUT /route``).

Each comparison is one *check*; a test records how many it made (``record_property``, so
``--junitxml`` sums them). Where the servers differ on purpose, the difference is listed in
spec/protocol.md ("Deliberate differences from SGLang 0.5.23") and tested as a difference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import requests
import zmq

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import DecodeLayout
from statemachine.errors import NotFound, NotReady, UnknownRoom
from statemachine.validation import PLAN_KEYS, TOPOLOGY_KEYS
from statemachine.wire.reference import SimpleBackend
from tests.support.http_support import running_server
from tests.support.sglang_support import (
    import_sglang,
    make_kv_args,
    requires_sglang,
    sglang_bootstrap_server,
    sglang_decode_manager,
    sglang_prefill_rank,
)

pytestmark = requires_sglang

TIMEOUT = 5
TOPOLOGY = (-1, -1, -1, -1)
#: Fields of SGLang's ``PrefillServerInfo`` that its *decode* fills in after the fetch; its
#: server's reply carries them as null only because it serialises the whole dataclass
#: (``dataclasses.asdict``, common/conn.py:3231). Ours omits them (a deliberate difference).
DECODE_SIDE_FIELDS = (
    "target_tp_rank",
    "target_tp_ranks",
    "target_cp_ranks",
    "target_pp_ranks",
    "required_dst_info_num",
    "required_prefill_response_num",
)


class Checks:
    """Comparisons of our answer with SGLang's; the test fails listing every one that differs."""

    def __init__(self, record_property: Callable[[str, object], None]) -> None:
        self.made = 0
        self.differ: list[str] = []
        self._record = record_property

    def same(self, what: str, ours: object, theirs: object) -> None:
        self.made += 1
        if ours != theirs:
            self.differ.append(f"{what}: ours {ours!r}, SGLang's {theirs!r}")

    def verify(self) -> None:
        self._record("sglang_checks", self.made)
        assert not self.differ, f"{len(self.differ)} of {self.made} checks differ:\n" + "\n".join(
            self.differ
        )


@pytest.fixture
def checks(record_property: Callable[[str, object], None]) -> Checks:
    return Checks(record_property)


# --- SGLang's prefill ranks, as its real code builds their registrations ----------------------


@dataclass(frozen=True)
class Rank:
    tp_rank: int
    attn_tp_rank: int | None = None
    attn_cp_rank: int = 0
    kv: dict[str, int] = field(default_factory=dict)  # KVArgs fields: system_dp_rank, pp_rank


@dataclass(frozen=True)
class Prefill:
    """One SGLang prefill: its ``ServerArgs`` fields and its ranks."""

    tp_size: int
    ranks: tuple[Rank, ...]
    fields: dict[str, Any] = field(default_factory=dict)
    #: Payload fields set after SGLang built the body, only where its constructor cannot build
    #: that rank on CPU: pp > 1 needs a torch pp group before it registers.
    edit: dict[str, Any] = field(default_factory=dict)


def _tp(size: int, **fields: Any) -> Prefill:
    return Prefill(size, tuple(Rank(r) for r in range(size)), fields)


PREFILLS = {
    "tp1": _tp(1),
    "tp2": _tp(2),
    "tp4": _tp(4, port=31000),  # port: the prefill's HTTP API port (prefill_http_port)
    "cp2": Prefill(2, (Rank(0, 0, 0), Rank(1, 0, 1)), {"attn_cp_size": 2}),
    "dp2xtp2": Prefill(
        2,
        tuple(Rank(tp, kv={"system_dp_rank": dp}) for dp in (0, 1) for tp in (0, 1)),
        {"dp_size": 2},
    ),
    "pp2": Prefill(
        1, (Rank(0, kv={"pp_rank": 0}), Rank(0, kv={"pp_rank": 1})), edit={"pp_size": 2}
    ),
    "prefill_complete": _tp(2, disaggregation_decode_allocation_policy="prefill_complete"),
    "follow_bootstrap_room_dp2": Prefill(
        1,
        (Rank(0, kv={"system_dp_rank": 0}), Rank(0, kv={"system_dp_rank": 1})),
        {"dp_size": 2, "load_balance_method": "follow_bootstrap_room"},
    ),
}


def sglang_payloads(prefill: Prefill, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The ``PUT /route`` body of each rank, built by SGLang's ``register_to_bootstrap()``."""
    conn = import_sglang()
    built: list[dict[str, Any]] = []
    with monkeypatch.context() as patch:
        # Keep the body SGLang built instead of sending it: the test sends it to both servers.
        patch.setattr(
            conn.CommonKVManager,
            "_register_topology_row",
            lambda self, url, payload: built.append(dict(payload)),
        )
        for rank in prefill.ranks:
            kv_args = make_kv_args(engine_rank=rank.tp_rank, **rank.kv)
            with sglang_prefill_rank(
                "127.0.0.1:1",
                tp_size=prefill.tp_size,
                tp_rank=rank.tp_rank,
                attn_tp_rank=rank.attn_tp_rank,
                attn_cp_rank=rank.attn_cp_rank,
                kv_args=kv_args,
                **prefill.fields,
            ):
                pass
    assert len(built) == len(prefill.ranks)
    return [{**body, **prefill.edit} for body in built]


def rank_keys(payloads: list[dict[str, Any]]) -> list[tuple[int, int, int, int]]:
    """(dp group, cp, tp, pp) of each body, as both servers key their port tables."""
    return [
        (
            p["attn_dp_rank"] if p["system_dp_size"] == 1 else p["system_dp_rank"],
            p["attn_cp_rank"],
            p["attn_tp_rank"],
            p["pp_rank"],
        )
        for p in payloads
    ]


# --- the two servers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Servers:
    ours: str
    sglang: str

    def both(self) -> tuple[str, str]:
        return self.ours, self.sglang


@pytest.fixture
def servers() -> Iterator[Servers]:
    # SGLang's prefill sends no Authorization header: a token would answer it 401 (difference).
    with running_server(insecure=True) as ours, sglang_bootstrap_server() as theirs:
        yield Servers(ours.address, theirs)


def put(addr: str, body: Any, **kw: Any) -> int:
    """A registration sent as SGLang's ``_register_topology_row`` sends it (one try)."""
    return requests.put(f"http://{addr}/route", timeout=TIMEOUT, **kw, json=body).status_code


def get(addr: str, key: tuple[int, int, int, int]) -> tuple[int, Any]:
    dp, cp, tp, pp = key
    reply = requests.get(
        f"http://{addr}/route",
        params={
            "prefill_dp_rank": dp,
            "prefill_cp_rank": cp,
            "target_tp_rank": tp,
            "target_pp_rank": pp,
        },
        timeout=TIMEOUT,
    )
    # Error bodies differ on purpose (ours say what to do next); the status is the contract.
    return reply.status_code, reply.json() if reply.status_code == 200 else None


def sglang_topology(reply: tuple[int, Any]) -> tuple[int, Any]:
    """SGLang's topology reply without its decode-side null fields (see DECODE_SIDE_FIELDS)."""
    status, body = reply
    if status != 200:
        return reply
    assert all(body.pop(name) is None for name in DECODE_SIDE_FIELDS)
    return status, body


def sglang_rank_query(addr: str, key: tuple[int, int, int, int]) -> Any:
    """SGLang's decode-side rank query (``CommonKVReceiver._get_bootstrap_info_from_server``)."""
    conn = import_sglang()
    receiver = SimpleNamespace(bootstrap_addr=addr)
    return conn.CommonKVReceiver._get_bootstrap_info_from_server(receiver, *key)


# --- 1. SGLang's registrations into our server ---------------------------------------------------


@pytest.mark.parametrize("name", list(PREFILLS))
def test_sglang_registrations_answered_as_sglangs_server_answers(
    name: str, servers: Servers, checks: Checks, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill = PREFILLS[name]
    payloads = sglang_payloads(prefill, monkeypatch)
    keys = rank_keys(payloads)
    statuses = []
    for i, body in enumerate(payloads):
        ours, theirs = (put(addr, body) for addr in servers.both())
        checks.same(f"PUT /route of rank {keys[i]}", ours, theirs)
        statuses.append(ours)
        if i == 0 and len(payloads) > 1:
            # Not every rank registered yet: both refuse the topology and any rank with 503.
            for key in (TOPOLOGY, keys[0]):
                checks.same(
                    f"GET {key} before the last rank", *(get(a, key)[0] for a in servers.both())
                )
    checks.same(
        "GET topology",
        get(servers.ours, TOPOLOGY),
        sglang_topology(get(servers.sglang, TOPOLOGY)),
    )
    for key in keys:
        checks.same(f"GET rank {key}", get(servers.ours, key), get(servers.sglang, key))
        checks.same(
            f"SGLang decode's rank query {key}",
            sglang_rank_query(servers.ours, key),
            sglang_rank_query(servers.sglang, key),
        )
    dp_size = len({key[0] for key in keys})
    outside = (dp_size, 0, 0, 0)
    checks.same(f"GET rank {outside} (outside)", *(get(a, outside)[0] for a in servers.both()))
    # What SGLang's own decode makes of each topology reply: its PrefillServerInfo, with the
    # rank mapping it derives for its (tp=1) decode rank.
    with sglang_decode_manager() as decode:
        for addr in servers.both():
            assert decode.try_ensure_parallel_info(addr), addr
        checks.same(
            "SGLang decode's PrefillServerInfo",
            decode.prefill_info_table[servers.ours],
            decode.prefill_info_table[servers.sglang],
        )
    checks.verify()
    assert statuses == [200] * len(payloads)  # alike, and accepted


@pytest.mark.parametrize(
    ("field", "second"),
    [
        ("decode_allocation_policy", "prefill_complete"),
        ("dsv41_spec_layout", {"num_draft_tokens": 4, "compression_ratios": [0, 2]}),
    ],
)
def test_ranks_that_disagree_are_refused_as_sglang_refuses_them(
    field: str, second: Any, servers: Servers, checks: Checks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP-59: 400 from both for the rank that differs; nothing stored; the same rank with the
    agreed value is then accepted by both, and both answer alike."""
    first, last = sglang_payloads(PREFILLS["tp2"], monkeypatch)
    differing = {**last, field: second}
    if field == "decode_allocation_policy":
        # The real body of a rank started with the other policy, not an edited one.
        policy = _tp(2, disaggregation_decode_allocation_policy=second)
        differing = sglang_payloads(policy, monkeypatch)[1]
        assert differing[field] == second
    checks.same("PUT rank 0", *(put(a, first) for a in servers.both()))
    checks.same(f"PUT rank 1 with another {field}", *(put(a, differing) for a in servers.both()))
    checks.same("GET topology after the refusal", *(get(a, TOPOLOGY)[0] for a in servers.both()))
    checks.same("PUT rank 1 agreeing", *(put(a, last) for a in servers.both()))
    checks.same(
        "GET topology",
        get(servers.ours, TOPOLOGY),
        sglang_topology(get(servers.sglang, TOPOLOGY)),
    )
    checks.verify()
    assert put(servers.ours, differing) == 400  # what both answered, not merely the same


def test_restarted_rank_re_registers_its_new_port_on_both(
    servers: Servers, checks: Checks, monkeypatch: pytest.MonkeyPatch
) -> None:
    payloads = sglang_payloads(PREFILLS["tp2"], monkeypatch)
    for body in payloads:
        checks.same("PUT", *(put(a, body) for a in servers.both()))
    restarted = sglang_payloads(PREFILLS["tp2"], monkeypatch)[1]  # a new PULL, a new port
    checks.same("PUT restarted rank 1", *(put(a, restarted) for a in servers.both()))
    checks.same("GET rank 1", get(servers.ours, (0, 0, 1, 0)), get(servers.sglang, (0, 0, 1, 0)))
    checks.verify()
    assert get(servers.ours, (0, 0, 1, 0))[1]["rank_port"] == restarted["rank_port"]


def test_dp_rank_registry_answers_sglangs_sender_and_decode_alike(
    servers: Servers, checks: Checks
) -> None:
    """SGLang's prefill sender registers a room's dp rank (``_register_prefill_dp_rank``) and
    its decode asks for them (``query_prefill_dp_ranks``): both servers answer alike."""
    conn = import_sglang()
    for addr in servers.both():
        for room, dp in ((11, 0), (12, 1), (2**63 - 1, 3)):
            sender = SimpleNamespace(
                bootstrap_server_url=addr,
                bootstrap_room=room,
                kv_mgr=SimpleNamespace(attn_dp_rank=dp),
            )
            conn.CommonKVSender._register_prefill_dp_rank(sender)
    for rooms in ([11, 12, 2**63 - 1], [13], []):
        checks.same(
            f"query_prefill_dp_ranks {rooms}",
            *(conn.CommonKVReceiver.query_prefill_dp_ranks(a, rooms) for a in servers.both()),
        )
    assert conn.CommonKVReceiver.query_prefill_dp_ranks(servers.ours, [12]) == {"12": 1}
    checks.verify()


@pytest.mark.parametrize(
    ("method", "path", "params"),
    [
        ("GET", "/health", None),
        ("DELETE", "/route", None),
        ("GET", "/route", {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0}),
        (
            "GET",
            "/route",
            {"prefill_dp_rank": "", "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0},
        ),
        ("GET", "/nowhere", None),
    ],
)
def test_other_requests_answered_alike(
    method: str, path: str, params: Any, servers: Servers, checks: Checks
) -> None:
    statuses = [
        requests.request(method, f"http://{a}{path}", params=params, timeout=TIMEOUT).status_code
        for a in servers.both()
    ]
    checks.same(f"{method} {path} {params}", *statuses)
    checks.verify()


# --- 1b. Where our server answers otherwise, on purpose (spec/protocol.md) -----------------------


def _complete_tp1(servers: Servers, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    (body,) = sglang_payloads(PREFILLS["tp1"], monkeypatch)
    assert [put(a, body) for a in servers.both()] == [200, 200]
    return body


def test_difference_conflicting_topology_after_complete_is_400_here(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP-51: SGLang accepts a rank claiming another tp size, page size or dtype (first
    writer wins, 200); ours refuses it (400) once the topology is complete."""
    body = _complete_tp1(servers, monkeypatch)
    for change in (
        {"attn_tp_size": 2, "attn_tp_rank": 1},
        {"page_size": 64},
        {"kv_cache_dtype": "fp8_e4m3"},
    ):
        conflicting = {**body, **change}
        assert (put(servers.ours, conflicting), put(servers.sglang, conflicting)) == (400, 200)


def test_difference_readiness_counts_distinct_ranks_here(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP-54: SGLang counts PUTs, so rank 0 registering twice makes a tp=2 prefill "ready"
    and rank 1's query 404; ours waits for rank 1 (503 for both queries)."""
    first, _ = sglang_payloads(PREFILLS["tp2"], monkeypatch)
    for _ in range(2):
        assert [put(a, first) for a in servers.both()] == [200, 200]
    assert [get(a, TOPOLOGY)[0] for a in servers.both()] == [503, 200]
    assert [get(a, (0, 0, 1, 0))[0] for a in servers.both()] == [503, 404]


@pytest.mark.parametrize(
    "bad",
    ["missing attn_tp_rank", "rank_port not a number", "not JSON"],
)
def test_difference_bad_registration_is_400_here_500_there(
    bad: str, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP-60: a bad body is the sender's error (400 saying which field), never a 5xx."""
    (body,) = sglang_payloads(PREFILLS["tp1"], monkeypatch)
    kw: dict[str, Any]
    if bad == "missing attn_tp_rank":
        kw = {"json": {k: v for k, v in body.items() if k != "attn_tp_rank"}}
    elif bad == "rank_port not a number":
        kw = {"json": {**body, "rank_port": "x"}}
    else:
        kw = {"data": b"{not json", "headers": {"Content-Type": "application/json"}}
    statuses = [
        requests.put(f"http://{a}/route", timeout=TIMEOUT, **kw).status_code for a in servers.both()
    ]
    assert statuses == [400, 500]


def test_difference_non_integer_rank_parameter_is_400_here_500_there(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    _complete_tp1(servers, monkeypatch)
    params = {
        "prefill_dp_rank": "x",
        "prefill_cp_rank": 0,
        "target_tp_rank": 0,
        "target_pp_rank": 0,
    }
    statuses = [
        requests.get(f"http://{a}/route", params=params, timeout=TIMEOUT).status_code
        for a in servers.both()
    ]
    assert statuses == [400, 500]


def test_difference_a_token_server_answers_sglangs_registration_401(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HTTP-53: SGLang's prefill sends no Authorization header; in front of it, run ours
    without a token (``serve --insecure``) on a trusted network, as the servers above are."""
    (body,) = sglang_payloads(PREFILLS["tp1"], monkeypatch)
    with running_server(token="s3cret") as ours:
        assert put(ours.address, body) == 401
        assert put(ours.address, body, headers={"Authorization": "Bearer s3cret"}) == 200


# --- 2. Our client and manager against SGLang's server -------------------------------------------


def test_our_client_reads_sglangs_server_after_real_sglang_registrations(checks: Checks) -> None:
    with (
        sglang_bootstrap_server() as addr,
        BootstrapClient() as client,
        sglang_prefill_rank(addr, tp_size=2, tp_rank=0, port=31000) as rank0,
    ):
        # One of two ranks: SGLang's 503 is our NotReady (retryable) for both queries.
        for query in (
            lambda: client.get_topology(addr),
            lambda: client.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0),
        ):
            with pytest.raises(NotReady) as not_ready:
                query()
            checks.same("status before the last rank", not_ready.value.status, 503)
        with sglang_prefill_rank(addr, tp_size=2, tp_rank=1, port=31000) as rank1:
            _, raw = get(addr, TOPOLOGY)
            topology = client.get_topology(addr)
            for key in sorted(TOPOLOGY_KEYS | PLAN_KEYS):
                checks.same(f"Topology.{key}", getattr(topology, key), raw.get(key))
            extra = {k: v for k, v in raw.items() if k not in TOPOLOGY_KEYS | PLAN_KEYS}
            checks.same("Topology.extra", dict(topology.extra), extra)
            checks.same("Topology.instance_id (SGLang sends none)", topology.instance_id, None)
            for tp, rank in ((0, rank0), (1, rank1)):
                reply = client.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0)
                checks.same(
                    f"rank {tp}", (reply.rank_ip, reply.rank_port), (rank.local_ip, rank.rank_port)
                )
            with pytest.raises(NotFound) as outside:
                client.get_rank(addr, dp_rank=0, cp_rank=0, tp_rank=2, pp_rank=0)
            checks.same("status of a rank outside", outside.value.status, 404)
            checks.same("health() (no instance id)", client.health(addr), None)
    checks.verify()


def test_our_client_reads_sglangs_dp_rank_registry(checks: Checks) -> None:
    conn = import_sglang()
    with sglang_bootstrap_server() as addr, BootstrapClient() as client:
        for room, dp in ((21, 0), (22, 3)):
            sender = SimpleNamespace(
                bootstrap_server_url=addr,
                bootstrap_room=room,
                kv_mgr=SimpleNamespace(attn_dp_rank=dp),
            )
            conn.CommonKVSender._register_prefill_dp_rank(sender)
        checks.same("query_dp_ranks", client.query_dp_ranks(addr, [21, 22, 23]), {21: 0, 22: 3})
        checks.same("dp_rank_of", client.dp_rank_of(addr, 22), 3)
        with pytest.raises(UnknownRoom):
            client.dp_rank_of(addr, 23)
    checks.verify()


def test_our_manager_bootstraps_from_sglangs_server_to_a_real_sglang_rank(checks: Checks) -> None:
    """A DecodeManager finds SGLang's rank through SGLang's server and messages its real PULL
    socket: the register and metadata messages arrive there (what the rank would do with them
    is issue 16's). Completion comes from the engine (``completion="external"``)."""
    with (
        sglang_bootstrap_server() as addr,
        sglang_prefill_rank(addr, tp_size=1, tp_rank=0) as rank,
        DecodeManager(
            completion="external",
            backend=SimpleBackend("127.0.0.1", 1, "engine-session"),
            layout=DecodeLayout(tp_rank=0, tp_size=1),
            health_probes=False,
        ) as manager,
    ):
        receiver = manager.receiver(addr, 5)
        checks.same("init()", receiver.init(), KVPoll.WaitingForInput)
        checks.same("send_metadata()", receiver.send_metadata((1, 2, 3)), KVPoll.Transferring)
        received = []
        while rank.server_socket.poll(2000, zmq.POLLIN):
            received.append(rank.server_socket.recv_multipart())
            if len(received) == 2:
                break
        checks.same("messages at SGLang's rank", len(received), 2)
        assert manager.complete(5)
        checks.same("poll() after complete()", receiver.poll(), KVPoll.Success)
    checks.verify()
