"""SGLang 0.5.23's Mooncake layouts as a :class:`~statemachine.backend.KVBackend`.

Frame by frame in ``spec/sglang-wire.md`` (SGW-3 registration, SGW-4 metadata, SGW-6
BOOTSTRAP, SGW-7 ABORT, SGW-8/SGW-9 what comes back). The builders follow
``MooncakeKVManager.build_receiver_registration_message`` / ``build_receiver_metadata_message``
(``mooncake/conn.py:3215-3308``); the prefill parses them with ``KVArgsRegisterInfo.from_zmq``
and ``TransferInfo.from_zmq`` (``mooncake/conn.py:119-229``) on a bootstrap thread that dies on
the first exception, so every input is checked here, at construction or per call, and refused
with :class:`~statemachine.validation.InvalidArgument`.

A registration naming memory the decode's engine does not serve (a buffer not registered with
it, or a session id that is not its own) survives the prefill's parser but fails every transfer
to this decode, reported as the prefill's failure. The public ways to make a backend
(:meth:`MooncakeBackend.from_engine`, :meth:`~MooncakeBackend.from_engine_session`,
:meth:`~MooncakeBackend.factory`) therefore read one byte at each end of every claimed buffer
through the claimed session first (SGW-12); the constructor takes a witness only they (and
:func:`unverified_mooncake_backend`, for tests whose engine is a stand-in) hold.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Sequence
from typing import Any, Final

from statemachine.completion import PrefillEvent
from statemachine.errors import ConfigurationError, InvalidArgument
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
#: Mooncake's register_memory result for memory an earlier registration already covers.
_ALREADY_REGISTERED = -7
METADATA_FRAMES = 10


class _Verified:
    """The type of :data:`_VERIFIED`: the constructor's witness that its inputs were read back
    through the engine (or that the caller said, by name, that its engine is a stand-in)."""

    __slots__ = ()


_VERIFIED: Final = _Verified()


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
        self,
        decode_ip: str,
        decode_port: int,
        session_id: str,
        kv_args: DecodeKVArgs,
        *,
        _witness: object = None,
    ) -> None:
        if _witness is not _VERIFIED:
            raise InvalidArgument(
                "MooncakeBackend(...) is not a public constructor: it cannot tell whether the "
                "session serves the buffers kv_args names. Use MooncakeBackend.from_engine(engine, "
                "host, kv_args), from_engine_session(engine, session_id, kv_args) or "
                "factory(session_id, kv_args), which read them back through the session first"
            )
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
        cls, session_id: str, kv_args: DecodeKVArgs, *, protocol: str = "tcp", device: str = ""
    ) -> Callable[[str, int], MooncakeBackend]:
        """A ``backend_factory`` for :class:`~statemachine.decode.manager.DecodeManager`, which
        calls it with its ack listener's ip and port (the decode's own PULL endpoint).

        Every buffer ``kv_args`` names is read back first through ``session_id`` as a prefill
        would reach it: a Mooncake engine of this call's own (on the session's host, with
        ``protocol`` and ``device``: the ones the decode's engine uses) reads one byte at each
        end of every KV and state buffer and the first byte of every aux buffer. A buffer the
        session's engine does not serve, or a session that is not the decode's engine, is
        refused here; a prefill would otherwise fail every transfer to this decode. Costs one
        engine's start and stop, once per decode process (``docs/sglang-interop.md``); needs
        Mooncake installed. :meth:`from_engine` reads through the decode's engine itself."""
        session = check_session_id(session_id)
        _check_kv_args(kv_args)
        host = session.rpartition(b":")[0].decode("ascii")
        reader = _reading_engine(host, protocol, device)
        try:
            _verify_session(reader, session_id, kv_args)
        finally:
            del reader  # the engine's own threads stop here, not at the next collection
        return cls._builder(session_id, kv_args)

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
        for later rooms, so all of it is read back through the session (the engine reading
        from itself, as :meth:`factory` does with an engine of its own) before anything is
        sent."""
        _check_kv_args(kv_args)
        port = engine.get_rpc_port()
        if type(port) is not int or not 0 < port <= 65535:
            raise InvalidArgument(
                f"the Mooncake engine reports rpc port {port!r}: call engine.initialize(host, "
                "'P2PHANDSHAKE', protocol, device) first (it returns 0 once the engine runs)"
            )
        session_id = f"{host}:{port}"
        check_session_id(session_id)
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
        return cls.from_engine_session(engine, session_id, kv_args)

    @classmethod
    def from_engine_session(
        cls, engine: Any, session_id: str, kv_args: DecodeKVArgs
    ) -> Callable[[str, int], MooncakeBackend]:
        """A ``backend_factory`` from the decode's Mooncake engine (a
        ``mooncake.engine.TransferEngine``) and the session id a prefill reaches it by, for a
        caller that registered every buffer itself and holds the id already (SGLang's
        ``MooncakeTransferEngine.get_session_id()``; the drop-in manager's path). Registers
        nothing: the engine reads every buffer back through ``session_id``, as
        :meth:`from_engine` does, before anything is sent."""
        check_session_id(session_id)
        _check_kv_args(kv_args)
        _verify_session(engine, session_id, kv_args)
        return cls._builder(session_id, kv_args)

    @classmethod
    def _builder(
        cls, session_id: str, kv_args: DecodeKVArgs
    ) -> Callable[[str, int], MooncakeBackend]:
        """The factory proper, once the caller's inputs were verified."""

        def build(ip: str, port: int) -> MooncakeBackend:
            return cls(ip, port, session_id, kv_args, _witness=_VERIFIED)

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


def _check_kv_args(kv_args: object) -> None:
    if not isinstance(kv_args, DecodeKVArgs):
        raise InvalidArgument(f"kv_args must be a DecodeKVArgs, got {type(kv_args).__name__}")


def _probes(kv_args: DecodeKVArgs) -> list[tuple[str, int, int]]:
    """(what, pointer, offset) of the bytes to read back: both ends of every KV and state
    buffer whose length is known, the first byte of the others (aux buffers carry no length
    in kv_args).
    Mooncake serves a read only inside one registered buffer, so a buffer registered shorter
    than claimed fails its last byte."""
    buffers = [
        (f"kv_data_ptrs[{i}]", ptr, length)
        for i, (ptr, length) in enumerate(
            zip(
                kv_args.kv_data_ptrs,
                [*kv_args.kv_data_lens, *[1] * len(kv_args.kv_data_ptrs)],
                strict=False,
            )
        )
    ]
    buffers += [(f"aux_data_ptrs[{i}]", ptr, 1) for i, ptr in enumerate(kv_args.aux_data_ptrs)]
    for t, (ptrs, lens) in enumerate(
        zip(kv_args.state_data_ptrs, kv_args.state_data_lens, strict=False)
    ):
        buffers += [
            (f"state_data_ptrs[{t}][{i}]", ptr, length)
            for i, (ptr, length) in enumerate(zip(ptrs, lens, strict=False))
        ]
    return [
        (what, ptr, offset)
        for what, ptr, length in buffers
        for offset in ((0, length - 1) if length > 1 else (0,))
    ]


def _reading_engine(host: str, protocol: str, device: str) -> Any:
    """A Mooncake engine of :meth:`MooncakeBackend.factory`'s own, to read the session with."""
    try:
        transfer_engine = importlib.import_module("mooncake.engine").TransferEngine
    except ImportError as exc:
        raise ConfigurationError(
            "MooncakeBackend.factory reads the buffers back through the session with a Mooncake "
            "engine of its own, and Mooncake is not installed: install it (as for SGLang's "
            "Mooncake backend), or use MooncakeBackend.from_engine(engine, host, kv_args)"
        ) from exc
    engine = transfer_engine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise InvalidArgument(
            f"a Mooncake engine on {host!r} with protocol {protocol!r} and device {device!r} "
            f"could not start (initialize returned {rc}) to read the session back: the session "
            "id's host must be an address of this machine (the decode's engine runs here), and "
            "factory(..., protocol=..., device=...) the ones the decode's engine uses"
        )
    return engine


def _verify_session(engine: Any, session_id: str, kv_args: DecodeKVArgs) -> None:
    """Read every probe of ``kv_args`` through ``session_id`` with ``engine`` into a scratch
    byte of its own; refuse what fails. A read is served only by the session's engine, from
    memory registered with it; nothing is written anywhere but the scratch byte."""
    scratch = ctypes.create_string_buffer(1)
    local = ctypes.addressof(scratch)
    rc = engine.register_memory(local, 1)
    if rc != 0:
        raise ConfigurationError(
            f"the Mooncake engine refused a one-byte scratch buffer (register_memory returned "
            f"{rc}): it cannot read the session back"
        )
    try:
        probes = _probes(kv_args)
        failed = [
            (what, ptr, offset)
            for what, ptr, offset in probes
            if engine.transfer_sync_read(session_id, local, ptr + offset, 1) != 0
        ]
    finally:
        engine.unregister_memory(local)
    if not failed:
        return
    if len(failed) == len(probes):
        raise InvalidArgument(
            f"no buffer kv_args names could be read through Mooncake session {session_id!r}: "
            "pass the decode's own engine's session, f\"{host}:{engine.get_rpc_port()}\" with "
            "the host it was initialized with, after registering every buffer with it"
        )
    what, ptr, offset = failed[0]
    others = sorted({w for w, _, _ in failed} - {what})
    also = f" (also: {', '.join(others)})" if others else ""
    where = "its last byte" if offset else "its first byte"
    raise InvalidArgument(
        f"{what} ({ptr:#x}) is not registered with the Mooncake engine of session "
        f"{session_id!r} ({where} could not be read back){also}: a prefill's writes there "
        "would fail. Register every buffer first with engine.register_memory(ptr, nbytes), "
        "at its full length (unregister a shorter registration first: Mooncake keeps it)"
    )


def unverified_mooncake_backend(
    decode_ip: str, decode_port: int, session_id: str, kv_args: DecodeKVArgs
) -> MooncakeBackend:
    """A :class:`MooncakeBackend` whose session nobody read back (the form of its inputs is
    checked): for tests and benchmarks with no Mooncake engine behind the session (a wire
    test comparing frames, a benchmark of the bootstrap path against sinks), never for a
    decode that talks to a prefill. Not exported from :mod:`statemachine.sglang.v0_5_23`."""
    return MooncakeBackend(decode_ip, decode_port, session_id, kv_args, _witness=_VERIFIED)


def unverified_mooncake_factory(
    session_id: str, kv_args: DecodeKVArgs
) -> Callable[[str, int], MooncakeBackend]:
    """A ``backend_factory`` of :func:`unverified_mooncake_backend`: the same use, the same
    warning."""
    check_session_id(session_id)
    _check_kv_args(kv_args)
    return MooncakeBackend._builder(session_id, kv_args)
