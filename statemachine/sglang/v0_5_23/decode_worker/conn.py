"""SGLang 0.5.23's decode-side KV manager and receiver, as classes its decode scheduler can use.

SGLang's decode scheduler (``sglang/srt/disaggregation/decode.py`` in the 0.5.23 wheel) takes
its KV manager and receiver classes from ``get_kv_class`` (``decode.py:765-770``: one manager
per process; ``decode.py:905-911``: one receiver per request). The classes here have those
constructors and the members ``decode.py`` uses, and are built on one :class:`DecodeManager`
per process and its receivers, so the scheduler's requests get this library's recovery (a dead
or replaced prefill fails the requests that depend on it at once, typed) while the scheduler's
own code stays SGLang's. :func:`statemachine.sglang.v0_5_23.decode_worker.install` puts them in
place; ``docs/sglang-decode.md`` says what changes and what is refused.

SGLang itself is imported only when a manager is built (``sglang`` is not a dependency of this
package): SGLang's ``KVArgs`` come in, its transfer engine (Mooncake) or a NIXL agent made as
SGLang's manager makes it holds the KV buffers, its ``KVPoll`` values go out, and
``failure_exception()`` raises its ``KVTransferError``.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from statemachine.backend import KVBackend
from statemachine.completion import KVPoll
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import DecodeLayout, RankPlan
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.errors import (
    BootstrapError,
    ConfigurationError,
    FailedOnAnotherRank,
    PeerLost,
    SGLangFeatureRefused,
    TopologyMismatch,
)
from statemachine.sglang.v0_5_23.kv_args import DecodeKVArgs
from statemachine.sglang.v0_5_23.mooncake import MooncakeBackend
from statemachine.sglang.v0_5_23.nixl import NixlBackend
from statemachine.validation import Topology

__all__ = [
    "MooncakeKVManager",
    "MooncakeKVReceiver",
    "NixlKVManager",
    "NixlKVReceiver",
    "PrefillInfo",
    "SGLangFeatureRefused",
]


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _env(name: str) -> Any:
    """SGLang's environment setting ``name``, read through SGLang's own ``envs``."""
    return getattr(_module("sglang.srt.environ").envs, name).get()


#: SGLang's KVPoll values for this library's receivers' polls. Transferring is
#: reported as WaitingForInput: 0.5.23's receiver never says Transferring (decode.py's
#: handshake check, decode.py:1153-1177, only knows Bootstrapping/WaitingForInput/Failed).
_POLL_OUT = {
    KVPoll.Failed: 0,
    KVPoll.Bootstrapping: 1,
    KVPoll.WaitingForInput: 2,
    KVPoll.Transferring: 2,
    KVPoll.Success: 4,
}


@dataclass(frozen=True)
class PrefillInfo:
    """One prefill's topology and this rank's plan against it (None: the prefill cannot serve
    this decode, and each request fails ``TopologyMismatch``), answering what ``decode.py``
    reads of SGLang's ``PrefillServerInfo`` to resolve a request's prefill dp rank
    (``decode.py:879-897``)."""

    topology: Topology
    plan: RankPlan | None

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def follow_bootstrap_room(self) -> bool:
        # SGLang's server reports true when the prefill never set it (common/conn.py:3213).
        return self.topology.follow_bootstrap_room is not False

    @property
    def prefill_http_port(self) -> int | None:
        return self.topology.prefill_http_port

    @property
    def required_prefill_response_num(self) -> int:
        return 0 if self.plan is None else self.plan.required_prefill_response_num


class _DecodeKVManager:
    """The per-process decode KV manager, as SGLang 0.5.23's decode scheduler uses one.

    Built as ``cls(kv_args, DisaggregationMode.DECODE, server_args, is_mla_backend)``
    (``decode.py:765-770``). It reads SGLang's runtime context the way SGLang's own manager
    does (``common/conn.py:345-368``, ``478-492``), builds this library's
    :class:`DecodeManager` from it (``self.decode_manager``), and registers the KV buffers with
    the transfer engine. Closed by :meth:`close` (SGLang's never is: it lives as long as the
    scheduler).
    """

    #: SGLang's transfer backend these classes stand in for (``TransferBackend`` value).
    backend_name = ""
    # What SGLang's decode scheduler reads off a manager class, answered as SGLang's own
    # Mooncake/NIXL managers answer with the features off (base/conn.py:131-170).
    supports_host_destination = False
    supports_deferred_decode_kv_release = True
    supports_role_switch = False
    defer_decode_allocation = False
    enable_staging = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        if getattr(disaggregation_mode, "value", disaggregation_mode) != "decode":
            raise SGLangFeatureRefused(
                f"{type(self).__name__} is the decode side only, not {disaggregation_mode!r}: "
                "the prefill keeps SGLang's own classes (install() patches decode.py only)"
            )
        runtime = _module("sglang.srt.runtime_context")
        parallel = runtime.get_parallel()
        disagg = runtime.get_disagg()
        _refuse_features(args, parallel, disagg)
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.disaggregation_mode = disaggregation_mode
        self.attn_tp_size = int(parallel.attn_tp_size)
        self.attn_tp_rank = int(parallel.attn_tp_rank)
        self.pp_size = int(parallel.pp_size)
        self.pp_rank = int(args.pp_rank)
        self.waiting_timeout = int(_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT"))
        #: whether the scheduler holds a failed room's KV until the prefill acknowledges the
        #: ABORT (decode.py:2895-2906), as SGLang's managers decide it (common/conn.py:338)
        self.enable_deferred_decode_kv_release = bool(
            _env("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE")
        )
        #: what decode.py's dp-rank resolution reads: ``.get(addr)`` (decode.py:880, 1244)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self.local_ip = str(_module("sglang.srt.utils.network").get_local_ip_auto())
        self.decode_kv_args = _decode_kv_args(args, parallel, self.attn_tp_size)
        layout = DecodeLayout(
            tp_rank=int(args.engine_rank),
            tp_size=self.attn_tp_size,
            page_size=int(args.page_size),
            kv_cache_dtype=str(args.kv_cache_dtype_str),
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            is_mla=self.is_mla_backend,
            is_hybrid_mla=bool(getattr(args, "is_hybrid_mla_backend", False)),
            all_cp_ranks=bool(_env("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")),
            kv_layout=getattr(args, "kv_layout", None),
            decode_allocation_policy=str(disagg.disaggregation_decode_allocation_policy),
        )
        self._open_engine()
        try:
            self.decode_manager = DecodeManager(
                layout=layout,
                backend_factory=self._backend_factory(),
                ack_ip=self.local_ip,
                # SGLang judges a prefill dead after MAX_FAILURE heartbeats INTERVAL apart: the
                # same bound on silence, from which every other timeout follows (ZMQ-25).
                liveness_timeout_s=max(float(_env("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL")), 2.0)
                * max(int(_env("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE")), 1),
                waiting_timeout_s=float(self.waiting_timeout),
                send_timeout_ms=int(_env("SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT")) * 1000,
                kv_release_timeout_s=float(
                    _env("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT")
                ),
            )
        except BaseException:
            self._close_engine()
            raise

    @property
    def rank_port(self) -> int:
        """This decode's own PULL port, where prefill ranks send statuses and ABORT_ACKs
        (SGLang's manager's ``rank_port``): the library's ack listener."""
        acks = self.decode_manager.acks
        assert acks is not None  # completion="acks": the manager made its listener
        return int(acks.port)

    # --- the transfer engine (per backend) ---------------------------------------------------

    def _open_engine(self) -> None:
        raise NotImplementedError  # pragma: no cover - each backend class defines it

    def _close_engine(self) -> None:
        raise NotImplementedError  # pragma: no cover

    def _backend_factory(self) -> Callable[[str, int], KVBackend]:
        raise NotImplementedError  # pragma: no cover

    def register_buffer_to_engine(self) -> None:
        """Register the KV pool's buffers with the transfer engine (decode.py:1018-1019 after
        a memory release; the constructor does it first, as SGLang's managers do)."""
        raise NotImplementedError  # pragma: no cover

    def deregister_buffer_to_engine(self) -> None:
        """Deregister them (decode.py:1014-1015, before the KV pool's memory is released)."""
        raise NotImplementedError  # pragma: no cover

    # --- what decode.py asks of a manager ----------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Fetch and cache ``bootstrap_addr``'s topology and this rank's plan against it
        (decode.py:1200); False while the prefill cannot answer (decode.py retries once a
        second, 15 times, then aborts the address's requests: decode.py:1181-1223).

        A prefill whose format cannot serve this decode (page size, KV dtype, layout) is
        where SGLang raises out of its event loop and the decode process exits (its
        ``common/conn.py:1319-1425``). Here the topology is cached all the same and True is
        returned: each request's ``init()`` then fails, typed (``TopologyMismatch``, saying what
        to fix), and the process keeps serving other prefills.
        """
        manager = self.decode_manager
        try:
            try:
                plan = manager.plan_for(bootstrap_addr)
            except TopologyMismatch:
                plan = None
            topology = manager.topology(bootstrap_addr)
        except BootstrapError:
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(topology, plan)
        return True

    def forget_prefill(self, bootstrap_addr: str) -> None:
        """A request against ``bootstrap_addr`` failed because the prefill died or was
        replaced: forget its cached info, so decode.py fetches it again for the next
        requests (as SGLang's node-failure handler pops it: common/conn.py:2060-2106)."""
        self.prefill_info_table.pop(bootstrap_addr, None)

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang's base answer (base/conn.py:137). decode.py asks only with
        ``--disaggregation-enable-kv-checksum`` on, which this manager refuses."""
        return True

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Whether a failed room's KV may be freed (decode.py:3059): every prefill rank the
        ABORT went to acknowledged it, or the release timeout passed (this library counts the
        ranks itself: ``DecodeManager.kv_release``, MGR-15)."""
        return self.decode_manager.kv_release(bootstrap_room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """decode.py:3027 after a release. The library forgets a hold when it reports the
        room released, and bounds the holds it keeps: nothing to do here."""

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The shared executor decode.py runs its batched dp-rank queries on
        (decode.py:1255-1259), made on first use as SGLang's is (common/conn.py:1138-1158)."""
        with self._executor_lock:
            if self._executor is None:
                workers = _env("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE") or 16
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(1, int(workers)), thread_name_prefix="pd-rebootstrap-prefill"
                )
            return self._executor

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """PD true-retraction rebootstrap (decode.py:1115-1122, 1869-1873): not implemented
        here. The request fails, typed, and decode.py streams the abort to its client."""
        kv_receiver.refuse(
            SGLangFeatureRefused(
                f"room {kv_receiver.bootstrap_room}: PD retract rebootstrap (the prefill "
                "recompute of a retracted request) is not supported by the statemachine "
                "decode classes; retry the request, or run this decode with SGLang's own "
                "classes (statemachine.sglang.v0_5_23.uninstall()) where retraction is used"
            )
        )

    def close(self) -> None:
        """Stop the manager's threads, close its sockets, deregister the buffers."""
        self.decode_manager.close()
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self._close_engine()


def _refuse_features(args: Any, parallel: Any, disagg: Any) -> None:
    """Refuse, typed, what SGLang's decode would run that these classes do not implement."""
    refused: list[str] = []
    if _env("SGLANG_DISAGG_STAGING_BUFFER"):
        refused.append("the staging buffer (unset SGLANG_DISAGG_STAGING_BUFFER)")
    if float(disagg.disaggregation_decode_host_receive_threshold) < 1:
        refused.append(
            "host KV destinations (set --disaggregation-decode-host-receive-threshold to 1)"
        )
    if disagg.disaggregation_enable_kv_checksum:
        refused.append("the KV checksum (drop --disaggregation-enable-kv-checksum)")
    if getattr(args, "state_types", None):
        refused.append(
            "hybrid-model state pools (Mamba, SWA, DSA state: kv_args.state_types is "
            f"{list(args.state_types)!r}); serve this model with SGLang's own classes"
        )
    if getattr(parallel, "enable_kv_cache_sharding", False):
        refused.append("decode-side KV cache sharding (drop --enable-kv-cache-sharding)")
    if refused:
        raise SGLangFeatureRefused(
            "the statemachine decode classes do not implement "
            + "; ".join(refused)
            + ": switch these off, or uninstall() to run SGLang's own classes"
        )


def _decode_kv_args(args: Any, parallel: Any, attn_tp_size: int) -> DecodeKVArgs:
    """SGLang's ``KVArgs`` as this library's :class:`DecodeKVArgs` (checked once, here)."""
    kinds = getattr(args, "kv_data_mem_kinds", None) or ["VRAM"] * len(args.kv_data_ptrs)
    return DecodeKVArgs(
        engine_rank=int(args.engine_rank),
        attn_tp_size=attn_tp_size,
        kv_data_ptrs=list(args.kv_data_ptrs),
        kv_data_lens=list(args.kv_data_lens),
        kv_item_lens=list(args.kv_item_lens),
        kv_layer_ids=list(getattr(args, "kv_layer_ids", None) or []),
        aux_data_ptrs=list(args.aux_data_ptrs),
        kv_mem_kinds=list(kinds),
        gpu_id=int(getattr(args, "gpu_id", 0) or 0),
        dcp_size=int(getattr(parallel, "attn_dcp_size", 1) or 1),
        dcp_rank=int(getattr(parallel, "attn_dcp_rank", 0) or 0),
    )


def _regions(args: Any) -> list[tuple[int, int]]:
    """The (pointer, length) buffers to register, zero lengths and exact repeats dropped, as
    SGLang's Mooncake manager lists them (``mooncake/conn.py:395-422``)."""
    regions: list[tuple[int, int]] = []
    for ptrs, lens in (
        (args.kv_data_ptrs, args.kv_data_lens),
        (args.aux_data_ptrs, args.aux_data_lens),
    ):
        for ptr, length in zip(ptrs or [], lens or [], strict=False):
            if length and (ptr, length) not in regions:
                regions.append((ptr, length))
    return regions


class MooncakeKVManager(_DecodeKVManager):
    """SGLang 0.5.23's ``MooncakeKVManager`` on the decode side, on this library.

    The transfer engine is SGLang's shared one: its scheduler creates it before the manager
    (``init_mooncake_transfer_engine``); this manager takes it from
    ``get_mooncake_transfer_engine()`` as SGLang's does (``mooncake/conn.py:389-390``) and
    registers the KV and aux buffers with it.
    """

    backend_name = "mooncake"

    def _open_engine(self) -> None:
        engine = _module("sglang.srt.distributed.parallel_state").get_mooncake_transfer_engine()
        if engine is None:
            raise ConfigurationError(
                "no Mooncake transfer engine: SGLang's scheduler creates it before the KV "
                "manager; call sglang.srt.distributed.device_communicators."
                "mooncake_transfer_engine.init_mooncake_transfer_engine(hostname, gpu_id, "
                "ib_device) first"
            )
        self.engine = engine
        self.register_buffer_to_engine()

    def _close_engine(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.deregister_buffer_to_engine()

    def get_session_id(self) -> str:
        """This decode's transfer-engine session, ``host:port`` (what every frame names)."""
        return str(self.engine.get_session_id())

    def _backend_factory(self) -> Callable[[str, int], KVBackend]:
        return MooncakeBackend.factory(self.get_session_id(), self.decode_kv_args)

    def register_buffer_to_engine(self) -> None:
        regions = _regions(self.kv_args)
        if regions:
            ptrs, lens = zip(*regions, strict=True)
            self.engine.batch_register(list(ptrs), list(lens))

    def deregister_buffer_to_engine(self) -> None:
        regions = _regions(self.kv_args)
        if regions:
            self.engine.batch_deregister([ptr for ptr, _ in regions])


class NixlKVManager(_DecodeKVManager):
    """SGLang 0.5.23's ``NixlKVManager`` on the decode side, on this library.

    Makes its NIXL agent as SGLang's does (``nixl/conn.py:524-636``): a uuid4 name, the backend
    of ``SGLANG_DISAGGREGATION_NIXL_BACKEND`` with ``…_NIXL_BACKEND_PARAMS``, the KV buffers
    registered by memory kind and the aux buffers as DRAM; the agent's metadata is taken after
    the registration (it is a snapshot).
    """

    backend_name = "nixl"

    def _open_engine(self) -> None:
        try:
            api = _module("nixl._api")
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
        params = json.loads(_env("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"))
        config = api.nixl_agent_config(
            backends=[], num_threads=0, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = api.nixl_agent(str(uuid.uuid4()), config)
        self.agent.create_backend(_env("SGLANG_DISAGGREGATION_NIXL_BACKEND"), params)
        self._registered: list[Any] = []
        self.register_buffer_to_engine()

    def _close_engine(self) -> None:
        if getattr(self, "agent", None) is not None:
            self.deregister_buffer_to_engine()

    def _backend_factory(self) -> Callable[[str, int], KVBackend]:
        return NixlBackend.from_agent(self.agent, self.decode_kv_args)

    def register_buffer_to_engine(self) -> None:
        args = self.kv_args
        by_kind: dict[str, list[tuple[int, int, int, str]]] = {"VRAM": [], "DRAM": []}
        kinds: Sequence[str] = self.decode_kv_args.kv_mem_kinds
        for ptr, length, kind in zip(args.kv_data_ptrs, args.kv_data_lens, kinds, strict=False):
            by_kind[kind].append((ptr, length, 0 if kind == "DRAM" else int(args.gpu_id or 0), ""))
        by_kind["DRAM"] += [
            (ptr, length, 0, "")
            for ptr, length in zip(args.aux_data_ptrs, args.aux_data_lens, strict=False)
        ]
        for kind, addrs in by_kind.items():
            if addrs:
                descs = self.agent.register_memory(addrs, kind)
                if not descs:
                    raise ConfigurationError(f"NIXL refused to register the {kind} KV buffers")
                self._registered.append(descs)

    def deregister_buffer_to_engine(self) -> None:
        for descs in self._registered:
            self.agent.deregister_memory(descs)
        self._registered = []


class _DecodeKVReceiver:
    """One request's receiver, as SGLang 0.5.23's decode scheduler uses one.

    Built as ``cls(mgr=, bootstrap_addr=, bootstrap_room=)`` (``decode.py:905-911``); wraps one
    :class:`BootstrapReceiver` of the manager's :class:`DecodeManager`. The attributes are the
    ones ``decode.py`` reads: ``conclude_state`` (decode.py:1108), ``abort_notified`` and
    ``bootstrap_infos`` (decode.py:2899-2912, 3002-3006), ``require_staging`` (decode.py:1855),
    ``kv_mgr`` (decode.py:2897, 3027, 3059).
    """

    require_staging = False

    def __init__(
        self, mgr: _DecodeKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: int | None = None
        self.abort_notified = False
        #: every prefill rank of the room (what an ABORT goes to), known after init()
        self.bootstrap_infos: list[dict[str, object]] | None = None
        self._error: BootstrapError | None = None
        self._receiver: BootstrapReceiver | None = None
        try:
            self._receiver = mgr.decode_manager.receiver(bootstrap_addr, bootstrap_room)  # type: ignore[arg-type]
        except BootstrapError as error:  # a room already in flight, a closed manager
            self._error = error
            self.conclude_state = _kvpoll(KVPoll.Failed)

    @property
    def supports_host_destination(self) -> bool:
        """decode.py:1469: host KV destinations are not implemented (refused when on)."""
        return False

    def init(self, prefill_dp_rank: int) -> None:
        """Resolve the room's prefill ranks (decode.py:1105)."""
        if self._receiver is None or self.conclude_state is not None:
            return
        if self._receiver.init(prefill_dp_rank) == KVPoll.Failed:
            self._conclude_failed()
            return
        self.bootstrap_infos = [
            {"rank_ip": rank.ip, "rank_port": rank.port} for _, rank in self._receiver.ranks()
        ]

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        """Send the room's page indices to every rank (decode.py:1863-1868)."""
        if destination is not None and getattr(destination, "name", "DEVICE") != "DEVICE":
            raise SGLangFeatureRefused(
                f"room {self.bootstrap_room}: KV destination {destination!r} is not supported "
                "(device pages only): set --disaggregation-decode-host-receive-threshold to 1"
            )
        if self._receiver is None or self.conclude_state is not None:
            return
        if state_indices is not None and any(len(s or ()) for s in state_indices):
            self.refuse(
                SGLangFeatureRefused(
                    f"room {self.bootstrap_room}: state indices (hybrid-model state pools) are "
                    "not supported by the statemachine decode classes"
                )
            )
            return
        poll = self._receiver.send_metadata(
            kv_indices, 0 if aux_index is None else aux_index, prefix_len=decode_prefix_len or 0
        )
        if poll == KVPoll.Failed:
            self._conclude_failed()

    def poll(self) -> int | None:
        """SGLang's KVPoll (decode.py:1142-1145 and 2857-2860 through its all-reduce)."""
        if self.conclude_state is not None or self._receiver is None:
            return self.conclude_state
        poll = self._receiver.poll()
        if poll == KVPoll.Failed:
            self._conclude_failed()
        elif poll == KVPoll.Success:
            self.conclude_state = _kvpoll(KVPoll.Success)
        return _kvpoll(poll)

    def failure_exception(self) -> None:
        """Raise SGLang's ``KVTransferError`` for this room (decode.py:1162, 2870): the typed
        reason, its class named in the message; ``is_from_another_rank`` when this rank had no
        reason of its own. Like SGLang's, it fails a succeeded receiver too."""
        error = self._error
        if error is None and self._receiver is not None:
            try:
                self._receiver.failure_exception()
            except BootstrapError as raised:
                error = raised
        self._conclude_failed()
        if error is None:  # pragma: no cover - the receiver always raises
            error = FailedOnAnotherRank(f"room {self.bootstrap_room}: failed on another rank")
        self._error = error
        raise _transfer_error(self.bootstrap_room, error) from error

    def refuse(self, error: BootstrapError) -> None:
        """Fail the room with ``error`` (a feature refused after construction)."""
        if self._receiver is not None and not self._receiver.ended:
            self._receiver.abort()
            self.abort_notified = self.abort_notified or bool(self.bootstrap_infos)
        self._error = error
        self.conclude_state = _kvpoll(KVPoll.Failed)

    def abort(self) -> None:
        """The scheduler gives up on the room (user abort, decode.py:1217, scheduler.py
        5760-5780): every rank of the room is told once."""
        if self._receiver is not None and not self._receiver.ended:
            self._receiver.abort()
        self.abort_notified = self.abort_notified or bool(self.bootstrap_infos)
        self.conclude_state = _kvpoll(KVPoll.Failed)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """decode.py:2906 after a failed transfer. The library's receiver already sent the
        room's ranks one ABORT with a generation when it failed after its metadata went out
        (MGR-15); an unfinished receiver is aborted now."""
        if self._receiver is not None and not self._receiver.ended:
            self._receiver.abort()
        self.abort_notified = self.abort_notified or bool(self.bootstrap_infos)

    def is_abort_release_safe(self) -> bool:
        """Host destinations only (decode.py:3056): never used, as SGLang's base class."""
        raise NotImplementedError("host KV destinations are not supported here")

    def clear(self) -> None:
        """Forget the request (decode.py:1401, 2651, 2774, 2925, 3028): a terminal result
        stays; an unfinished request becomes Failed."""
        if self._receiver is not None:
            self._receiver.clear()
        if self.conclude_state is None:
            self.conclude_state = _kvpoll(KVPoll.Failed)

    def _conclude_failed(self) -> None:
        self.conclude_state = _kvpoll(KVPoll.Failed)
        receiver = self._receiver
        failure = None if receiver is None else receiver.failure
        if isinstance(failure, PeerLost) and not isinstance(failure, FailedOnAnotherRank):
            self.kv_mgr.forget_prefill(self.bootstrap_addr)


def _kvpoll(poll: KVPoll) -> int:
    """SGLang's KVPoll value: its ``KVPoll`` is a plain class of int constants
    (base/conn.py:123-128), so its values are these ints."""
    return _POLL_OUT[poll]


def _transfer_error(room: int | None, error: BootstrapError) -> Exception:
    conn = _module("sglang.srt.disaggregation.common.conn")
    transfer_error: Exception = conn.KVTransferError(
        room,
        f"{type(error).__name__}: {error}",
        is_from_another_rank=isinstance(error, FailedOnAnotherRank),
    )
    return transfer_error


class MooncakeKVReceiver(_DecodeKVReceiver):
    """SGLang 0.5.23's ``MooncakeKVReceiver`` on the decode side, on this library."""


class NixlKVReceiver(_DecodeKVReceiver):
    """SGLang 0.5.23's ``NixlKVReceiver`` on the decode side, on this library."""
