"""SGLang 0.5.23's Mooncake layouts as a :class:`~statemachine.backend.KVBackend`.

Frame by frame in ``spec/sglang-wire.md`` (SGW-3 registration, SGW-4 metadata, SGW-6
BOOTSTRAP, SGW-7 ABORT, SGW-8/SGW-9 what comes back). The builders follow
``MooncakeKVManager.build_receiver_registration_message`` / ``build_receiver_metadata_message``
(``mooncake/conn.py:3215-3308``); the prefill parses them with ``KVArgsRegisterInfo.from_zmq``
and ``TransferInfo.from_zmq`` (``mooncake/conn.py:119-229``) on a bootstrap thread that dies on
the first exception, so every input is checked here, at construction or per call, and refused
with :class:`~statemachine.validation.InvalidArgument`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from statemachine.completion import PrefillEvent
from statemachine.errors import InvalidArgument
from statemachine.pool import RankInfo
from statemachine.sglang.v0_5_23.control import (
    abort_message,
    ascii_int,
    ascii_text,
    bootstrap_message,
    decode_endpoint,
    decode_prefill_message,
)
from statemachine.sglang.v0_5_23.kv_args import DecodeKVArgs, pack_lists, pack_u32, pack_u64
from statemachine.wire.metadata import MetadataRequest

#: Frame 0 of a registration: the text ``None`` where metadata has its room.
REGISTRATION_ROOM = b"None"
REGISTRATION_FRAMES = 20
METADATA_FRAMES = 10


def check_session_id(session_id: object) -> bytes:
    """Mooncake's transfer-engine session id, ``host:port`` (SGW-1): the prefill applies
    ``int()`` to the text after the last ``:`` of every session of a room
    (``mooncake/conn.py:3116-3118``), on its scheduler thread."""
    encoded = ascii_text("Mooncake session_id", session_id)
    host, sep, port = encoded.rpartition(b":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise InvalidArgument(
            f"Mooncake session_id must be 'host:port' (the transfer engine's session id, e.g. "
            f"from TransferEngine.get_session_id()), got {session_id!r}"
        )
    return encoded


class MooncakeBackend:
    """The decode side of SGLang 0.5.23's Mooncake transfer backend.

    ``decode_ip``/``decode_port``: the decode's own PULL endpoint, where the prefill sends
    statuses and ABORT_ACKs (the manager's ack listener). ``session_id``: this decode's Mooncake
    transfer-engine session, ``host:port``. ``kv_args``: its KV buffers. The registration does
    not depend on the rank, so it is built once, here.

    The target instance id (ZMQ-21) is accepted and never put on the wire (SGW-5).
    """

    __slots__ = ("_endpoint", "_prefix", "_registration", "kv_args", "session_id")

    def __init__(
        self, decode_ip: str, decode_port: int, session_id: str, kv_args: DecodeKVArgs
    ) -> None:
        if not isinstance(kv_args, DecodeKVArgs):
            raise InvalidArgument(f"kv_args must be a DecodeKVArgs, got {type(kv_args).__name__}")
        self._endpoint = decode_endpoint(decode_ip, decode_port)
        session = check_session_id(session_id)
        self.session_id = session_id
        self.kv_args = kv_args
        #: ip, port, session: frames 1-3 of every registration and metadata message
        self._prefix = (*self._endpoint, session)
        self._registration = self._build_registration()

    @classmethod
    def factory(
        cls, session_id: str, kv_args: DecodeKVArgs
    ) -> Callable[[str, int], MooncakeBackend]:
        """A ``backend_factory`` for :class:`~statemachine.decode.manager.DecodeManager`, which
        calls it with its ack listener's ip and port (the decode's own PULL endpoint)."""

        def build(ip: str, port: int) -> MooncakeBackend:
            return cls(ip, port, session_id, kv_args)

        return build

    def _build_registration(self) -> list[bytes]:
        args = self.kv_args
        return [
            REGISTRATION_ROOM,
            *self._prefix,
            pack_u64(args.kv_data_ptrs),
            pack_u64(args.aux_data_ptrs),
            pack_lists(args.state_data_ptrs, "Q"),
            ascii_int(args.engine_rank),
            ascii_int(args.attn_tp_size),
            ascii_int(args.kv_item_len),
            pack_lists(args.state_item_lens, "I"),
            pack_lists(args.state_dim_per_tensor, "I"),
            pack_u32(args.kv_layer_ids),
            pack_lists(args.state_layer_ids, "I"),
            b"",  # staging base pointer: no staging buffer (SGW-3)
            b"",  # staging total size
            ascii_int(args.dcp_size),
            ascii_int(args.dcp_rank),
            b"",  # staging slot layer ids
            pack_u64(args.kv_item_lens),
        ]

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        return list(self._registration)  # a copy: the caller may keep it

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        if rank.is_dummy:
            # Frames 4 and 5 both empty is how the prefill tells a dummy peer (SGW-4).
            return [
                request.ascii_room,
                *self._prefix,
                b"",
                b"",
                b"",
                request.ascii_required_dst_info_num,
                request.ascii_prefix_len,
                b"",
            ]
        return [
            request.ascii_room,
            *self._prefix,
            request.kv_bytes,
            request.ascii_aux_index,
            request.state_bytes,
            request.ascii_required_dst_info_num,
            request.ascii_prefix_len,
            request.device_kv_bytes,
        ]

    def abort_frames(
        self,
        rank: RankInfo,
        room: int,
        *,
        instance_id: str | None = None,
        abort_seq: int | None = None,
    ) -> list[bytes]:
        return abort_message(room, self._endpoint, abort_seq)

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        return bootstrap_message(room, self._endpoint)

    def decode_message(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        """Mooncake statuses are untagged ``[room, status, prefill rank]`` (SGW-8)."""
        return decode_prefill_message(frames, None)
