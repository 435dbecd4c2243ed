"""One SGLang 0.5.23 prefill rank in its own process, as SGLang hosts it, moving real KV bytes.

Run by :mod:`real_prefill.harness` (``python -m real_prefill.prefill_process ...``): SGLang's
own bootstrap server (with ``--serve``, as the rank-0 process of a prefill hosts it), its
Mooncake or NIXL prefill KV manager on a real transfer engine with KV, aux and state buffers in
CPU memory, and a loop that drives one sender per request the way SGLang's prefill scheduler
does: ``Sender(mgr, addr, room)`` -> ``init(pages, aux_index)`` -> poll until WaitingForInput ->
fill the pages (the "forward pass": the known pattern of :mod:`real_prefill.pattern`) ->
``send(pages, state_indices)`` -> poll until Success or Failed -> ``clear()``.

Commands come one JSON object a line on stdin; this process prints ``READY {...}`` once it is
registered, then per request a :class:`RoomReport` line (``{"room", "status", "metadata_at",
"sent_at", "concluded_at"}``) when it sends and again when the request ends, each line the
room's whole report so far (a later one replaces an earlier one).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tests.real_prefill.pattern import Geometry, aux_bytes, page_bytes, state_bytes

_ROOT = Path(__file__).resolve().parents[2]
_TESTS = _ROOT / "tests"
STATE_FIELDS = (
    "state_types",
    "state_data_ptrs",
    "state_data_lens",
    "state_item_lens",
    "state_layer_ids",
    "state_dim_per_tensor",
)


@dataclass(frozen=True)
class RoomReport:
    """What a rank reports of one room. Times are ``time.monotonic()``, one clock for every
    process of the machine (Linux's CLOCK_MONOTONIC), so a reader can order them against the
    decode's own events; None: not (yet) happened. ``metadata_at`` and ``concluded_at`` come
    from the manager's own threads (:meth:`Prefill._stamp_statuses`), ``sent_at`` from the
    scheduler loop. Read through ``RealPrefill.report``: by ``restart.prefill_was_late``
    (``metadata_at``, ``concluded_at``) and by ``bench_e2e``'s phases (``sent_at``,
    ``concluded_at``)."""

    #: "Success" or "Failed", as the rank's sender polled it at the end; None: in flight
    status: str | None = None
    #: the manager took the decode's metadata (the room went to WaitingForInput); if the
    #: stamp is missing when the loop sends, the send time (the metadata had arrived by then)
    metadata_at: float | None = None
    #: the scheduler loop called ``send()``, the room's pages filled; None: never sent
    sent_at: float | None = None
    #: the manager set Success or Failed, just before it told the decode; if it never did
    #: (the sender concluded on its own), when the loop polled the end
    concluded_at: float | None = None


def has_state(backend: str) -> bool:
    """Whether this harness gives ``backend``'s ranks a state buffer (see ``state_fields``)."""
    return backend == "mooncake"


def _environment(backend: str) -> None:
    """What SGLang needs to run on a CPU machine over loopback (set before it is imported)."""
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    if backend == "mooncake":
        os.environ["MOONCAKE_PROTOCOL"] = "tcp"  # SGLang's default, rdma, needs hardware
        os.environ["MC_FORCE_TCP"] = "1"
    else:
        os.environ["UCX_TLS"] = "tcp"
        os.environ["UCX_MODULES"] = "^ib"  # the wheel's bundled libnl crashes at exit otherwise
        os.environ["UCX_HANDLE_ERRORS"] = "none"  # no NAME.btr crash files in the cwd
    sys.path.insert(0, str(_TESTS / "sglang_stubs"))
    sys.path.insert(0, str(_ROOT))


