"""Our SGLang 0.5.23 backends against SGLang 0.5.23's own code (spec/sglang-wire.md, SGW-n).

Everything on SGLang's side is the real wheel (tests/support/sglang_support.py): its prefill
parsers on
every frame each backend sends, its own frame builders for byte equality, its real Mooncake and
NIXL prefill managers (CPU: a transfer engine that only names its session, a stand-in NIXL agent)
whose bootstrap threads read our messages from a real PULL socket, its status and ABORT_ACK
senders, and its decode-side parsers and Mooncake decode thread for what comes back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine.completion import (
    AbortAck,
    KVPoll,
    PrefillStatus,
)
from statemachine.errors import ConfigurationError
from statemachine.pool import RankInfo
from statemachine.sglang.v0_5_23 import DecodeKVArgs
from statemachine.sglang.v0_5_23.mooncake import unverified_mooncake_backend
from statemachine.sglang.v0_5_23.nixl import GUARD, unverified_nixl_backend
from statemachine.wire.metadata import MetadataRequest
from statemachine.wire.reference import SimpleBackend
from tests.support.sglang_support import import_sglang, requires_sglang, sglang_bootstrap_server
from tests.support.sglang_wire_support import (
    SESSION_ID,
    Prefill,
    mooncake_module,
    nixl_module,
    sglang_decode_builders,
    sglang_prefill,
    thread_deaths,
)

pytestmark = requires_sglang

LOOPBACK = "127.0.0.1"
BACKENDS = ("mooncake", "nixl")
AGENT = "decode-agent-0"
AGENT_METADATA = b"agent-metadata:" + AGENT.encode()
REAL = RankInfo(LOOPBACK, 7000, 0, False)
DUMMY = RankInfo(LOOPBACK, 7001, 0, True)

# A decode rank with every registration field set to something distinguishable.
RICH = DecodeKVArgs(
    engine_rank=1,
    attn_tp_size=2,
    kv_data_ptrs=(0x1000, 0x2000, 0x3000),
    kv_data_lens=(4096, 4096, 1024),
    kv_item_lens=(64, 64, 32),
    kv_layer_ids=(0, 1, 2),
    aux_data_ptrs=(0x9000, 0x9100),
    state_data_ptrs=((0xA000, 0xA100), (0xB000,)),
    state_data_lens=((10, 20), (30,)),
    state_item_lens=((8, 8), (16,)),
    state_dim_per_tensor=((4,), (2,)),
    state_layer_ids=((0, 1), (2,)),
    kv_mem_kinds=("VRAM", "DRAM", "VRAM"),
    gpu_id=3,
    dcp_size=2,
    dcp_rank=1,
)
# What tests/sglang_support.make_kv_args gives SGLang's own managers, as our value.
HARNESS_KV = DecodeKVArgs(
    engine_rank=0,
    attn_tp_size=1,
    kv_data_ptrs=(0x1000, 0x2000),
    kv_data_lens=(4096, 4096),
    kv_item_lens=(64, 64),
    kv_layer_ids=(0, 1),
    aux_data_ptrs=(0x3000,),
    kv_mem_kinds=("VRAM", "VRAM"),
)
REQUESTS = {
    "plain": MetadataRequest(7, (3, 1, 4), 2),
    "hybrid": MetadataRequest(
        2**63 + 5,
        (9, 8),
        0,
        11,
        required_dst_info_num=2,
        state_indices=[(5, 6), (7,)],
        device_kv_indices=(1, 2),
    ),
    "radix-hit": MetadataRequest(8, (), 4, 32),
}


def ours(backend: str, kv_args: DecodeKVArgs, ip: str = LOOPBACK, port: int = 5555) -> Any:
    if backend == "mooncake":
        return unverified_mooncake_backend(ip, port, SESSION_ID, kv_args)
    return unverified_nixl_backend(ip, port, AGENT, AGENT_METADATA, kv_args)


def prefill_parse(backend: str, frames: list[bytes], kind: str) -> Any:
    """SGLang's prefill-side parser of ``kind`` on ``frames`` (NIXL's after its GUARD frame)."""
    if backend == "mooncake":
        module = mooncake_module()
    else:
        module = nixl_module()
        assert frames[0] == GUARD
        frames = frames[1:]
    parser = module.KVArgsRegisterInfo if kind == "register" else module.TransferInfo
    return parser.from_zmq(frames)


# --- SGW-3, SGW-4: SGLang's prefill parsers on every frame we send ------------------------


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgw3_registration_parses_to_what_we_meant(backend: str) -> None:
    info = prefill_parse(backend, ours(backend, RICH).register_frames(REAL), "register")
    assert (info.room, info.endpoint, info.dst_port) == ("None", LOOPBACK, 5555)
    assert info.dst_kv_ptrs == list(RICH.kv_data_ptrs)
    assert info.dst_aux_ptrs == list(RICH.aux_data_ptrs)
    assert info.dst_state_data_ptrs == [list(p) for p in RICH.state_data_ptrs]
    assert info.dst_kv_item_len == 64
    assert info.dst_kv_item_lens == list(RICH.kv_item_lens)
    assert info.dst_kv_layer_ids == list(RICH.kv_layer_ids)
    assert info.dst_state_item_lens == [list(x) for x in RICH.state_item_lens]
    assert info.dst_state_dim_per_tensor == [list(x) for x in RICH.state_dim_per_tensor]
    assert info.dst_state_layer_ids == [list(x) for x in RICH.state_layer_ids]
    assert (info.dst_dcp_size, info.dst_dcp_rank) == (2, 1)
    assert (info.staging_base_ptr, info.staging_total_size) == (0, 0)
    if backend == "mooncake":
        assert info.mooncake_session_id == SESSION_ID
        assert (info.dst_tp_rank, info.dst_attn_tp_size) == (1, 2)
        assert info.staging is None
    else:
        assert (info.agent_name, info.agent_metadata) == (AGENT, AGENT_METADATA)
        assert (info.decode_tp_rank, info.decode_tp_size, info.gpu_id) == (1, 2, 3)
        assert info.dst_kv_mem_kinds == ["VRAM", "DRAM", "VRAM"]
        assert info.dst_num_slots == 32  # min(4096 // 64, 4096 // 64, 1024 // 32)
        assert info.dst_state_data_lens == [list(x) for x in RICH.state_data_lens]


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(REQUESTS))
@pytest.mark.parametrize("rank", [REAL, DUMMY], ids=["real", "dummy"])
def test_sgw4_metadata_parses_to_what_we_meant(backend: str, name: str, rank: RankInfo) -> None:
    request = REQUESTS[name]
    info = prefill_parse(backend, ours(backend, RICH).metadata_frames(rank, request), "metadata")
    assert (info.room, info.endpoint, info.dst_port) == (request.room, LOOPBACK, 5555)
    assert info.required_dst_info_num == request.required_dst_info_num
    assert info.decode_prefix_len == request.prefix_len
    assert info.is_dummy is rank.is_dummy
    if rank.is_dummy:
        assert info.dst_kv_indices.size == 0
        assert info.dst_state_indices == []
    else:
        assert tuple(info.dst_kv_indices) == request.kv_indices
        assert info.dst_aux_index == request.aux_index
        assert info.dst_state_indices == [list(x) for x in request.state_indices]
    if backend == "mooncake":
        assert info.mooncake_session_id == SESSION_ID
        device = info.dst_device_kv_indices
        if rank.is_dummy or not request.device_kv_bytes:
            assert device is None
        else:
            assert list(device) == [1, 2]
    else:
        assert info.agent_name == AGENT
        assert info.dst_aux_index == request.aux_index  # NIXL sends it for a dummy too


# --- SGW-5, SGW-6, SGW-7: ABORT and BOOTSTRAP, and no instance frame anywhere ------------


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgw7_abort_parses_with_and_without_generation(backend: str) -> None:
    conn = import_sglang()
    backend_ = ours(backend, HARNESS_KV)
    legacy = conn.AbortNotification.from_zmq(backend_.abort_frames(REAL, 9, instance_id="inst"))
    assert (legacy.room, legacy.decode_ip, legacy.decode_port) == (9, LOOPBACK, 5555)
    assert legacy.generation is None  # SGLang names its abort counter "generation"
    assert legacy.deferred_ack_target() is None  # nothing for the prefill to acknowledge
    armed = conn.AbortNotification.from_zmq(
        backend_.abort_frames(REAL, 9, instance_id="inst", abort_seq=3)
    )
    assert (armed.room, armed.generation) == (9, 3)
    assert tuple(armed.deferred_ack_target()) == (LOOPBACK, 5555, 3)


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgw5_the_instance_id_never_reaches_sglang(backend: str) -> None:
    """A target instance id is accepted by every builder and put in no frame (SGW-5)."""
    backend_ = ours(backend, HARNESS_KV)
    request = REQUESTS["plain"]
    calls = {
        "register": lambda i: backend_.register_frames(REAL, instance_id=i),
        "metadata": lambda i: backend_.metadata_frames(REAL, request, instance_id=i),
        "abort": lambda i: backend_.abort_frames(REAL, 1, instance_id=i),
        "abort+generation": lambda i: backend_.abort_frames(REAL, 1, instance_id=i, abort_seq=2),
    }
    if backend == "mooncake":
        calls["bootstrap"] = lambda i: backend_.bootstrap_frames(REAL, 1, instance_id=i)
    for name, call in calls.items():
        assert call("12345") == call(None), name  # a numeric id would read as a generation


# --- byte equality with SGLang's own builders ---------------------------------------------


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgw3_sgw4_sgw7_bytes_equal_sglang_builders(backend: str) -> None:
    conn = import_sglang()
    state = {
        "state_data_ptrs": [[0xA000, 0xA100], [0xB000]],
        "state_data_lens": [[10, 20], [30]],
        "state_item_lens": [[8, 8], [16]],
        "state_dim_per_tensor": [[4], [2]],
        "state_layer_ids": [[0, 1], [2]],
    }
    kv_args = DecodeKVArgs(
        engine_rank=0,
        attn_tp_size=1,
        kv_data_ptrs=(0x1000, 0x2000),
        kv_data_lens=(4096, 4096),
        kv_item_lens=(64, 64),
        kv_layer_ids=(0, 1),
        aux_data_ptrs=(0x3000,),
        kv_mem_kinds=("VRAM", "VRAM"),
        state_data_ptrs=((0xA000, 0xA100), (0xB000,)),
        state_data_lens=((10, 20), (30,)),
        state_item_lens=((8, 8), (16,)),
        state_dim_per_tensor=((4,), (2,)),
        state_layer_ids=((0, 1), (2,)),
    )
    with sglang_decode_builders(backend, **state) as sglang:
        backend_ = ours(backend, kv_args, sglang.local_ip, sglang.rank_port)
        assert backend_.register_frames(REAL) == sglang.build_receiver_registration_message()
        cases = [
            (REQUESTS["plain"], [], None),
            (REQUESTS["hybrid"], [[5, 6], [7]], [1, 2] if backend == "mooncake" else None),
            (REQUESTS["radix-hit"], None, None),
        ]
        for request, state_indices, device in cases:
            for rank in (REAL, DUMMY):
                expected = sglang.build_receiver_metadata_message(
                    bootstrap_room=request.room,
                    required_dst_info_num=request.required_dst_info_num,
                    kv_indices=np.array(request.kv_indices, dtype=np.int32),
                    aux_index=request.aux_index,
                    state_indices=state_indices,
                    decode_prefix_len=request.prefix_len,
                    is_dummy=rank.is_dummy,
                    device_kv_indices=None if device is None else np.array(device, np.int32),
                )
                assert backend_.metadata_frames(rank, request) == expected, (request, rank)
        for generation in (None, 1, 2**40):
            expected = conn.AbortNotification(
                room=2**64 - 1,
                decode_ip=sglang.local_ip,
                decode_port=sglang.rank_port,
                generation=generation,
            ).to_zmq()
            assert backend_.abort_frames(REAL, 2**64 - 1, abort_seq=generation) == expected


# --- SGLang's real prefill bootstrap threads ------------------------------------------------


@pytest.fixture
def bootstrap_url() -> Iterator[str]:
    """SGLang's real bootstrap server, one per test: a prefill of another allocation policy
    registering with the same server would be refused."""
    with sglang_bootstrap_server() as url:
        yield url


@pytest.fixture
def decode_pull() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    """The decode's own PULL endpoint: where SGLang's prefill sends statuses and ABORT_ACKs."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
    try:
        yield sock, port
    finally:
        sock.close(linger=0)
        context.destroy(linger=0)


