"""A prefill SIGKILL and replacement, under SGLang 0.5.23's own decode queues: SGLang's classes
against the installed ones, in one run, with real KV bytes.

The prefill is SGLang 0.5.23's real prefill in its own processes (``tests/real_prefill``: its
bootstrap server, its Mooncake prefill manager on a real Mooncake engine over loopback TCP,
pages filled with a pattern keyed by room, buffer, page, token and head). The decode is SGLang's
own ``DecodePreallocQueue`` and ``DecodeTransferQueue`` (tests/support/sglang_decode_support.py) on
SGLang's shared Mooncake engine (``init_mooncake_transfer_engine``, as its scheduler makes it),
with numpy KV and aux buffers registered with it - once with SGLang's own manager and receiver
classes, once after ``install()``. Same queues, same prefill, same settings.

The script, per run: two requests complete and their pages are checked byte for byte; a third
is in flight (its metadata sent, the prefill not yet sending) when every prefill rank is
SIGKILLed; a new prefill starts behind the same bootstrap port; once it printed READY, two new
requests start. Then the queues are stepped for ``OBSERVE_S`` seconds. A request is *hung* if it
is neither done nor failed by then. The heartbeat interval is 30 s in both runs (SGLang's
``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL``, read by both managers), so the replacement is READY
within two heartbeats: the case SGLang's heartbeat cannot see. The waiting timeout stays
SGLang's default, 300 s.

decode.py calls run and replayed are those of tests/sglang/test_sglang_decode_queues.py; in addition
``pop_preallocated``'s removal of failed requests (decode.py:1389-1404: stream, ``clear()``,
drop) is replayed for requests that fail before their metadata is sent.
"""

from __future__ import annotations

import importlib
import threading
import time
import types
from collections.abc import Iterator
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest

from statemachine.sglang.v0_5_23 import decode_worker
from tests.real_prefill.engines import engine_unavailable, loopback_environment
from tests.real_prefill.harness import Layout, RealPrefill, wrong_pages
from tests.support.http_support import free_port
from tests.support.sglang_decode_support import KVPool, MetadataBuffers, Req, decode_queues, pages
from tests.support.sglang_support import import_sglang, requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]

#: After the new prefill is READY. The installed classes' requests end within 0.2 s of READY
#: (2 s the slowest seen, on a loaded machine), so 10 s is five times that; SGLang's classes
#: hang the same whether watched for 10 s or 20 s (nothing of theirs can end them before the
#: next heartbeat, which cannot see a replacement, or the 300 s waiting timeout).
OBSERVE_S = 10.0
PAGES_PER_REQUEST = 4


def prefill_side(k: int) -> tuple[list[int], int]:
    """The k-th request's source pages and aux slot on the prefill: its own, since requests
    overlap (a scattered order, so a page landing on the wrong destination reads wrong)."""
    base = 8 + k * PAGES_PER_REQUEST
    return [base + i for i in (2, 0, 3, 1)], k % GEOMETRY.aux_slots


LAYOUT = Layout()
GEOMETRY = LAYOUT.side(1)


@dataclass
class Outcome:
    label: str
    state: str = "pending"  # "done", "failed", "pending"
    detail: str = ""
    seconds: float | None = None  # from the kill (in flight) or READY (after) to the outcome


@dataclass
class Run:
    classes: str
    outcomes: list[Outcome] = field(default_factory=list)
    ready_after_s: float = 0.0


