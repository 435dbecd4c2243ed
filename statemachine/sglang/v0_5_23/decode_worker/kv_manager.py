"""The decode KV manager's part common to both transfer backends: what SGLang's decode scheduler
asks of its one KV manager per process, answered by one :class:`DecodeManager`.

:class:`DecodeKVManagerBase` reads SGLang's runtime context as SGLang's own manager does,
refuses (typed) the features these classes do not implement, turns SGLang's ``KVArgs`` into
this library's :class:`DecodeKVArgs` and its context into a :class:`DecodeLayout`, builds the
:class:`DecodeManager`, and answers the calls ``decode.py`` makes on a manager (the prefill's
topology, deferred KV release, memory release and resume, PD retract rebootstrap). What differs
per transfer backend (the engine, the buffer registration) is left to the classes SGLang picks,
in :mod:`.conn`.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from statemachine.backend import KVBackend
from statemachine.decode.manager import DecodeManager
from statemachine.decode.metrics import MULTIPROC_DIR_ENV, MultiprocessMetrics
from statemachine.decode.plan import DecodeLayout, RankPlan
from statemachine.errors import (
    BootstrapError,
    RequestRejected,
    SGLangFeatureRefused,
    TopologyMismatch,
    TransportFailure,
)
from statemachine.sglang.v0_5_23.decode_worker.sglang_imports import sglang_env, sglang_module
from statemachine.sglang.v0_5_23.kv_args import DecodeKVArgs
from statemachine.validation import Topology

__all__ = ["DecodeKVManagerBase", "PrefillInfo"]


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


class DecodeKVManagerBase:
    """The per-process decode KV manager, as SGLang 0.5.23's decode scheduler uses one (the
    part both backends share: :mod:`.conn`'s ``MooncakeKVManager`` and ``NixlKVManager`` add
    the transfer engine).

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
        runtime = sglang_module("sglang.srt.runtime_context")
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
        self.waiting_timeout = int(sglang_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT"))
        #: whether the scheduler holds a failed room's KV until the prefill acknowledges the
        #: ABORT (decode.py:2895-2906), as SGLang's managers decide it (common/conn.py:338)
        self.enable_deferred_decode_kv_release = bool(
            sglang_env("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE")
        )
        #: what decode.py's dp-rank resolution reads: ``.get(addr)`` (decode.py:880, 1244)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        #: one HTTP session per executor thread (a session is not for concurrent threads)
        self._recompute_sessions = threading.local()
        #: "early" or "prefill_complete" (what duplicate rooms turn on: DecodeKVReceiverBase)
        self.allocation_policy = str(disagg.disaggregation_decode_allocation_policy)
        self.local_ip = str(sglang_module("sglang.srt.utils.network").get_local_ip_auto())
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
            all_cp_ranks=bool(sglang_env("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")),
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
                liveness_timeout_s=max(
                    float(sglang_env("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL")), 2.0
                )
                * max(int(sglang_env("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE")), 1),
                waiting_timeout_s=float(self.waiting_timeout),
                send_timeout_ms=int(sglang_env("SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT")) * 1000,
                kv_release_timeout_s=float(
                    sglang_env("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT")
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
                workers = sglang_env("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE") or 16
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
        network = sglang_module("sglang.srt.disaggregation.common.conn").NetworkAddress
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
            session = sglang_module("requests").Session()
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
    if sglang_env("SGLANG_DISAGG_STAGING_BUFFER"):
        refused.append("the staging buffer (unset SGLANG_DISAGG_STAGING_BUFFER)")
    if float(disagg.disaggregation_decode_host_receive_threshold) < 1:
        refused.append(
            "host KV destinations (set --disaggregation-decode-host-receive-threshold to 1)"
        )
    if disagg.disaggregation_enable_kv_checksum:
        refused.append("the KV checksum (drop --disaggregation-enable-kv-checksum)")
    if getattr(sglang_module("sglang.srt.runtime_context").get_memory(), "enable_hisparse", False):
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
