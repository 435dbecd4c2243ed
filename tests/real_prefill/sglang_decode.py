"""SGLang 0.5.23's own decode side, the baseline: its KV manager in DECODE mode on a real engine
and its receivers, driven the way its ``decode.py`` scheduler drives them.

Per request: the prefill's topology is fetched with ``try_ensure_parallel_info`` (at most once a
second per address, 15 tries, then the request is aborted, as ``decode.py`` does), then
``Receiver(mgr, addr, room)`` -> ``init(dp_rank)`` -> ``send_metadata(pages, aux, state)`` ->
``poll()`` each step -> on Failed ``failure_exception()``. The manager starts its own threads
(status listener, heartbeat) exactly as in a server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tests.real_prefill import engines
from tests.real_prefill.harness import Layout
from tests.real_prefill.prefill_process import has_state

#: decode.py's topology retry: once a second, 15 tries (``decode.py:1181-1223``).
TOPOLOGY_TRIES = 15


class SGLangRequest:
    """One request as SGLang's decode scheduler holds it."""

    def __init__(self, decode: SGLangDecode, address: str, room: int, dst: Sequence[int],
                 aux_index: int, state_index: int | None) -> None:  # fmt: skip
        self.decode, self.address, self.room = decode, address, room
        self.dst, self.aux_index, self.state_index = list(dst), aux_index, state_index
        self.receiver: Any = None
        self.failure: str | None = None
        self.tries = 0
        self.next_try = 0.0

    def poll(self) -> Any:
        kv_poll = self.decode.kv_poll
        if self.failure is not None:
            return kv_poll.Failed
        if self.receiver is None and not self._start():
            return kv_poll.Bootstrapping
        state = self.receiver.poll()
        if state == kv_poll.Failed and self.failure is None:
            try:
                self.receiver.failure_exception()
            except Exception as err:  # SGLang's KVTransferError
                self.failure = str(err)
        return state

    def _start(self) -> bool:
        now = time.monotonic()
        if now < self.next_try:
            return False
        mgr = self.decode.manager
        if not mgr.try_ensure_parallel_info(self.address):
            self.tries += 1
            self.next_try = now + 1.0
            if self.tries >= TOPOLOGY_TRIES:
                self.failure = f"no prefill topology from {self.address} in {TOPOLOGY_TRIES} tries"
            return False
        self.receiver = self.decode.receiver_class(mgr, self.address, self.room)
        self.receiver.init(0)
        states = None
        if self.state_index is not None and self.decode.has_state:
            states = [np.asarray([self.state_index], dtype=np.int32)]
        self.receiver.send_metadata(np.asarray(self.dst, dtype=np.int32), self.aux_index, states)
        return True

    def clear(self) -> None:
        if self.receiver is not None:
            self.receiver.clear()