class Decode:
    """One decode rank: SGLang's queues, its buffers, and the loop its scheduler runs."""

    def __init__(self, prealloc: Any, transfer: Any, pool: KVPool, metadata: MetadataBuffers):
        self.prealloc, self.transfer = prealloc, transfer
        self.pool, self.metadata = pool, metadata
        self.requests: dict[int, tuple[Any, list[int], Outcome, float]] = {}
        #: per completed room, the destination byte ranges that do not hold its pattern
        self.wrong: dict[int, list[str]] = {}
        self.view = types.SimpleNamespace(
            layout=LAYOUT,
            tp_size=1,
            tp_rank=0,
            backend="mooncake",
            kv=pool.buffers,
            aux=metadata.bootstrap_room.view("uint8").reshape(-1),
        )
        self.next_page = 0
        transfer._commit_transfer_to_req = self._commit

    def _commit(self, decode_req: Any) -> None:
        # decode.py:2600-2773 reads the first output token from GPU tensors (replaced);
        # its last step, decode.py:2774-2775, is kept.
        # The check runs here, where SGLang reads the aux row (pop_transferred clears the slot
        # right after this call).
        room = decode_req.req.bootstrap_room
        self.wrong[room] = wrong_pages(
            self.view, room, self.requests[room][1], decode_req.metadata_buffer_index, None
        )
        decode_req.kv_receiver.clear()
        decode_req.kv_receiver = None

    def start(self, addr: str, room: int, label: str, since: float) -> Outcome:
        dst = list(range(self.next_page, self.next_page + PAGES_PER_REQUEST))
        self.next_page += PAGES_PER_REQUEST
        outcome = Outcome(label)
        req = Req(addr, room)
        self.requests[room] = (req, dst, outcome, since)
        self.prealloc.add(req)  # decode.py:808
        return outcome

    def clock_from(self, room: int, since: float) -> None:
        """Time ``room``'s outcome from ``since`` (the kill, for the request in flight)."""
        req, dst, outcome, _ = self.requests[room]
        self.requests[room] = (req, dst, outcome, since)

    def step(self) -> None:
        """One scheduler step of the decode's bootstrap path."""
        prealloc, transfer = self.prealloc, self.transfer
        prealloc._resolve_pending_reqs()  # decode.py:1325
        prealloc._update_handshake_waiters()  # decode.py:1364
        for decode_req in list(prealloc.queue):
            if decode_req.req.finished_reason is not None:  # decode.py:1389-1404, replayed
                transfer.scheduler.output_streamer.stream_output([decode_req.req], False)
                decode_req.kv_receiver.clear()
                decode_req.kv_receiver = None
                prealloc.queue.remove(decode_req)
                self._conclude(decode_req.req)
            elif decode_req.waiting_for_input:  # the allocation of decode.py:1448-1651
                room = decode_req.req.bootstrap_room
                prealloc._send_kv_metadata(decode_req, pages(self.requests[room][1]), 1)
                prealloc.queue.remove(decode_req)
                transfer.extend([decode_req])
        before = {id(d.req) for d in transfer.queue}
        for req in transfer.pop_transferred():  # decode.py:2826
            self._conclude(req)
        for decode_req in [d for d in self._all_failed(before)]:
            self._conclude(decode_req)
        transfer.resolve_deferred_releases()  # decode.py:3030

    def _all_failed(self, before: set[int]) -> list[Any]:
        left = {id(d.req) for d in self.transfer.queue}
        return [
            req
            for req, _, outcome, _ in self.requests.values()
            if id(req) in before
            and id(req) not in left
            and outcome.state == "pending"
            and req.finished_reason is not None
        ]

    def _conclude(self, req: Any) -> None:
        _, _dst, outcome, since = self.requests[req.bootstrap_room]
        if outcome.state != "pending":
            return
        outcome.seconds = time.monotonic() - since
        if req.finished_reason is not None:
            outcome.state = "failed"
            message = str(req.finished_reason.message)
            # decode.py's text, then the receiver's exception: keep the exception
            outcome.detail = (
                message[message.find("KVTransferError") :]
                if "KVTransferError" in message
                else message
            )
            return
        wrong = self.wrong[req.bootstrap_room]
        outcome.state = "done" if not wrong else "failed"
        outcome.detail = "pages verified byte for byte" if not wrong else f"wrong: {wrong[:3]}"

    def pending(self) -> list[Outcome]:
        return [o for _, _, o, _ in self.requests.values() if o.state == "pending"]