def _receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(5000), "SGLang's prefill sent nothing within 5 s"
    return sock.recv_multipart()


class _Sender:
    """One PUSH socket to a prefill rank, as the decode's transport would hold."""

    def __init__(self, port: int) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{LOOPBACK}:{port}")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.destroy(linger=0)


def _peer_key(backend: str) -> str:
    return SESSION_ID if backend == "mooncake" else AGENT


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgw2_sglang_prefill_thread_survives_every_message_and_acks_the_abort(
    backend: str, bootstrap_url: str, decode_pull: tuple[zmq.Socket[bytes], int]
) -> None:
    """SGLang's real bootstrap thread reads each of our messages, acts on it, and lives on; an
    abort with a generation comes back as SGLang's own ABORT_ACK, which decodes to an AbortAck."""
    pull, port = decode_pull
    backend_ = ours(backend, HARNESS_KV, LOOPBACK, port)
    with sglang_prefill(backend, bootstrap_url) as prefill:
        sender = _Sender(prefill.port)
        try:
            manager = prefill.manager
            sender.send(backend_.register_frames(REAL))
            assert prefill.wait(lambda: _peer_key(backend) in manager.decode_kv_args_table)
            for room, rank in ((21, REAL), (22, DUMMY)):
                sender.send(backend_.metadata_frames(rank, MetadataRequest(room, (1, 2), 0)))
                assert prefill.wait(lambda r=room: r in manager.transfer_infos)
                assert manager.transfer_infos[room][_peer_key(backend)].is_dummy is rank.is_dummy
            sender.send(backend_.abort_frames(REAL, 21))  # legacy: acknowledged by nothing
            sender.send(backend_.abort_frames(REAL, 22, abort_seq=5))
            event = backend_.decode_message(_receive(pull))
            assert event == AbortAck(22, manager._prefill_unique_rank(), 5)
            # SGLang marked both rooms Failed: the aborts were read in order, and acted on.
            assert manager.check_status(21) == manager.check_status(22) == 0
            assert prefill.thread.is_alive()
            assert prefill.deaths.errors == []
        finally:
            sender.close()


