"""SGLang 0.5.23's own decode scheduler queues driving this library's installed classes.

``DecodePreallocQueue`` and ``DecodeTransferQueue`` of the 0.5.23 wheel are built by their own
constructors (tests/support/sglang_decode_support.py: stand-ins only for the GPU pools, the
scheduler
and torch's one-rank group) after ``statemachine.sglang.decode_worker.install()``; the prefill is
SGLang's own bootstrap server and a prefill-mode ``CommonKVManager`` registered by SGLang's
``register_to_bootstrap``, whose PULL socket the test reads, parsing every frame with SGLang's
own parsers, and whose status sender reports back.

decode.py methods run unchanged: ``DecodePreallocQueue.__init__`` / ``_init_kv_manager``
(decode.py:608-806: the manager built through ``get_kv_class``), ``add`` (decode.py:808-860),
``_resolve_pending_reqs`` / ``_ensure_prefill_info`` / ``_resolve_prefill_dp_rank``
(decode.py:1184-1389), ``_init_receiver`` (1104-1114), ``_update_handshake_waiters``
(1124-1177), ``_send_kv_metadata`` (1845-1876), ``DecodeTransferQueue.extend``/``pop_transferred``
(2573-2992), ``_defer_release`` / ``resolve_deferred_releases`` / ``_do_release``
(2994-3109), and ``release_memory_occupation`` / ``resume_memory_occupation`` (1006-1019).
Replayed in decode.py's order instead of run: ``pop_preallocated``'s allocation (decode.py:
1448-1651 needs the real token pools; the tests call ``_send_kv_metadata`` for a waiting request
as its line 1645 does and move it to the transfer queue as the scheduler does), and
``_commit_transfer_to_req`` (decode.py:2600-2777 reads the output token out of GPU tensors;
its last step, ``clear()`` at 2774-2775, is replayed), and ``_release_request`` (decode.py:
2812-2820 frees the pages the replayed allocation never took: recorded instead).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import zmq

from statemachine.errors import ConfigurationError
from statemachine.sglang.v0_5_23 import decode_worker
from statemachine.sglang.v0_5_23.decode_worker import conn as ours
from tests.support.sglang_decode_support import (
    Req,
    StandInMooncakeEngine,
    decode_module,
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


class TransferQueue:
    """``_commit_transfer_to_req`` replaced (it reads the first output token from GPU tensors,
    decode.py:2600-2773); its final step, decode.py:2774-2775, is kept."""

    @staticmethod
    def commit(decode_req: Any) -> None:
        decode_req.kv_receiver.clear()
        decode_req.kv_receiver = None


@pytest.fixture
def prefill() -> Iterator[tuple[str, Any]]:
    """SGLang's bootstrap server and one prefill rank (tp 1) registered with it."""
    with ExitStack() as stack:
        addr = stack.enter_context(sglang_bootstrap_server())
        rank = stack.enter_context(prefill_rank(addr, tp_size=1, tp_rank=0))
        yield addr, rank


@pytest.fixture
def installed() -> Iterator[None]:
    with decode_worker.install(["mooncake"]), mooncake_engine(StandInMooncakeEngine()):
        yield


def received(rank: Any, timeout_ms: int = 5000) -> list[bytes]:
    sock = rank.server_socket
    assert sock.poll(timeout_ms, zmq.POLLIN), "the prefill rank received nothing"
    frames: list[bytes] = sock.recv_multipart()
    return frames


def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)


def bootstrap(prealloc: Any, req: Any) -> Any:
    """decode.py's path from ``add`` to a receiver waiting for KV memory."""
    prealloc.add(req)  # decode.py:808: creates the receiver through get_kv_class
    decode_req = prealloc.queue[-1]
    prealloc._resolve_pending_reqs()  # decode.py:1325 (first step of pop_preallocated)
    prealloc._update_handshake_waiters()  # decode.py:1364
    return decode_req


def to_transfer(prealloc: Any, transfer: Any, decode_req: Any, kv_pages: list[int]) -> None:
    """pop_preallocated's allocation, replayed: decode.py:1645 sends the metadata of a request
    whose pages were allocated, 1649-1651 removes it from the prealloc queue, and the
    scheduler hands it to the transfer queue (decode.py:2573-2578)."""
    prealloc._send_kv_metadata(decode_req, pages(kv_pages), page_size=1)
    prealloc.queue.remove(decode_req)
    transfer.extend([decode_req])


