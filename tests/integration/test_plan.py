"""Rank plans (spec/plans.md, PLAN-1 .. PLAN-9): SGLang 0.5.23's mapping, row by row.

The tables below are the worked examples that were run against SGLang 0.5.23's own
``_resolve_rank_mapping`` (its ``disaggregation/common/conn.py:1432-1530``) and the dummy flag of
``_setup_bootstrap_infos`` (``:2634-2643``), written out as explicit expectations. The whole grid,
computed by SGLang's code itself, is ``tests/sglang/test_sglang_plans.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import (
    DEFAULT_PLAN,
    DecodeLayout,
    RankPlan,
    derive_plan,
    plan_without_layout,
)
from statemachine.errors import MalformedReply, TopologyMismatch
from statemachine.pool import EVERY_TP_RANK, PoolKey
from statemachine.prefill.registration import register_rank
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.http import route_payload, topology_reply
from tests.support.bootstrap_support import TOKEN

ADDR = "10.0.0.1:8998"


def topo(tp: int = 1, cp: int = 1, pp: int = 1, **fields: Any) -> Any:
    """A prefill topology reply, parsed as the client parses it."""
    reply: dict[str, object] = {
        "attn_tp_size": tp,
        "attn_cp_size": cp,
        "dp_size": 1,
        "pp_size": pp,
        "page_size": 16,
        "kv_cache_dtype": "bfloat16",
        "follow_bootstrap_room": True,
    }
    reply.update(fields)
    return topology_reply(reply, addr=ADDR, status=200, instance_id="i")


def row(plan: RankPlan) -> tuple[int | None, tuple[str, ...], int, int]:
    """A plan as the reference's table writes it: target tp rank, tp ranks with ``D`` on the
    dummy ones, required_dst_info_num, required_prefill_response_num."""
    ranks = tuple(f"{tp}D" if tp in plan.dummy_tp_ranks else str(tp) for tp in plan.tp_ranks)
    return (
        plan.target_tp_rank,
        ranks,
        plan.required_dst_info_num,
        plan.required_prefill_response_num,
    )


NON_MLA: dict[str, Any] = {}
MLA: dict[str, Any] = {"is_mla": True}
HYBRID: dict[str, Any] = {"is_hybrid_mla": True}

# --- the reference's §1.9 table: prefill cp 1, pp 1, no sharding --------------------------------

# (P, D) -> per decode rank, non-MLA (hybrid MLA identical) and MLA.
TP_TABLE: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {
    (2, 2): (
        [(0, ("0",), 1, 1), (1, ("1",), 1, 1)],
        [(0, ("0",), 1, 1), (1, ("1",), 1, 1)],
    ),
    (2, 4): (  # PLAN-4: two decode ranks share each prefill rank; none is dummy
        [(0, ("0",), 2, 1), (0, ("0",), 2, 1), (1, ("1",), 2, 1), (1, ("1",), 2, 1)],
        [(0, ("0",), 2, 1), (0, ("0",), 2, 1), (1, ("1",), 2, 1), (1, ("1",), 2, 1)],
    ),
    (4, 2): (  # PLAN-5: MLA pulls one real rank, the other is a dummy
        [(0, ("0", "1"), 1, 2), (2, ("2", "3"), 1, 2)],
        [(0, ("0", "1D"), 1, 1), (2, ("2", "3D"), 1, 1)],
    ),
    (1, 4): (
        [(0, ("0",), 4, 1)] * 4,
        [(0, ("0",), 4, 1)] * 4,
    ),
    (4, 1): (
        [(0, ("0", "1", "2", "3"), 1, 4)],
        [(0, ("0", "1D", "2D", "3D"), 1, 1)],
    ),
}


@pytest.mark.parametrize("sizes", sorted(TP_TABLE), ids=lambda s: f"P{s[0]}-D{s[1]}")
def test_plan_3_to_5_tp_rule_matches_the_worked_table(sizes: tuple[int, int]) -> None:
    """PLAN-3..PLAN-5: every decode rank of every (P, D) of the table, in all three models."""
    prefill_tp, decode_tp = sizes
    non_mla, mla = TP_TABLE[sizes]
    for model, want in ((NON_MLA, non_mla), (HYBRID, non_mla), (MLA, mla)):
        got = [
            row(derive_plan(ADDR, topo(prefill_tp), DecodeLayout(r, decode_tp, **model)))
            for r in range(decode_tp)
        ]
        assert got == want, model


def test_plan_4_no_decode_rank_is_ever_dummy_when_decode_tp_is_larger() -> None:
    """PLAN-4 (the silent-success bug of issue 15): each of the k decode ranks sharing a prefill
    rank is a real peer that waits for its KV, for every model and ratio."""
    for prefill_tp, decode_tp in ((1, 2), (1, 8), (2, 4), (2, 8), (4, 8), (3, 6)):
        for model in (NON_MLA, MLA, HYBRID):
            for rank in range(decode_tp):
                plan = derive_plan(ADDR, topo(prefill_tp), DecodeLayout(rank, decode_tp, **model))
                share = decode_tp // prefill_tp
                assert plan.tp_ranks == (rank // share,)
                assert plan.dummy_tp_ranks == frozenset()
                assert plan.required_dst_info_num == share
                assert plan.required_prefill_response_num == 1


# --- the reference's §1.10 table: cp, pp and sharding -------------------------------------------


def test_plan_7_cp_rank_zero_only_by_default() -> None:
    """PLAN-7: prefill tp2 cp2 with no switch: cp rank 0 only, one response (any model but
    hybrid MLA); the other cp ranks send nothing in SGLang."""
    for model in (NON_MLA, MLA):
        plan = derive_plan(ADDR, topo(2, cp=2), DecodeLayout(1, 2, **model))
        assert (plan.cp_ranks, plan.pp_ranks, plan.required_prefill_response_num) == ((0,), (0,), 1)
        assert [key.cp_rank for key in plan.keys_for(ADDR, 0)] == [0]


@pytest.mark.parametrize(
    ("prefill_fields", "layout_fields"),
    [
        ({"enable_dsa_cache_layer_split": True}, {}),
        ({"enable_kv_cache_sharding": True}, {}),
        ({"enable_kv_cache_sharding": True}, {"is_mla": True}),  # cp > 1: not PLAN-6's branch
        ({}, {"is_hybrid_mla": True}),
        ({}, {"all_cp_ranks": True}),
        ({}, {"kv_shard_size": 2}),
    ],
    ids=["dsa-split", "sharding", "sharding-mla", "hybrid-mla", "all-cp-env", "kv-shard-size"],
)
def test_plan_7_every_switch_pulls_every_cp_rank(
    prefill_fields: dict[str, Any], layout_fields: dict[str, Any]
) -> None:
    """PLAN-7: each of SGLang's switches (the prefill's DSA layer split or KV-cache sharding;
    the decode's all-cp setting, hybrid MLA pool or own KV sharding) pulls both cp ranks: one
    pool key and one response per cp rank."""
    plan = derive_plan(ADDR, topo(2, cp=2, **prefill_fields), DecodeLayout(0, 2, **layout_fields))
    assert (plan.cp_ranks, plan.pp_ranks, plan.required_prefill_response_num) == ((0, 1), (0,), 2)
    assert plan.target_tp_rank == 0  # the cp case keeps the tp rule's own target
    assert [key.cp_rank for key in plan.keys_for(ADDR, 0)] == [0, 1]


def test_plan_7_switches_do_nothing_for_a_one_cp_prefill() -> None:
    plan = derive_plan(
        ADDR, topo(2, enable_dsa_cache_layer_split=True), DecodeLayout(0, 2, all_cp_ranks=True)
    )
    assert plan.cp_ranks == (0,) and plan.required_prefill_response_num == 1


def test_plan_8_pp_rule() -> None:
    """PLAN-8: decode pp 1 pulls every prefill pp rank, fetched highest first; equal pp sizes
    pull the decode's own pp rank only; anything else is refused."""
    plan = derive_plan(ADDR, topo(2, pp=2), DecodeLayout(0, 2))
    assert (plan.cp_ranks, plan.pp_ranks, plan.required_prefill_response_num) == ((0,), (0, 1), 2)
    assert plan.fetch_order == ((0, 1), (0, 0))
    whole = derive_plan(ADDR, topo(2, pp=2), DecodeLayout(0, 1))  # non-MLA, tp 0,1 x pp 0,1
    assert whole.required_prefill_response_num == 4
    assert whole.fetch_order == ((0, 1), (0, 0), (1, 1), (1, 0))
    for own in (0, 1):
        plan = derive_plan(ADDR, topo(1, pp=2), DecodeLayout(0, 1, pp_rank=own, pp_size=2))
        assert plan.pp_ranks == (own,) and plan.required_prefill_response_num == 1
    for prefill_pp, decode_pp in ((4, 2), (1, 2)):
        with pytest.raises(TopologyMismatch, match=r"pp size .* must equal the prefill's or be 1"):
            derive_plan(ADDR, topo(1, pp=prefill_pp), DecodeLayout(0, 1, pp_size=decode_pp))


