"""SGLang 0.5.23's decode surface on the installed classes, through SGLang's own code.

Each test drives the classes of ``statemachine/sglang/v0_5_23/decode_worker/conn.py`` with
SGLang's own decode queues (tests/support/sglang_decode_support.py: ``DecodePreallocQueue`` and
``DecodeTransferQueue`` built by their constructors, stand-ins only for the GPU pools, the
scheduler and torch's one-rank group), SGLang's bootstrap server and a prefill-mode
``CommonKVManager`` registered by SGLang's ``register_to_bootstrap``, whose PULL socket the test
reads with SGLang's own parsers. The decode.py calls run and replayed are those listed in
tests/sglang/test_sglang_decode_queues.py's docstring; each test names the lines it reaches.

The surface: ``send_metadata`` with SGLang's full signature (``device_kv_indices`` refused, typed,
naming ``--enable-hisparse``); duplicate bootstrap rooms under both allocation policies;
``release_memory_occupation`` / ``resume_memory_occupation`` (no room held after, NIXL
registrations carry the agent's metadata as it is after the resume, with a real NIXL agent);
the library's figures in SGLang's ``/metrics`` under prometheus_client's multiprocess mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import pytest
import zmq

from statemachine.sglang.v0_5_23 import decode_worker
from statemachine.sglang.v0_5_23.decode_worker import conn as ours
from tests.support.sglang_decode_support import (
    Req,
    StandInMooncakeEngine,
    decode_queues,
    mooncake_engine,
    pages,
)
from tests.support.sglang_support import (
    import_sglang,
    make_kv_args,
    requires_sglang,
    set_sglang_ranks,
    sglang_bootstrap_server,
    sglang_server_args,
)
from tests.support.sglang_support import sglang_prefill_rank as prefill_rank
from tests.support.sglang_wire_support import mooncake_module

pytestmark = requires_sglang


def received(rank: Any, timeout_ms: int = 5000) -> list[bytes]:
    sock = rank.server_socket
    assert sock.poll(timeout_ms, zmq.POLLIN), "the prefill rank received nothing"
    frames: list[bytes] = sock.recv_multipart()
    return frames


def nothing_received(rank: Any, timeout_ms: int = 300) -> bool:
    return not rank.server_socket.poll(timeout_ms, zmq.POLLIN)


def bootstrap(prealloc: Any, req: Any) -> Any:
    """decode.py's path from ``add`` (decode.py:808) through ``_resolve_pending_reqs``
    (1325) and ``_update_handshake_waiters`` (1364)."""
    prealloc.add(req)
    decode_req = prealloc.queue[-1]
    prealloc._resolve_pending_reqs()
    prealloc._update_handshake_waiters()
    return decode_req


@pytest.fixture
def prefill(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """SGLang's bootstrap server and one prefill rank (tp 1) under the allocation policy of
    the test's ``policy`` parameter (SGLang's default, ``early``, without one)."""
    policy = getattr(request, "param", "early")
    with ExitStack() as stack:
        addr = stack.enter_context(sglang_bootstrap_server())
        rank = stack.enter_context(
            prefill_rank(addr, tp_size=1, tp_rank=0, disaggregation_decode_allocation_policy=policy)
        )
        yield addr, rank


# --- send_metadata: SGLang's full signature -------------------------------------------------


def test_send_metadata_takes_sglangs_signature_and_refuses_hisparse_indices_typed(
    prefill: tuple[str, Any],
) -> None:
    """decode.py:1813-1816 passes ``decode_prefix_len`` and, under ``--enable-hisparse``,
    ``device_kv_indices`` through ``_send_kv_metadata`` (1844-1868): the first request carries
    every keyword of SGLang's signature (common/conn.py:2839-2847) and reaches the prefill;
    the second carries HiSparse's device indices and fails, typed, without raising in the
    scheduler loop and without a metadata message."""
    addr, rank = prefill
    mooncake = mooncake_module()
    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(StandInMooncakeEngine()),
        decode_queues("mooncake") as (prealloc, transfer),
    ):
        destination = import_sglang().KVTransferDestination.DEVICE
        first = bootstrap(prealloc, Req(addr, room=601))
        received(rank)  # the registration
        prealloc._send_kv_metadata(
            first, pages([2, 3]), 1, None, decode_prefix_len=0, destination=destination
        )
        info = mooncake.TransferInfo.from_zmq(received(rank))
        assert (info.room, list(info.dst_kv_indices)) == (601, [2, 3])

        req = Req(addr, room=602)
        second = bootstrap(prealloc, req)
        prealloc._send_kv_metadata(
            second, pages([4, 5]), 1, None, decode_prefix_len=0, device_kv_indices=pages([9])
        )
        # No metadata: the room's prefill rank is told the room is aborted (SGLang's parser).
        abort = import_sglang().AbortNotification.from_zmq(received(rank))
        assert abort is not None and abort.room == 602
        assert nothing_received(rank)
        prealloc.queue.remove(second)
        transfer.extend([second])
        assert transfer.pop_transferred() == []
        assert second not in transfer.queue, "decode.py:2861-2917 failed it"
        message = req.finished_reason.message
        assert "SGLangFeatureRefused" in message and "--enable-hisparse" in message


def test_a_hisparse_decode_is_refused_when_the_manager_is_built() -> None:
    """``--enable-hisparse`` is refused where SGLang's scheduler builds the manager
    (decode.py:765-770), before anything is registered with a prefill."""
    conn = import_sglang()
    with ExitStack() as stack:
        stack.enter_context(mooncake_engine(StandInMooncakeEngine()))
        server_args = stack.enter_context(
            sglang_server_args(disaggregation_mode="decode", host="127.0.0.1", enable_hisparse=True)
        )
        set_sglang_ranks(tp_rank=0)
        with pytest.raises(ours.SGLangFeatureRefused, match="--enable-hisparse"):
            ours.MooncakeKVManager(
                make_kv_args(), conn.DisaggregationMode.DECODE, server_args, False
            )


# --- duplicate bootstrap rooms ----------------------------------------------------------------


@pytest.mark.parametrize("prefill", ["early"], indirect=True)
def test_early_a_duplicate_room_is_refused_typed_and_the_first_request_goes_on(
    prefill: tuple[str, Any],
) -> None:
    """Under ``early`` SGLang has no guard (common/conn.py:2500-2510) and the two receivers
    would share the room's status while the prefill keeps one destination per (room, decode)
    (mooncake/conn.py:3018-3024): the installed classes refuse the second, typed, saying why,
    and the first completes its handshake. decode.py:1158-1177 aborts the duplicate."""
    addr, _ = prefill
    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(StandInMooncakeEngine()),
        decode_queues("mooncake") as (prealloc, _transfer),
    ):
        first = bootstrap(prealloc, Req(addr, room=9))
        second = bootstrap(prealloc, Req(addr, room=9))
        assert first.waiting_for_input and first.req.finished_reason is None
        message = second.req.finished_reason.message
        assert "InvalidRoom: room 9 is already in flight" in message
        assert "writes the KV of only one of them" in message
        assert "own bootstrap_room" in message


@pytest.mark.parametrize("classes", ["sglang", "installed"])
@pytest.mark.parametrize("prefill", ["prefill_complete"], indirect=True)
def test_prefill_complete_a_duplicate_room_fails_both_requests_as_sglang_does(
    prefill: tuple[str, Any], classes: str
) -> None:
    """Under ``prefill_complete`` SGLang fails the duplicate and sets the shared room Failed,
    which fails the first request too (common/conn.py:2500-2507). Same queues, same prefill,
    SGLang's classes and the installed ones: both requests of the room fail."""
    addr, _ = prefill
    installed = decode_worker.install(["mooncake"]) if classes == "installed" else nullcontext()
    with (
        installed,
        mooncake_engine(StandInMooncakeEngine()),
        decode_queues("mooncake", disaggregation_decode_allocation_policy="prefill_complete") as (
            prealloc,
            _transfer,
        ),
    ):
        first = bootstrap(prealloc, Req(addr, room=11))
        assert first.req.finished_reason is None, "the first bootstraps"
        # decode.py:1364's poll in bootstrap() sees both Failed (a second pass would abort
        # the failed requests again: pop_preallocated drops them first, decode.py:1389-1404).
        second = bootstrap(prealloc, Req(addr, room=11))
        assert second.req.finished_reason is not None
        assert first.req.finished_reason is not None
        if classes == "installed":
            for decode_req in (first, second):
                message = decode_req.req.finished_reason.message
                assert "InvalidRoom: room 11: duplicate decode bootstrap room" in message
        else:
            # SGLang records the reason once per room: whichever request's failure_exception()
            # runs first pops it (the first, here), the other reads "unknown reason".
            assert "Duplicate decode bootstrap room" in first.req.finished_reason.message
            assert "unknown reason" in second.req.finished_reason.message


