"""Our rank plans against SGLang's own mapping code, cell by cell (spec/plans.md, issue 15).

For every cell of a grid of layouts this runs SGLang's real decode side - a decode-mode
``CommonKVManager`` built by SGLang's constructor (which derives its all-cp switch from the
environment variable, the hybrid-MLA pool and its own KV sharding), its
``_resolve_rank_mapping`` on the prefill's ``PrefillServerInfo``, then a ``CommonKVReceiver``'s
``init()``, whose ``_setup_bootstrap_infos`` fetches the ranks (answered here without HTTP),
sets the dummy flags and fills the connection pool - and compares what it decided with
:func:`derive_plan` on the same topology, parsed from the reply SGLang's server would send.
Per cell: refused or not, the target tp rank, the fetched (cp, tp, pp, dummy) sequence in
order, the pool keys, ``required_dst_info_num`` and ``required_prefill_response_num``.

Tp sizes that do not divide are the one deliberate difference (PLAN-5): we refuse them, and
SGLang's own mapping is shown to be broken for each such pair of the grid.

The format checks that run before the mapping (PLAN-2) are compared separately: SGLang's own
``try_ensure_parallel_info`` and our client read one prefill registered with our reference server.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from statemachine.decode.client import BootstrapClient
from statemachine.decode.plan import DecodeLayout, RankPlan, derive_plan
from statemachine.errors import TopologyMismatch
from statemachine.pool import EVERY_TP_RANK
from statemachine.prefill.registration import register_rank
from statemachine.prefill.server import BootstrapServer
from statemachine.validation import Topology
from statemachine.wire.http import route_payload, topology_reply
from tests.support.bootstrap_support import TOKEN
from tests.support.sglang_support import (
    import_sglang,
    make_kv_args,
    requires_sglang,
    set_sglang_ranks,
    sglang_decode_manager,
    sglang_server_args,
)

pytestmark = requires_sglang

ADDR = "127.0.0.1:8998"
TP_SIZES = (1, 2, 3, 4, 8)
#: (decode pp size, decode pp rank)
DECODE_PP = ((1, 0), (2, 0), (2, 1))
PREFILL_PP = (1, 2)
PREFILL_CP = (1, 2)
#: name -> (is_mla, is_hybrid_mla)
MODELS = {"non-MLA": (False, False), "MLA": (True, False), "hybrid-MLA": (False, True)}
ALL_CP_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"

#: One cell's outcome: None when refused, else (target tp rank, fetched (cp, tp, pp, dummy) in
#: order, pool keys, required_dst_info_num, required_prefill_response_num).
Outcome = tuple[Any, ...] | None


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    prefill_tp: int
    prefill_cp: int
    prefill_pp: int
    dsa_split: bool
    prefill_sharding: bool
    decode_tp: int
    decode_rank: int
    decode_pp: int
    decode_pp_rank: int
    all_cp_env: bool
    decode_shard: bool

    @property
    def divides(self) -> bool:
        big, small = max(self.prefill_tp, self.decode_tp), min(self.prefill_tp, self.decode_tp)
        return big % small == 0


@dataclasses.dataclass
class Grid:
    ours: dict[Cell, Outcome]
    sglang: dict[Cell, Outcome]
    #: per cell, every prefill tp rank SGLang's mapping fetches (None when it refused)
    sglang_targets: dict[Cell, tuple[int, ...] | None]
    seconds: float
    cpu_seconds: float


def _ours(cell: Cell, topology: Topology) -> Outcome:
    is_mla, is_hybrid = MODELS[cell.model]
    layout = DecodeLayout(
        tp_rank=cell.decode_rank,
        tp_size=cell.decode_tp,
        pp_rank=cell.decode_pp_rank,
        pp_size=cell.decode_pp,
        page_size=1,
        kv_cache_dtype="bfloat16",
        is_mla=is_mla,
        is_hybrid_mla=is_hybrid,
        all_cp_ranks=cell.all_cp_env,
        kv_shard_size=2 if cell.decode_shard else 1,
    )
    try:
        plan = derive_plan(ADDR, topology, layout)
    except TopologyMismatch:
        return None
    return _describe(plan)


def _describe(plan: RankPlan) -> tuple[Any, ...]:
    fetched = tuple(
        (cp, tp, pp, tp in plan.dummy_tp_ranks)
        for cp in plan.cp_ranks
        for tp, pp in plan.fetch_order
    )
    # SGLang's connection-pool key is the text f"{addr}_{dp}_{cp}_{target tp rank}", the tp part
    # "None" under KV-cache sharding, where ours is EVERY_TP_RANK.
    keys = tuple(
        f"{k.addr}_{k.dp_rank}_{k.cp_rank}_{'None' if k.tp_rank == EVERY_TP_RANK else k.tp_rank}"
        for k in plan.keys_for(ADDR, 0)
    )
    return (
        plan.target_tp_rank,
        fetched,
        keys,
        plan.required_dst_info_num,
        plan.required_prefill_response_num,
    )


def _sglang(conn: Any, manager: Any, fields: dict[str, Any], room: int) -> tuple[Outcome, Any]:
    """SGLang's decision for one prefill topology, through its own code."""
    info = conn.PrefillServerInfo(**fields)
    try:
        manager._resolve_rank_mapping(info)
    except AssertionError:  # SGLang's refusals (pp sizes, sharded MLA with unequal tp)
        return None, None
    manager.connection_pool.clear()
    manager.prefill_info_table.clear()
    manager.prefill_info_table[ADDR] = info
    receiver = conn.CommonKVReceiver(manager, ADDR, room)
    fetched: list[tuple[int, int, int]] = []

    def answer(dp: int, cp: int, tp: int, pp: int) -> dict[str, Any]:
        # What the rank's GET /route would answer, plus the pp rank SGLang's own fetch adds.
        fetched.append((cp, tp, pp))
        return {"rank_ip": "127.0.0.1", "rank_port": 30000 + tp, "pp_rank": pp}

    receiver._get_bootstrap_info_from_server = answer
    receiver._register_kv_args = lambda: True  # no ZMQ registration: only the plan is compared
    receiver.init(0)
    dummies = [info_["is_dummy"] for info_ in receiver.bootstrap_infos]
    outcome = (
        receiver.target_tp_rank,
        tuple((cp, tp, pp, dummy) for (cp, tp, pp), dummy in zip(fetched, dummies, strict=True)),
        tuple(manager.connection_pool),
        receiver.required_dst_info_num,
        receiver.required_prefill_response_num,
    )
    return outcome, tuple(info.target_tp_ranks)


