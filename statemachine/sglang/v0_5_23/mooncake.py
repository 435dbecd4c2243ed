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
from typing import Any

from statemachine.completion import PrefillEvent
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
from statemachine.validation import InvalidArgument
from statemachine.wire.metadata import MetadataRequest

#: Frame 0 of a registration: the text ``None`` where metadata has its room.
REGISTRATION_ROOM = b"None"
REGISTRATION_FRAMES = 20
#: Mooncake's register_memory result for memory an earlier registration already covers.
_ALREADY_REGISTERED = -7
METADATA_FRAMES = 10


def check_session_id(session_id: object) -> bytes:
    """Mooncake's transfer-engine session id, ``host:port`` (SGW-1): the prefill applies
    ``int()`` to the text after the last ``:`` of every session of a room
    (``mooncake/conn.py:3116-3118``), on its scheduler thread."""
    encoded = ascii_text("Mooncake session_id", session_id)
    host, sep, port = encoded.rpartition(b":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise InvalidArgument(
            f"Mooncake session_id must be 'host:port': the host your transfer engine was "
            f"initialized with and its engine.get_rpc_port() (mooncake.engine.TransferEngine has "
            f'no get_session_id()), e.g. f"{{host}}:{{engine.get_rpc_port()}}"; got {session_id!r}'
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

    @classmethod
    def from_engine(
        cls, engine: Any, host: str, kv_args: DecodeKVArgs
    ) -> Callable[[str, int], MooncakeBackend]:
        """A ``backend_factory`` from the decode's Mooncake engine itself (preferred over
        :meth:`factory`): the session id is ``f"{host}:{engine.get_rpc_port()}"`` (``host``: the
        one the engine was initialized with), and every KV and state buffer ``kv_args`` names is
        registered with this engine here unless it already is. Aux buffers carry no length in
        ``kv_args``, so they must be registered already. A write into memory the engine does not
        know fails on the prefill, which then reports the room Failed and refuses this session
        for later rooms, so all of it is checked before anything is sent."""
        if not isinstance(kv_args, DecodeKVArgs):
            raise InvalidArgument(f"kv_args must be a DecodeKVArgs, got {type(kv_args).__name__}")
        port = engine.get_rpc_port()
        if type(port) is not int or not 0 < port <= 65535:
            raise InvalidArgument(
                f"the Mooncake engine reports rpc port {port!r}: call engine.initialize(host, "
                "'P2PHANDSHAKE', protocol, device) first (it returns 0 once the engine runs)"
            )
        regions = [
            (f"kv_data_ptrs[{i}]", ptr, length)
            for i, (ptr, length) in enumerate(
                zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens, strict=False)
            )
        ]
        if len(kv_args.kv_data_lens) < len(kv_args.kv_data_ptrs):
            raise InvalidArgument(
                "from_engine registers the KV buffers itself: give kv_data_lens, one per pointer"
            )
        for t, (ptrs, lens) in enumerate(
            zip(kv_args.state_data_ptrs, kv_args.state_data_lens, strict=False)
        ):
            regions += [
                (f"state_data_ptrs[{t}][{i}]", ptr, length)
                for i, (ptr, length) in enumerate(zip(ptrs, lens, strict=False))
            ]
        for what, ptr, length in regions:
            rc = engine.register_memory(ptr, length)
            if rc not in (0, _ALREADY_REGISTERED):
                raise InvalidArgument(
                    f"{what} ({ptr:#x}, {length} bytes): the Mooncake engine refused to register "
                    f"it (register_memory returned {rc}): pass memory this process owns"
                )
        for i, ptr in enumerate(kv_args.aux_data_ptrs):
            # A one-byte probe: taken when nothing covers the pointer (then undone and refused).
            if engine.register_memory(ptr, 1) == 0:
                engine.unregister_memory(ptr)
                raise InvalidArgument(
                    f"aux_data_ptrs[{i}] ({ptr:#x}) is not registered with this Mooncake engine: "
                    "register each aux buffer first with engine.register_memory(ptr, nbytes)"
                )
        return cls.factory(f"{host}:{port}", kv_args)

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
        generation: int | None = None,
    ) -> list[bytes]:
        return abort_message(room, self._endpoint, generation)

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        return bootstrap_message(room, self._endpoint)

    def decode_message(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        """Mooncake statuses are untagged ``[room, status, prefill rank]`` (SGW-8)."""
        return decode_prefill_message(frames, None)
