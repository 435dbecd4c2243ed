"""One rank of an SGLang 0.5.23 decode server at tp 2 or dp attention 2, in its own process:
SGLang's ``DecodePreallocQueue`` / ``DecodeTransferQueue`` over a real torch process group.

Run as ``python -m real_prefill.decode_rank --mode tp|dp --rank R --init-port P --classes
sglang|installed`` by :class:`real_prefill.multirank.DecodeRanks`. What is SGLang's own code:

* the process's place, as ``run_scheduler_process`` makes it (scheduler.py:6326-6335):
  ``publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=spawn_world_rank(...),
  dp_rank=..., gpu_id=...))``; with dp attention the dp rank is
  ``compute_dp_attention_world_info``'s, as the data-parallel controller computes it
  (data_parallel_controller.py:718-724);
* the process groups: SGLang's ``init_distributed_environment`` and
  ``initialize_model_parallel`` (distributed/parallel_state.py:2468, 2566) with torch's gloo
  backend on 127.0.0.1 (the real scheduler passes nccl for the device groups; every group
  SGLang builds also has the gloo ``cpu_group`` the decode queues reduce over);
* the requests reaching every rank of a group: ``broadcast_pyobj`` over the tp group
  (request_receiver.py:204-210), or with dp attention ``attn_cp_tp_broadcast_pyobj`` for the
  work and ``broadcast_pyobj`` over the whole tp group for control (request_receiver.py:171-199);
* the queues, built by their constructors (tests/support/sglang_decode_support.py), whose
  ``_update_handshake_waiters`` (decode.py:1143-1145), ``pop_transferred`` (decode.py:2785-2790,
  2959-2963) and ``resolve_deferred_releases`` (decode.py:3069-3071) reduce over
  ``attn_tp_group.cpu_group`` (decode.py:421, 2545) with ``all_reduce_flags``
  (disaggregation/utils.py:284-300): at tp 2 a real two-rank all-reduce, at dp attention 2 a
  real one-rank group per dp rank (attn tp 1), so SGLang returns the flags unchanged;
* SGLang's shared Mooncake engine (``init_mooncake_transfer_engine``), and the KV manager and
  receivers ``get_kv_class`` hands the prealloc queue: SGLang's, or the library's after
  ``decode_worker.install(["mooncake"])``.

Stand-ins (what a CPU process cannot have), as in tests/support/sglang_decode_support.py: numpy KV
and
aux buffers, the scheduler object, and ``pop_preallocated``'s allocation (decode.py:1448-1651),
replayed as the restart test replays it; the first-token read of ``_commit_transfer_to_req``
(decode.py:2600-2773) is replaced by the byte check. The model's forward and the rest of the
scheduler loop are not run.

torch is the real CPU build (``make .venv/.torch``, appended to ``sys.path`` after the venv's own
packages and imported before SGLang, so the torch stub is never loaded); triton, torchvision,
tvm_ffi and compressed_tensors stay stubs.

Protocol: stdin lines are JSON commands for the group leader (``start``: room, address;
``stop``, which reaches the group only from global rank 0, as SGLang's control messages);
stdout lines are JSON events: ``ready`` (the rank's place and classes), ``sent`` (the room's
metadata went out), ``outcome`` (done / failed / wrong, the detail, and ``at``:
``time.monotonic()``, the system-wide clock the parent reads too).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
#: where ``make .venv/.torch`` puts the real torch: beside the venv's site-packages, not in them
REAL_TORCH = Path(sys.prefix) / "real-torch"
PAGES_PER_REQUEST = 4


def _emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Rank:
    """One decode rank: SGLang's queues, its buffers, and the steps its scheduler runs."""

    def __init__(self, mode: str, rank: int, init_port: int, classes: str) -> None:
        import torch  # the real CPU build: first, before the stubs go on sys.path

        self.torch = torch
        sys.path.insert(0, str(_ROOT))
        from tests.real_prefill.engines import loopback_environment

        loopback_environment()
        os.environ["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"] = "30"
        from tests.support.sglang_support import import_sglang, stoppable_worker_threads

        import_sglang()
        import tests.support.sglang_decode_support as support
        from tests.real_prefill.harness import Layout, wrong_pages

        self.support, self.wrong_pages = support, wrong_pages
        self.mode, self.rank = mode, rank
        runtime = importlib.import_module("sglang.srt.runtime_context")
        fields: dict[str, Any] = {
            "disaggregation_mode": "decode",
            "disaggregation_transfer_backend": "mooncake",
            "host": "127.0.0.1",
            "tp_size": 2,
        }
        if mode == "dp":
            fields["attn_dp_size"] = 2
        server_args = runtime.get_context().override_server_args(**fields).install()
        stoppable_worker_threads(server_args)
        dp_rank = None
        if mode == "dp":
            dp_attention = importlib.import_module("sglang.srt.layers.dp_attention")
            _, _, dp_rank, _ = dp_attention.compute_dp_attention_world_info(rank, 2, 2)
        runtime.publish(
            server_args,
            role="scheduler",
            ranks=runtime.SpawnRanks(
                world_rank=runtime.spawn_world_rank(server_args, tp_rank=rank, pp_rank=0),
                dp_rank=dp_rank,
                gpu_id=rank,
            ),
        )
        parallel_state = importlib.import_module("sglang.srt.distributed.parallel_state")
        parallel_state.init_distributed_environment(
            world_size=2,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{init_port}",
            local_rank=rank,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(backend="gloo")
        self.parallel = parallel = runtime.get_parallel()
        self.leader = parallel.attn_tp_rank == 0
        attn_tp = parallel.attn_tp_size
        self.layout = Layout()
        self.geometry = self.layout.side(attn_tp)
        g = self.geometry
        mooncake = importlib.import_module(
            "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"
        )
        mooncake.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        if classes == "installed":
            from statemachine.sglang.v0_5_23 import decode_worker

            decode_worker.install(["mooncake"])
        self.pool = support.KVPool(buffers=g.buffers, pages=g.slots, page_bytes=g.item_len)
        self.metadata = support.MetadataBuffers(g.aux_slots, g.aux_item_len)
        self.prealloc, self.transfer = self._queues(server_args)
        self.view = types.SimpleNamespace(
            layout=self.layout,
            tp_size=attn_tp,
            tp_rank=parallel.attn_tp_rank,
            backend="mooncake",
            kv=self.pool.buffers,
            aux=self.metadata.bootstrap_room.view("uint8").reshape(-1),
        )
        self.transfer._commit_transfer_to_req = self._commit
        self.requests: dict[int, dict[str, Any]] = {}
        self.wrong: dict[int, list[str]] = {}
        self.next_page = 0
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self.summary = {
            "attn_tp_size": attn_tp,
            "attn_tp_rank": parallel.attn_tp_rank,
            "tp_group": parallel.tp_group.world_size,
            "dp_rank": parallel.dp_rank,
            "engine_rank": self.prealloc.kv_manager.kv_args.engine_rank,
            "system_dp_rank": self.prealloc.kv_manager.kv_args.system_dp_rank,
            "manager": type(self.prealloc.kv_manager).__module__
            + "."
            + type(self.prealloc.kv_manager).__name__,
            "torch": torch.__version__,
        }

    def _queues(self, server_args: Any) -> tuple[Any, Any]:
        """SGLang's two queues, as tests/sglang_decode_support.decode_queues builds them, over
        this process's real groups (not its one-rank stand-in)."""
        support = self.support
        decode = support.decode_module()
        utils = importlib.import_module("sglang.srt.disaggregation.utils")
        scheduler = support._scheduler()
        scheduler.server_args = server_args
        slots = decode.ReqToMetadataIdxAllocator(self.metadata.bootstrap_room.shape[0])
        tree_cache = support.TreeCache()
        transfer = decode.DecodeTransferQueue(slots, self.metadata, scheduler, tree_cache)
        prealloc = decode.DecodePreallocQueue(
            req_to_token_pool=types.SimpleNamespace(),
            token_to_kv_pool_allocator=support.KVAllocator(self.pool),
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=slots,
            metadata_buffers=self.metadata,
            scheduler=scheduler,
            transfer_queue=transfer,
            tree_cache=tree_cache,
            gpu_id=self.rank,
            bootstrap_port=0,
            max_total_num_tokens=1 << 20,
            num_reserved_decode_tokens=0,
            transfer_backend=utils.TransferBackend("mooncake"),
        )
        scheduler.disagg_decode_prealloc_queue = prealloc
        transfer.released = []  # the pages were never allocated: their release is recorded
        transfer._release_request = transfer.released.append
        return prealloc, transfer

    # -- requests reaching the group (SGLang's request receiver) ---------------------------

    def _received(self) -> list[dict[str, Any]]:
        """This step's commands on every rank of the group, as SGLang's request receiver
        broadcasts them (request_receiver.py:171-210)."""
        from sglang.srt.distributed.communication_op import attn_cp_tp_broadcast_pyobj
        from sglang.srt.utils import broadcast_pyobj

        work: list[dict[str, Any]] | None = None
        control: list[dict[str, Any]] | None = None
        if self.leader:
            drained = []
            while not self.commands.empty():
                drained.append(self.commands.get())
            work = [c for c in drained if c["op"] != "stop"]
            control = [c for c in drained if c["op"] == "stop"]
        tp_group = self.parallel.tp_group
        if self.mode == "dp":
            work = attn_cp_tp_broadcast_pyobj(work)  # request_receiver.py:179
            # Control fans out from global rank 0 over the whole tp group, every step
            # (request_receiver.py:194-199): the stop of another dp rank's leader is not sent.
            control = broadcast_pyobj(
                control if tp_group.rank == tp_group.ranks[0] else None,
                tp_group.rank,
                tp_group.cpu_group,
                src=tp_group.ranks[0],
            )
            return [*work, *control]
        mine = None if work is None or control is None else [*work, *control]
        return list(  # request_receiver.py:204-210
            broadcast_pyobj(mine, tp_group.rank, tp_group.cpu_group, src=tp_group.ranks[0])
        )

    def _start(self, command: dict[str, Any]) -> None:
        room = command["room"]
        dst = list(range(self.next_page, self.next_page + PAGES_PER_REQUEST))
        self.next_page += PAGES_PER_REQUEST
        req = self.support.Req(command["address"], room)
        self.requests[room] = {"req": req, "dst": dst, "done": False}
        self.prealloc.add(req)  # decode.py:808

    def _commit(self, decode_req: Any) -> None:
        # decode.py:2600-2773 reads the first output token from GPU tensors (replaced by the
        # byte check, where SGLang reads the aux row); its last step, decode.py:2774-2775, kept.
        room = decode_req.req.bootstrap_room
        self.wrong[room] = self.wrong_pages(
            self.view, room, self.requests[room]["dst"], decode_req.metadata_buffer_index, None
        )
        decode_req.kv_receiver.clear()
        decode_req.kv_receiver = None

    # -- one scheduler step of the bootstrap path ------------------------------------------

    def step(self) -> bool:
        """One step; False once the leader's ``stop`` reached this rank."""
        stop = False
        for command in self._received():
            if command["op"] == "stop":
                stop = True
            else:
                self._start(command)
        prealloc, transfer = self.prealloc, self.transfer
        transfer.resolve_deferred_releases()  # decode.py:3467
        prealloc._resolve_pending_reqs()  # decode.py:1325
        prealloc._update_handshake_waiters()  # decode.py:1364
        for decode_req in list(prealloc.queue):
            room = decode_req.req.bootstrap_room
            if decode_req.req.finished_reason is not None:  # decode.py:1389-1404, replayed
                transfer.scheduler.output_streamer.stream_output([decode_req.req], False)
                decode_req.kv_receiver.clear()
                decode_req.kv_receiver = None
                prealloc.queue.remove(decode_req)
                self._conclude(decode_req.req)
            elif decode_req.waiting_for_input:  # the allocation of decode.py:1448-1651
                pages = self.support.pages(self.requests[room]["dst"])
                prealloc._send_kv_metadata(decode_req, pages, 1)
                prealloc.queue.remove(decode_req)
                transfer.extend([decode_req])
                _emit(event="sent", room=room, rank=self.rank)
        for req in transfer.pop_transferred():  # decode.py:3486-3488
            self._conclude(req)
        for req in transfer.scheduler.output_streamer.streamed:  # failed in pop_transferred
            self._conclude(req)
        return not stop

    def _conclude(self, req: Any) -> None:
        entry = self.requests[req.bootstrap_room]
        if entry["done"]:
            return
        entry["done"] = True
        at = time.monotonic()  # CLOCK_MONOTONIC: the parent's clock too
        if req.finished_reason is not None:
            message = str(req.finished_reason.message)
            detail = (
                message[message.find("KVTransferError") :]
                if "KVTransferError" in message
                else message
            )
            state = "failed"
        else:
            wrong = self.wrong[req.bootstrap_room]
            state = "done" if not wrong else "wrong"
            detail = "pages verified byte for byte" if not wrong else f"wrong: {wrong[:3]}"
        _emit(event="outcome", room=req.bootstrap_room, rank=self.rank, state=state,
              detail=detail, at=at)  # fmt: skip

    def serve(self) -> None:
        def read() -> None:
            for line in sys.stdin:
                if line.strip():
                    self.commands.put(json.loads(line))
            self.commands.put({"op": "stop"})  # the parent went away

        threading.Thread(target=read, daemon=True).start()
        _emit(event="ready", rank=self.rank, **self.summary)
        while self.step():
            time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("tp", "dp"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-port", type=int, required=True)
    parser.add_argument("--classes", choices=("sglang", "installed"), required=True)
    args = parser.parse_args()
    if str(REAL_TORCH) not in sys.path:
        sys.path.append(str(REAL_TORCH))  # after the venv's own packages: only torch & deps
    Rank(args.mode, args.rank, args.init_port, args.classes).serve()
    sys.stdout.flush()
    # SGLang's manager threads and the engine are the process's: end without joining them.
    os._exit(0)


if __name__ == "__main__":
    main()
