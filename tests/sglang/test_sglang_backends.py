"""The SGLang 0.5.23 backends without SGLang: input checks and decoding (spec/sglang-wire.md).

What SGLang's own code says about these frames is tested in tests/sglang/test_sglang_wire.py; here,
what needs no SGLang: every bad input is a typed error before any frame exists (SGW-1, SGW-2),
frame counts and the dummy encoding (SGW-3, SGW-4), and decode_message on arbitrary frames
(SGW-8 … SGW-10).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine.completion import AbortAck, PrefillStatus
from statemachine.decode.manager import DecodeManager
from statemachine.errors import BootstrapError, ConfigurationError, InvalidArgument
from statemachine.pool import RankInfo
from statemachine.sglang.v0_5_23 import DecodeKVArgs, MooncakeBackend, NixlBackend
from statemachine.sglang.v0_5_23.control import MAX_REASON_CHARS
from statemachine.sglang.v0_5_23.mooncake import METADATA_FRAMES as MOONCAKE_METADATA
from statemachine.sglang.v0_5_23.mooncake import REGISTRATION_FRAMES as MOONCAKE_REGISTRATION
from statemachine.sglang.v0_5_23.mooncake import (
    unverified_mooncake_backend,
    unverified_mooncake_factory,
)
from statemachine.sglang.v0_5_23.nixl import GUARD, unverified_nixl_backend
from statemachine.sglang.v0_5_23.nixl import METADATA_FRAMES as NIXL_METADATA
from statemachine.sglang.v0_5_23.nixl import REGISTRATION_FRAMES as NIXL_REGISTRATION
from statemachine.wire.metadata import MetadataRequest

KV = DecodeKVArgs(
    engine_rank=0,
    attn_tp_size=1,
    kv_data_ptrs=(0x1000, 0x2000),
    kv_data_lens=(4096, 4096),
    kv_item_lens=(64, 64),
    aux_data_ptrs=(0x3000,),
)
REAL = RankInfo("127.0.0.1", 7000, 0, False)
DUMMY = RankInfo("127.0.0.1", 7001, 0, True)


def mooncake(**kwargs: Any) -> MooncakeBackend:
    args: dict[str, Any] = {
        "decode_ip": "127.0.0.1",
        "decode_port": 5555,
        "session_id": "10.0.0.1:17001",
        "kv_args": KV,
    }
    return unverified_mooncake_backend(**{**args, **kwargs})


def nixl(**kwargs: Any) -> NixlBackend:
    args: dict[str, Any] = {
        "decode_ip": "127.0.0.1",
        "decode_port": 5555,
        "agent_name": "agent-1",
        "agent_metadata": b"\x00meta",
        "kv_args": KV,
    }
    return unverified_nixl_backend(**{**args, **kwargs})


# --- SGW-1, SGW-2: every bad input is typed, before any frame exists ------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"engine_rank": 2, "attn_tp_size": 2}, "below attn_tp_size"),
        ({"engine_rank": -1, "attn_tp_size": 1}, "engine_rank"),
        ({"engine_rank": 0, "attn_tp_size": 0}, "attn_tp_size"),
        ({"engine_rank": 0, "attn_tp_size": 1, "dcp_rank": 1}, "below dcp_size"),
        ({"engine_rank": 0, "attn_tp_size": 1, "kv_data_ptrs": (-1,)}, "kv_data_ptrs"),
        ({"engine_rank": 0, "attn_tp_size": 1, "kv_data_ptrs": (2**64,)}, "kv_data_ptrs"),
        ({"engine_rank": 0, "attn_tp_size": 1, "kv_data_ptrs": "12"}, "sequence of ints"),
        ({"engine_rank": 0, "attn_tp_size": 1, "kv_item_lens": (0,)}, "positive"),
        ({"engine_rank": 0, "attn_tp_size": 1, "kv_layer_ids": (2**32,)}, "kv_layer_ids"),
        ({"engine_rank": 0, "attn_tp_size": 1, "state_item_lens": ((True,),)}, "state_item"),
        ({"engine_rank": 0, "attn_tp_size": 1, "state_data_ptrs": (1, 2)}, "state_data_ptrs"),
        ({"engine_rank": 0, "attn_tp_size": 1, "kv_mem_kinds": ("HBM",)}, "VRAM"),
        ({"engine_rank": 0, "attn_tp_size": 1, "kv_mem_kinds": "VRAM"}, "sequence"),
        ({"engine_rank": True, "attn_tp_size": 1}, "engine_rank"),
    ],
)
def test_sgw2_decode_kv_args_refuse_what_a_prefill_parser_would_die_of(
    fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        DecodeKVArgs(**fields)


def test_sgw2_decode_kv_args_are_normalised_to_tuples() -> None:
    args = DecodeKVArgs(
        engine_rank=0, attn_tp_size=1, kv_data_ptrs=[1, 2], state_layer_ids=[[0], [1, 2]]
    )
    assert args.kv_data_ptrs == (1, 2)
    assert args.state_layer_ids == ((0,), (1, 2))
    assert (args.kv_item_len, args.nixl_slot_count()) == (0, 0)
    assert (KV.kv_item_len, KV.nixl_slot_count()) == (64, 64)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: mooncake(decode_ip="localhost"), "IP"),
        (lambda: mooncake(decode_ip="0.0.0.0"), "unspecified"),
        (lambda: mooncake(decode_port=0), "decode port"),
        (lambda: mooncake(decode_port=True), "decode port"),
        (lambda: mooncake(session_id="10.0.0.1"), "host:port"),
        (lambda: mooncake(session_id=":17001"), "host:port"),
        (lambda: mooncake(session_id="10.0.0.1:x"), "host:port"),
        (lambda: mooncake(session_id="h:1 2"), "spaces"),
        (lambda: mooncake(session_id="hé:1"), "ASCII"),
        (lambda: mooncake(kv_args=object()), "DecodeKVArgs"),
        (lambda: nixl(agent_name=""), "agent_name"),
        (lambda: nixl(agent_metadata="text"), "agent_metadata"),
        (
            lambda: nixl(kv_args=DecodeKVArgs(0, 1, kv_data_ptrs=(1, 2), kv_item_lens=(8,))),
            "one kv_item_lens entry per KV pointer",
        ),
        (
            lambda: nixl(kv_args=DecodeKVArgs(0, 1, kv_data_ptrs=(1,), kv_mem_kinds=("VRAM",) * 2)),
            "one kv_mem_kinds entry per KV pointer",
        ),
        (lambda: mooncake().abort_frames(REAL, -1), "room"),
        (lambda: mooncake().abort_frames(REAL, 2**64), "room"),
        (lambda: mooncake().abort_frames(REAL, 1, abort_seq=-1), "abort_seq"),
        (lambda: nixl().abort_frames(REAL, 1, abort_seq=2**63), "abort_seq"),
        (lambda: mooncake().bootstrap_frames(REAL, -1), "room"),
    ],
)
def test_sgw1_bad_identity_or_arguments_are_invalid_arguments(build: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        build()


def test_sgw6_nixl_has_no_bootstrap() -> None:
    with pytest.raises(ConfigurationError, match="'early' policy"):
        nixl().bootstrap_frames(REAL, 1)


# --- SGW-3, SGW-4, SGW-5: shapes --------------------------------------------------------------


def test_sgw3_sgw4_frame_counts_and_dummy_encoding() -> None:
    request = MetadataRequest(5, (1, 2), 3, state_indices=[(4,)], device_kv_indices=(9,))
    moon, nix = mooncake(), nixl()
    assert len(moon.register_frames(REAL)) == MOONCAKE_REGISTRATION
    assert len(nix.register_frames(REAL)) == NIXL_REGISTRATION
    assert nix.register_frames(REAL)[0] == GUARD
    real = moon.metadata_frames(REAL, request)
    dummy = moon.metadata_frames(DUMMY, request)
    assert len(real) == len(dummy) == MOONCAKE_METADATA
    assert (real[4], real[5]) != (b"", b"")
    assert (dummy[4], dummy[5], dummy[6], dummy[9]) == (b"", b"", b"", b"")
    real, dummy = nix.metadata_frames(REAL, request), nix.metadata_frames(DUMMY, request)
    assert len(real) == len(dummy) == NIXL_METADATA
    assert (real[6], real[10], dummy[6], dummy[10]) == (b"3", b"0", b"3", b"1")
    assert (dummy[5], dummy[8]) == (b"", b"")
    # The registration is built once; callers get copies they may change.
    frames = moon.register_frames(REAL)
    frames.append(b"x")
    assert len(moon.register_frames(REAL)) == MOONCAKE_REGISTRATION


@pytest.mark.parametrize("backend", [mooncake(), nixl()], ids=["mooncake", "nixl"])
def test_sgw7_abort_frames(backend: Any) -> None:
    assert backend.abort_frames(REAL, 9) == [b"ABORT", b"9", b"127.0.0.1", b"5555"]
    assert backend.abort_frames(REAL, 9, abort_seq=4, instance_id="x")[4:] == [b"4"]


def test_sgw12_the_constructors_are_closed() -> None:
    """Only the verified paths (and the unverified_* functions, for stand-in engines) hold
    the constructors' witness; anything else is refused, whatever it passes
    (test_public_path_mistakes.py shows it against SGLang's real prefills)."""
    with pytest.raises(InvalidArgument, match=r"MooncakeBackend\(\.\.\.\) is not a public"):
        MooncakeBackend("127.0.0.1", 5555, "10.0.0.1:17001", KV)
    with pytest.raises(InvalidArgument, match=r"NixlBackend\(\.\.\.\) is not a public"):
        NixlBackend("127.0.0.1", 5555, "agent-1", b"m", KV, _witness=object())


def test_manager_accepts_the_backends_through_its_factory() -> None:
    """The manager builds them with its ack listener's endpoint (and checks their methods)."""
    for factory in (
        # The public factories read a real engine's or agent's buffers back
        # (test_public_path_mistakes.py); here the manager's side only, with no engine behind
        # the session: any callable of (ip, port) building the backend.
        unverified_mooncake_factory("10.0.0.1:17001", KV),
        lambda ip, port: unverified_nixl_backend(ip, port, "agent-1", b"m", KV),
    ):
        manager = DecodeManager(backend_factory=factory, health_probes=False)
        try:
            backend = manager.backend
            assert manager.acks is not None
            assert backend.abort_frames(REAL, 1)[2:] == [b"127.0.0.1", b"%d" % manager.acks.port]
        finally:
            manager.close()


# --- SGW-8 … SGW-10: decode_message -------------------------------------------------------


def test_sgw8_statuses_per_backend() -> None:
    moon, nix = mooncake(), nixl()
    assert moon.decode_message([b"7", b"4", b"3"]) == PrefillStatus(7, 4, 3)
    assert moon.decode_message([b"7", b"0", b"3", b"why"]) == PrefillStatus(7, 0, 3, "why")
    assert moon.decode_message([b"7", b"2", b"3", b""]) == PrefillStatus(7, 2, 3)
    assert nix.decode_message([b"KV_STATUS", b"7", b"0", b"1", b"boom"]) == PrefillStatus(
        7, 0, 1, "boom"
    )
    assert nix.decode_message([b"KV_STATUS", b"7", b"4", b"1", b""]) == PrefillStatus(7, 4, 1)
    assert nix.decode_message([b"7", b"4", b"3"]) is None
    assert moon.decode_message([b"KV_STATUS", b"7", b"4", b"1", b""]) is None
    reason = nix.decode_message([b"KV_STATUS", b"7", b"0", b"1", b"r" * 10_000])
    assert isinstance(reason, PrefillStatus) and len(reason.reason or "") == MAX_REASON_CHARS
    assert nix.decode_message([b"KV_STATUS", b"7", b"0", b"1", b"\xff"]) == PrefillStatus(
        7, 0, 1, "\ufffd"
    )


@pytest.mark.parametrize("backend", [mooncake(), nixl()], ids=["mooncake", "nixl"])
def test_sgw9_abort_acks(backend: Any) -> None:
    assert backend.decode_message([b"ABORT_ACK", b"7", b"2", b"5"]) == AbortAck(7, 2, 5)
    assert backend.decode_message([b"ABORT_ACK", b"7", b"2"]) == AbortAck(7, 2, None)
    assert backend.decode_message([b"ABORT_ACK", b"7"]) == AbortAck(7, None, None)
    for bad in ([b"ABORT_ACK"], [b"ABORT_ACK", b"-7"], [b"ABORT_ACK", b"7", b"2", b" 5"]):
        assert backend.decode_message(bad) is None


@pytest.mark.parametrize("backend", [mooncake(), nixl()], ids=["mooncake", "nixl"])
@given(frames=st.lists(st.binary(max_size=12), max_size=7))
def test_sgw10_decode_message_never_raises(backend: Any, frames: list[bytes]) -> None:
    event = backend.decode_message(frames)
    assert event is None or isinstance(event, (PrefillStatus, AbortAck))


@pytest.mark.parametrize("backend", [mooncake(), nixl()], ids=["mooncake", "nixl"])
def test_sgw10_unsupported_and_odd_inputs_are_none(backend: Any) -> None:
    for frames in (
        [],
        [b"AUX_DATA", b"7", b"0", b"0", b"\x00\x00\x00\x01", b"x"],
        [b"STAGING_REQ", b"7", b"0", b"1", b"s"],
        [b"CHUNK_READY", b"7", b"0", b"0", b"1", b"w", b"0"],
        [object()],  # not bytes at all
        [b"7", b"3", b"0"],  # Transferring is not a status the decode acts on
        [b"KV_STATUS", b"7", b"3", b"0", b""],
    ):
        assert backend.decode_message(frames) is None  # type: ignore[arg-type]


def test_errors_are_bootstrap_errors() -> None:
    assert issubclass(InvalidArgument, BootstrapError)
    assert issubclass(ConfigurationError, BootstrapError)


# --- A NIXL decode of another tp size into host memory: refused before anything is sent ------


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "kinds", "mla", "refused"),
    [
        (2, 1, ("DRAM", "DRAM"), False, True),
        (1, 2, ("VRAM", "DRAM"), False, True),
        (1, 1, ("DRAM", "DRAM"), False, False),  # equal tp: SGLang moves it into DRAM
        (2, 1, (), False, False),  # empty kinds: VRAM
        (2, 1, ("DRAM", "DRAM"), True, False),  # MLA: the pool is sent whole
    ],
)
def test_nixl_check_topology_refuses_heterogeneous_tp_into_host_memory(
    prefill_tp: int, decode_tp: int, kinds: tuple[str, ...], mla: bool, refused: bool
) -> None:
    from dataclasses import replace

    from statemachine.decode.plan import DecodeLayout
    from statemachine.errors import TopologyMismatch
    from statemachine.validation import Topology

    backend = nixl(kv_args=replace(KV, kv_mem_kinds=kinds))
    topology = Topology(
        dp_size=1, attn_cp_size=1, attn_tp_size=prefill_tp, pp_size=1, page_size=16,
        kv_cache_dtype="bfloat16", follow_bootstrap_room=None, instance_id=None,
    )  # fmt: skip
    layout = DecodeLayout(tp_rank=0, tp_size=decode_tp, page_size=16, is_mla=mla)
    if refused:
        with pytest.raises(TopologyMismatch, match="with the prefill's attention tp size"):
            backend.check_topology("10.0.0.2:8998", topology, layout)
    else:
        backend.check_topology("10.0.0.2:8998", topology, layout)