def restart_run(classes: str, port: int, rooms: Iterator[int]) -> Run:
    run = Run(classes)
    prefill = RealPrefill("mooncake", layout=LAYOUT, bootstrap_port=port)
    pool = KVPool(buffers=GEOMETRY.buffers, pages=GEOMETRY.slots, page_bytes=GEOMETRY.item_len)
    metadata = MetadataBuffers(GEOMETRY.aux_slots, GEOMETRY.aux_item_len)
    installed = decode_worker.install(["mooncake"]) if classes == "installed" else nullcontext()
    with ExitStack() as stack:
        stack.callback(prefill.close)
        prefill.start()
        stack.enter_context(installed)
        prealloc, transfer = stack.enter_context(
            decode_queues("mooncake", pool=pool, metadata=metadata)
        )
        decode = Decode(prealloc, transfer, pool, metadata)

        def drive(until: float) -> None:
            while decode.pending() and time.monotonic() < until:
                decode.step()
                time.sleep(0.005)

        now = time.monotonic()
        for label in ("before the kill, 1", "before the kill, 2"):
            room = next(rooms)
            run.outcomes.append(decode.start(prefill.address, room, label, now))
            src, aux = prefill_side(len(run.outcomes))
            prefill.transfer(room, src, aux_index=aux)
        drive(time.monotonic() + 60.0)

        in_flight_room = next(rooms)
        run.outcomes.append(
            decode.start(prefill.address, in_flight_room, "in flight at the kill", 0.0)
        )
        deadline = time.monotonic() + 30.0
        while not decode.transfer.queue and time.monotonic() < deadline:
            decode.step()  # until its metadata went out (no transfer: the prefill waits)
        killed = time.monotonic()
        decode.clock_from(in_flight_room, killed)
        prefill.kill()
        # The new prefill, behind the same bootstrap port; the decode keeps stepping while it
        # starts, as a scheduler does, until every rank printed READY.
        prefill.spawn()
        starting = threading.Thread(target=prefill.wait_ready, daemon=True)
        starting.start()
        while starting.is_alive():
            decode.step()
            time.sleep(0.005)
        assert len(prefill.ready) == prefill.tp_size, "the new prefill did not start"
        ready = time.monotonic()
        run.ready_after_s = ready - killed
        for label in ("after READY, 1", "after READY, 2"):
            room = next(rooms)
            run.outcomes.append(decode.start(prefill.address, room, label, ready))
            src, aux = prefill_side(len(run.outcomes))
            prefill.transfer(room, src, aux_index=aux)
        drive(ready + OBSERVE_S)
    return run


@pytest.fixture
def engine_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    reason = engine_unavailable("mooncake")
    if reason is not None:
        pytest.skip(reason)
    loopback_environment()
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "30")
    import_sglang()
    module = importlib.import_module(
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"
    )
    if module.get_mooncake_transfer_engine() is None:
        module.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    yield


def table(runs: list[Run]) -> str:
    lines = [
        "| request | "
        + " | ".join(f"SGLang 0.5.23 decode.py + {r.classes} classes" for r in runs)
        + " |",
        "|---|" + "---|" * len(runs),
    ]
    for i, outcome in enumerate(runs[0].outcomes):
        cells = []
        for run in runs:
            o = run.outcomes[i]
            when = "" if o.seconds is None else f" after {o.seconds:.1f} s"
            text = {"done": "completed", "failed": "failed", "pending": "HUNG"}[o.state]
            detail = (
                o.detail if o.state != "pending" else f"still waiting {OBSERVE_S:.0f} s after READY"
            )
            cells.append(f"{text}{when}: {detail[:110]}")
        lines.append(f"| {outcome.label} | " + " | ".join(cells) + " |")
    lines.append(
        "| new prefill READY after the kill | "
        + " | ".join(f"{r.ready_after_s:.1f} s" for r in runs)
        + " |"
    )
    return "\n".join(lines)


