"""SGLang 0.5.23's NIXL layouts as a :class:`~statemachine.backend.KVBackend`.

Frame by frame in ``spec/sglang-wire.md`` (SGW-3 registration, SGW-4 metadata, SGW-6
BOOTSTRAP, SGW-7 ABORT, SGW-8/SGW-9 what comes back). The builders follow
``NixlKVManager.build_receiver_registration_message`` / ``build_receiver_metadata_message``
(``nixl/conn.py:3428-3526``). Every registration and metadata message starts with the GUARD
frame: NIXL's prefill bootstrap thread asserts it (``nixl/conn.py:3379-3382``), strips it, and
parses the rest with ``KVArgsRegisterInfo.from_zmq`` / ``TransferInfo.from_zmq``
(``nixl/conn.py:302-456``); an exception there ends the thread, so inputs are checked here.
An agent name or metadata that does not describe the buffers ``kv_args`` names ends it too
(``NIXL_ERR_NOT_FOUND``), so the public ways to make a backend (:meth:`NixlBackend.from_agent`,
:meth:`NixlBackend.factory`) read them back first (SGW-12); the constructor takes a witness
only they (and :func:`unverified_nixl_backend`, for tests whose agent is a stand-in) hold.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from statemachine.completion import PrefillEvent
from statemachine.errors import ConfigurationError, InvalidArgument, TopologyMismatch
from statemachine.pool import RankInfo
from statemachine.sglang.v0_5_23.control import (
    abort_message,
    ascii_int,
    ascii_text,
    decode_endpoint,
    decode_prefill_message,
)
from statemachine.sglang.v0_5_23.kv_args import DecodeKVArgs, pack_lists, pack_u32, pack_u64
from statemachine.validation import Topology
from statemachine.wire.metadata import MetadataRequest


class DecodeShape(Protocol):
    """What :meth:`NixlBackend.check_topology` reads of the decode's ``DecodeLayout``."""

    @property
    def tp_size(self) -> int: ...
    @property
    def is_mla(self) -> bool: ...
    @property
    def is_hybrid_mla(self) -> bool: ...


#: The first frame of every NIXL registration and metadata message (``nixl/conn.py:78``).
GUARD = b"NixlMsgGuard"
#: The tag of a NIXL status message (``nixl/conn.py:515``).
KV_STATUS_TAG = b"KV_STATUS"
REGISTRATION_ROOM = b"None"
REGISTRATION_FRAMES = 25
METADATA_FRAMES = 11
_DUMMY = {False: b"0", True: b"1"}


class _Verified:
    """The type of :data:`_VERIFIED`: the constructor's witness that its agent name and
    metadata were read back (or that the caller said, by name, that its agent is a stand-in)."""

    __slots__ = ()


_VERIFIED: Final = _Verified()