@requires_sglang
def test_installed_classes_complete_a_request_through_sglangs_queues(
    prefill: tuple[str, Any], installed: None
) -> None:
    addr, rank = prefill
    mooncake = mooncake_module()
    with decode_queues("mooncake") as (prealloc, transfer):
        assert type(prealloc.kv_manager) is ours.MooncakeKVManager
        req = Req(addr, room=4242)
        decode_req = bootstrap(prealloc, req)
        assert type(decode_req.kv_receiver) is ours.MooncakeKVReceiver
        # The registration went to the prefill rank in SGLang's layout.
        registration = mooncake.KVArgsRegisterInfo.from_zmq(received(rank))
        assert registration.mooncake_session_id == "127.0.0.1:17777"
        assert decode_req.waiting_for_input, "decode.py saw WaitingForInput"

        to_transfer(prealloc, transfer, decode_req, [3, 5, 7, 9])
        info = mooncake.TransferInfo.from_zmq(received(rank))
        assert (info.room, list(info.dst_kv_indices)) == (4242, [3, 5, 7, 9])
        assert transfer.pop_transferred() == []  # no status yet: still waiting

        manager = prealloc.kv_manager
        rank.send_kv_status_message(  # SGLang's own status sender: Success from rank 0
            targets=[(manager.local_ip, manager.rank_port)], bootstrap_room=4242, status=4
        )
        # The aux row lands with the KV (the metadata gate reads it, utils.py:245-260).
        transfer.metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0] = 4242
        transfer._commit_transfer_to_req = TransferQueue.commit
        done: list[Any] = []
        wait_for(lambda: done.extend(transfer.pop_transferred()) or done, "the request completes")
        assert done == [req]
        assert transfer.queue == [] and prealloc.queue == []
        assert prealloc.kv_manager.decode_manager.stats().in_flight == 0


@requires_sglang
def test_a_prefill_reported_failure_is_typed_held_and_released_on_the_abort_ack(
    prefill: tuple[str, Any], installed: None
) -> None:
    addr, rank = prefill
    conn = import_sglang()
    with decode_queues("mooncake") as (prealloc, transfer):
        manager = prealloc.kv_manager
        req = Req(addr, room=77)
        decode_req = bootstrap(prealloc, req)
        received(rank)  # the registration
        to_transfer(prealloc, transfer, decode_req, [1, 2])
        received(rank)  # the metadata
        slot = decode_req.metadata_buffer_index
        rank.send_kv_status_message(
            targets=[(manager.local_ip, manager.rank_port)], bootstrap_room=77, status=0
        )
        wait_for(lambda: transfer.pop_transferred() == [] and not transfer.queue, "failed")
        # decode.py:2861-2917 ran: failure_exception() raised SGLang's KVTransferError with
        # the library's typed reason, the request was aborted with it and streamed.
        reason = req.finished_reason.message
        assert "KVTransferError(bootstrap_room=77): TransferFailed:" in reason
        assert "Failed to get kvcache from prefill instance" in reason
        assert transfer.scheduler.output_streamer.streamed == [req]
        # ... and the KV is held (decode.py:2994-3013) until the prefill rank acknowledges the
        # ABORT the failure sent it, with a generation (SGLang's own parser reads it).
        abort = conn.AbortNotification.from_zmq(received(rank))
        assert abort is not None and abort.room == 77 and abort.generation is not None
        assert transfer.num_pending_deferred_releases() == 1
        transfer.resolve_deferred_releases()
        assert transfer.num_pending_deferred_releases() == 1, "no ack yet: still held"
        ack = conn.AbortAck(room=77, prefill_rank=0, generation=abort.generation)
        with zmq.Context.instance().socket(zmq.PUSH) as push:
            push.connect(f"tcp://{manager.local_ip}:{manager.rank_port}")
            push.send_multipart(ack.to_zmq())
        wait_for(
            lambda: (
                transfer.resolve_deferred_releases() or not transfer.has_pending_deferred_releases()
            ),
            "the held KV is released on the ack",
        )
        assert slot in transfer.req_to_metadata_buffer_idx_allocator.free_slots
        assert transfer.released == [decode_req]
        assert decode_req.kv_receiver is None  # _do_release cleared it (decode.py:3028-3029)
        assert manager.decode_manager.kv_holds().released_by_acks == 1