@requires_sglang
def test_sgw6_bootstrap_under_prefill_complete_gets_sglangs_ready_status(
    bootstrap_url: str, decode_pull: tuple[zmq.Socket[bytes], int]
) -> None:
    """A prefill_complete Mooncake prefill reads our BOOTSTRAP and, once its prefill is done,
    SGLang's own status sender tells our endpoint WaitingForInput."""
    pull, port = decode_pull
    backend_ = ours("mooncake", HARNESS_KV, LOOPBACK, port)
    with sglang_prefill(
        "mooncake", bootstrap_url, disaggregation_decode_allocation_policy="prefill_complete"
    ) as prefill:
        sender = _Sender(prefill.port)
        try:
            deferred = prefill.manager.deferred_bootstrap
            owner = object()
            assert deferred.open(31, owner) is not None
            assert deferred.complete(31, owner) is None  # done, but no decode endpoint yet
            sender.send(backend_.bootstrap_frames(REAL, 31))
            event = backend_.decode_message(_receive(pull))
            rank = prefill.manager._prefill_unique_rank()
            assert event == PrefillStatus(31, KVPoll.WaitingForInput, rank)
            sender.send(backend_.register_frames(REAL))
            assert prefill.wait(lambda: SESSION_ID in prefill.manager.decode_kv_args_table)
            assert prefill.thread.is_alive()
            assert prefill.deaths.errors == []
        finally:
            sender.close()


