"""A prefill SIGKILL and replacement under SGLang 0.5.23's own decode queues at decode tp 2 and at
dp attention 2: SGLang's classes against the installed ones, real bytes, a real process group.

Each decode rank is its own process (tests/real_prefill/decode_rank.py): SGLang's
``DecodePreallocQueue`` / ``DecodeTransferQueue``, its rank publication, process groups
(``init_distributed_environment`` / ``initialize_model_parallel`` over torch's gloo backend on
127.0.0.1, real torch 2.13 CPU), its request broadcast and the queues' all-reduces over
``attn_tp_group.cpu_group``. At tp 2 the two ranks reduce their polls together (a two-rank MIN);
at dp attention 2 each dp rank is attention tp 1 (its group answers world size 1, so SGLang
returns the polls unchanged) and the two share the tp group SGLang broadcasts control over
each step. The prefill is SGLang's real prefill (tests/real_prefill: its bootstrap server, its
Mooncake prefill manager on a real engine over loopback TCP) at tp 2 for tp 2, tp 1 for dp
attention. Stand-ins: numpy KV/aux buffers, the scheduler object, ``pop_preallocated``'s
allocation (replayed in decode_rank.py, citing decode.py's lines).

The script (tests/real_prefill/multirank.py): two requests complete and every rank's pages are
checked byte for byte; two more are in flight (metadata sent by every rank holding them) when
every prefill rank is SIGKILLed; a new prefill starts behind the same bootstrap port; after its
READY two new requests start, watched ``OBSERVE_S`` seconds. The heartbeat interval is 30 s
(SGLang's ``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL``, read by both managers): the replacement
is READY within two heartbeats, the case SGLang's heartbeat cannot see.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.real_prefill.engines import engine_unavailable, loopback_environment
from tests.real_prefill.multirank import restart_run, table, torch_unavailable
from tests.support.http_support import free_port
from tests.support.sglang_support import requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]

_rooms = itertools.count(9_200)


@pytest.fixture
def environment() -> Iterator[None]:
    reason = engine_unavailable("mooncake") or torch_unavailable()
    if reason is not None:
        pytest.skip(reason)
    loopback_environment()
    yield


@pytest.mark.parametrize("mode", ["tp", "dp"])
def test_sglangs_classes_hang_at_a_prefill_restart(
    environment: None, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang's own classes, both ranks: the baseline before the kill is right, then requests
    hang (nothing of theirs ends them before the 300 s waiting timeout)."""
    run = restart_run(mode, "sglang", free_port(), _rooms)
    with capsys.disabled():
        print("\n" + table([run]))
    assert {r["manager"] for r in run.ranks} == {
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
    }
    assert [o.state for o in run.outcomes[:2]] == ["done", "done"], table([run])
    assert any(o.state == "pending" for o in run.outcomes[2:]), table([run])


@pytest.mark.parametrize("mode", ["tp", "dp"])
def test_the_installed_classes_recover_from_a_prefill_restart(
    environment: None, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library's classes in both ranks: nothing hangs, the requests in flight fail typed,
    every request after READY completes with every rank's pages verified byte for byte."""
    run = restart_run(mode, "installed", free_port(), _rooms)
    with capsys.disabled():
        print("\n" + table([run]))
    details = [(o.label, o.state, o.detail) for o in run.outcomes]
    assert {r["manager"].rsplit(".", 2)[0] for r in run.ranks} == {
        "statemachine.sglang.v0_5_23.decode_worker"
    }, run.ranks
    if mode == "tp":  # the real groups SGLang built: attention tp 2, engine ranks 0 and 1
        assert [(r["attn_tp_size"], r["engine_rank"]) for r in run.ranks] == [(2, 0), (2, 1)]
    else:  # dp attention 2: two attention-tp-1 replicas, system dp ranks 0 and 1
        assert [(r["attn_tp_size"], r["system_dp_rank"]) for r in run.ranks] == [(1, 0), (1, 1)]
    assert all(o.state != "pending" for o in run.outcomes), details
    before, in_flight, after = run.outcomes[:2], run.outcomes[2:4], run.outcomes[4:]
    assert [o.state for o in before + after] == ["done"] * 4, details
    for outcome in in_flight:
        assert outcome.state == "failed" and "KVTransferError" in outcome.detail, details
    assert all(o.verified == len(o.ranks) for o in before + after), details