# --- release_memory_occupation / resume_memory_occupation ------------------------------------


def test_a_memory_release_leaves_no_room_held_and_the_room_serves_again_after_resume(
    prefill: tuple[str, Any],
) -> None:
    """decode.py:1004-1015 and 3110-3114 drop both queues without a ``clear()`` on their
    receivers and call ``deregister_buffer_to_engine``: the installed manager ends every room
    still in flight there (its prefill rank told, as an abort tells it), so the room table is
    empty; after ``resume_memory_occupation`` (1017-1019) the same room bootstraps again."""
    addr, rank = prefill
    conn = import_sglang()
    engine = StandInMooncakeEngine()
    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(engine),
        decode_queues("mooncake") as (prealloc, transfer),
    ):
        manager = prealloc.kv_manager.decode_manager
        waiting = bootstrap(prealloc, Req(addr, room=21))
        received(rank)  # the registration
        sent = bootstrap(prealloc, Req(addr, room=22))
        prealloc._send_kv_metadata(sent, pages([1, 2]), 1)
        received(rank)  # room 22's metadata
        prealloc.queue.remove(sent)
        transfer.extend([sent])
        assert waiting.waiting_for_input
        assert {r.room for r in manager.in_flight()} == {21, 22}

        transfer.release_memory_occupation()
        prealloc.release_memory_occupation()
        assert manager.in_flight() == [] and manager.get(21) is None and manager.get(22) is None
        assert engine.registered == []
        aborts = {conn.AbortNotification.from_zmq(received(rank)).room for _ in range(2)}
        assert aborts == {21, 22}

        prealloc.resume_memory_occupation()
        transfer.resume_memory_occupation()
        assert engine.registered, "the buffers are registered again"
        again = bootstrap(prealloc, Req(addr, room=21))
        assert again.waiting_for_input and again.req.finished_reason is None