@requires_sglang
def test_sgw6_nixl_refuses_to_build_a_bootstrap() -> None:
    with pytest.raises(ConfigurationError, match="Mooncake transfer backend only"):
        ours("nixl", HARNESS_KV).bootstrap_frames(REAL, 1)


KILLERS = {
    "SimpleBackend register": lambda port: SimpleBackend(LOOPBACK, port, "s").register_frames(REAL),
    "SimpleBackend metadata": lambda port: SimpleBackend(LOOPBACK, port, "s").metadata_frames(
        REAL, MetadataRequest(1, (), 0)
    ),
    # SGW-6: BOOTSTRAP is for a prefill_complete Mooncake prefill only; any other dies of it.
    "BOOTSTRAP to an early prefill": lambda port: unverified_mooncake_backend(
        LOOPBACK, port, SESSION_ID, HARNESS_KV
    ).bootstrap_frames(REAL, 1),
}


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("killer", sorted(KILLERS))
def test_sgw2_frames_of_another_layout_kill_sglangs_bootstrap_thread(
    backend: str, killer: str, bootstrap_url: str
) -> None:
    """The bug of issue 16, shown on the real thread: it dies, and nothing restarts it."""
    with sglang_prefill(backend, bootstrap_url) as prefill:
        sender = _Sender(prefill.port)
        try:
            sender.send(KILLERS[killer](5555))
            prefill.thread.join(5.0)
            assert not prefill.thread.is_alive()
            assert prefill.deaths.errors, "the thread ended without an exception"
        finally:
            sender.close()


