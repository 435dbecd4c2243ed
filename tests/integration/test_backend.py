"""The KVBackend seam's SGLang-facing parts on the reference layout (spec/zmq.md ZMQ-22).

The new frames of ``SimpleBackend`` (BOOTSTRAP, the abort with a generation), its
``decode_message`` of every reply kind, ``MetadataRequest``'s keyword fields, the list-of-lists
container, the manager's construction check, and the reference prefill rank (a real process and
a real bootstrap server on 127.0.0.1) answering BOOTSTRAP and an abort with a generation.
"""

from __future__ import annotations

import struct

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from statemachine.completion import (
    AbortAck,
    KVPoll,
    PrefillStatus,
)
from statemachine.decode.manager import DecodeManager
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.errors import ConfigurationError, MalformedFrames
from statemachine.pool import RankInfo
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.metadata import MetadataRequest, pack_int_lists, unpack_int_lists
from statemachine.wire.reference import (
    ABORT_FRAMES,
    ABORT_GENERATION_FRAMES,
    BOOTSTRAP_FRAMES,
    MAX_REASON_BYTES,
    SimpleBackend,
    abort_ack_frames,
    ack_frames,
    failed_frames,
    parse_abort,
    parse_bootstrap,
    prefill_rank_id,
    ready_frames,
)
from tests.support.bootstrap_support import TOKEN
from tests.support.zmq_support import LOOPBACK, pull_peer

RANK = RankInfo(LOOPBACK, 7000, 1, False)
BACKEND = SimpleBackend(LOOPBACK, 5555, "session-d")


# --- MetadataRequest's keyword fields --------------------------------------------------------


def test_metadata_request_defaults_are_a_plain_request() -> None:
    request = MetadataRequest(1, (2, 3), 4)
    assert request.required_dst_info_num == 1
    assert (request.state_bytes, request.device_kv_bytes) == (b"", b"")
    assert request.state_indices == ()


def test_metadata_request_packs_state_and_device_indices_once() -> None:
    request = MetadataRequest(
        1,
        (2,),
        0,
        required_dst_info_num=3,
        state_indices=[(5, -1), None, []],
        device_kv_indices=(9, 8),
    )
    assert request.required_dst_info_num == 3
    # count 3, byte lengths 8/0/0, then the int32 values little-endian.
    assert request.state_bytes == struct.pack("<4I2i", 3, 8, 0, 0, 5, -1)
    assert request.state_indices == ((5, -1), (), ())
    assert request.device_kv_bytes == struct.pack("<2i", 9, 8)
    assert MetadataRequest(1, (), 0, state_indices=None).state_bytes == b""
    assert "required_dst_info_num=3" in repr(request)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"required_dst_info_num": 0}, ValueError),
        ({"required_dst_info_num": True}, TypeError),
        ({"state_indices": "abc"}, TypeError),
        ({"state_indices": [(2**31,)]}, ValueError),
        ({"state_indices": [(1.5,)]}, TypeError),
        ({"device_kv_indices": [-(2**31) - 1]}, ValueError),
    ],
)
def test_metadata_request_rejects_bad_keyword_fields(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        MetadataRequest(1, (), 0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("room", -1, ValueError),
        ("room", 2**64, ValueError),
        ("room", True, TypeError),
        ("room", 1.0, TypeError),
        ("aux_index", -1, ValueError),
        ("aux_index", 2**31, ValueError),
        ("prefix_len", -1, ValueError),
        ("prefix_len", 2**31, ValueError),
        ("prefix_len", False, TypeError),
        ("required_dst_info_num", 2**31, ValueError),
    ],
)
def test_metadata_request_refuses_each_out_of_range_int(
    field: str, value: object, error: type[Exception]
) -> None:
    """Each int field is range-checked on the fast path (plain ints) as on the named checks."""
    fields: dict[str, object] = {"room": 1, "kv_indices": (), "aux_index": 0, "prefix_len": 0}
    fields[field] = value
    with pytest.raises(error, match=field):
        MetadataRequest(**fields)  # type: ignore[arg-type]


def test_metadata_request_takes_int_subclasses_as_before() -> None:
    """An IntEnum (an int that is not exactly ``int``) takes the named checks, and passes."""
    import enum

    class Room(enum.IntEnum):
        SEVEN = 7

    request = MetadataRequest(Room.SEVEN, (1,), Room.SEVEN, Room.SEVEN)
    assert (request.room, request.aux_index, request.prefix_len) == (7, 7, 7)


