"""Start SGLang 0.5.23's real prefill in its own processes and a decode with its own engine.

The API the end-to-end tests, the SGLang demo and ``benchmarks/bench_e2e.py`` build on:

* :class:`RealPrefill` — one SGLang prefill: one process per tp rank
  (:mod:`real_prefill.prefill_process`), rank 0 hosting SGLang's bootstrap server, each rank
  SGLang's Mooncake or NIXL prefill manager on a real engine with CPU buffers. ``start()``,
  ``transfer(room, src_pages, aux_index, state_index)`` (what the prefill's scheduler does for a
  request), ``report(room)`` (what rank 0 saw of it, with its times), ``kill()`` (SIGKILL every
  rank), ``start()`` again behind the same bootstrap port, ``close()``.
* :class:`LibraryDecode` — this library's ``DecodeManager`` with its own engine or agent and
  registered buffers; ``request(...)`` starts a room, ``wrong_pages(...)`` checks byte for byte.
* :class:`Layout` — the model both sides agree on (heads, layers, page size, MLA).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from statemachine.prefill.readiness import READY, read_prefixed_line
from tests.real_prefill import engines
from tests.real_prefill.pattern import Geometry, aux_bytes, page_bytes, state_bytes
from tests.real_prefill.prefill_process import RoomReport, has_state
from tests.support.http_support import free_port

_ROOT = Path(__file__).resolve().parents[2]
_names = itertools.count()
_NOTHING_REPORTED = RoomReport()


@dataclass(frozen=True)
class Layout:
    """What prefill and decode agree on: the model (KV heads of all ranks, MLA or not) and the
    pool geometry. Each side's pages hold its own tp share of the heads (all of them for MLA)."""

    total_heads: int = 4
    mla: bool = False
    geometry: Geometry = field(default_factory=Geometry)

    def side(self, tp_size: int) -> Geometry:
        heads = 1 if self.mla else self.total_heads // tp_size
        return replace(self.geometry, heads=heads)

    def first_head(self, tp_rank: int, tp_size: int) -> int:
        return 0 if self.mla else tp_rank * (self.total_heads // tp_size)


class RealPrefill:
    """SGLang's prefill (``tp_size`` rank processes) behind one bootstrap port."""

    def __init__(
        self,
        backend: str,
        *,
        tp_size: int = 1,
        layout: Layout | None = None,
        bootstrap_port: int | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.backend = backend
        self.tp_size = tp_size
        self.layout = layout or Layout()
        self.port = bootstrap_port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="real-prefill-"))
        self.procs: list[subprocess.Popen[str]] = []
        self.ready: list[dict[str, Any]] = []
        #: room -> rank 0's latest report of it (each line replaces the room's entry whole)
        self._reports: dict[int, RoomReport] = {}
        self._starts = 0
        self._warm = False
        self._lock = threading.Lock()  # transfer() from several threads, spawn() swapping procs
        #: per process (by pid): what the READY reader read past the line it returned
        self._buffers: dict[int, bytearray] = {}

    def command(self, tp_rank: int) -> list[str]:
        g = self.layout.geometry
        cmd = [
            sys.executable, "-m", "tests.real_prefill.prefill_process",
            "--backend", self.backend,
            "--bootstrap-port", str(self.port),
            "--tp-size", str(self.tp_size),
            "--tp-rank", str(tp_rank),
            "--layers", str(g.layers),
            "--slots", str(g.slots),
            "--page-size", str(g.page_size),
            "--total-heads", str(self.layout.total_heads),
            "--head-bytes", str(g.head_bytes),
            "--aux-slots", str(g.aux_slots),
        ]  # fmt: skip
        if tp_rank == 0:
            cmd.append("--serve")
        if self.layout.mla:
            cmd.append("--mla")
        if self._warm:
            cmd.append("--wait-go")
        return cmd

    def spawn(self, *, warm: bool = False) -> None:
        """Start every rank process; :meth:`wait_ready` waits for them. ``warm``: each imports
        SGLang and waits for :meth:`go` (a replacement standing by, ready at once)."""
        self._starts += 1
        self._warm = warm
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.procs, self.ready = [], []
        for rank in range(self.tp_size):
            log = open(self.log_dir / f"rank{rank}-start{self._starts}.log", "w")  # noqa: SIM115
            proc = subprocess.Popen(
                self.command(rank), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, env=env, cwd=self.log_dir, start_new_session=True,
            )  # fmt: skip
            log.close()
            self.procs.append(proc)

    def go(self) -> None:
        """Let a warm replacement (``spawn(warm=True)``) bind and register now."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(self.procs):
            line = self._read_line(proc, deadline, READY)
            if line is None:
                self.kill()
                log = (self.log_dir / f"rank{rank}-start{self._starts}.log").read_text()[-3000:]
                raise RuntimeError(
                    f"SGLang prefill rank {rank} did not start (no READY line before it exited "
                    f"or in time):\n{log}"
                )
            self.ready.append(json.loads(line[len(READY) :]))
        first = self.procs[0]
        leftover = bytes(self._buffers.pop(first.pid, b""))
        threading.Thread(target=self._read_reports, args=(first, leftover), daemon=True).start()

    def start(self, timeout: float = 120.0) -> RealPrefill:
        self.spawn()
        self.wait_ready(timeout)
        return self

    def wait_warm(self, timeout: float = 120.0) -> None:
        """Wait until every rank of a warm spawn imported SGLang and waits for :meth:`go`."""
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(self.procs):
            line = self._read_line(proc, deadline, b"WARM")
            if line is None:
                raise RuntimeError(
                    f"SGLang prefill rank {rank} did not get warm (no WARM line before it "
                    "exited or in time)"
                )

    def _read_line(self, proc: subprocess.Popen[str], deadline: float, prefix: bytes) -> str | None:
        """The first line of ``proc``'s stdout starting with ``prefix`` (NIXL logs to stdout
        too: others are skipped), through the package's one reader of such lines; None when
        the process ended or ``deadline`` passed first. The bytes read past it stay in the
        process's buffer for the next call (or the report reader)."""
        assert proc.stdout is not None
        buffer = self._buffers.setdefault(proc.pid, bytearray())
        try:
            line = read_prefixed_line(proc.stdout.fileno(), prefix, deadline, buffer)
        except TimeoutError:
            return None
        return None if line is None else line.decode("utf-8", "replace").strip()

    def _read_reports(self, proc: subprocess.Popen[str], leftover: bytes) -> None:
        """Rank 0's report lines, until its stdout closes (its exit, or ``kill()`` closing it
        under this read): first those in ``leftover`` (what the READY reader read past its
        line), then the stream's. Other writers share that stdout (NIXL logs to it, from C++):
        a line is read as the reports it starts with, and text after them is skipped, so no
        other writer's text can cost a report or end this reader."""
        assert proc.stdout is not None
        stream = proc.stdout
        decoder = json.JSONDecoder()

        def lines() -> Iterator[str]:
            *whole, partial = leftover.decode("utf-8", "replace").split("\n")
            yield from whole
            for line in stream:  # the text layer read nothing yet: it starts where we stopped
                yield partial + line
                partial = ""
            if partial:
                yield partial

        try:
            for line in lines():
                text = line.strip()
                while text.startswith("{"):
                    try:
                        fields, end = decoder.raw_decode(text)
                    except json.JSONDecodeError:
                        break
                    room = fields.pop("room")
                    self._reports[room] = RoomReport(**fields)
                    text = text[end:].lstrip()
        except (ValueError, OSError):
            return  # kill() closed the stream: there is nothing more to read

    def report(self, room: int) -> RoomReport:
        """What rank 0 reported of ``room`` so far (every field None: nothing yet). Its times are
        ``time.monotonic()`` of the rank's process, the same clock as this one's."""
        return self._reports.get(room, _NOTHING_REPORTED)

    def transfer(
        self,
        room: int,
        src_pages: Sequence[int] | int,
        aux_index: int | None = None,
        state_index: int | None = None,
        *,
        break_source: bool = False,
    ) -> None:
        """What SGLang's prefill scheduler does for one request, on every rank: a sender for the
        room, its pages computed (the pattern), sent once the decode's metadata arrived.
        ``src_pages``: the rank's pages, or how many (each rank then takes free ones of its
        own and an aux slot, returned when the request ends). ``break_source``: the rank's
        transfer fails (source pages outside its buffers)."""
        command: dict[str, Any] = {
            "op": "send",
            "room": room,
            "state_index": state_index,
            "break_source": break_source,
        }
        if isinstance(src_pages, int):
            command["pages"] = src_pages
        else:
            command.update(src_pages=list(src_pages), aux_index=aux_index)
        line = json.dumps(command)
        with self._lock:
            for proc in self.procs:
                if proc.poll() is None and proc.stdin is not None:
                    try:
                        proc.stdin.write(line + "\n")
                        proc.stdin.flush()
                    except (BrokenPipeError, OSError, ValueError):
                        pass  # killed under us: the request fails on the decode side

    def swap_in(self, replacement: RealPrefill) -> None:
        """Route :meth:`transfer` to ``replacement``'s processes (started behind this port)."""
        with self._lock:
            self.procs, self.ready = replacement.procs, replacement.ready

    def kill(self) -> None:
        """SIGKILL every rank (and the bootstrap server with rank 0)."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    close = kill

    def __enter__(self) -> RealPrefill:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LibraryDecode:
    """This library's decode rank: a ``DecodeManager`` with SGLang 0.5.23's frames, its own real
    engine (Mooncake) or agent (NIXL), and KV/aux/state buffers registered with it."""

    def __init__(
        self,
        backend: str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        layout: Layout | None = None,
        liveness_timeout_s: float = 2.0,  # health probes every 0.5 s
        waiting_timeout_s: float = 30.0,
        **manager_options: Any,
    ) -> None:
        from statemachine import DecodeLayout, DecodeManager
        from statemachine.sglang.v0_5_23 import DecodeKVArgs, MooncakeBackend, NixlBackend

        self.backend = backend
        self.layout = layout or Layout()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.geometry = g = self.layout.side(tp_size)
        self.kv = [np.zeros(g.slots * g.item_len, dtype=np.uint8) for _ in range(g.buffers)]
        self.aux = np.zeros(g.aux_slots * g.aux_item_len, dtype=np.uint8)
        self.state = np.zeros(g.state_slots * g.state_item_len, dtype=np.uint8)
        self.has_state = has_state(backend)
        buffers = [*self.kv, self.aux, *([self.state] if self.has_state else [])]
        kv_args = DecodeKVArgs(
            engine_rank=tp_rank,
            attn_tp_size=tp_size,
            kv_data_ptrs=[b.ctypes.data for b in self.kv],
            kv_data_lens=[b.nbytes for b in self.kv],
            kv_item_lens=[g.item_len] * g.buffers,
            aux_data_ptrs=[self.aux.ctypes.data],
            **self.state_fields(),
            kv_mem_kinds=["DRAM"] * g.buffers if backend == "nixl" else (),
        )
        if backend == "mooncake":
            self.engine, self.session_id = engines.mooncake_engine()
            # Aux only: from_engine registers the KV and state buffers itself.
            engines.register(backend, self.engine, [self.aux])
            factory: Any = MooncakeBackend.from_engine(self.engine, "127.0.0.1", kv_args)
        else:
            self.engine = engines.nixl_agent(f"library-decode-{os.getpid()}-{next(_names)}")
            engines.register(backend, self.engine, buffers)
            self.session_id = self.engine.name
            factory = NixlBackend.from_agent(self.engine, kv_args)
        self.manager = DecodeManager(
            layout=DecodeLayout(
                tp_rank=tp_rank,
                tp_size=tp_size,
                page_size=g.page_size,
                kv_cache_dtype="bfloat16",
                is_mla=self.layout.mla,
            ),
            backend_factory=factory,
            ack_ip="127.0.0.1",
            liveness_timeout_s=liveness_timeout_s,
            waiting_timeout_s=waiting_timeout_s,
            **manager_options,
        )

    def state_fields(self) -> dict[str, Any]:
        if not has_state(self.backend):
            return {}
        return {
            "state_data_ptrs": [[self.state.ctypes.data]],
            "state_data_lens": [[self.state.nbytes]],
            "state_item_lens": [[self.geometry.state_item_len]],
            "state_dim_per_tensor": [[]],
            "state_layer_ids": [[]],
        }

    def request(
        self,
        address: str,
        room: int,
        dst_pages: Sequence[int],
        aux_index: int,
        state_index: int | None = None,
    ) -> Any:
        """``init()`` then ``send_metadata()``, as a decode scheduler does; returns the receiver."""
        from statemachine.completion import KVPoll

        receiver = self.manager.receiver(address, room, prefill_dp_rank=0)
        if receiver.init() == KVPoll.WaitingForInput:
            states = [[state_index]] if state_index is not None and self.has_state else ()
            receiver.send_metadata(list(dst_pages), aux_index, state_indices=states)
        return receiver

    def wrong_pages(
        self,
        room: int,
        dst_pages: Sequence[int],
        aux_index: int,
        state_index: int | None = None,
    ) -> list[str]:
        """Every destination byte range that does not hold ``room``'s pattern (empty: all right)."""
        return wrong_pages(self, room, dst_pages, aux_index, state_index)

    def reset(self) -> None:
        """Zero every buffer (so a later check cannot pass on an earlier room's bytes)."""
        for array in (*self.kv, self.aux, self.state):
            array[:] = 0

    def close(self) -> None:
        self.manager.close()