def _decode_configs() -> Iterator[tuple[int, int, int, int, str, bool, bool]]:
    for decode_tp, (decode_pp, pp_rank), model, env, shard in itertools.product(
        TP_SIZES, DECODE_PP, MODELS, (False, True), (False, True)
    ):
        for rank in range(decode_tp):
            yield decode_tp, rank, decode_pp, pp_rank, model, env, shard


def _prefills(conn: Any) -> list[tuple[tuple[Any, ...], dict[str, Any], Topology]]:
    """Every prefill of the grid: its switches, SGLang's ``PrefillServerInfo`` fields, and the
    topology we parse from the reply SGLang's server sends for it (``asdict`` of that info)."""
    prefills = []
    for config in itertools.product(TP_SIZES, PREFILL_CP, PREFILL_PP, (False, True), (False, True)):
        p_tp, p_cp, p_pp, dsa, sharding = config
        fields = {
            "attn_tp_size": p_tp,
            "attn_cp_size": p_cp,
            "dp_size": 1,
            "pp_size": p_pp,
            "page_size": 1,
            "kv_cache_dtype": "bfloat16",
            "follow_bootstrap_room": True,
            "enable_dsa_cache_layer_split": dsa,
            "enable_kv_cache_sharding": sharding,
        }
        reply = dataclasses.asdict(conn.PrefillServerInfo(**fields))
        topology = topology_reply(reply, addr=ADDR, status=200, instance_id=None)
        prefills.append((config, fields, topology))
    return prefills