def test_numpy_indices_of_every_int32_shape_and_byte_order_pack_to_the_wire() -> None:
    """The int32 fast path: contiguous, strided and big-endian int32 arrays give the same
    little-endian bytes as the list; a 2-d int32 array is refused, as every 2-d array is."""
    numpy = pytest.importorskip("numpy")
    values = [5, -1, 2**31 - 1, -(2**31), 0, 42]
    expected = struct.pack("<6i", *values)
    native = numpy.array(values, dtype=numpy.int32)
    doubled = numpy.array([v for v in values for _ in (0, 1)], dtype=numpy.int32)
    for indices in (
        native,
        doubled[::2],  # a strided view: not contiguous
        native.astype(">i4"),  # the wire's type in the other byte order
        numpy.array(values, dtype=numpy.int64),
    ):
        assert MetadataRequest(1, indices, 0).kv_bytes == expected, indices.dtype
    with pytest.raises(TypeError, match="1-d"):
        MetadataRequest(1, native.reshape(2, 3), 0)
    with pytest.raises(ValueError, match="int32"):
        MetadataRequest(1, numpy.array([2**31], dtype=numpy.int64), 0)


@given(st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=5), max_size=5))
def test_int_lists_container_round_trips(lists: list[list[int]]) -> None:
    packed = pack_int_lists(lists, "Q")
    assert unpack_int_lists(packed, "Q") == tuple(tuple(values) for values in lists)


@pytest.mark.parametrize(
    "data",
    [
        b"\x01",
        struct.pack("<I", 2),
        struct.pack("<2I", 1, 8) + b"\x00" * 4,
        struct.pack("<2I", 1, 3),
    ],
)
def test_int_lists_container_rejects_inconsistent_bytes(data: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_int_lists(data, "i")


# --- the new frames --------------------------------------------------------------------------


def test_zmq22_legacy_abort_is_unchanged() -> None:
    frames = BACKEND.abort_frames(RANK, 7)
    assert frames == [b"abort", b"7", b"session-d", b"1"]
    assert len(frames) == ABORT_FRAMES
    assert parse_abort(frames).abort_seq is None


def test_zmq22_abort_with_a_generation() -> None:
    frames = BACKEND.abort_frames(RANK, 7, abort_seq=3)
    assert frames == [b"abort", b"7", b"session-d", b"1", b"", b"3"]
    assert len(frames) == ABORT_GENERATION_FRAMES
    parsed = parse_abort(frames)
    assert (parsed.room, parsed.abort_seq, parsed.instance_id) == (7, 3, None)
    targeted = parse_abort(BACKEND.abort_frames(RANK, 7, instance_id="inst", abort_seq=0))
    assert (targeted.abort_seq, targeted.instance_id) == (0, "inst")
    with pytest.raises(ValueError):
        BACKEND.abort_frames(RANK, 7, abort_seq=-1)
    for bad in (b"", b"x", b"-1", b" 3"):
        with pytest.raises(MalformedFrames):
            parse_abort([*frames[:5], bad])


def test_zmq22_bootstrap_frames() -> None:
    frames = BACKEND.bootstrap_frames(RANK, 2**64 - 1)
    assert len(frames) == BOOTSTRAP_FRAMES
    parsed = parse_bootstrap(frames)
    assert (parsed.room, parsed.decode_ip, parsed.decode_port) == (2**64 - 1, LOOPBACK, 5555)
    assert (parsed.session_id, parsed.target_pp_rank, parsed.instance_id) == ("session-d", 1, None)
    assert parse_bootstrap(BACKEND.bootstrap_frames(RANK, 1, instance_id="i")).instance_id == "i"
    with pytest.raises(ValueError):
        BACKEND.bootstrap_frames(RANK, -1)
    for bad in (frames[:5], [b"bootstrap", b"x", *frames[2:]], [b"boot", *frames[1:]]):
        with pytest.raises(MalformedFrames):
            parse_bootstrap(bad)


# --- decode_message ---------------------------------------------------------------------------


def test_zmq22_decode_message_of_every_reply_kind() -> None:
    sender = prefill_rank_id(2, 1)
    assert BACKEND.decode_message(ack_frames(9, 2, 1)) == PrefillStatus(9, KVPoll.Success, sender)
    assert BACKEND.decode_message(ready_frames(9, 2, 1)) == PrefillStatus(
        9, KVPoll.WaitingForInput, sender
    )
    assert BACKEND.decode_message(failed_frames(9, 2, 1, "boom")) == PrefillStatus(
        9, KVPoll.Failed, sender, "boom"
    )
    assert BACKEND.decode_message(failed_frames(9, 2, 1, "")) == PrefillStatus(
        9, KVPoll.Failed, sender, None
    )
    assert BACKEND.decode_message(abort_ack_frames(9, 2, 1, 4)) == AbortAck(9, sender, 4)
    # Distinct (tp, pp) pairs are distinct senders.
    assert len({prefill_rank_id(tp, pp) for tp in range(4) for pp in range(4)}) == 16
    long_reason = failed_frames(1, 0, 0, "é" * MAX_REASON_BYTES)[4]
    assert len(long_reason) <= MAX_REASON_BYTES
    long_reason.decode("utf-8")  # cut on a character boundary


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"ack"],
        [b"ack", b"1", b"0"],
        [b"ack", b"1", b"0", b"0", b"extra"],
        [b"ready", b"1", b"0", b"0", b""],
        [b"failed", b"1", b"0", b"0"],
        [b"abort_ack", b"1", b"0", b"0"],
        [b"abort_ack", b"1", b"0", b"0", b"x"],
        [b"ack", b"-1", b"0", b"0"],
        [b"ack", b"1", b"2" * 21, b"0"],
        [b"ack", b"1", b"%d" % 2**32, b"0"],
        [b"ack", str(2**64).encode(), b"0", b"0"],
        [b"ack", "١".encode(), b"0", b"0"],
        [b"failed", b"1", b"0", b"0", b"r" * (MAX_REASON_BYTES + 1)],
        [b"4", b"1", b"0"],  # an SGLang Mooncake status is not this backend's
        [b"KV_STATUS", b"1", b"4", b"0", b""],
        [b"hello", b"1", b"0", b"0"],
    ],
)
def test_zmq22_decode_message_drops_what_is_not_a_reply(frames: list[bytes]) -> None:
    assert BACKEND.decode_message(frames) is None