def test_plan_6_mla_kv_cache_sharding() -> None:
    """PLAN-6: MLA against a cp-1 prefill that shards its KV cache: every tp rank is a real
    sender, one pool key whose tp part is None (SGLang's "None" in the key string), each prefill
    rank waits for every decode rank; unequal tp sizes are refused."""
    prefill = topo(2, enable_kv_cache_sharding=True)
    for rank in (0, 1):
        plan = derive_plan(ADDR, prefill, DecodeLayout(rank, 2, is_mla=True))
        assert row(plan) == (None, ("0", "1"), 2, 2)
        assert plan.cp_ranks == (0,) and plan.pp_ranks == (0,)
        assert plan.keys_for(ADDR, 3) == (PoolKey(ADDR, 3, 0, EVERY_TP_RANK),)
    # Non-MLA never reads the flag for tp (only for cp): an ordinary one-to-one plan.
    assert row(derive_plan(ADDR, prefill, DecodeLayout(1, 2))) == (1, ("1",), 1, 1)
    assert row(derive_plan(ADDR, prefill, DecodeLayout(1, 2, is_hybrid_mla=True))) == (
        1,
        ("1",),
        1,
        1,
    )
    with pytest.raises(TopologyMismatch, match="sharded MLA needs equal attention tp sizes"):
        derive_plan(ADDR, prefill, DecodeLayout(0, 4, is_mla=True))