@pytest.fixture(scope="module")
def grid() -> Iterator[Grid]:
    conn = import_sglang()
    runtime = importlib.import_module("sglang.srt.runtime_context")
    saved_env = os.environ.get(ALL_CP_ENV)
    # A decode with its own KV sharding asks torch for its shard group; there is none on CPU,
    # so the group lookup answers a group of 2 (what kv_shard_size=2 says on our side).
    saved_group = conn.get_kv_shard_group
    conn.get_kv_shard_group = lambda is_mla: types.SimpleNamespace(rank_in_group=0, world_size=2)
    ours: dict[Cell, Outcome] = {}
    sglang: dict[Cell, Outcome] = {}
    targets: dict[Cell, tuple[int, ...] | None] = {}
    room = itertools.count()
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        prefills = _prefills(conn)
        configs = sorted(_decode_configs(), key=lambda c: (c[0], c[2]))
        for (decode_tp, decode_pp), group in itertools.groupby(configs, key=lambda c: (c[0], c[2])):
            with sglang_server_args(
                disaggregation_mode="decode", host="127.0.0.1", tp_size=decode_tp, pp_size=decode_pp
            ) as server_args:
                for _, rank, _, pp_rank, model, env, shard in group:
                    is_mla, is_hybrid = MODELS[model]
                    os.environ[ALL_CP_ENV] = "1" if env else "0"
                    set_sglang_ranks(tp_rank=rank, pp_rank=pp_rank)
                    runtime.get_parallel().override_permanently(enable_kv_cache_sharding=shard)
                    kv_args = make_kv_args(
                        engine_rank=rank, pp_rank=pp_rank, is_hybrid_mla_backend=is_hybrid
                    )
                    manager = conn.CommonKVManager(
                        kv_args, conn.DisaggregationMode.DECODE, server_args, is_mla_backend=is_mla
                    )
                    try:
                        for config, fields, topology in prefills:
                            cell = Cell(
                                model, *config, decode_tp, rank, decode_pp, pp_rank, env, shard
                            )
                            sglang[cell], targets[cell] = _sglang(conn, manager, fields, next(room))
                            ours[cell] = _ours(cell, topology)
                    finally:
                        manager._zmq_ctx.destroy(linger=0)
    finally:
        conn.get_kv_shard_group = saved_group
        runtime.get_parallel().override_permanently(enable_kv_cache_sharding=False)
        conn.CommonKVReceiver.close_all_sockets()
        if saved_env is None:
            os.environ.pop(ALL_CP_ENV, None)
        else:
            os.environ[ALL_CP_ENV] = saved_env
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    yield Grid(ours, sglang, targets, wall, cpu)


def _show(cells: list[Cell], grid: Grid) -> str:
    return "\n".join(
        f"{c}\n  ours:   {grid.ours[c]}\n  sglang: {grid.sglang[c]}" for c in cells[:5]
    )


@pytest.mark.parametrize("model", list(MODELS))
def test_every_cell_with_dividing_tp_sizes_equals_sglang(grid: Grid, model: str) -> None:
    """Every cell whose tp sizes divide: the same plan as SGLang 0.5.23, or both refuse."""
    cells = [c for c in grid.ours if c.model == model and c.divides]
    differ = [c for c in cells if grid.ours[c] != grid.sglang[c]]
    assert not differ, f"{len(differ)} of {len(cells)} cells differ, e.g.:\n{_show(differ, grid)}"


def test_tp_sizes_that_do_not_divide_are_refused_where_sglang_maps_them_wrong(grid: Grid) -> None:
    """PLAN-5's deliberate difference, shown on SGLang's own mapping: for every layout of the
    grid whose tp sizes do not divide, we refuse every decode rank, and where SGLang maps them
    at all, its decode ranks together either name a prefill tp rank that does not exist or never
    fetch one that does."""
    groups: dict[tuple[Any, ...], list[Cell]] = {}
    for cell in grid.ours:
        if not cell.divides:
            key = dataclasses.astuple(dataclasses.replace(cell, decode_rank=0))
            groups.setdefault(key, []).append(cell)
    assert groups
    mapped = 0
    for cells in groups.values():
        assert all(grid.ours[c] is None for c in cells), cells[0]
        fetched = [grid.sglang_targets[c] for c in cells]
        if any(f is None for f in fetched):
            continue  # SGLang refuses too (a pp pair or sharded MLA): both refuse
        mapped += 1
        union = set().union(*(set(f) for f in fetched if f is not None))
        assert union != set(range(cells[0].prefill_tp)), cells[0]
    assert mapped > 0


def test_the_grid_reaches_every_rule(grid: Grid) -> None:
    """The grid is not vacuous: it holds cells of every rule and both refusals, and its size
    and runtime are as reported."""
    outcomes = [o for o in grid.sglang.values() if o is not None]
    refused = sum(1 for o in grid.sglang.values() if o is None)
    assert refused > 0
    assert any(o[0] is None for o in outcomes)  # PLAN-6: sharded MLA, one None-keyed entry
    assert any(any(f[3] for f in o[1]) for o in outcomes)  # PLAN-5: MLA dummy targets
    assert any(o[3] > 1 and o[0] is not None for o in outcomes)  # PLAN-4: shared prefill rank
    assert any(len(o[2]) == 2 for o in outcomes)  # PLAN-7: both cp ranks pulled
    assert any({f[2] for f in o[1]} == {1} for o in outcomes)  # PLAN-8: own pp rank 1 only
    highest_first = ((0, 0, 1, False), (0, 0, 0, False))  # PLAN-10: pp fetched highest first
    assert any(o[1][:2] == highest_first for o in outcomes)
    print(
        f"\nSGLang plan grid: {len(grid.sglang)} cells ({refused} refused by SGLang), "
        f"{grid.seconds:.1f} s wall, {grid.cpu_seconds:.1f} s CPU"
    )