def test_sgw12_mooncake_manager_reads_its_buffers_back_before_any_frame() -> None:
    """The drop-in manager registers the buffers SGLang hands it with SGLang's shared engine,
    then builds its backend only once that engine read each of them back through its own
    session (SGW-12, as ``MooncakeBackend.from_engine`` does). An engine that lost one
    registration (as a real one whose ``batch_register`` failed for a buffer would) fails the
    manager's construction typed, naming the buffer, before any prefill is contacted.
    Stand-in: SGLang's shared engine (``StandInMooncakeEngine``, answering reads as Mooncake
    does: ``test_public_path_mistakes.py`` runs the same read-back on a real engine)."""
    from statemachine.errors import InvalidArgument

    class LosesTheLastBuffer(StandInMooncakeEngine):
        def batch_register(self, ptrs: list[int], lens: list[int]) -> int:
            return super().batch_register(ptrs[:-1], lens[:-1])

    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(LosesTheLastBuffer()),
        pytest.raises(InvalidArgument, match=r"aux_data_ptrs\[0\] .* is not registered"),
        decode_queues("mooncake"),
    ):
        pass


def test_nixl_registrations_after_a_resume_carry_the_agents_metadata_of_then() -> None:
    """A real NIXL agent (UCX over TCP, DRAM buffers) against SGLang's real NIXL prefill in its
    own processes (tests/real_prefill). decode.py cannot build its queues around NIXL on CPU
    (it registers the KV pool as VRAM: decode.py:664-672), so the calls are replayed in its
    order: the manager (765-770), a receiver (905-911), ``try_ensure_parallel_info`` (1200),
    ``init`` (1105), then ``release_memory_occupation``'s ``deregister_buffer_to_engine``
    (1014-1015) with that request in flight, ``resume_memory_occupation``'s
    ``register_buffer_to_engine`` (1018-1019), and a new request: ``send_metadata``
    (1863-1868), ``poll`` (2857-2860), ``clear`` (2774-2775).

    The agent's metadata describes the registered memory (it differs while the buffers are
    deregistered); SGLang reads it at each registration (nixl/conn.py:3473): every
    registration built after the release, and after the resume, carries the agent's metadata of
    that moment, not the constructor's. The request in flight at the release is gone from the
    room table; the one after the resume receives real bytes, checked byte for byte."""
    from tests.real_prefill.engines import engine_unavailable, loopback_environment
    from tests.real_prefill.harness import Layout, RealPrefill, wrong_pages
    from tests.support.sglang_decode_support import KVPool, MetadataBuffers

    reason = engine_unavailable("nixl")
    if reason is not None:
        pytest.skip(reason)
    loopback_environment()
    conn = import_sglang()
    import time
    import types

    layout = Layout()
    g = layout.side(1)
    pool = KVPool(buffers=g.buffers, pages=g.slots, page_bytes=g.item_len)
    metadata = MetadataBuffers(g.aux_slots, g.aux_item_len)
    kv_ptrs, kv_lens, kv_item_lens = pool.get_contiguous_buf_infos()
    aux_ptrs, aux_lens, aux_item_lens = metadata.get_buf_infos()
    kv_args = make_kv_args(
        kv_data_ptrs=kv_ptrs,
        kv_data_lens=kv_lens,
        kv_item_lens=kv_item_lens,
        kv_layer_ids=[],
        kv_data_mem_kinds=["DRAM"] * len(kv_ptrs),
        aux_data_ptrs=aux_ptrs,
        aux_data_lens=aux_lens,
        aux_item_lens=aux_item_lens,
    )
    view = types.SimpleNamespace(
        layout=layout,
        tp_size=1,
        tp_rank=0,
        backend="nixl",
        kv=pool.buffers,
        aux=metadata.bootstrap_room.view("uint8").reshape(-1),
    )
    with ExitStack() as stack:
        prefill = stack.enter_context(RealPrefill("nixl", layout=layout))
        server_args = stack.enter_context(
            sglang_server_args(disaggregation_mode="decode", host="127.0.0.1")
        )
        set_sglang_ranks(tp_rank=0)
        manager = ours.NixlKVManager(kv_args, conn.DisaggregationMode.DECODE, server_args, False)
        stack.callback(manager.close)
        backend = manager.decode_manager.backend
        rank = types_rank()
        at_start = manager.agent_metadata()
        assert backend.register_frames(rank)[5] == at_start
        assert manager.try_ensure_parallel_info(prefill.address)
        in_flight = ours.NixlKVReceiver(
            mgr=manager, bootstrap_addr=prefill.address, bootstrap_room=8101
        )
        in_flight.init(0)
        assert in_flight.poll() == 2  # SGLang's KVPoll.WaitingForInput: registered

        manager.deregister_buffer_to_engine()
        assert manager.decode_manager.get(8101) is None, "no room held after the release"
        released = manager.agent_metadata()
        assert released != at_start, "the metadata describes the registered memory"
        assert backend.register_frames(rank)[5] == released

        manager.register_buffer_to_engine()
        resumed = manager.agent_metadata()
        assert resumed != released
        assert backend.register_frames(rank)[5] == resumed

        dst, slot = [40, 43, 41, 42], 2
        prefill.transfer(8102, [8, 9, 10, 11], aux_index=0)
        receiver = ours.NixlKVReceiver(
            mgr=manager, bootstrap_addr=prefill.address, bootstrap_room=8102
        )
        receiver.init(0)
        receiver.send_metadata(pages(dst), slot, None)
        deadline = time.monotonic() + 30.0
        while (state := receiver.poll()) not in (0, 4):
            assert time.monotonic() < deadline, "the NIXL request neither succeeded nor failed"
            time.sleep(0.001)
        assert state == 4, receiver.failure_exception()
        assert wrong_pages(view, 8102, dst, slot, None) == []
        receiver.clear()
        assert manager.decode_manager.stats().in_flight == 0