def test_plan_6_sharding_with_pp_multiplies_responses() -> None:
    plan = derive_plan(
        ADDR, topo(2, pp=2, enable_kv_cache_sharding=True), DecodeLayout(0, 2, is_mla=True)
    )
    assert plan.target_tp_rank is None and plan.required_prefill_response_num == 4
    assert plan.fetch_order == ((0, 1), (0, 0), (1, 1), (1, 0))


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 3), (3, 2), (4, 6), (6, 4), (3, 5)])
def test_plan_5_tp_sizes_that_do_not_divide_are_refused(prefill_tp: int, decode_tp: int) -> None:
    """A deliberate difference (PLAN-5): SGLang integer-divides here and maps some decode rank
    to a prefill rank that does not exist, or leaves a prefill rank unfetched (shown against
    SGLang's own code in tests/sglang/test_sglang_plans.py); we refuse with a next step."""
    for rank in range(decode_tp):
        with pytest.raises(TopologyMismatch, match=r"do not divide one another.*multiple"):
            derive_plan(ADDR, topo(prefill_tp), DecodeLayout(rank, decode_tp))


@pytest.mark.parametrize(
    ("prefill_fields", "layout_fields", "match"),
    [
        ({"page_size": 32}, {"page_size": 16}, "page_size"),
        ({"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype"),
        ({"kv_layout": "paged"}, {"kv_layout": "flat"}, "kv_layout"),
        ({"dsv41_spec_layout": {"block": 64}}, {"dsv41_spec_layout": {"block": 32}}, "DSpark"),
    ],
)
def test_plan_2_format_mismatch_is_refused(
    prefill_fields: dict[str, Any], layout_fields: dict[str, Any], match: str
) -> None:
    """PLAN-2: the KV format must match where both sides state it."""
    with pytest.raises(TopologyMismatch, match=match) as caught:
        derive_plan(ADDR, topo(2, **prefill_fields), DecodeLayout(0, 2, **layout_fields))
    assert "same" in str(caught.value) or "together" in str(caught.value)


def test_plan_2_unstated_formats_are_not_compared() -> None:
    """None on either side (an older server, a decode that did not say) skips the check."""
    plan = derive_plan(ADDR, topo(2, kv_layout="paged"), DecodeLayout(0, 2, page_size=16))
    assert plan.tp_ranks == (0,)
    assert derive_plan(ADDR, topo(2, page_size=None), DecodeLayout(0, 2, page_size=64)).tp_ranks


def test_plan_2_dspark_needs_equal_tp_but_an_mla_decode_may_match_tp_times_cp() -> None:
    spec = {"block_size": 64, "draft": "paged"}
    same = derive_plan(
        ADDR, topo(2, dsv41_spec_layout=spec), DecodeLayout(1, 2, dsv41_spec_layout=spec)
    )
    assert same.tp_ranks == (1,)
    with pytest.raises(TopologyMismatch, match=r"DSpark .* equal attention tp sizes"):
        derive_plan(
            ADDR, topo(2, dsv41_spec_layout=spec), DecodeLayout(0, 4, dsv41_spec_layout=spec)
        )
    # SGLang's one exception: a (hybrid) MLA decode whose tp is the prefill's tp x cp.
    for model in (MLA, HYBRID):
        layout = DecodeLayout(3, 4, dsv41_spec_layout=spec, **model)
        assert derive_plan(ADDR, topo(2, cp=2, dsv41_spec_layout=spec), layout).tp_ranks == (1,)
    with pytest.raises(TopologyMismatch, match="DSpark"):
        derive_plan(
            ADDR, topo(2, cp=2, dsv41_spec_layout=spec), DecodeLayout(3, 4, dsv41_spec_layout=spec)
        )


def test_plan_2_dspark_on_one_side_only_is_refused() -> None:
    """An absent DSpark layout means DSpark off (SGLang compares None too), unlike the other
    format fields, where None means not stated."""
    spec = {"block_size": 64}
    with pytest.raises(TopologyMismatch, match=r"dsv41_spec_layout is \{'block_size': 64\}"):
        derive_plan(ADDR, topo(2, dsv41_spec_layout=spec), DecodeLayout(0, 2))
    with pytest.raises(TopologyMismatch, match="dsv41_spec_layout is None"):
        derive_plan(ADDR, topo(2), DecodeLayout(0, 2, dsv41_spec_layout=spec))


def test_decode_layout_copies_its_dspark_layout() -> None:
    spec: dict[str, object] = {"block_size": 64}
    layout = DecodeLayout(dsv41_spec_layout=spec)
    spec["block_size"] = 32
    assert layout.dsv41_spec_layout == {"block_size": 64}
    assert hash(layout) == hash(DecodeLayout(dsv41_spec_layout={"block_size": 1}))


# --- PLAN-1: the topology carries SGLang's optional keys ----------------------------------------


def test_plan_1_topology_reply_parses_the_plan_switches() -> None:
    parsed = topo(
        2,
        enable_kv_cache_sharding=True,
        enable_dsa_cache_layer_split=False,
        kv_layout="paged",
        decode_allocation_policy="prefill_complete",
        dsv41_spec_layout={"block_size": 64},
    )
    assert parsed.enable_kv_cache_sharding is True
    assert parsed.enable_dsa_cache_layer_split is False
    assert parsed.kv_layout == "paged"
    assert parsed.decode_allocation_policy == "prefill_complete"
    assert parsed.dsv41_spec_layout == {"block_size": 64}
    assert "kv_layout" not in parsed.extra and "enable_kv_cache_sharding" not in parsed.extra
    absent = topo(2)
    assert absent.kv_layout is None and absent.enable_kv_cache_sharding is None
    for bad in ({"kv_layout": 3}, {"enable_kv_cache_sharding": "yes"}):
        with pytest.raises(MalformedReply, match=next(iter(bad))):
            topo(2, **bad)


# --- PLAN-9: no silent default --------------------------------------------------------------------


def test_plan_9_without_a_layout_only_a_one_rank_prefill_is_planned() -> None:
    assert plan_without_layout(ADDR, topo(1)) is DEFAULT_PLAN
    assert DEFAULT_PLAN.required_prefill_response_num == 1
    for sizes in ({"tp": 2}, {"cp": 2}, {"pp": 2}):
        with pytest.raises(TopologyMismatch, match=r"layout=DecodeLayout\(") as caught:
            plan_without_layout(ADDR, topo(**sizes))
        assert "explicit RankPlan" in str(caught.value)


@contextmanager
def prefill_server(tp_size: int, **fields: Any) -> Iterator[str]:
    """Our reference bootstrap server with ``tp_size`` ranks registered (HTTP only: no rank
    process is needed to plan)."""
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    try:
        for tp in range(tp_size):
            payload = route_payload(
                rank_ip="127.0.0.1", rank_port=20000 + tp, tp_rank=tp, tp_size=tp_size
            )
            payload.update(fields)
            register_rank(server.address, TOKEN, payload, attempts=1)  # raises unless 200
        yield server.address
    finally:
        server.stop()


@contextmanager
def manager(layout: DecodeLayout | None) -> Iterator[DecodeManager]:
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    decode = DecodeManager(source=client, layout=layout, health_probes=False)
    try:
        yield decode
    finally:
        decode.close()
        client.close()


def test_plan_9_manager_without_layout_refuses_a_tp2_prefill() -> None:
    """Before: DecodeManager() planned tp rank 0 only against a tp-2 prefill and reported
    success covering half the KV. Now the request fails at init with a TopologyMismatch that
    says to pass the layout; with the layout the same prefill is planned as SGLang plans it,
    and the switches the server carried from the registrations reach the plan."""
    with prefill_server(2, kv_layout="paged", enable_kv_cache_sharding=True) as addr:
        with manager(None) as decode:
            receiver = decode.receiver(addr, 1, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.Failed
            assert isinstance(receiver.failure, TopologyMismatch)
            assert "layout=DecodeLayout(" in str(receiver.failure)
        with manager(DecodeLayout(1, 2, page_size=16, is_mla=True)) as decode:
            topology = decode.topology(addr)
            assert topology.kv_layout == "paged" and topology.enable_kv_cache_sharding is True
            plan = decode.plan_for(addr)
            assert row(plan) == (None, ("0", "1"), 2, 2)
            assert decode.plan_for(addr) is plan  # derived once per address


def test_plan_9_manager_without_layout_plans_a_one_rank_prefill() -> None:
    with prefill_server(1) as addr, manager(None) as decode:
        assert decode.plan_for(addr) is DEFAULT_PLAN


@pytest.mark.parametrize(("model", "responses"), [(NON_MLA, 2), (MLA, 1)], ids=["gqa", "mla"])
def test_plan_5_decode_rank_1_of_a_smaller_tp_pulls_its_own_prefill_ranks(
    model: dict[str, Any], responses: int
) -> None:
    """PLAN-5 end to end for a decode rank other than 0: decode rank 1 of tp 2 against four
    real prefill rank processes (tp 4) fetches, registers with and completes on prefill ranks
    2 and 3 - the pool key named by tp rank 2, the generation holding their ports, their acks
    completing the room (MLA: rank 3 is a dummy, one response). Catches a span that starts at
    the decode rank instead of rank x span, and a key named by the decode rank: for rank 0
    both coincide with the right answer."""
    from statemachine.prefill.rank_process import PrefillRankProcess

    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    ranks = [PrefillRankProcess(server.address, TOKEN, tp_rank=tp, tp_size=4) for tp in range(4)]
    try:
        for rank in ranks:
            rank.start()
        with manager(DecodeLayout(1, 2, **model)) as decode:
            receiver = decode.receiver(server.address, 7, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.WaitingForInput, receiver.failure
            key = PoolKey(server.address, 0, 0, 2)
            assert list(receiver.entries) == [key]
            generation = receiver.entries[key]
            assert [rank.port for rank in generation.ranks] == [ranks[2].port, ranks[3].port]
            assert receiver.expected_acks() == responses
            assert receiver.send_metadata((1, 2)) == KVPoll.Transferring
            deadline = time.monotonic() + 10.0
            while receiver.poll() == KVPoll.Transferring and time.monotonic() < deadline:
                time.sleep(0.005)
            assert receiver.poll() == KVPoll.Success, receiver.failure
    finally:
        for rank in ranks:
            rank.kill()
        server.stop()