# --- PLAN-2: SGLang's format checks, against our reference server --------------------------------

_SPEC = {"num_draft_tokens": 4, "compression_ratios": [2, 4]}

#: (name, prefill registration fields, decode (page_size, kv_cache_dtype, kv_layout, DSpark), D,
#: refused)
FORMAT_CASES: list[tuple[str, dict[str, Any], tuple[Any, ...], int, bool]] = [
    ("all equal", {}, (16, "bfloat16", None, None), 2, False),
    ("page size", {}, (32, "bfloat16", None, None), 2, True),
    ("kv dtype", {}, (16, "fp8_e4m3", None, None), 2, True),
    ("kv layout equal", {"kv_layout": "paged"}, (16, "bfloat16", "paged", None), 2, False),
    ("kv layout differs", {"kv_layout": "paged"}, (16, "bfloat16", "flat", None), 2, True),
    ("kv layout one side", {"kv_layout": "paged"}, (16, "bfloat16", None, None), 2, False),
    ("dspark equal", {"dsv41_spec_layout": _SPEC}, (16, "bfloat16", None, _SPEC), 2, False),
    ("dspark differs", {"dsv41_spec_layout": _SPEC}, (16, "bfloat16", None, {"x": 1}), 2, True),
    ("dspark prefill only", {"dsv41_spec_layout": _SPEC}, (16, "bfloat16", None, None), 2, True),
    ("dspark decode only", {}, (16, "bfloat16", None, _SPEC), 2, True),
    ("dspark tp differs", {"dsv41_spec_layout": _SPEC}, (16, "bfloat16", None, _SPEC), 4, True),
    ("mixed tp, no dspark", {}, (16, "bfloat16", None, None), 4, False),
]


@pytest.mark.parametrize(
    ("prefill_fields", "decode", "decode_tp", "refused"),
    [case[1:] for case in FORMAT_CASES],
    ids=[case[0] for case in FORMAT_CASES],
)
def test_plan_2_format_checks_refuse_where_sglangs_do(
    prefill_fields: dict[str, Any], decode: tuple[Any, ...], decode_tp: int, refused: bool
) -> None:
    """A tp-2 prefill registered with our reference server; SGLang's own decode fetches its
    topology (``try_ensure_parallel_info``, which raises on a format mismatch) and so does our
    client (``derive_plan`` raising TopologyMismatch): both refuse, or neither does, as the
    case expects."""
    page_size, dtype, kv_layout, spec = decode
    conn = import_sglang()
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    try:
        for tp in range(2):
            payload = route_payload(
                rank_ip="127.0.0.1", rank_port=31000 + tp, tp_rank=tp, tp_size=2, page_size=16
            )
            payload.update(prefill_fields)
            register_rank(server.address, TOKEN, payload, attempts=1)
        kv_args = make_kv_args(page_size=page_size, kv_cache_dtype_str=dtype, kv_layout=kv_layout)
        with sglang_decode_manager(kv_args=kv_args, tp_size=decode_tp) as manager:
            # SGLang derives this from its KV pool and speculative settings; set what it found.
            manager.dsv41_spec_layout = spec
            try:
                assert manager.try_ensure_parallel_info(server.address) is True
                sglang_refuses = False
            except RuntimeError:
                sglang_refuses = True
        layout = DecodeLayout(
            0, decode_tp, page_size=page_size, kv_cache_dtype=dtype, kv_layout=kv_layout,
            dsv41_spec_layout=spec,
        )  # fmt: skip
        try:
            derive_plan(server.address, client.get_topology(server.address), layout)
            we_refuse = False
        except TopologyMismatch:
            we_refuse = True
    finally:
        client.close()
        server.stop()
        conn.CommonKVReceiver.close_all_sockets()
    assert (we_refuse, sglang_refuses) == (refused, refused)