def _wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class Prefill:
    """The rank: its buffers, its manager, and the senders in flight."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.geometry = Geometry(
            layers=args.layers,
            slots=args.slots,
            page_size=args.page_size,
            heads=1 if args.mla else args.total_heads // args.tp_size,
            head_bytes=args.head_bytes,
            aux_slots=args.aux_slots,
        )
        self.first_head = 0 if args.mla else args.tp_rank * self.geometry.heads
        g = self.geometry
        self.kv = [np.zeros(g.slots * g.item_len, dtype=np.uint8) for _ in range(g.buffers)]
        self.aux = np.zeros(g.aux_slots * g.aux_item_len, dtype=np.uint8)
        self.state = np.zeros(g.state_slots * g.state_item_len, dtype=np.uint8)
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        order = np.random.default_rng(args.tp_rank).permutation(g.slots)  # scattered pages
        self.free_pages = collections.deque(int(page) for page in order)
        self.free_aux = collections.deque(range(g.aux_slots))
        self.senders: dict[int, tuple[Any, dict[str, Any]]] = {}
        #: room -> the manager's stamps (:meth:`_stamp_statuses`), until the loop reports them
        self.metadata_at: dict[int, float] = {}
        self.concluded_at: dict[int, float] = {}

    def state_fields(self) -> dict[str, Any]:
        """One Mamba state buffer, Mooncake only: SGLang 0.5.23's NIXL manager registers state
        buffers as VRAM whatever they are, which a CPU buffer cannot be."""
        if not has_state(self.args.backend):
            return {name: [] for name in STATE_FIELDS}
        g = self.geometry
        return {
            "state_types": ["mamba"],
            "state_data_ptrs": [[self.state.ctypes.data]],
            "state_data_lens": [[self.state.nbytes]],
            "state_item_lens": [[g.state_item_len]],
            "state_layer_ids": [[]],
            "state_dim_per_tensor": [[]],
        }

    def start(self) -> dict[str, Any]:
        args = self.args
        import sglang.srt.disaggregation.common.conn as common
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.runtime_context import get_context, get_parallel

        self.server = None
        if args.serve:
            self.server = common.CommonKVBootstrapServer("127.0.0.1", args.bootstrap_port)
        # Every rank registers in its manager's constructor, and a refused PUT backs off 1 s,
        # 2 s, ...: wait until the server (rank 0's, started in parallel) listens.
        _wait_listening(args.bootstrap_port, timeout=60.0)
        override = get_context().override_server_args(
            disaggregation_mode="prefill",
            disaggregation_transfer_backend=args.backend,
            host="127.0.0.1",
            disaggregation_bootstrap_port=args.bootstrap_port,
            tp_size=args.tp_size,
        )
        server_args = override.install()
        parallel = get_parallel()
        parallel.clear_stamp()
        parallel.override_permanently(
            attn_tp_rank=args.tp_rank,
            attn_cp_rank=0,
            attn_dp_rank=0,
            attn_dcp_rank=0,
            tp_rank=args.tp_rank,
            pp_rank=0,
            pp_group=None,
            world_group=None,
        )
        g = self.geometry
        kv_args = KVArgs()
        fields: dict[str, Any] = {
            "engine_rank": args.tp_rank,
            "page_size": g.page_size,
            "kv_cache_dtype_str": "bfloat16",
            "kv_layout": None,
            "pp_rank": 0,
            "system_dp_rank": 0,
            "is_hybrid_mla_backend": False,
            "mla_compression_ratios": None,
            "kv_data_ptrs": [b.ctypes.data for b in self.kv],
            "kv_data_lens": [b.nbytes for b in self.kv],
            "kv_item_lens": [g.item_len] * g.buffers,
            "kv_layer_ids": [],
            "kv_data_mem_kinds": ["DRAM"] * g.buffers,
            "aux_data_ptrs": [self.aux.ctypes.data],
            "aux_data_lens": [self.aux.nbytes],
            "aux_item_lens": [g.aux_item_len],
            **self.state_fields(),
            "state_slice_outer_counts": [],
            "state_conv_shard_groups": [],
            "swa_kv_cache_layout": None,
            "ib_device": "",
            "gpu_id": 0,
            "kv_head_num": 1 if args.mla else g.heads,
            "total_kv_head_num": 1 if args.mla else args.total_heads,
            "rust_http_port": None,
            "prefill_start_layer": 0,
            "prefill_end_layer": None,
            "kv_buf_groups": 1,
            "hidden_kv_layers": 0,
            "draft_kv_layers": 0,
        }
        for name, value in fields.items():
            setattr(kv_args, name, value)
        mode = common.DisaggregationMode.PREFILL
        if args.backend == "mooncake":
            from sglang.srt.disaggregation.mooncake import conn as backend
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                init_mooncake_transfer_engine,
            )

            # SGLang's scheduler creates the shared engine before the manager uses it.
            init_mooncake_transfer_engine("127.0.0.1", gpu_id=0, ib_device=None)
            self.manager = backend.MooncakeKVManager(
                kv_args, mode, server_args, is_mla_backend=args.mla
            )
            self.sender_class = backend.MooncakeKVSender
            session = self.manager.engine.get_session_id()
        else:
            from sglang.srt.disaggregation.nixl import conn as backend

            self.manager = backend.NixlKVManager(
                kv_args, mode, server_args, is_mla_backend=args.mla
            )
            self.sender_class = backend.NixlKVSender
            session = self.manager.agent.name
        self.kv_poll = common.KVPoll
        self._stamp_statuses(common.KVPoll)
        return {"session": session, "rank_port": self.manager.rank_port, "pid": os.getpid()}

    def _stamp_statuses(self, kv_poll: Any) -> None:
        """Note when each room's metadata arrived and when the rank concluded it, as the manager
        saw them: its bootstrap thread moves a room to WaitingForInput as it takes the decode's
        metadata, its transfer worker to Success or Failed just before it tells the decode. So
        the times are exact, not this loop's next poll (which lags under load). This observes
        only: every call goes on as made."""
        manager, metadata_at, concluded_at = self.manager, self.metadata_at, self.concluded_at
        update_status = manager.update_status
        ends = (kv_poll.Success, kv_poll.Failed)

        def stamped(room: int, status: Any, *args: Any, **kwargs: Any) -> Any:
            if status == kv_poll.WaitingForInput:
                metadata_at.setdefault(room, time.monotonic())
            elif status in ends:
                concluded_at.setdefault(room, time.monotonic())
            return update_status(room, status, *args, **kwargs)

        manager.update_status = stamped

    def wait_registered(self, timeout: float) -> None:
        """The server answers a room's ranks once every rank registered; rank 0 waits for it
        (only the process with the server can ask it without a decode's help)."""
        if self.server is None:
            return
        import requests

        url = f"http://127.0.0.1:{self.args.bootstrap_port}/route"
        query = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}?{query}", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"the bootstrap server saw no complete topology in {timeout} s")

    def read_commands(self) -> None:
        for line in sys.stdin:
            if line.strip():
                self.commands.put(json.loads(line))
        self.commands.put({"op": "exit"})

    def allocate(self, request: dict[str, Any]) -> bool:
        """This rank's own pages for a request that named only how many: scattered slots no
        request in flight holds (a real prefill's KV allocator), and an aux slot."""
        if len(self.free_pages) < request["pages"] or not self.free_aux:
            return False
        request["src_pages"] = [self.free_pages.popleft() for _ in range(request["pages"])]
        request["aux_index"] = self.free_aux.popleft()
        request["allocated"] = True
        return True

    def fill(self, room: int, request: dict[str, Any]) -> None:
        """The forward pass: this rank's heads of every page of the request, aux and state."""
        g = self.geometry
        for buffer, kv in enumerate(self.kv):
            pages = kv.reshape(g.slots, g.item_len)
            for number, page in enumerate(request["src_pages"]):
                pages[page] = page_bytes(room, buffer, number, g, self.first_head, g.heads)
        aux = self.aux.reshape(g.aux_slots, g.aux_item_len)
        aux[request["aux_index"]] = aux_bytes(room, 0, g.aux_item_len)
        if request.get("state_index") is not None and has_state(self.args.backend):
            state = self.state.reshape(g.state_slots, g.state_item_len)
            state[request["state_index"]] = state_bytes(room, 0, g.state_item_len)

    def step(self) -> None:
        """One scheduler iteration: start new requests, advance the ones in flight."""
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            if command["op"] == "exit":
                raise SystemExit(0)
            room = command["room"]
            sender = self.sender_class(self.manager, f"127.0.0.1:{self.args.bootstrap_port}", room)
            pages = command.get("pages") or len(command["src_pages"])
            sender.init(pages, command.get("aux_index"))
            self.senders[room] = (sender, {**command, "report": RoomReport()})
        for room, (sender, request) in list(self.senders.items()):
            status = sender.poll()
            report: RoomReport = request["report"]
            if report.sent_at is None and status == self.kv_poll.WaitingForInput:
                if "src_pages" not in request:
                    if not self.allocate(request):
                        continue  # no free pages: wait for a request to end, as a scheduler does
                    sender.aux_index = request["aux_index"]  # what init() would have been given
                self.fill(room, request)
                state = request.get("state_index") if has_state(self.args.backend) else None
                pages = np.asarray(request["src_pages"], dtype=np.int32)
                if request.get("break_source"):
                    # A prefill-side transfer failure: source pages outside every registered
                    # buffer, so the engine refuses the write and the rank reports Failed.
                    pages = pages + np.int32(1 << 30)
                sender.send(
                    pages, [np.asarray([state], dtype=np.int32)] if state is not None else None
                )
                sent_at = time.monotonic()
                report = replace(
                    report, metadata_at=self.metadata_at.pop(room, sent_at), sent_at=sent_at
                )
                request["report"] = report
                self.publish(room, report)
            elif status in (self.kv_poll.Success, self.kv_poll.Failed):
                sender.clear()
                del self.senders[room]
                report = replace(
                    report,
                    status="Success" if status == self.kv_poll.Success else "Failed",
                    # once sent, the report holds the stamp (the send popped it)
                    metadata_at=self.metadata_at.pop(room, report.metadata_at),
                    concluded_at=self.concluded_at.pop(room, time.monotonic()),
                )
                if request.get("allocated"):
                    self.free_pages.extend(request["src_pages"])
                    self.free_aux.append(request["aux_index"])
                self.publish(room, report)

    @staticmethod
    def publish(room: int, report: RoomReport) -> None:
        # One write: print() writes the text and its newline apart, and another thread's
        # write to stdout between them would join this line (the reader could not parse it).
        sys.stdout.write(json.dumps({"room": room, **asdict(report)}) + "\n")
        sys.stdout.flush()

    def run(self) -> None:
        threading.Thread(target=self.read_commands, daemon=True).start()
        while True:
            self.step()
            time.sleep(0.0005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("mooncake", "nixl"), required=True)
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--serve", action="store_true", help="host SGLang's bootstrap server")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--mla", action="store_true")
    parser.add_argument("--layers", type=int, default=Geometry.layers)
    parser.add_argument("--slots", type=int, default=Geometry.slots)
    parser.add_argument("--page-size", type=int, default=Geometry.page_size)
    parser.add_argument("--total-heads", type=int, default=Geometry.heads)
    parser.add_argument("--head-bytes", type=int, default=Geometry.head_bytes)
    parser.add_argument("--aux-slots", type=int, default=Geometry.aux_slots)
    parser.add_argument(
        "--wait-go", action="store_true", help="import SGLang, then start on a 'go' line (warm)"
    )
    args = parser.parse_args()
    _environment(args.backend)
    prefill = Prefill(args)
    if args.wait_go:
        import sglang.srt.disaggregation.common.conn  # noqa: F401  (the slow part: SGLang's import)

        print("WARM", flush=True)
        sys.stdin.readline()
    ready = prefill.start()
    prefill.wait_registered(timeout=60.0)
    print("READY " + json.dumps(ready), flush=True)
    prefill.run()


if __name__ == "__main__":
    main()