def wrong_pages(
    decode: Any, room: int, dst_pages: Sequence[int], aux_index: int, state_index: int | None
) -> list[str]:
    """The check, for any decode holding ``kv``/``aux``/``state`` arrays laid out by ``layout``
    for its ``tp_rank`` of ``tp_size`` (the library's and SGLang's own decode alike)."""
    layout: Layout = decode.layout
    g = layout.side(decode.tp_size)
    first = layout.first_head(decode.tp_rank, decode.tp_size)
    wrong = []
    for buffer, kv in enumerate(decode.kv):
        pages = kv.reshape(g.slots, g.item_len)
        for number, page in enumerate(dst_pages):
            if not np.array_equal(pages[page], page_bytes(room, buffer, number, g, first, g.heads)):
                wrong.append(f"kv buffer {buffer} page {page} (request page {number})")
    aux = decode.aux.reshape(g.aux_slots, g.aux_item_len)
    if not np.array_equal(aux[aux_index], aux_bytes(room, 0, g.aux_item_len)):
        wrong.append(f"aux slot {aux_index}")
    if state_index is not None and has_state(decode.backend):
        state = decode.state.reshape(g.state_slots, g.state_item_len)
        if not np.array_equal(state[state_index], state_bytes(room, 0, g.state_item_len)):
            wrong.append(f"state slot {state_index}")
    return wrong


