"""SGLang 0.5.23's decode scheduler queues, built for real on CPU around light stand-ins.

``DecodePreallocQueue`` and ``DecodeTransferQueue`` (``sglang/srt/disaggregation/decode.py``)
are constructed with their own constructors; what they are handed is what a CPU test cannot
have (a GPU KV pool, the scheduler, torch tensors, a torch process group) and is replaced by the
smallest object that answers what the queues' bootstrap path reads:

* :class:`KVPool` / :class:`KVAllocator`: a KV pool of numpy buffers (``get_contiguous_buf_infos``
  gives real pointers, so a real transfer engine can write into them), one page size;
* :class:`MetadataBuffers`: the aux rows; ``bootstrap_room[idx, 0]`` is what decode.py's
  metadata gate reads (``utils.py:245-260``) - the prefill's aux write lands it;
* :class:`Pages`: the page-index tensor ``kv_to_page_indices`` slices (``.cpu().numpy()``);
* :class:`Req`, :class:`Scheduler`: the fields of SGLang's ``Req`` and ``Scheduler`` those
  methods read;
* a one-rank attention-tp group: ``torch.distributed.get_world_size`` answers 1, so SGLang's
  all-reduces of polls and flags (``utils.py:284-300``) return them unchanged, as on one rank.

What is not constructed is the allocation in ``pop_preallocated`` (it needs the real token
pools); tests replay its bootstrap calls in its order, citing the lines.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from tests.support.sglang_support import (
    import_sglang,
    retire_sglang_manager,
    set_sglang_ranks,
    sglang_server_args,
    stoppable_worker_threads,
)

__all__ = [
    "KVPool",
    "MetadataBuffers",
    "Pages",
    "Req",
    "StandInMooncakeEngine",
    "decode_module",
    "decode_queues",
    "one_rank_group",
]

_rids = itertools.count(1)


def decode_module() -> Any:
    """``sglang.srt.disaggregation.decode``, imported on CPU with the stubs."""
    import_sglang()
    return importlib.import_module("sglang.srt.disaggregation.decode")


class Pages(np.ndarray):
    """A page-index "tensor": decode.py slices it and calls ``.cpu().numpy()``."""

    def cpu(self) -> Pages:
        return self

    def numpy(self) -> np.ndarray:
        return np.asarray(self)


def pages(indices: list[int]) -> Pages:
    return np.asarray(indices, dtype=np.int64).view(Pages)


class KVPool:
    """A KV pool of ``buffers`` numpy buffers of ``pages`` pages of ``page_bytes`` each."""

    def __init__(self, *, buffers: int = 2, pages: int = 16, page_bytes: int = 64) -> None:
        self.page_size = 1
        self.page_bytes = page_bytes
        self.buffers = [np.zeros(pages * page_bytes, dtype=np.uint8) for _ in range(buffers)]

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        return (
            [int(b.ctypes.data) for b in self.buffers],
            [int(b.nbytes) for b in self.buffers],
            [self.page_bytes] * len(self.buffers),
        )


class KVAllocator:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size

    def get_kvcache(self) -> KVPool:
        return self.pool

    def prealloc_ceiling_fits(self, full: int, swa: int) -> None:
        return None  # no unified budget: decode.py checks the token capacity instead

    def prealloc_fits_assumes_reclaim(self) -> bool:
        return False


class MetadataBuffers:
    """The aux rows: one int64 room per slot (what the metadata gate reads), as numpy."""

    def __init__(self, slots: int = 8, row_bytes: int = 64) -> None:
        self.bootstrap_room = np.zeros((slots, row_bytes // 8), dtype=np.int64)

    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        row = int(self.bootstrap_room[0].nbytes)
        return [int(self.bootstrap_room.ctypes.data)], [int(self.bootstrap_room.nbytes)], [row]

    def clear_slot(self, idx: int) -> None:
        self.bootstrap_room[idx] = 0


class _TimeStats:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None  # set_bootstrap_done_time & co.: not measured here


class Req:
    """The fields of SGLang's ``Req`` the bootstrap path of decode.py reads."""

    def __init__(self, bootstrap_addr: str, room: int, *, input_len: int = 4) -> None:
        host, _, port = bootstrap_addr.rpartition(":")
        self.rid = f"req-{next(_rids)}"
        self.bootstrap_host = host
        self.bootstrap_port = int(port)
        self.bootstrap_room = room
        self.disagg_prefill_dp_rank: int | None = None
        self.finished_reason: Any = None
        self.to_finish: Any = None
        self.finished_output = False
        self.return_logprob = False
        self.origin_input_ids = list(range(input_len))
        self.output_ids: list[int] = []
        self.sampling_params = types.SimpleNamespace(max_new_tokens=4)
        self.time_stats = _TimeStats()
        self.priority = 0
        self.lora_id = None

    def build_rebootstrap_payload(self) -> dict[str, Any]:
        """The ``/generate`` body of a PD retract rebootstrap (schedule_batch.py:2149-2197)."""
        return {"rid": self.rid, "bootstrap_room": self.bootstrap_room}