def types_rank() -> Any:
    """A prefill rank as the registration builder sees it (NIXL's does not depend on it)."""
    from statemachine.pool import RankInfo

    return RankInfo(ip="127.0.0.1", port=1, pp_rank=0)


# --- metrics under SGLang's multiprocess mode ------------------------------------------------

_METRICS_CHILD = textwrap.dedent(
    """
    # A scheduler process as SGLang's Engine spawns it: PROMETHEUS_MULTIPROC_DIR was set by the
    # parent before prometheus_client is imported here.
    from contextlib import ExitStack

    from tests.support.sglang_decode_support import (
        Req,
        StandInMooncakeEngine,
        decode_queues,
        mooncake_engine,
    )
    from tests.support.sglang_support import sglang_bootstrap_server, sglang_prefill_rank

    from statemachine.sglang.v0_5_23 import decode_worker

    with ExitStack() as stack:
        addr = stack.enter_context(sglang_bootstrap_server())
        stack.enter_context(sglang_prefill_rank(addr, tp_size=1, tp_rank=0))
        stack.enter_context(decode_worker.install(["mooncake"]))
        stack.enter_context(mooncake_engine(StandInMooncakeEngine()))
        prealloc, _ = stack.enter_context(decode_queues("mooncake"))
        for room in (5, 6):
            prealloc.add(Req(addr, room))
        prealloc._resolve_pending_reqs()
        prealloc._update_handshake_waiters()
        prealloc.queue[0].kv_receiver.abort()  # the scheduler's abort (scheduler.py:5760-5780)
        prealloc.kv_manager.metrics.sync()
        print("METRICS WRITTEN", flush=True)
        input()  # the parent scrapes while this scheduler lives
    """
)