@given(st.lists(st.binary(max_size=24), max_size=7))
def test_zmq22_decode_message_never_raises(frames: list[bytes]) -> None:
    event = BACKEND.decode_message(frames)
    assert event is None or isinstance(event, (PrefillStatus, AbortAck))


# --- the manager's construction check --------------------------------------------------------


class _NoBootstrap:
    """A backend written before ZMQ-22: no bootstrap_frames, no decode_message."""

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        return []

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        return []

    def abort_frames(
        self,
        rank: RankInfo,
        room: int,
        *,
        instance_id: str | None = None,
        abort_seq: int | None = None,
    ) -> list[bytes]:
        return []


class _AbortWithoutGeneration(SimpleBackend):
    def abort_frames(  # type: ignore[override]
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        return super().abort_frames(rank, room, instance_id=instance_id)


@pytest.mark.parametrize(
    ("backend", "match"),
    [
        (_NoBootstrap(), r"KVBackend with bootstrap_frames\(\)"),
        (_AbortWithoutGeneration(LOOPBACK, 5555, "s"), r"abort_frames\(\) .*abort_seq"),
    ],
)
def test_zmq22_a_backend_without_the_new_methods_is_a_configuration_error(
    backend: object, match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        DecodeManager(backend=backend, completion="external", health_probes=False)  # type: ignore[arg-type]


# --- the reference prefill rank ---------------------------------------------------------------


def _receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(10_000), "no reply from the reference rank within 10 s"
    return sock.recv_multipart()


def test_zmq22_reference_rank_answers_bootstrap_and_an_abort_with_a_generation(
    server: BootstrapServer,
) -> None:
    """BOOTSTRAP -> ready (WaitingForInput); legacy abort -> nothing; abort + generation -> ack."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with (
            pull_peer(context) as (replies, port),
            PrefillRankProcess(server.address, TOKEN, tp_rank=1, tp_size=2) as rank,
            ZmqTransport() as transport,
        ):
            backend = SimpleBackend(LOOPBACK, port, "decode-7")
            target = RankInfo(LOOPBACK, rank.port, 0)
            endpoint = (LOOPBACK, rank.port)
            sender = prefill_rank_id(1, 0)
            transport.send(endpoint, backend.register_frames(target))
            transport.send(endpoint, backend.bootstrap_frames(target, 11))
            assert backend.decode_message(_receive(replies)) == PrefillStatus(
                11, KVPoll.WaitingForInput, sender
            )
            # A legacy abort is not acknowledged: the next reply is the generation's ack.
            transport.send(endpoint, backend.abort_frames(target, 11))
            transport.send(endpoint, backend.abort_frames(target, 11, abort_seq=2))
            assert backend.decode_message(_receive(replies)) == AbortAck(11, sender, 2)
            # An abort from a session that never registered has no endpoint to ack to.
            stranger = SimpleBackend(LOOPBACK, port, "stranger")
            transport.send(endpoint, stranger.abort_frames(target, 12, abort_seq=1))
            # A BOOTSTRAP for another pp rank is misaddressed; this one is served.
            transport.send(endpoint, backend.bootstrap_frames(RankInfo(LOOPBACK, 1, 1), 13))
            transport.send(endpoint, backend.bootstrap_frames(target, 14))
            assert backend.decode_message(_receive(replies)) == PrefillStatus(
                14, KVPoll.WaitingForInput, sender
            )
            stats = rank.terminate()
    finally:
        context.destroy(linger=0)
    assert stats is not None
    assert (stats["bootstrap"], stats["aborts"], stats["acks_sent"]) == (2, 3, 3)
    assert (stats["unregistered"], stats["misaddressed"], stats["malformed"]) == (1, 1, 0)