class StandInMooncakeEngine:
    """SGLang's shared Mooncake engine where none can run: a session id and the registered
    regions (the real-bytes tests use the real engine). Its ``engine`` (SGLang's wrapper holds
    the ``mooncake.engine.TransferEngine`` there) answers the drop-in manager's read-back of
    its buffers as a real engine would: a one-byte read through this session succeeds inside a
    registered region and fails (-1) anywhere else or through another session. No byte moves."""

    def __init__(self, session_id: str = "127.0.0.1:17777") -> None:
        self.session_id = session_id
        self.regions: dict[int, int] = {}
        self.engine = self

    @property
    def registered(self) -> list[int]:
        return list(self.regions)

    def get_session_id(self) -> str:
        return self.session_id

    def batch_register(self, ptrs: list[int], lens: list[int]) -> int:
        self.regions.update(zip(ptrs, lens, strict=True))
        return 0

    def batch_deregister(self, ptrs: list[int]) -> int:
        for ptr in ptrs:
            self.regions.pop(ptr, None)
        return 0

    def register_memory(self, ptr: int, length: int) -> int:
        self.regions[ptr] = length
        return 0

    def unregister_memory(self, ptr: int) -> int:
        self.regions.pop(ptr, None)
        return 0

    def transfer_sync_read(self, session_id: str, local: int, remote: int, length: int) -> int:
        served = session_id == self.session_id and any(
            start <= remote and remote + length <= start + size
            for start, size in self.regions.items()
        )
        return 0 if served else -1


class TreeCache:
    """The radix tree: decode.py only unlocks a HiCache restore lock here (none is taken)."""

    def unlock(self, lock: Any) -> None:
        assert lock is None, "no HiCache restore lock is ever taken in these tests"


class _Streamer:
    def __init__(self) -> None:
        self.streamed: list[Any] = []

    def stream_output(self, reqs: list[Any], return_logprob: bool) -> None:
        self.streamed += reqs


def _scheduler() -> Any:
    model_runner = types.SimpleNamespace(kv_cache_dtype_str="bfloat16")
    return types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(is_hybrid_swa=False, model_runner=model_runner),
        enable_hisparse=False,
        enable_decode_hicache=False,
        enable_priority_scheduling=False,
        enable_lora=False,
        enable_overlap=False,
        model_config=types.SimpleNamespace(num_hidden_layers=2),
        random_seed=0,
        spec_algorithm=None,
        kv_checksum_computer=None,
        metrics_reporter=types.SimpleNamespace(enable_metrics=False),
        output_streamer=_Streamer(),
        running_batch=types.SimpleNamespace(reqs=[]),
        waiting_queue=[],
        server_args=None,
        disagg_decode_prealloc_queue=None,
    )


@contextmanager
def one_rank_group() -> Iterator[None]:
    """torch.distributed's answer for a group of one rank (the stub's is a stand-in)."""
    dist = sys.modules["torch.distributed"]
    saved = dist.__dict__.get("get_world_size")
    dist.get_world_size = lambda group=None: 1  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if saved is None:
            del dist.get_world_size
        else:
            dist.get_world_size = saved


@contextmanager
def mooncake_engine(engine: Any) -> Iterator[Any]:
    """Publish ``engine`` as SGLang's shared Mooncake engine for the block (its scheduler
    calls ``init_mooncake_transfer_engine`` before the manager)."""
    import_sglang()
    module = importlib.import_module(
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"
    )
    saved = module._mooncake_transfer_engine
    module._mooncake_transfer_engine = engine
    try:
        yield engine
    finally:
        module._mooncake_transfer_engine = saved


@contextmanager
def decode_queues(
    backend: str = "mooncake",
    *,
    pool: KVPool | None = None,
    metadata: MetadataBuffers | None = None,
    **server_fields: Any,
) -> Iterator[tuple[Any, Any]]:
    """SGLang's own ``DecodeTransferQueue`` and ``DecodePreallocQueue`` of one decode rank (tp
    1), built by their constructors; the prealloc queue's constructor builds the KV manager
    through ``get_kv_class`` (decode.py:608-806), so whatever is installed then is what runs.
    The manager is retired after (``retire_sglang_manager``: SGLang's has no close())."""
    decode = decode_module()
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    runtime = importlib.import_module("sglang.srt.runtime_context")
    pool = pool or KVPool()
    fields = {
        "disaggregation_mode": "decode",
        "host": "127.0.0.1",
        "disaggregation_transfer_backend": backend,
        **server_fields,
    }
    with ExitStack() as stack:
        server_args = stack.enter_context(sglang_server_args(**fields))
        stoppable_worker_threads(server_args)
        set_sglang_ranks(tp_rank=0)
        runtime.get_parallel().override_permanently(
            attn_tp_group=types.SimpleNamespace(cpu_group=None), dp_rank=None
        )
        stack.enter_context(one_rank_group())
        scheduler = _scheduler()
        scheduler.server_args = server_args
        metadata = metadata or MetadataBuffers()
        slots = decode.ReqToMetadataIdxAllocator(metadata.bootstrap_room.shape[0])
        tree_cache = TreeCache()
        transfer = decode.DecodeTransferQueue(slots, metadata, scheduler, tree_cache)
        prealloc = decode.DecodePreallocQueue(
            req_to_token_pool=types.SimpleNamespace(),
            token_to_kv_pool_allocator=KVAllocator(pool),
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=slots,
            metadata_buffers=metadata,
            scheduler=scheduler,
            transfer_queue=transfer,
            tree_cache=tree_cache,
            gpu_id=0,
            bootstrap_port=0,
            max_total_num_tokens=1 << 20,
            num_reserved_decode_tokens=0,
            transfer_backend=utils.TransferBackend(backend),
        )
        scheduler.disagg_decode_prealloc_queue = prealloc
        # The KV pages were never allocated (pop_preallocated's allocation is replayed by the
        # tests): releasing them (decode.py:2812-2820) is recorded instead.
        transfer.released = []
        transfer._release_request = transfer.released.append
        stack.callback(retire_sglang_manager, prealloc.kv_manager)
        yield prealloc, transfer