@requires_sglang
def test_a_prefill_restart_hangs_sglangs_classes_and_not_the_installed_ones(
    engine_environment: None, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # both runs' prefills, and each replacement, listen here
    rooms = iter(range(9_000, 9_100))
    runs = [restart_run("SGLang's own", port, rooms), restart_run("installed", port, rooms)]
    with capsys.disabled():
        print("\n" + table(runs))
    sglang, ours = (run.outcomes for run in runs)
    # Before the kill, both complete with the right bytes.
    assert [o.state for o in sglang[:2]] == ["done", "done"], table(runs)
    assert [o.state for o in ours[:2]] == ["done", "done"], table(runs)
    # SGLang's classes: the baseline hangs (what this issue is about).
    assert any(o.state == "pending" for o in sglang[2:]), table(runs)
    # Installed: nothing hangs; the request in flight fails typed; none after READY fails.
    assert ours[2].state == "failed" and "KVTransferError" in ours[2].detail, table(runs)
    assert [o.state for o in ours[3:]] == ["done", "done"], table(runs)


@requires_sglang
def test_the_nixl_classes_receive_real_bytes_from_sglangs_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The installed NIXL classes with a real NIXL agent, against SGLang's real NIXL prefill.

    decode.py cannot be built around them on CPU: it registers the KV pool as VRAM for NIXL
    (decode.py:664-668, 671-672), which this machine has not. So the decode.py calls are
    replayed in decode.py's order, with SGLang's ``KVArgs`` as decode.py fills them except for
    the memory kinds (DRAM): the manager as decode.py:765-770 builds it, the receiver as
    decode.py:905-911, ``try_ensure_parallel_info`` (decode.py:1200), ``init`` (1105),
    ``poll`` (1142-1145), ``send_metadata`` (1863-1868), ``poll`` (2857-2860), ``clear``
    (2774-2775)."""
    reason = engine_unavailable("nixl")
    if reason is not None:
        pytest.skip(reason)
    loopback_environment()
    conn = import_sglang()
    from statemachine.sglang.v0_5_23.decode_worker import conn as ours
    from tests.support.sglang_support import make_kv_args, set_sglang_ranks, sglang_server_args

    pool = KVPool(buffers=GEOMETRY.buffers, pages=GEOMETRY.slots, page_bytes=GEOMETRY.item_len)
    metadata = MetadataBuffers(GEOMETRY.aux_slots, GEOMETRY.aux_item_len)
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
        layout=LAYOUT,
        tp_size=1,
        tp_rank=0,
        backend="nixl",
        kv=pool.buffers,
        aux=metadata.bootstrap_room.view("uint8").reshape(-1),
    )
    with ExitStack() as stack:
        prefill = stack.enter_context(RealPrefill("nixl", layout=LAYOUT))
        server_args = stack.enter_context(
            sglang_server_args(disaggregation_mode="decode", host="127.0.0.1")
        )
        set_sglang_ranks(tp_rank=0)
        manager = ours.NixlKVManager(kv_args, conn.DisaggregationMode.DECODE, server_args, False)
        stack.callback(manager.close)
        assert manager.try_ensure_parallel_info(prefill.address)
        for k, room in enumerate((7001, 7002)):
            src, aux = prefill_side(k)
            dst = [40 + 4 * k + i for i in range(PAGES_PER_REQUEST)]
            slot = 2 + k
            prefill.transfer(room, src, aux_index=aux)
            receiver = ours.NixlKVReceiver(
                mgr=manager, bootstrap_addr=prefill.address, bootstrap_room=room
            )
            receiver.init(0)
            assert receiver.poll() == 2  # SGLang's KVPoll.WaitingForInput
            receiver.send_metadata(pages(dst), slot, None)
            deadline = time.monotonic() + 30.0
            while (state := receiver.poll()) not in (0, 4):
                assert time.monotonic() < deadline, "the NIXL request neither succeeded nor failed"
                time.sleep(0.001)
            assert state == 4, receiver.failure_exception()
            assert wrong_pages(view, room, dst, slot, None) == []
            receiver.clear()
        assert manager.decode_manager.stats().in_flight == 0