class NixlBackend:
    """The decode side of SGLang 0.5.23's NIXL transfer backend.

    ``decode_ip``/``decode_port``: the decode's own PULL endpoint (statuses and ABORT_ACKs come
    back there). ``agent_name`` and ``agent_metadata``: this decode's NIXL agent (``agent.name``
    and ``agent.get_agent_metadata()``); the name identifies the decode peer to the prefill, the
    metadata is opaque bytes handed to the prefill's agent. ``kv_args``: the KV buffers. The
    registration does not depend on the rank, so it is built once, here.

    The target instance id (ZMQ-21) is accepted and never put on the wire (SGW-5).
    """

    __slots__ = ("_endpoint", "_prefix", "_registration", "agent_name", "kv_args")

    def __init__(
        self,
        decode_ip: str,
        decode_port: int,
        agent_name: str,
        agent_metadata: bytes,
        kv_args: DecodeKVArgs,
        *,
        _witness: object = None,
    ) -> None:
        if _witness is not _VERIFIED:
            raise InvalidArgument(
                "NixlBackend(...) is not a public constructor: it cannot tell whether the agent's "
                "metadata describes the buffers kv_args names, and a prefill's bootstrap thread "
                "ends on one that does not. Use NixlBackend.from_agent(agent, kv_args) or "
                "NixlBackend.factory(agent_name, agent_metadata, kv_args), which read them back"
            )
        if not isinstance(kv_args, DecodeKVArgs):
            raise InvalidArgument(f"kv_args must be a DecodeKVArgs, got {type(kv_args).__name__}")
        if not isinstance(agent_metadata, bytes):
            raise InvalidArgument(
                f"agent_metadata must be the bytes of agent.get_agent_metadata(), got "
                f"{type(agent_metadata).__name__}"
            )
        kv_args.check_for_nixl()
        self._endpoint = decode_endpoint(decode_ip, decode_port)
        name = ascii_text("NIXL agent_name", agent_name)
        self.agent_name = agent_name
        self.kv_args = kv_args
        #: ip, port, agent name: frames 2-4 of every registration and metadata message
        self._prefix = (*self._endpoint, name)
        self._registration = self._build_registration(agent_metadata)

    @classmethod
    def factory(
        cls, agent_name: str, agent_metadata: bytes, kv_args: DecodeKVArgs, *, backend: str = "UCX"
    ) -> Callable[[str, int], NixlBackend]:
        """A ``backend_factory`` for :class:`~statemachine.decode.manager.DecodeManager`, which
        calls it with its ack listener's ip and port (the decode's own PULL endpoint).

        The metadata is read back first as a prefill reads it: a NIXL agent of this call's own
        (on ``backend``, the one the decode's agent uses: SGLang's
        ``SGLANG_DISAGGREGATION_NIXL_BACKEND``, UCX by default) loads it as a remote agent,
        its name must be ``agent_name``, and every buffer ``kv_args`` names must be prepared
        under the kind it claims (KV as ``kv_mem_kinds``, aux as DRAM, state as VRAM). A
        prefill rank would otherwise fail on its bootstrap thread (``NIXL_ERR_NOT_FOUND``),
        which ends that thread for every decode (``nixl/conn.py:2046``). Needs NIXL installed;
        :meth:`from_agent` checks the agent itself instead, without a second agent."""
        if not isinstance(kv_args, DecodeKVArgs):
            raise InvalidArgument(f"kv_args must be a DecodeKVArgs, got {type(kv_args).__name__}")
        if not isinstance(agent_metadata, bytes):
            raise InvalidArgument(
                f"agent_metadata must be the bytes of agent.get_agent_metadata(), got "
                f"{type(agent_metadata).__name__}"
            )
        kv_args.check_for_nixl()
        _check_metadata(agent_name, agent_metadata, kv_args, backend)
        return cls._builder(agent_name, agent_metadata, kv_args)

    @classmethod
    def from_agent(cls, agent: Any, kv_args: DecodeKVArgs) -> Callable[[str, int], NixlBackend]:
        """A ``backend_factory`` from the decode's NIXL agent itself (preferred over
        :meth:`factory`): the name and metadata are the agent's own, the metadata taken now,
        after the buffers were registered, and every buffer ``kv_args`` names is checked first
        to be registered with this agent under the kind it claims. A prefill rank would
        otherwise fail to prepare its transfers to this decode (``NIXL_ERR_NOT_FOUND``) on its
        bootstrap thread, which ends that thread for every decode (``nixl/conn.py:2046``)."""
        if not isinstance(kv_args, DecodeKVArgs):
            raise InvalidArgument(f"kv_args must be a DecodeKVArgs, got {type(kv_args).__name__}")
        kv_args.check_for_nixl()
        for what, ptr, length, kind in _regions(kv_args):
            device = kv_args.gpu_id if kind == "VRAM" else 0
            try:
                handle = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", [(ptr, max(length, 1), device)], kind
                )
            except Exception as exc:  # nixlNotFoundError and kin: not registered as claimed
                raise InvalidArgument(
                    f"{what} ({ptr:#x}, {length} bytes, {kind}) is not registered with NIXL agent "
                    f"{agent.name!r} as {kind} ({exc}): register it first with "
                    f"agent.register_memory([(ptr, nbytes, device, '')], {kind!r}), and give "
                    "DecodeKVArgs(kv_mem_kinds=...) the kind you registered (empty means VRAM)"
                ) from exc
            agent.release_dlist_handle(handle)
        return cls._builder(str(agent.name), bytes(agent.get_agent_metadata()), kv_args)

    @classmethod
    def _builder(
        cls, agent_name: str, agent_metadata: bytes, kv_args: DecodeKVArgs
    ) -> Callable[[str, int], NixlBackend]:
        """The factory proper, once the caller's inputs were checked."""

        def build(ip: str, port: int) -> NixlBackend:
            return cls(ip, port, agent_name, agent_metadata, kv_args, _witness=_VERIFIED)

        return build

    def refresh_agent_metadata(self, agent_metadata: bytes) -> None:
        """Carry ``agent_metadata`` in every registration from now on: the agent's metadata
        describes the memory registered with it, so it changes when the buffers are
        deregistered and registered again (a memory release and resume). SGLang reads it at
        each registration (``nixl/conn.py:3473``); the registration is rebuilt here instead,
        once per change (one attribute store: a registration being built keeps the old
        frames or takes the new ones, never a mix)."""
        if not isinstance(agent_metadata, bytes):
            raise InvalidArgument(
                f"agent_metadata must be the bytes of agent.get_agent_metadata(), got "
                f"{type(agent_metadata).__name__}"
            )
        self._registration = self._build_registration(agent_metadata)

    def check_topology(self, addr: str, topology: Topology, layout: DecodeShape) -> None:
        """Refuse a prefill whose attention tp size differs from this decode's when the KV
        buffers are not all VRAM: SGLang 0.5.23's NIXL prefill moves KV between different tp
        sizes into GPU memory only, and raises NotImplementedError ("heterogeneous-TP
        direct-to-host KV transfer is not implemented") on its bootstrap thread when it reads
        this decode's registration (``nixl/conn.py:1519-1594``), which ends that thread for
        every decode. MLA pools are sent whole, so any tp sizes work."""
        if layout.is_mla or layout.is_hybrid_mla or topology.attn_tp_size == layout.tp_size:
            return
        kinds = self.kv_args.kv_mem_kinds or ("VRAM",)
        if any(kind != "VRAM" for kind in kinds):
            raise TopologyMismatch(
                f"{addr}: the prefill has attention tp {topology.attn_tp_size} and this decode "
                f"{layout.tp_size}, with KV buffers of kinds {sorted(set(kinds))}: SGLang "
                "0.5.23's NIXL prefill transfers between different tp sizes only "
                "into VRAM, and a registration like this one would end its bootstrap thread for "
                "every decode. Run this decode with the prefill's attention tp size, or with "
                "its KV cache in GPU memory registered as VRAM (DecodeKVArgs(kv_mem_kinds=...))"
            )

    def _build_registration(self, agent_metadata: bytes) -> list[bytes]:
        args = self.kv_args
        return [
            GUARD,
            REGISTRATION_ROOM,
            *self._prefix,
            agent_metadata,
            pack_u64(args.kv_data_ptrs),
            pack_u64(args.aux_data_ptrs),
            pack_lists(args.state_data_ptrs, "Q"),
            ascii_int(args.gpu_id),
            ascii_int(args.attn_tp_size),
            ascii_int(args.engine_rank),
            ascii_int(args.kv_item_len),
            pack_lists(args.state_item_lens, "I"),
            pack_lists(args.state_dim_per_tensor, "I"),
            b"",  # staging base pointer: no staging buffer (SGW-3)
            b"",  # staging total size
            ascii_int(args.nixl_slot_count()),
            ",".join(args.kv_mem_kinds).encode("ascii"),
            pack_u64(args.kv_item_lens),
            pack_lists(args.state_layer_ids, "I"),
            pack_u32(args.kv_layer_ids),
            ascii_int(args.dcp_size),
            ascii_int(args.dcp_rank),
            pack_lists(args.state_data_lens, "Q"),
        ]

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        return list(self._registration)  # a copy: the caller may keep it

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        dummy = rank.is_dummy
        return [
            GUARD,
            request.ascii_room,
            *self._prefix,
            b"" if dummy else request.kv_bytes,
            request.ascii_aux_index,  # sent for a dummy too, unlike Mooncake (SGW-4)
            request.ascii_required_dst_info_num,
            b"" if dummy else request.state_bytes,
            request.ascii_prefix_len,
            _DUMMY[dummy],
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
        """Refused (SGW-6): 0.5.23 runs the ``prefill_complete`` policy with Mooncake only
        (``arg_groups/pd_disaggregation_hook.py:199-243``), and NIXL's prefill bootstrap thread
        reads its socket without the BOOTSTRAP handler, so a BOOTSTRAP fails its GUARD assert and
        ends the thread (``nixl/conn.py:3355-3382``)."""
        raise ConfigurationError(
            "SGLang 0.5.23 supports the prefill_complete decode allocation policy with the "
            "Mooncake transfer backend only; a BOOTSTRAP would end a NIXL prefill's bootstrap "
            "thread. Run NIXL prefills and this decode with the 'early' policy"
        )

    def decode_message(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        """NIXL statuses are ``[KV_STATUS, room, status, prefill rank, reason]`` (SGW-8)."""
        return decode_prefill_message(frames, KV_STATUS_TAG)


def unverified_nixl_backend(
    decode_ip: str, decode_port: int, agent_name: str, agent_metadata: bytes, kv_args: DecodeKVArgs
) -> NixlBackend:
    """A :class:`NixlBackend` whose metadata nobody read back (the form of its inputs is
    checked): for tests with no NIXL agent behind the name (a wire test comparing frames),
    never for a decode that talks to a prefill (metadata that does not describe the buffers
    ends a NIXL prefill's bootstrap thread). Not exported from the package."""
    return NixlBackend(
        decode_ip, decode_port, agent_name, agent_metadata, kv_args, _witness=_VERIFIED
    )


def _regions(kv_args: DecodeKVArgs) -> list[tuple[str, int, int, str]]:
    """(what, pointer, length, kind) of every buffer ``kv_args`` names, as a NIXL prefill
    prepares them: KV as claimed (empty kinds mean VRAM), aux as DRAM, state as VRAM
    (``nixl/conn.py:1972-2030``)."""
    kinds = kv_args.kv_mem_kinds or ("VRAM",) * len(kv_args.kv_data_ptrs)
    regions = [
        (f"kv_data_ptrs[{i}]", ptr, length, kind)
        for i, (ptr, length, kind) in enumerate(
            zip(
                kv_args.kv_data_ptrs, kv_args.kv_data_lens or (1,) * len(kinds), kinds, strict=False
            )
        )
    ]
    regions += [
        (f"aux_data_ptrs[{i}]", ptr, 1, "DRAM") for i, ptr in enumerate(kv_args.aux_data_ptrs)
    ]
    for t, (ptrs, lens) in enumerate(
        zip(kv_args.state_data_ptrs, kv_args.state_data_lens, strict=False)
    ):
        regions += [
            (f"state_data_ptrs[{t}][{i}]", p, n, "VRAM")
            for i, (p, n) in enumerate(zip(ptrs, lens, strict=False))
        ]
    return regions


def _check_metadata(
    agent_name: str, agent_metadata: bytes, kv_args: DecodeKVArgs, backend: str
) -> None:
    """Read ``agent_metadata`` back as a prefill does (a NIXL agent of our own loads it as a
    remote agent and prepares every buffer under its kind); refuse what a prefill would choke
    on. Nothing is sent to the decode's agent: loading metadata and preparing descriptors are
    local to the checking agent."""
    try:
        api = importlib.import_module("nixl._api")
    except ImportError as exc:
        raise ConfigurationError(
            "NixlBackend.factory reads the agent's registrations back from its metadata with a "
            "NIXL agent of its own, and NIXL is not installed: install it (as for SGLang's NIXL "
            "backend), or use NixlBackend.from_agent(agent, kv_args)"
        ) from exc
    checker = api.nixl_agent(
        f"statemachine-metadata-check-{uuid.uuid4()}", api.nixl_agent_config(backends=[backend])
    )
    try:
        remote = checker.add_remote_agent(agent_metadata)
    except Exception as exc:  # not a NIXL agent's metadata, or of a backend we lack
        raise InvalidArgument(
            f"agent_metadata ({len(agent_metadata)} bytes) cannot be loaded as a NIXL agent's "
            f"metadata on backend {backend!r} ({exc}): pass agent.get_agent_metadata() of the "
            "decode's agent, and factory(..., backend=...) the backend that agent uses"
        ) from exc
    try:
        name = remote.decode() if isinstance(remote, bytes) else str(remote)
        if name != agent_name:
            raise InvalidArgument(
                f"agent_name {agent_name!r} is not the name in agent_metadata ({name!r}): a "
                "prefill would answer a peer it does not know; pass agent.name of the agent "
                "whose get_agent_metadata() you pass"
            )
        for what, ptr, length, kind in _regions(kv_args):
            device = kv_args.gpu_id if kind == "VRAM" else 0
            try:
                handle = checker.prep_xfer_dlist(remote, [(ptr, max(length, 1), device)], kind)
            except Exception as exc:  # nixlNotFoundError: not in the metadata as claimed
                raise InvalidArgument(
                    f"{what} ({ptr:#x}, {length} bytes, {kind}) is not registered as {kind} in "
                    f"agent_metadata of NIXL agent {agent_name!r} ({exc}): register it first "
                    f"with agent.register_memory([(ptr, nbytes, device, '')], {kind!r}), take "
                    "agent.get_agent_metadata() after registering (it is a snapshot), and give "
                    "DecodeKVArgs(kv_mem_kinds=...) the kind you registered (empty means VRAM)"
                ) from exc
            checker.release_dlist_handle(handle)
    finally:
        checker.remove_remote_agent(remote)