# --- SGW-8, SGW-9: SGLang's status and ABORT_ACK senders -> our decode_message ----------


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgw8_sglang_status_sender_completes_and_fails_rooms(
    backend: str, bootstrap_url: str, decode_pull: tuple[zmq.Socket[bytes], int]
) -> None:
    pull, port = decode_pull
    backend_ = ours(backend, HARNESS_KV, LOOPBACK, port)
    other = ours("nixl" if backend == "mooncake" else "mooncake", HARNESS_KV, LOOPBACK, port)
    with sglang_prefill(backend, bootstrap_url) as prefill:
        manager = prefill.manager
        rank = manager._prefill_unique_rank()
        cases = [
            (KVPoll.Success, None, PrefillStatus(41, KVPoll.Success, rank)),
            (KVPoll.Failed, "boom é", PrefillStatus(41, KVPoll.Failed, rank, "boom é")),
            (KVPoll.Failed, None, PrefillStatus(41, KVPoll.Failed, rank)),
        ]
        for status, reason, expected in cases:
            manager.send_kv_status_message(
                targets=[(LOOPBACK, port)],
                bootstrap_room=41,
                status=status,
                failure_reason=reason,
            )
            frames = _receive(pull)
            if backend == "mooncake":
                expected = PrefillStatus(41, status, rank)  # Mooncake carries no reason
            assert backend_.decode_message(frames) == expected
            # A Mooncake decode drops NIXL's tagged status; a NIXL decode, Mooncake's untagged.
            assert other.decode_message(frames) is None
        conn = import_sglang()
        for generation in (1, 7):
            manager._send_abort_ack(41, conn.AckTarget(LOOPBACK, port, generation))
            assert backend_.decode_message(_receive(pull)) == AbortAck(41, rank, generation)


# --- what the decode listener must survive -------------------------------------------------