class SGLangDecode:
    """SGLang's decode rank, in this process, with its own engine (the shared one SGLang's
    scheduler creates) and CPU buffers registered by its manager."""

    def __init__(
        self,
        backend: str,
        *,
        layout: Layout | None = None,
        waiting_timeout_s: int = 300,
        heartbeat_interval_s: int = 2,
    ) -> None:
        from tests.support.sglang_support import (
            import_sglang,
            set_sglang_ranks,
            sglang_server_args,
            stoppable_worker_threads,
        )

        engines.loopback_environment()
        os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(waiting_timeout_s)
        os.environ["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"] = str(heartbeat_interval_s)
        common = import_sglang()
        from sglang.srt.disaggregation.base.conn import KVArgs

        self.backend = backend
        self.layout = layout or Layout()
        self.tp_rank, self.tp_size = 0, 1
        self.geometry = g = self.layout.side(1)
        self.has_state = has_state(backend)
        self.kv = [np.zeros(g.slots * g.item_len, dtype=np.uint8) for _ in range(g.buffers)]
        self.aux = np.zeros(g.aux_slots * g.aux_item_len, dtype=np.uint8)
        self.state = np.zeros(g.state_slots * g.state_item_len, dtype=np.uint8)
        self._args_override = sglang_server_args(
            disaggregation_mode="decode", disaggregation_transfer_backend=backend,
            host="127.0.0.1", tp_size=1,
        )  # fmt: skip
        server_args = self._args_override.__enter__()
        stoppable_worker_threads(server_args)
        set_sglang_ranks(tp_rank=0)
        kv_args = KVArgs()
        state = self.has_state
        fields: dict[str, Any] = {
            "engine_rank": 0, "page_size": g.page_size, "kv_cache_dtype_str": "bfloat16",
            "kv_layout": None, "pp_rank": 0, "system_dp_rank": 0,
            "is_hybrid_mla_backend": False, "mla_compression_ratios": None,
            "kv_data_ptrs": [b.ctypes.data for b in self.kv],
            "kv_data_lens": [b.nbytes for b in self.kv],
            "kv_item_lens": [g.item_len] * g.buffers, "kv_layer_ids": [],
            "kv_data_mem_kinds": ["DRAM"] * g.buffers,
            "aux_data_ptrs": [self.aux.ctypes.data], "aux_data_lens": [self.aux.nbytes],
            "aux_item_lens": [g.aux_item_len],
            "state_types": ["mamba"] if state else [],
            "state_data_ptrs": [[self.state.ctypes.data]] if state else [],
            "state_data_lens": [[self.state.nbytes]] if state else [],
            "state_item_lens": [[g.state_item_len]] if state else [],
            "state_layer_ids": [[]] if state else [],
            "state_dim_per_tensor": [[]] if state else [],
            "state_slice_outer_counts": [], "state_conv_shard_groups": [],
            "swa_kv_cache_layout": None, "ib_device": "", "gpu_id": 0,
            "kv_head_num": 1 if self.layout.mla else self.layout.total_heads,
            "total_kv_head_num": 1 if self.layout.mla else self.layout.total_heads,
            "rust_http_port": None, "prefill_start_layer": 0, "prefill_end_layer": None,
            "kv_buf_groups": 1, "hidden_kv_layers": 0, "draft_kv_layers": 0,
        }  # fmt: skip
        for name, value in fields.items():
            setattr(kv_args, name, value)
        mode = common.DisaggregationMode.DECODE
        if backend == "mooncake":
            from sglang.srt.disaggregation.mooncake import conn as backend_conn
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                init_mooncake_transfer_engine,
            )

            init_mooncake_transfer_engine("127.0.0.1", gpu_id=0, ib_device=None)
            self.manager = backend_conn.MooncakeKVManager(
                kv_args, mode, server_args, is_mla_backend=self.layout.mla
            )
            self.receiver_class = backend_conn.MooncakeKVReceiver
        else:
            from sglang.srt.disaggregation.nixl import conn as backend_conn

            self.manager = backend_conn.NixlKVManager(
                kv_args, mode, server_args, is_mla_backend=self.layout.mla
            )
            self.receiver_class = backend_conn.NixlKVReceiver
        self.kv_poll = common.KVPoll

    def request(self, address: str, room: int, dst_pages: Sequence[int], aux_index: int,
                state_index: int | None = None) -> SGLangRequest:  # fmt: skip
        request = SGLangRequest(self, address, room, dst_pages, aux_index, state_index)
        request.poll()
        return request

    def wrong_pages(self, room: int, dst_pages: Sequence[int], aux_index: int,
                    state_index: int | None = None) -> list[str]:  # fmt: skip
        from tests.real_prefill.harness import wrong_pages

        return wrong_pages(self, room, dst_pages, aux_index, state_index)

    def cached_rank_ports(self) -> set[int]:
        """The prefill rank ports SGLang's connection pool holds."""
        return {
            int(info["rank_port"])
            for infos in self.manager.connection_pool.values()
            for info in infos
        }

    def close(self) -> None:
        from tests.support.sglang_support import retire_sglang_manager

        retire_sglang_manager(self.manager)
        self._args_override.__exit__(None, None, None)
