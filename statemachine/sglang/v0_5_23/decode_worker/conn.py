"""SGLang 0.5.23's decode-side KV manager and receiver classes, as its decode scheduler uses them.

SGLang's decode scheduler (``sglang/srt/disaggregation/decode.py`` in the 0.5.23 wheel) takes
its KV manager and receiver classes from ``get_kv_class`` (``decode.py:765-770``: one manager
per process; ``decode.py:905-911``: one receiver per request). The four classes here are the
ones it gets for ``mooncake`` and ``nixl`` once
:func:`statemachine.sglang.v0_5_23.decode_worker.install` puts them in place
(``docs/sglang-decode.md`` says what changes and what is refused). Each manager is built on one
:class:`DecodeManager` per process and each receiver on one of its receivers, so the
scheduler's requests get this library's recovery (a dead or replaced prefill fails the requests
that depend on it at once, typed) while the scheduler's own code stays SGLang's.

This module holds what differs per transfer backend: how the manager takes its transfer engine
(SGLang's shared Mooncake engine, or a NIXL agent made as SGLang's manager makes it) and
registers the KV buffers with it. What both backends share is in
:mod:`.kv_manager` (:class:`DecodeKVManagerBase`: SGLang's runtime context, the feature
refusals, the calls ``decode.py`` makes on a manager) and :mod:`.kv_receiver`
(:class:`DecodeKVReceiverBase`: SGLang's ``KVPoll`` values out, its ``KVTransferError`` raised).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from statemachine.backend import KVBackend
from statemachine.errors import ConfigurationError, SGLangFeatureRefused
from statemachine.sglang.v0_5_23.decode_worker.kv_manager import DecodeKVManagerBase
from statemachine.sglang.v0_5_23.decode_worker.kv_receiver import DecodeKVReceiverBase
from statemachine.sglang.v0_5_23.decode_worker.sglang_imports import sglang_env, sglang_module
from statemachine.sglang.v0_5_23.mooncake import MooncakeBackend
from statemachine.sglang.v0_5_23.nixl import NixlBackend

__all__ = [
    "MooncakeKVManager",
    "MooncakeKVReceiver",
    "NixlKVManager",
    "NixlKVReceiver",
    "SGLangFeatureRefused",
]


def _regions(args: Any) -> list[tuple[int, int]]:
    """The (pointer, length) buffers to register - KV, aux, then each state type's - zero
    lengths and exact repeats dropped, as SGLang's Mooncake manager lists them
    (``mooncake/conn.py:392-422``: a unified pool reports one buffer as both KV and state)."""
    regions: list[tuple[int, int]] = []
    for ptrs, lens in (
        (args.kv_data_ptrs, args.kv_data_lens),
        (args.aux_data_ptrs, args.aux_data_lens),
        *zip(
            getattr(args, "state_data_ptrs", None) or [],
            getattr(args, "state_data_lens", None) or [],
            strict=False,
        ),
    ):
        for ptr, length in zip(ptrs or [], lens or [], strict=False):
            if length and (ptr, length) not in regions:
                regions.append((ptr, length))
    return regions


class MooncakeKVManager(DecodeKVManagerBase):
    """SGLang 0.5.23's ``MooncakeKVManager`` on the decode side, on this library.

    The transfer engine is SGLang's shared one: its scheduler creates it before the manager
    (``init_mooncake_transfer_engine``); this manager takes it from
    ``get_mooncake_transfer_engine()`` as SGLang's does (``mooncake/conn.py:389-390``) and
    registers the KV and aux buffers with it.
    """

    backend_name = "mooncake"

    def _open_engine(self) -> None:
        engine = sglang_module(
            "sglang.srt.distributed.parallel_state"
        ).get_mooncake_transfer_engine()
        if engine is None:
            raise ConfigurationError(
                "no Mooncake transfer engine: SGLang's scheduler creates it before the KV "
                "manager; call sglang.srt.distributed.device_communicators."
                "mooncake_transfer_engine.init_mooncake_transfer_engine(hostname, gpu_id, "
                "ib_device) first"
            )
        self.engine = engine
        self._register_buffers()

    def _close_engine(self) -> None:
        if getattr(self, "engine", None) is not None:
            self._deregister_buffers()

    def get_session_id(self) -> str:
        """This decode's transfer-engine session, ``host:port`` (what every frame names)."""
        return str(self.engine.get_session_id())

    def _backend_factory(self) -> Callable[[str, int], KVBackend]:
        """Verified as :meth:`MooncakeBackend.from_engine` verifies: SGLang's engine (its
        ``mooncake.engine.TransferEngine``, the wrapper's ``engine``) reads every buffer back
        through its own session before a registration is built."""
        return MooncakeBackend.from_engine_session(
            self.engine.engine, self.get_session_id(), self.decode_kv_args
        )

    def _register_buffers(self) -> None:
        regions = _regions(self.kv_args)
        if regions:
            ptrs, lens = zip(*regions, strict=True)
            self.engine.batch_register(list(ptrs), list(lens))

    def _deregister_buffers(self) -> None:
        regions = _regions(self.kv_args)
        if regions:
            self.engine.batch_deregister([ptr for ptr, _ in regions])