MALFORMED = [
    [b""],
    [b"7"],
    [b"7", b"4"],
    [b"x", b"4", b"0"],
    [b"7", b"x", b"0"],
    [b"7", b"4", b"-"],
    [b"7", b"3", b"0"],  # Transferring: SGLang ignores non-terminal statuses
    [b"\xff\xfe", b"4", b"0"],
    [b"KV_STATUS"],
    [b"KV_STATUS", b"7", b"4"],
    [b"KV_STATUS", b"7", b"x", b"0", b""],
    [b"ABORT_ACK"],
    [b"ABORT_ACK", b"x"],
    [b"ABORT_ACK", b"7", b"x", b"1"],
    [b"ABORT_ACK", b"7", b"0", b"g"],
    [b"AUX_DATA", b"7"],
    [b"AUX_DATA", b"7", b"0", b"0", b"\x00\x00\x00\x09", b"short"],
    [b"STAGING_REQ", b"7"],
    [b"CHUNK_READY", b"7"],
    [b"BOOTSTRAP", b"7", b"127.0.0.1", b"1"],
]


def _sglang_expected(backend: str, frames: list[bytes]) -> Any:
    """The event SGLang 0.5.23's decode listener would act on for ``frames``, or None."""
    conn = import_sglang()
    if frames and frames[0] in (b"AUX_DATA", b"CHUNK_READY", b"STAGING_REQ"):
        return None  # features we do not run (SGW-10)
    if frames and frames[0] == b"ABORT_ACK":
        if len(frames) == 2 and frames[1].isdigit():
            return AbortAck(int(frames[1]), None, None)  # the legacy form, SGW-9
        ack = conn.AbortAck.from_zmq(frames)
        return None if ack is None else AbortAck(ack.room, ack.prefill_rank, ack.generation)
    tag = b"KV_STATUS" if backend == "nixl" else None
    parsed = _status_parser(tag)(frames)
    if parsed is None:
        return None
    room, status, rank, reason = parsed
    if status not in (KVPoll.Failed, KVPoll.WaitingForInput, KVPoll.Success):
        return None
    return PrefillStatus(room, status, rank, reason)


def _status_parser(tag: bytes | None) -> Any:
    """SGLang's own ``parse_kv_status_message`` with the backend's tag (a plain function)."""
    conn = import_sglang()
    holder = type(
        "StatusLayout",
        (),
        {"kv_status_msg_tag": tag, "kv_status_msg_carries_reason": tag is not None},
    )()
    return lambda frames: conn.CommonKVManager.parse_kv_status_message(holder, frames)


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("frames", MALFORMED, ids=range(len(MALFORMED)))
def test_sgw10_malformed_prefill_messages_decode_as_sglang_reads_them(
    backend: str, frames: list[bytes]
) -> None:
    assert ours(backend, HARNESS_KV).decode_message(frames) == _sglang_expected(backend, frames)


_CANONICAL = st.integers(0, 2**63 - 1).map(lambda n: b"%d" % n)
_FRAME = st.one_of(
    _CANONICAL,
    st.sampled_from([b"0", b"2", b"4", b"3", b"", b"ABORT_ACK", b"KV_STATUS", b"boom"]),
    st.binary(max_size=6),
)


@requires_sglang
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(_FRAME, min_size=1, max_size=6))
def test_sgw10_decode_message_agrees_with_sglang_on_any_frames(
    backend: str, frames: list[bytes]
) -> None:
    """On canonical integers our decoder acts exactly when SGLang's decode would; it is
    stricter only on integers no 0.5.23 sender writes (a sign, spaces, ``_``)."""
    ours_event = ours(backend, HARNESS_KV).decode_message(frames)
    expected = _sglang_expected(backend, frames)
    if ours_event != expected:
        # The only allowed difference: SGLang's int() took a frame we refuse as non-canonical.
        assert ours_event is None
        assert any(f.strip() != f or f[:1] in (b"+", b"-") or b"_" in f for f in frames)