@requires_sglang
def test_install_answers_ours_for_the_chosen_backends_and_uninstall_restores_sglangs() -> None:
    decode = decode_module()
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    manager, receiver = utils.KVClassType.MANAGER, utils.KVClassType.RECEIVER
    mooncake, nixl = utils.TransferBackend.MOONCAKE, utils.TransferBackend.NIXL
    sglangs = decode.get_kv_class
    with decode_worker.install(["nixl"]) as installation:
        assert decode_worker.installed() == {"nixl"}
        assert decode.get_kv_class(nixl, manager) is ours.NixlKVManager
        assert decode.get_kv_class(nixl, receiver) is ours.NixlKVReceiver
        # Everything else stays SGLang's: other backends, KVArgs, the prefill's classes.
        assert decode.get_kv_class(mooncake, receiver) is sglangs(mooncake, receiver)
        assert decode.get_kv_class(nixl, utils.KVClassType.KVARGS) is sglangs(
            nixl, utils.KVClassType.KVARGS
        )
        assert decode.get_kv_class(nixl, utils.KVClassType.SENDER) is sglangs(
            nixl, utils.KVClassType.SENDER
        )
        assert utils.get_kv_class is sglangs  # only the name decode.py holds changed
        with pytest.raises(ConfigurationError, match="already installed"):
            decode_worker.install(["mooncake"])
    assert decode.get_kv_class is sglangs and decode_worker.installed() == frozenset()
    installation.uninstall()  # idempotent
    decode_worker.install()
    assert decode.get_kv_class(mooncake, manager) is ours.MooncakeKVManager
    decode_worker.uninstall()
    assert decode.get_kv_class is sglangs


def test_install_refuses_another_sglang_release_and_unknown_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from statemachine.sglang.v0_5_23.decode_worker import installer

    monkeypatch.setattr(installer, "_installed_version", lambda: "0.5.22")
    with pytest.raises(ConfigurationError, match=r"SGLang 0\.5\.22 is installed.*0\.5\.23"):
        decode_worker.install()
    monkeypatch.setattr(installer, "_installed_version", lambda: None)
    with pytest.raises(ConfigurationError, match=r"not installed.*sglang==0\.5\.23"):
        decode_worker.install()
    with pytest.raises(ConfigurationError, match="mori"):
        decode_worker.install(["mori"])
    assert decode_worker.installed() == frozenset()


@requires_sglang
@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"env": "SGLANG_DISAGG_STAGING_BUFFER"}, "SGLANG_DISAGG_STAGING_BUFFER"),
        ({"disaggregation_enable_kv_checksum": True}, "--disaggregation-enable-kv-checksum"),
        (
            {"disaggregation_decode_host_receive_threshold": 0.5},
            "--disaggregation-decode-host-receive-threshold",
        ),
    ],
)
def test_features_not_implemented_are_refused_typed_when_switched_on(
    setting: dict[str, Any], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = import_sglang()
    env = setting.pop("env", None)
    if env is not None:
        monkeypatch.setenv(env, "1")
    with ExitStack() as stack:
        stack.enter_context(mooncake_engine(StandInMooncakeEngine()))
        server_args = stack.enter_context(
            sglang_server_args(disaggregation_mode="decode", host="127.0.0.1", **setting)
        )
        set_sglang_ranks(tp_rank=0)
        with pytest.raises(ours.SGLangFeatureRefused, match=named):
            ours.MooncakeKVManager(
                make_kv_args(), conn.DisaggregationMode.DECODE, server_args, False
            )


@requires_sglang
def test_a_room_already_in_flight_fails_typed_instead_of_sharing_its_state(
    prefill: tuple[str, Any], installed: None
) -> None:
    addr, _ = prefill
    with decode_queues("mooncake") as (prealloc, _transfer):
        first = bootstrap(prealloc, Req(addr, room=9))
        second = bootstrap(prealloc, Req(addr, room=9))
        assert first.waiting_for_input
        # decode.py:1158-1177 aborted the duplicate with the typed reason; the first goes on.
        assert "InvalidRoom: room 9 is already in flight" in second.req.finished_reason.message
        assert first.req.finished_reason is None


@requires_sglang
def test_a_memory_release_deregisters_the_buffers_and_the_resume_registers_them(
    prefill: tuple[str, Any],
) -> None:
    """decode.py:1006-1019. What a release does to the rooms in flight, and retract
    rebootstraps, are tests/sglang/test_sglang_decode_surface.py's."""
    engine = StandInMooncakeEngine()
    with (
        decode_worker.install(["mooncake"]),
        mooncake_engine(engine),
        decode_queues("mooncake") as (prealloc, _transfer),
    ):
        registered = list(engine.registered)
        assert registered, "the manager registered the KV and aux buffers"
        prealloc.release_memory_occupation()
        assert engine.registered == []
        prealloc.resume_memory_occupation()
        assert engine.registered == registered