def scrape_sglangs_metrics_endpoint() -> str:
    """GET /metrics from SGLang's own endpoint: a Starlette app given its route by SGLang's
    ``add_prometheus_middleware`` (utils/common.py:2844-2853: a fresh registry holding only a
    ``MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR``). The app is called through
    httpx's ASGI transport: the HTTP server SGLang runs it under (uvicorn) is not installed
    here, so the listener is the one stand-in; the route, registry and rendering are SGLang's."""
    import asyncio

    import httpx
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.applications import Starlette

    app = Starlette()
    add_prometheus_middleware(app)

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://decode") as client:
            return await client.get("/metrics")

    response = asyncio.run(get())
    assert response.status_code == 200, response.text
    return response.text


def test_the_library_metrics_reach_sglangs_metrics_endpoint_in_multiprocess_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` before it spawns its schedulers
    (entrypoints/engine.py:1942, utils/common.py:2825-2841) and its /metrics merges the value
    files they write there. The scheduler here is a child process started with the directory
    set before its imports, running SGLang's decode queues with the installed classes: one
    request aborted, one in flight. The scrape is SGLang's own endpoint, while the child lives
    and after it exits."""
    import_sglang()
    pytest.importorskip("prometheus_client")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    tests = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests / "sglang_stubs"), str(tests.parent)]),
        "SGLANG_HOST_IP": "127.0.0.1",
    }
    child = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", _METRICS_CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = ""
        while "METRICS WRITTEN" not in line:
            line = child.stdout.readline()
            assert line, f"the scheduler process exited: {child.stderr.read()[-2000:]}"  # type: ignore[union-attr]
        text = scrape_sglangs_metrics_endpoint()
        # (the merge sorts the labels)
        failed = 'pd_bootstrap_requests_failed_total{pp_rank="0",reason="Aborted",tp_rank="0"}'
        assert f"{failed} 1.0" in text
        assert 'pd_bootstrap_requests_in_flight{pp_rank="0",tp_rank="0"} 1.0' in text
        assert "pd_bootstrap_cache_misses_total" in text
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0, child.stderr.read()[-2000:]  # type: ignore[union-attr]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # The counters outlive the process (multiprocess mode keeps its files, as for SGLang's).
    assert f"{failed} 1.0" in scrape_sglangs_metrics_endpoint()


# --- hybrid models' state pools, real bytes from SGLang's real prefill ----------------------


@pytest.mark.slow
def test_a_hybrid_models_state_slot_arrives_byte_for_byte_from_sglangs_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hybrid model's Mamba state, end to end: SGLang's real prefill in its own processes
    (tests/real_prefill: its Mooncake prefill manager on a real Mooncake engine over loopback
    TCP, with KV, aux and one Mamba state buffer, each filled with a pattern keyed by room),
    and on the decode SGLang's own queues with the installed classes on SGLang's shared
    Mooncake engine.

    One stand-in: SGLang's ``setup_state_kv_args`` (decode.py:676-682) finds state buffers
    only on its GPU hybrid pools (``HybridLinearKVPool.get_state_buf_infos``), which cannot be
    built here; the test runs SGLang's own function, then adds the Mamba component with
    SGLang's own ``append_state_component`` over a numpy buffer, as its hybrid branch does
    (disaggregation/utils.py:1598-1620). The state slot is passed to ``_send_kv_metadata`` as
    decode.py:1783-1820 passes it: one index list per state type."""
    from tests.real_prefill.engines import engine_unavailable, loopback_environment
    from tests.real_prefill.harness import Layout, RealPrefill, wrong_pages
    from tests.support.sglang_decode_support import KVPool, MetadataBuffers

    reason = engine_unavailable("mooncake")
    if reason is not None:
        pytest.skip(reason)
    loopback_environment()
    import_sglang()
    import importlib
    import time
    import types

    import numpy as np

    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    state_type = importlib.import_module("sglang.srt.disaggregation.base.conn").StateType
    engine_module = importlib.import_module(
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"
    )
    if engine_module.get_mooncake_transfer_engine() is None:
        engine_module.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    layout = Layout()
    g = layout.side(1)
    state = np.zeros(g.state_slots * g.state_item_len, dtype=np.uint8)

    def setup_state_kv_args(kv_args: Any, *args: Any, **kwargs: Any) -> None:
        utils.setup_state_kv_args(kv_args, *args, **kwargs)
        utils.append_state_component(
            kv_args, state_type.MAMBA, [state.ctypes.data], [state.nbytes], [g.state_item_len]
        )

    monkeypatch.setattr(decode, "setup_state_kv_args", setup_state_kv_args)
    pool = KVPool(buffers=g.buffers, pages=g.slots, page_bytes=g.item_len)
    metadata = MetadataBuffers(g.aux_slots, g.aux_item_len)
    view = types.SimpleNamespace(
        layout=layout,
        tp_size=1,
        tp_rank=0,
        backend="mooncake",
        kv=pool.buffers,
        aux=metadata.bootstrap_room.view("uint8").reshape(-1),
        state=state,
    )
    with ExitStack() as stack:
        prefill = stack.enter_context(RealPrefill("mooncake", layout=layout))
        stack.enter_context(decode_worker.install(["mooncake"]))
        prealloc, transfer = stack.enter_context(
            decode_queues("mooncake", pool=pool, metadata=metadata)
        )
        assert list(prealloc.kv_manager.kv_args.state_types) == [state_type.MAMBA]
        checked: dict[int, list[str]] = {}

        def commit(decode_req: Any) -> None:
            # decode.py:2600-2773 reads the first output token from GPU tensors (replaced);
            # the check runs where SGLang reads the aux row; its last step (2774-2775) kept.
            room = decode_req.req.bootstrap_room
            dst, slot = rooms[room]
            checked[room] = wrong_pages(view, room, dst, decode_req.metadata_buffer_index, slot)
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None

        transfer._commit_transfer_to_req = commit
        rooms = {9101: ([5, 1, 6, 2], 3), 9102: ([9, 12, 10, 11], 0)}
        for k, (room, (dst, slot)) in enumerate(rooms.items()):
            req = Req(prefill.address, room)
            prefill.transfer(
                room, [20 + 4 * k + i for i in range(4)], aux_index=k, state_index=1 + k
            )
            decode_req = bootstrap(prealloc, req)
            deadline = time.monotonic() + 30.0
            while not decode_req.waiting_for_input:
                assert req.finished_reason is None, req.finished_reason.message
                assert time.monotonic() < deadline, "the handshake did not finish"
                bootstrap_step(prealloc)
            prealloc._send_kv_metadata(
                decode_req, pages(dst), 1, [np.asarray([slot], dtype=np.int32)]
            )
            prealloc.queue.remove(decode_req)
            transfer.extend([decode_req])
            done: list[Any] = []
            deadline = time.monotonic() + 30.0
            while not done:
                assert req.finished_reason is None, req.finished_reason.message
                assert time.monotonic() < deadline, "the transfer did not finish"
                done.extend(transfer.pop_transferred())
                time.sleep(0.005)
            assert done == [req]
            assert checked[room] == [], checked[room]
        assert prealloc.kv_manager.decode_manager.stats().completed == 2


def bootstrap_step(prealloc: Any) -> None:
    prealloc._resolve_pending_reqs()  # decode.py:1325
    prealloc._update_handshake_waiters()  # decode.py:1364
    import time

    time.sleep(0.005)


# --- retract rebootstrap ---------------------------------------------------------------------


class RetractedReq(Req):
    """A retracted request's rebootstrap body as SGLang's ``Req`` builds it
    (schedule_batch.py:2149-2197: the prompt plus output ids, the same bootstrap host, port
    and room, ``routed_dp_rank`` = ``disagg_prefill_dp_rank``), reduced to what the test checks."""

    def build_rebootstrap_payload(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "input_ids": self.origin_input_ids + self.output_ids,
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": self.bootstrap_room,
            "routed_dp_rank": self.disagg_prefill_dp_rank,
            "disagg_prefill_dp_rank": self.disagg_prefill_dp_rank,
        }


@pytest.fixture
def prefill_http(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, Any]]:
    """SGLang's bootstrap server, one prefill rank registered with ``prefill_http_port`` (its
    ``--port``, common/conn.py:1607), and a real HTTP server on that port standing in for the
    prefill's ``/generate`` (the real one needs a model): (address, rank, server)."""
    from tests.support.http_support import ScriptedServer

    policy = getattr(request, "param", "early")
    with ExitStack() as stack:
        server = stack.enter_context(ScriptedServer())
        http_port = int(server.address.rpartition(":")[2])
        addr = stack.enter_context(sglang_bootstrap_server())
        rank = stack.enter_context(
            prefill_rank(
                addr,
                tp_size=1,
                tp_rank=0,
                port=http_port,
                disaggregation_decode_allocation_policy=policy,
            )
        )
        yield addr, rank, server


def posted(server: Any, timeout: float = 10.0) -> dict[str, Any]:
    import json
    import time

    deadline = time.monotonic() + timeout
    while not server.requests:
        assert time.monotonic() < deadline, "no rebootstrap POST reached the prefill"
        time.sleep(0.01)
    method, path, _headers, body = server.requests[0]
    assert (method, path) == ("POST", "/generate")
    payload: dict[str, Any] = json.loads(body)
    return payload


def test_a_retract_rebootstrap_posts_decode_pys_payload_and_the_request_completes(
    prefill_http: tuple[str, Any, Any],
) -> None:
    """``early``: decode.py re-adds a retracted request with ``is_rebootstrap`` (808) and asks
    for the recompute right after its metadata (1869-1873): the installed manager POSTs
    decode.py's payload, unchanged, to the prefill's ``/generate``; the prefill's Success then
    completes the request through the transfer queue (2826-2917)."""
    addr, rank, server = prefill_http
    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(StandInMooncakeEngine()),
        decode_queues("mooncake") as (prealloc, transfer),
    ):
        req = RetractedReq(addr, room=31)
        prealloc.add(req, is_rebootstrap=True)
        decode_req = prealloc.queue[-1]
        prealloc._resolve_pending_reqs()
        prealloc._update_handshake_waiters()
        received(rank)  # the registration
        assert server.requests == [], "early: nothing before the metadata"
        prealloc._send_kv_metadata(decode_req, pages([4]), 1)
        prealloc.queue.remove(decode_req)
        transfer.extend([decode_req])
        received(rank)  # the metadata
        assert posted(server) == req.build_rebootstrap_payload()
        manager = prealloc.kv_manager
        rank.send_kv_status_message(
            targets=[(manager.local_ip, manager.rank_port)], bootstrap_room=31, status=4
        )
        transfer.metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0] = 31

        def commit(d: Any) -> None:  # decode.py:2774-2775 (the rest reads GPU tensors)
            d.kv_receiver.clear()
            d.kv_receiver = None

        transfer._commit_transfer_to_req = commit
        done: list[Any] = []
        import time

        deadline = time.monotonic() + 10.0
        while not done:
            assert time.monotonic() < deadline, "the rebootstrapped request did not complete"
            done.extend(transfer.pop_transferred())
            time.sleep(0.01)
        assert done == [req] and req.finished_reason is None


def test_a_rebootstrap_the_prefill_refuses_fails_the_request_typed(
    prefill_http: tuple[str, Any, Any],
) -> None:
    """The prefill's ``/generate`` answers 500: the request fails through decode.py's
    transfer-failure path (2861-2917), typed, with the status (SGLang: common/conn.py:
    1269-1283)."""
    addr, _rank, server = prefill_http
    server.set(500, b"recompute failed")
    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(StandInMooncakeEngine()),
        decode_queues("mooncake") as (prealloc, transfer),
    ):
        req = RetractedReq(addr, room=32)
        prealloc.add(req, is_rebootstrap=True)
        decode_req = prealloc.queue[-1]
        prealloc._resolve_pending_reqs()
        prealloc._update_handshake_waiters()
        prealloc._send_kv_metadata(decode_req, pages([4]), 1)
        prealloc.queue.remove(decode_req)
        transfer.extend([decode_req])
        posted(server)
        import time

        deadline = time.monotonic() + 10.0
        while decode_req in transfer.queue:
            assert time.monotonic() < deadline, "the refused rebootstrap did not fail"
            transfer.pop_transferred()
            time.sleep(0.01)
        message = req.finished_reason.message
        assert "TransportFailure" in message and "answered 500" in message


@pytest.mark.parametrize("prefill_http", ["prefill_complete"], indirect=True)
def test_prefill_complete_the_rebootstrap_goes_out_after_init_pinned_to_the_bound_dp_rank(
    prefill_http: tuple[str, Any, Any],
) -> None:
    """``prefill_complete``: ``_init_receiver`` writes the resolved prefill dp rank back to the
    request (decode.py:1104-1110) and asks for the recompute right after ``init``
    (1113-1114), before any KV is allocated: the POST carries that dp rank as
    ``routed_dp_rank`` (SGLang PR #40731's pin)."""
    addr, _rank, server = prefill_http
    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(StandInMooncakeEngine()),
        decode_queues("mooncake", disaggregation_decode_allocation_policy="prefill_complete") as (
            prealloc,
            _transfer,
        ),
    ):
        req = RetractedReq(addr, room=33)
        prealloc.add(req, is_rebootstrap=True)
        prealloc._resolve_pending_reqs()
        assert req.disagg_prefill_dp_rank == 0, "decode.py bound the request's dp rank"
        payload = posted(server)
        assert payload["routed_dp_rank"] == 0 and payload["bootstrap_room"] == 33
        assert payload == req.build_rebootstrap_payload()