@requires_sglang
def test_sgw10_what_kills_sglangs_mooncake_decode_thread_is_none_to_us() -> None:
    """SGLang's own Mooncake decode thread dies of a malformed AUX_DATA or a STAGING_REQ while
    staging is off; ours returns None for them, and for every malformed status before them,
    which the real thread survives (a Failed status after them is applied)."""
    conn = import_sglang()
    module = mooncake_module()
    backend_ = ours("mooncake", HARNESS_KV)
    from tests.support.sglang_support import make_kv_args, set_sglang_ranks, sglang_server_args
    from tests.support.sglang_wire_support import _cpu_mooncake

    with sglang_server_args(disaggregation_mode="decode", host=LOOPBACK) as server_args:
        set_sglang_ranks(tp_rank=0)
        with thread_deaths() as deaths:
            manager = _cpu_mooncake(module.MooncakeKVManager)(
                make_kv_args(), conn.DisaggregationMode.DECODE, server_args
            )
            decode_thread = manager._worker_threads[0]
            sender = _Sender(manager.rank_port)
            try:
                manager.update_status(51, 2)
                for frames in MALFORMED[:15]:
                    assert backend_.decode_message(frames) is None or frames[0] == b"ABORT_ACK"
                    sender.send(frames)
                sender.send([b"51", b"0", b"0", b"after the junk"])
                probe = Prefill("mooncake", manager, decode_thread, deaths)
                assert probe.wait(lambda: manager.check_status(51) == 0)
                assert manager.failure_records[51] == "after the junk"
                assert decode_thread.is_alive()
                for killer in ([b"AUX_DATA", b"51"], [b"STAGING_REQ", b"51"]):
                    assert backend_.decode_message(killer) is None
                sender.send([b"AUX_DATA", b"51"])
                decode_thread.join(5.0)
                assert not decode_thread.is_alive()
                assert deaths.errors
            finally:
                sender.close()
                manager.teardown()
                decode_thread.join(5.0)
                manager._zmq_ctx.destroy(linger=0)


# --- the same bytes as SGLang's own decode, end to end ---------------------------------------


@requires_sglang
def test_sgw3_sgw4_sgw6_sgw7_sglangs_receiver_sends_our_bytes() -> None:
    """SGLang's real ``CommonKVReceiver`` (Mooncake builders, prefill_complete, deferred release
    on) against SGLang's bootstrap server and a registered prefill rank whose socket the test
    reads: registration, BOOTSTRAP, metadata, the legacy ABORT and the ABORT with a generation
    are, byte for byte, what MooncakeBackend builds for the same inputs."""
    from tests.support.sglang_support import sglang_prefill_rank

    conn = import_sglang()
    policy = {"disaggregation_decode_allocation_policy": "prefill_complete"}
    with (
        sglang_bootstrap_server() as addr,
        sglang_prefill_rank(addr, tp_size=1, tp_rank=0, **policy) as rank,
        sglang_decode_builders("mooncake", deferred_release=True, server_fields=policy) as mgr,
    ):

        def received() -> list[bytes]:
            assert rank.server_socket.poll(5000), "the prefill rank received nothing in 5 s"
            frames: list[bytes] = rank.server_socket.recv_multipart()
            return frames

        backend_ = ours("mooncake", HARNESS_KV, mgr.local_ip, mgr.rank_port)
        assert mgr.try_ensure_parallel_info(addr)
        first = conn.CommonKVReceiver(mgr, addr, 61)
        first.init(0)
        assert received() == backend_.register_frames(REAL)
        assert received() == backend_.bootstrap_frames(REAL, 61)
        first.abort()  # before its metadata: the legacy ABORT
        assert received() == backend_.abort_frames(REAL, 61)
        second = conn.CommonKVReceiver(mgr, addr, 62)
        second.init(0)  # a pool hit: no second registration
        assert received() == backend_.bootstrap_frames(REAL, 62)
        second.send_metadata(np.array([4, 5], dtype=np.int32), 3, None, 16)
        assert received() == backend_.metadata_frames(REAL, MetadataRequest(62, (4, 5), 3, 16))
        second.abort()  # after its metadata: armed, generation 1
        assert received() == backend_.abort_frames(REAL, 62, abort_seq=1)
