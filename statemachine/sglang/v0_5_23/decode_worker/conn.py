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
from statemachine.decode.metrics import MULTIPROC_DIR_ENV, MultiprocessMetrics
from statemachine.decode.plan import DecodeLayout, RankPlan
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.errors import (
    BootstrapError,
    ConfigurationError,
    FailedOnAnotherRank,
    InvalidRoom,
    PeerLost,
    RequestRejected,
    SGLangFeatureRefused,
    TopologyMismatch,
    TransportFailure,
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
        self.attn_cp_rank = int(getattr(parallel, "attn_cp_rank", 0) or 0)
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
        #: one HTTP session per executor thread (a session is not for concurrent threads)
        self._recompute_sessions = threading.local()
        #: "early" or "prefill_complete" (what duplicate rooms turn on: _DecodeKVReceiver)
        self.allocation_policy = str(disagg.disaggregation_decode_allocation_policy)
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
            decode_allocation_policy=self.allocation_policy,
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
        self._buffers_changed()
        #: the library's figures for SGLang's /metrics (multiprocess mode), None without it
        self.metrics = self._start_metrics()

    def _start_metrics(self) -> MultiprocessMetrics | None:
        """Write the manager's figures where SGLang's ``/metrics`` reads them.

        SGLang serves ``/metrics`` in prometheus_client's multiprocess mode: it sets
        ``PROMETHEUS_MULTIPROC_DIR`` before it spawns the schedulers and its endpoint merges the
        value files every process writes there (``utils/common.py:2825-2853``), so a collector
        registered in this scheduler process would never be read. With the variable set and
        prometheus_client installed, the figures are written there, labelled with this rank.
        """
        if not os.environ.get(MULTIPROC_DIR_ENV):
            return None
        try:
            importlib.import_module("prometheus_client")
        except ImportError:
            return None  # SGLang's metrics need it too: without it there is no /metrics
        labels = {
            "tp_rank": str(self.attn_tp_rank),
            "pp_rank": str(self.pp_rank),
        }
        return MultiprocessMetrics(self.decode_manager, labels=labels).start()

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

    def _register_buffers(self) -> None:
        raise NotImplementedError  # pragma: no cover

    def _deregister_buffers(self) -> None:
        raise NotImplementedError  # pragma: no cover

    def _buffers_changed(self) -> None:
        """The registered buffers changed (NIXL: the agent's metadata with them)."""

    def register_buffer_to_engine(self) -> None:
        """Register the KV pool's buffers with the transfer engine: the constructor does it
        first, as SGLang's managers do, and ``resume_memory_occupation`` again
        (decode.py:1017-1019)."""
        self._register_buffers()
        if getattr(self, "decode_manager", None) is not None:
            self._buffers_changed()

    def deregister_buffer_to_engine(self) -> None:
        """What ``release_memory_occupation`` calls on the manager (decode.py:1004-1015),
        before the KV pool's memory is released: the buffers are deregistered, and every room
        still in flight is ended here. SGLang drops its queues there without a ``clear()`` on
        their receivers (decode.py:1006, 3110-3114), so nothing else would end them: each is
        aborted (its prefill ranks told once, so they free the room) and forgotten, and the
        room table holds no room when the memory goes."""
        manager = getattr(self, "decode_manager", None)
        if manager is not None:
            for receiver in manager.in_flight():
                receiver.abort()
                receiver.clear()
        self._deregister_buffers()
        if manager is not None:
            self._buffers_changed()

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
        """PD retract rebootstrap (decode.py:1113-1122, 1869-1873): ask the prefill to compute
        a retracted request's prefix again, as SGLang's manager does (common/conn.py:
        1169-1291). ``payload`` is decode.py's (``Req.build_rebootstrap_payload``), posted
        unchanged: its ``routed_dp_rank`` is the prefill dp rank decode.py bound the request
        to (under ``prefill_complete`` written back at ``_init_receiver``, decode.py:
        1104-1110), so the recompute goes to that dp rank.

        Only the attention-tp / cp group leader of the first pp stage posts (every decode rank
        gets the call; the prefill sends the recomputed KV to all of them). The POST runs on
        the shared executor, bounded by the waiting timeout, to
        ``http://{bootstrap host}:{prefill_http_port}/generate``. A prefill that registered no
        HTTP port, an HTTP status of 400 or more, or no answer fails the room, typed; a room
        whose KV already arrived is left alone (the answer can come after the transfer)."""
        if self.attn_tp_rank != 0 or self.attn_cp_rank != 0 or self.pp_rank != 0:
            return
        addr = kv_receiver.bootstrap_addr
        info = self.prefill_info_table.get(addr)
        if info is None or info.prefill_http_port is None:
            kv_receiver.refuse(
                TopologyMismatch(
                    f"room {kv_receiver.bootstrap_room}: PD retract rebootstrap needs the "
                    f"prefill's HTTP port, and the prefill at {addr} registered none: run the "
                    "prefill with SGLang's own server (it registers its --port), or turn "
                    "retraction off on this decode"
                )
            )
            return
        network = _module("sglang.srt.disaggregation.common.conn").NetworkAddress
        url = network(network.parse(addr).host, info.prefill_http_port).to_url()
        self._ensure_prefill_recompute_executor().submit(
            self._post_recompute, kv_receiver, url.rstrip("/") + "/generate", payload
        )

    def _post_recompute(self, kv_receiver: Any, url: str, payload: dict[str, Any]) -> None:
        """The rebootstrap POST, on an executor thread; a failure reaches the room through
        ``fail_from_any_thread``."""
        room = kv_receiver.bootstrap_room
        session = getattr(self._recompute_sessions, "session", None)
        if session is None:
            session = _module("requests").Session()
            self._recompute_sessions.session = session
        try:
            response = session.post(url, json=payload, timeout=self.waiting_timeout)
        except Exception as exc:  # requests' connection errors and timeouts, and kin
            kv_receiver.fail_from_any_thread(
                TransportFailure(
                    f"room {room}: the PD retract rebootstrap POST {url} got no answer "
                    f"({type(exc).__name__}: {exc}): the prefill's HTTP server is down or "
                    "unreachable; retry the request",
                    addr=url,
                )
            )
            return
        status = int(response.status_code)
        if status >= 400:
            kind = RequestRejected if status < 500 else TransportFailure
            kv_receiver.fail_from_any_thread(
                kind(
                    f"room {room}: the PD retract rebootstrap POST {url} answered {status} "
                    f"({response.text[:200]!r}): see the prefill's log; retry the request",
                    addr=url,
                    status=status,
                )
            )

    def close(self) -> None:
        """Stop the manager's threads, close its sockets, deregister the buffers."""
        if self.metrics is not None:
            self.metrics.close()  # a last write first, while the manager still answers
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
    if getattr(_module("sglang.srt.runtime_context").get_memory(), "enable_hisparse", False):
        refused.append(
            "HiSparse device-only KV transfer (drop --enable-hisparse: its send_metadata "
            "carries device_kv_indices, decode.py:1789-1816)"
        )
    if getattr(parallel, "enable_kv_cache_sharding", False):
        refused.append("decode-side KV cache sharding (drop --enable-kv-cache-sharding)")
    if refused:
        raise SGLangFeatureRefused(
            "the statemachine decode classes do not implement "
            + "; ".join(refused)
            + ": switch these off, or unset PD_BOOTSTRAP_SGLANG_DECODE (uninstall() where you"
            + " installed them yourself) to run SGLang's own classes"
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
        state_data_ptrs=[list(p) for p in getattr(args, "state_data_ptrs", None) or []],
        state_data_lens=[list(n) for n in getattr(args, "state_data_lens", None) or []],
        state_item_lens=[list(n) for n in getattr(args, "state_item_lens", None) or []],
        state_dim_per_tensor=[list(n) for n in getattr(args, "state_dim_per_tensor", None) or []],
        state_layer_ids=[list(n) for n in getattr(args, "state_layer_ids", None) or []],
        kv_mem_kinds=list(kinds),
        gpu_id=int(getattr(args, "gpu_id", 0) or 0),
        dcp_size=int(getattr(parallel, "attn_dcp_size", 1) or 1),
        dcp_rank=int(getattr(parallel, "attn_dcp_rank", 0) or 0),
    )


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
        self._register_buffers()

    def _close_engine(self) -> None:
        if getattr(self, "engine", None) is not None:
            self._deregister_buffers()

    def get_session_id(self) -> str:
        """This decode's transfer-engine session, ``host:port`` (what every frame names)."""
        return str(self.engine.get_session_id())

    def _backend_factory(self) -> Callable[[str, int], KVBackend]:
        return MooncakeBackend.factory(self.get_session_id(), self.decode_kv_args)

    def _register_buffers(self) -> None:
        regions = _regions(self.kv_args)
        if regions:
            ptrs, lens = zip(*regions, strict=True)
            self.engine.batch_register(list(ptrs), list(lens))

    def _deregister_buffers(self) -> None:
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
        live = None if bootstrap_room is None else mgr.decode_manager.get(bootstrap_room)
        if live is not None:
            self._refuse_duplicate(live)
            return
        try:
            self._receiver = mgr.decode_manager.receiver(bootstrap_addr, bootstrap_room)  # type: ignore[arg-type]
        except BootstrapError as error:  # a closed manager; a room taken since the look-up
            self._error = error
            self.conclude_state = _kvpoll(KVPoll.Failed)

    def _refuse_duplicate(self, live: BootstrapReceiver) -> None:
        """A second live receiver of one room: SGLang keys its decode manager's room state
        (status, responses, expected count) by room, so two receivers of one room share it.

        * ``prefill_complete``: SGLang fails the newcomer and sets the shared room Failed,
          which fails the first too unless it already concluded (``common/conn.py:2500-2507``).
          Matched: both fail, typed.
        * ``early``: SGLang has no guard, and the two would share one status while the
          prefill keeps one destination per (room, decode session) - the later metadata
          replaces the earlier (``mooncake/conn.py:3018-3024``) - so one request would be
          reported Success without its KV. Not matched: the newcomer fails, typed, the first
          goes on.
        """
        room = self.bootstrap_room
        advice = (
            "give each request its own bootstrap_room (a parallel-sampling request with a list "
            "of rooms repeats each room n times: managers/io_struct.py:925-931; pass one int "
            "room, which SGLang spreads as room + i)"
        )
        if self.kv_mgr.allocation_policy == "prefill_complete":
            error = InvalidRoom(
                f"room {room}: duplicate decode bootstrap room under the prefill_complete "
                "allocation policy, which fails every request of the room as SGLang does; " + advice
            )
            live.mark_lost(error)
        else:
            error = InvalidRoom(
                f"room {room} is already in flight on this decode: two requests of one room "
                "would share its status while the prefill writes the KV of only one of them, "
                "so this one is refused; " + advice
            )
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
        device_kv_indices: Any = None,
    ) -> None:
        """Send the room's page indices to every rank (decode.py:1863-1868), with SGLang's
        full signature (``common/conn.py:2839-2847``). ``state_indices``: a hybrid model's
        state slots, one list per state type of ``kv_args.state_types``, sent as SGLang
        sends them. What is not implemented fails the room, typed, instead of raising in the
        scheduler loop: a host destination, and HiSparse's ``device_kv_indices``
        (decode.py:1789-1816; both are refused when the manager is built, so these are a
        second line)."""
        if self._receiver is None or self.conclude_state is not None:
            return
        if destination is not None and getattr(destination, "name", "DEVICE") != "DEVICE":
            self.refuse(
                SGLangFeatureRefused(
                    f"room {self.bootstrap_room}: KV destination {destination!r} is not "
                    "supported (device pages only): set "
                    "--disaggregation-decode-host-receive-threshold to 1"
                )
            )
            return
        if device_kv_indices is not None:
            self.refuse(
                SGLangFeatureRefused(
                    f"room {self.bootstrap_room}: HiSparse device KV indices are not supported "
                    "by the statemachine decode classes: drop --enable-hisparse, or run this "
                    "decode with SGLang's own classes (unset PD_BOOTSTRAP_SGLANG_DECODE)"
                )
            )
            return
        poll = self._receiver.send_metadata(
            kv_indices,
            0 if aux_index is None else aux_index,
            prefix_len=decode_prefix_len or 0,
            state_indices=() if state_indices is None else state_indices,
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

    def fail_from_any_thread(self, error: BootstrapError) -> None:
        """Fail the room with ``error`` from a thread that does not own it (the rebootstrap
        POST's answer): stored, and the owner's next ``poll`` ends the room with it. A room
        whose every response arrived is left alone."""
        receiver = self._receiver
        if receiver is not None:
            receiver.mark_lost(error)

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
