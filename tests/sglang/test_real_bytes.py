"""Real KV bytes from SGLang 0.5.23's own prefill into this library's decode, per engine.

SGLang's prefill runs in its own processes (``tests/real_prefill``): its bootstrap server, its
Mooncake or NIXL prefill manager on a real engine, senders driven as its scheduler drives them,
CPU buffers holding a known pattern. The decode is this library's ``DecodeManager`` with its own
engine or agent and registered buffers. Source and destination pages are scattered differently;
every destination page is compared byte for byte with what it must hold, and untouched pages must
still be zero (the negative control: the same check on another room's pattern fails everywhere).

Not covered on this CPU machine, because SGLang 0.5.23 itself cannot: NIXL with different tp
sizes into DRAM (its prefill raises "heterogeneous-TP direct-to-host KV transfer is not
implemented": the decode refuses that locally, tested below), and NIXL state buffers (it
registers them as VRAM).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from statemachine.completion import KVPoll
from statemachine.errors import TopologyMismatch, TransferFailed
from tests.real_prefill.engines import engine_unavailable
from tests.real_prefill.harness import LibraryDecode, PrefillPool, RealPrefill
from tests.real_prefill.pattern import aux_bytes, page_bytes
from tests.support.sglang_support import requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]

SRC = [5, 17, 3, 40, 41, 90]  # the prefill's pages of a request
DST = [60, 2, 33, 9, 8, 71]  # where the decode wants them: another order, other slots
DONE = (KVPoll.Success, KVPoll.Failed)


def needs(backend: str) -> None:
    reason = engine_unavailable(backend)
    if reason is not None:
        pytest.skip(reason)


def finish(receiver: Any, timeout: float = 30.0) -> KVPoll:
    deadline = time.monotonic() + timeout
    while (state := receiver.poll()) not in DONE:
        assert time.monotonic() < deadline, "the request neither succeeded nor failed"
        time.sleep(0.001)
    return state


def run(prefill: RealPrefill, decodes: list[LibraryDecode], room: int, state: int | None) -> None:
    """One request through every decode rank; each ends Success with the right bytes."""
    for decode in decodes:
        decode.reset()
    prefill.transfer(room, SRC, aux_index=3, state_index=state)
    receivers = [
        d.request(prefill.address, room, DST, aux_index=7, state_index=state) for d in decodes
    ]
    for receiver in receivers:
        assert finish(receiver) == KVPoll.Success, receiver.failure
    for decode in decodes:
        assert decode.wrong_pages(room, DST, 7, state) == []
        # Negative control: another room's pattern matches no page, and no other page was written.
        assert (
            len(decode.wrong_pages(room + 1, DST, 7, None))
            == decode.geometry.buffers * len(DST) + 1
        )
        untouched = np.setdiff1d(np.arange(decode.geometry.slots), DST)
        for kv in decode.kv:
            assert not kv.reshape(decode.geometry.slots, -1)[untouched].any()
        assert decode.manager.stats().in_flight == 0


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def backend(request: pytest.FixtureRequest) -> str:
    needs(request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def prefills() -> Iterator[PrefillPool]:
    usable = [b for b in ("mooncake", "nixl") if engine_unavailable(b) is None]
    shapes = [(b, 1, False) for b in usable] + [(b, 2, True) for b in usable]
    if "mooncake" in usable:
        shapes.append(("mooncake", 2, False))
    pool = PrefillPool(spawn=shapes)
    yield pool
    pool.close()


@pytest.fixture
def prefill_tp1(prefills: PrefillPool, backend: str) -> RealPrefill:
    return prefills.get(backend)


@pytest.fixture
def prefill_mla_tp2(prefills: PrefillPool, backend: str) -> RealPrefill:
    return prefills.get(backend, 2, mla=True)


def test_one_to_one_kv_aux_and_state(prefill_tp1: RealPrefill) -> None:
    decode = LibraryDecode(prefill_tp1.backend)
    try:
        run(prefill_tp1, [decode], room=1001, state=2)
        run(prefill_tp1, [decode], room=1002, state=5)  # the cached generation: a hit
        assert decode.manager.stats().hits >= 1
    finally:
        decode.close()


def test_mla_one_prefill_rank_sends(prefill_mla_tp2: RealPrefill) -> None:
    decode = LibraryDecode(prefill_mla_tp2.backend, layout=prefill_mla_tp2.layout)
    try:
        run(prefill_mla_tp2, [decode], room=2001, state=None)
        plan = decode.manager.plan_for(prefill_mla_tp2.address)
        assert plan.tp_ranks == (0, 1) and plan.dummy_tp_ranks == frozenset({1})
    finally:
        decode.close()


def test_failed_transfer_ends_typed_with_sglangs_text(prefill_tp1: RealPrefill) -> None:
    # Its own decode: a Mooncake prefill refuses a session whose transfer failed from then on.
    decode = LibraryDecode(prefill_tp1.backend)
    try:
        prefill_tp1.transfer(3001, SRC, aux_index=0, break_source=True)
        receiver = decode.request(prefill_tp1.address, 3001, DST, aux_index=0)
        assert finish(receiver) == KVPoll.Failed
        assert isinstance(receiver.failure, TransferFailed)
        reason = {
            "mooncake": "Failed to get kvcache from prefill instance, it might be dead",
            "nixl": "NIXL_ERR_INVALID_PARAM",  # NIXL's status carries the prefill's reason
        }[prefill_tp1.backend]
        assert reason in str(receiver.failure)
        assert decode.manager.stats().in_flight == 0
    finally:
        decode.close()


# Head slicing: each rank holds its share of the KV heads. Mooncake only (see the docstring).


@pytest.fixture
def mooncake_tp1(prefills: PrefillPool) -> RealPrefill:
    needs("mooncake")
    return prefills.get("mooncake")


@pytest.fixture
def mooncake_tp2(prefills: PrefillPool) -> RealPrefill:
    needs("mooncake")
    return prefills.get("mooncake", 2)


def test_prefill_tp2_into_decode_tp1_gathers_both_halves(mooncake_tp2: RealPrefill) -> None:
    decode = LibraryDecode("mooncake")
    try:
        run(mooncake_tp2, [decode], room=4001, state=None)
        assert decode.manager.plan_for(mooncake_tp2.address).tp_ranks == (0, 1)
    finally:
        decode.close()


def test_decode_tp2_from_prefill_tp1_each_rank_gets_its_half(mooncake_tp1: RealPrefill) -> None:
    decodes = [LibraryDecode("mooncake", tp_rank=r, tp_size=2) for r in (0, 1)]
    try:
        run(mooncake_tp1, decodes, room=5001, state=None)
    finally:
        for decode in decodes:
            decode.close()


def test_integration_docs_real_deployment_example(mooncake_tp1: RealPrefill) -> None:
    """docs/integration.md's worked example (engine, registered buffers, session id), run as
    printed against SGLang's real prefill: the bytes land in the example's own buffers."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()
    section = text.split("## A real deployment", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "the real-deployment section lost its example"
    namespace: dict[str, Any] = {"__name__": "integration_real_deployment"}
    exec(compile(block.group(1), "docs/integration.md", "exec"), namespace)
    # The prefill's geometry is the harness default; the example's must match it byte for byte.
    g = mooncake_tp1.layout.side(1)
    assert (namespace["LAYERS"], namespace["PAGE_BYTES"]) == (g.layers, g.item_len)
    assert namespace["AUX_BYTES"] == g.aux_item_len
    manager, _engine, buffers = namespace["make_mooncake_decode"]()
    try:
        room, dst = 6001, [9, 0, 31, 4, 22, 63]
        mooncake_tp1.transfer(room, SRC, aux_index=1)
        receiver = manager.receiver(mooncake_tp1.address, room, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput
        receiver.send_metadata(dst, 5)
        assert finish(receiver) == KVPoll.Success, receiver.failure
        for buffer, kv in enumerate(buffers[:-1]):
            pages = kv.reshape(-1, g.item_len)
            for number, page in enumerate(dst):
                expected = page_bytes(room, buffer, number, g, 0, g.heads)
                assert np.array_equal(pages[page], expected), (buffer, page)
        aux = buffers[-1].reshape(-1, g.aux_item_len)
        assert np.array_equal(aux[5], aux_bytes(room, 0, g.aux_item_len))
    finally:
        manager.close()


# A decode's mistake never reaches the prefill: refused here, and SGLang's prefill still serves.


@pytest.mark.parametrize("mistake", ["unregistered buffer", "kinds left at VRAM"])
def test_nixl_decode_mistake_refused_locally_prefill_still_serves(
    prefills: PrefillPool, mistake: str
) -> None:
    needs("nixl")
    from statemachine.errors import InvalidArgument
    from statemachine.sglang.v0_5_23 import DecodeKVArgs, NixlBackend
    from tests.real_prefill import engines

    prefill = prefills.get("nixl")
    agent = engines.nixl_agent(f"mistaken-{mistake.replace(' ', '-')}")
    kv = [np.zeros(4096, dtype=np.uint8) for _ in range(4)]
    registered = kv[:-1] if mistake == "unregistered buffer" else kv
    engines.register("nixl", agent, registered)
    kv_args = DecodeKVArgs(
        engine_rank=0,
        attn_tp_size=1,
        kv_data_ptrs=[b.ctypes.data for b in kv],
        kv_data_lens=[b.nbytes for b in kv],
        kv_item_lens=[128] * 4,
        kv_mem_kinds=["DRAM"] * 4 if mistake == "unregistered buffer" else (),
    )
    with pytest.raises(InvalidArgument, match="is not registered with NIXL agent"):
        NixlBackend.from_agent(agent, kv_args)
    # Nothing was sent: the same prefill serves a correct decode right after.
    decode = LibraryDecode("nixl")
    try:
        run(prefill, [decode], room=7001 + len(mistake), state=None)
    finally:
        decode.close()


def test_mooncake_decode_mistake_refused_locally_prefill_still_serves(
    prefills: PrefillPool,
) -> None:
    needs("mooncake")
    from statemachine.errors import InvalidArgument
    from statemachine.sglang.v0_5_23 import DecodeKVArgs, MooncakeBackend
    from tests.real_prefill import engines

    prefill = prefills.get("mooncake")
    engine, _session = engines.mooncake_engine()
    kv = [np.zeros(4096, dtype=np.uint8) for _ in range(4)]
    aux = np.zeros(384, dtype=np.uint8)  # never registered: the mistake
    kv_args = DecodeKVArgs(
        engine_rank=0,
        attn_tp_size=1,
        kv_data_ptrs=[b.ctypes.data for b in kv],
        kv_data_lens=[b.nbytes for b in kv],
        kv_item_lens=[128] * 4,
        aux_data_ptrs=[aux.ctypes.data],
    )
    with pytest.raises(InvalidArgument, match=r"aux_data_ptrs\[0\] .* is not registered"):
        MooncakeBackend.from_engine(engine, "127.0.0.1", kv_args)
    # Nothing was sent: the same prefill serves a correct decode right after.
    decode = LibraryDecode("mooncake")
    try:
        run(prefill, [decode], room=8001, state=2)
    finally:
        decode.close()


def test_nixl_decode_of_another_tp_size_into_dram_refused_prefill_still_serves(
    prefills: PrefillPool,
) -> None:
    """SGLang's NIXL prefill moves KV between different tp sizes only into VRAM; a DRAM decode
    of another tp size would end its bootstrap thread. Refused here, before anything is sent."""
    needs("nixl")
    prefill = prefills.get("nixl")  # tp 1
    mistaken = LibraryDecode("nixl", tp_rank=0, tp_size=2)  # DRAM buffers
    try:
        receiver = mistaken.manager.receiver(prefill.address, 7101, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.Failed
        assert isinstance(receiver.failure, TopologyMismatch)
        assert "with the prefill's attention tp size" in str(receiver.failure)
        assert mistaken.manager.stats().in_flight == 0
    finally:
        mistaken.close()
    decode = LibraryDecode("nixl")
    try:
        run(prefill, [decode], room=7102, state=None)
    finally:
        decode.close()