class NixlKVManager(DecodeKVManagerBase):
    """SGLang 0.5.23's ``NixlKVManager`` on the decode side, on this library.

    Makes its NIXL agent as SGLang's does (``nixl/conn.py:524-636``): a uuid4 name, the backend
    of ``SGLANG_DISAGGREGATION_NIXL_BACKEND`` with ``…_NIXL_BACKEND_PARAMS``, the KV buffers
    registered by memory kind and the aux buffers as DRAM; the agent's metadata is taken after
    the registration (it is a snapshot).
    """

    backend_name = "nixl"

    def _open_engine(self) -> None:
        try:
            api = sglang_module("nixl._api")
        except ImportError as exc:
            raise ConfigurationError(
                "NIXL is not installed: install it as for SGLang's NIXL backend "
                "(https://github.com/ai-dynamo/nixl)"
            ) from exc
        if getattr(self.kv_args, "ib_device", None) and not os.environ.get("UCX_NET_DEVICES"):
            raise SGLangFeatureRefused(
                "--disaggregation-ib-device is not mapped to a UCX device list here: set "
                "UCX_NET_DEVICES instead (SGLang itself prefers it when set)"
            )
        params = json.loads(sglang_env("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"))
        config = api.nixl_agent_config(
            backends=[], num_threads=0, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = api.nixl_agent(str(uuid.uuid4()), config)
        self.agent.create_backend(sglang_env("SGLANG_DISAGGREGATION_NIXL_BACKEND"), params)
        self._registered: list[Any] = []
        self._register_buffers()

    def _close_engine(self) -> None:
        if getattr(self, "agent", None) is not None:
            self._deregister_buffers()

    def agent_metadata(self) -> bytes:
        """The agent's metadata now (it describes the memory registered with the agent)."""
        return bytes(self.agent.get_agent_metadata())

    def _backend_factory(self) -> Callable[[str, int], KVBackend]:
        return NixlBackend.from_agent(self.agent, self.decode_kv_args)

    def _buffers_changed(self) -> None:
        """Every registration from now on carries the agent's metadata as it is now, as
        SGLang's reads it at each registration (``nixl/conn.py:3473``). A prefill rank that
        already registered this agent keeps what it loaded: SGLang's prefill ignores a second
        registration from a known agent name (``nixl/conn.py:2031-2036``), for SGLang's own
        manager as for this one."""
        backend = self.decode_manager.backend
        assert isinstance(backend, NixlBackend)  # _backend_factory made it
        backend.refresh_agent_metadata(self.agent_metadata())

    def _register_buffers(self) -> None:
        args = self.kv_args
        by_kind: dict[str, list[tuple[int, int, int, str]]] = {"VRAM": [], "DRAM": []}
        kinds: Sequence[str] = self.decode_kv_args.kv_mem_kinds
        for ptr, length, kind in zip(args.kv_data_ptrs, args.kv_data_lens, kinds, strict=False):
            by_kind[kind].append((ptr, length, 0 if kind == "DRAM" else int(args.gpu_id or 0), ""))
        by_kind["DRAM"] += [
            (ptr, length, 0, "")
            for ptr, length in zip(args.aux_data_ptrs, args.aux_data_lens, strict=False)
        ]
        # State buffers as VRAM whatever they are, as SGLang's manager registers them and its
        # prefill reads them (nixl/conn.py:2011-2028): a CPU state buffer cannot serve NIXL.
        by_kind["STATE"] = [
            (ptr, length, int(args.gpu_id or 0), "")
            for ptrs, lens in zip(
                getattr(args, "state_data_ptrs", None) or [],
                getattr(args, "state_data_lens", None) or [],
                strict=False,
            )
            for ptr, length in zip(ptrs, lens, strict=False)
            if ptr and length
        ]
        for kind, addrs in by_kind.items():
            if addrs:
                descs = self.agent.register_memory(addrs, "VRAM" if kind == "STATE" else kind)
                if not descs:
                    raise ConfigurationError(f"NIXL refused to register the {kind} KV buffers")
                self._registered.append(descs)

    def _deregister_buffers(self) -> None:
        for descs in self._registered:
            self.agent.deregister_memory(descs)
        self._registered = []


class MooncakeKVReceiver(DecodeKVReceiverBase):
    """SGLang 0.5.23's ``MooncakeKVReceiver`` on the decode side, on this library."""


class NixlKVReceiver(DecodeKVReceiverBase):
    """SGLang 0.5.23's ``NixlKVReceiver`` on the decode side, on this library."""