class PrefillPool:
    """Started prefills shared by the tests of a session, one per (backend, tp, MLA): a start
    costs seconds (SGLang's import), a request milliseconds. ``close()`` stops them all."""

    def __init__(self, spawn: Sequence[tuple[str, int, bool]] = ()) -> None:
        """``spawn``: (backend, tp, MLA) keys to start at once, in parallel (their imports
        overlap); each is waited for on its first :meth:`get`."""
        self._prefills: dict[tuple[str, int, bool], RealPrefill] = {}
        self._waiting: set[tuple[str, int, bool]] = set()
        for backend, tp_size, mla in spawn:
            prefill = RealPrefill(backend, tp_size=tp_size, layout=Layout(mla=mla))
            prefill.spawn()
            self._prefills[backend, tp_size, mla] = prefill
            self._waiting.add((backend, tp_size, mla))

    def get(self, backend: str, tp_size: int = 1, *, mla: bool = False) -> RealPrefill:
        key = (backend, tp_size, mla)
        if key not in self._prefills:
            self._prefills[key] = RealPrefill(backend, tp_size=tp_size, layout=Layout(mla=mla))
            self._prefills[key].spawn()
            self._waiting.add(key)
        if key in self._waiting:
            self._waiting.discard(key)
            self._prefills[key].wait_ready()
        return self._prefills[key]

    def close(self) -> None:
        for prefill in self._prefills.values():
            prefill.close()
        self._prefills.clear()
