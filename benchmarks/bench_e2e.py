"""Real KV bytes through SGLang 0.5.23's own prefill: one decode's requests/s and its latency from
``init()`` to Success, this library vs SGLang's own decode, with the engine's own writes as floor.

The prefill is SGLang's real one (``tests/real_prefill``: its bootstrap server and its Mooncake
or NIXL prefill manager in their own process, senders driven as its scheduler drives them, CPU
buffers), tp 1. The two decodes run in this process, one after the other, each with its own
real engine (or agent) and registered CPU buffers:

* **ours**: a ``DecodeManager`` with the backend's ``from_engine``/``from_agent``;
* **sglang**: SGLang's own decode KV manager and receivers, driven as its ``decode.py`` does.

A round, per decode and per request size (1, 8, 64 pages): ``--batch`` requests issued back to
back (the prefill told of each, then ``init()`` and ``send_metadata()`` on the decode), then
every one polled until it ends. Figures: requests/s over the round (first ``init()`` to the last
Success), and p50/p99 of each request's ``init()`` → Success. Every Success is then checked byte
for byte (outside the timed window, the same check for both); a wrong byte or a failure makes
the benchmark exit 1. Rounds interleave the decodes (their order alternating); each figure is
the median over rounds. The ratio row pairs the two decodes round by round (they ran back to
back): the median of the per-round ratios, ours over SGLang's for requests/s and SGLang's over
ours for latencies (> 1: ours is better), and in how many rounds ours was faster. A round's time
is heavy-tailed here (a transfer on the prefill stalls for 0.3-0.8 s in some rounds, whichever
decode runs), so five rounds are too few: 15 by default.

Where a request's time goes, from the prefill's own timestamps (p50 per round, then the median):
``to send``: ``init()`` -> the prefill's ``send()`` (the metadata arrived and the prefill's
scheduler acted on it); ``xfer``: ``send()`` -> the prefill's manager set Success (the bytes
written, just before it tells the decode); ``seen``: that -> the decode's ``poll()`` said
Success (the status message's way, the decode's reading of it and its next poll). The first
two are the prefill's work, the same frames for both decodes; only ``seen`` (and the
metadata's way there) is the decode's. And what the decode costs its scheduler's thread, in
CPU time (which the machine's load does not stretch as it stretches wall time): ``init µs``
per ``request()`` (``init()`` and ``send_metadata()``), ``poll µs`` per ``poll()``; their
ratios are SGLang's over ours.

The floor (Mooncake): the same bytes written by a second engine in this process with
``transfer_sync_write``, one call per page per buffer and one for aux (as the prefill's
scattered pages need), with no bootstrap, no messages and no status: what the engine alone
costs. NIXL has no floor row here.

Everything runs on loopback TCP on a CPU machine shared with other work: indicative only.

    .venv/bin/python -m benchmarks bench_e2e            # Mooncake and NIXL, ~2 minutes
    .venv/bin/python -m benchmarks.bench_e2e --smoke    # seconds: Mooncake, 1 and 8 pages
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent  # the repository: tests.support, tests.real_prefill
SIZES = (1, 8, 64)
SUCCESS, FAILED = 4, 0  # KVPoll values, the same in SGLang and this library


@contextmanager
def _tests_on_path() -> Iterator[None]:
    sys.path.insert(0, str(_REPO))
    try:
        yield
    finally:
        sys.path.remove(str(_REPO))


def unavailable(backend: str) -> str | None:
    """Why the benchmark cannot run ``backend`` here, or None."""
    with _tests_on_path():
        from tests.real_prefill.engines import engine_unavailable
        from tests.support.sglang_support import sglang_unavailable

        return sglang_unavailable() or engine_unavailable(backend)


@dataclass
class Figures:
    """One decode's rounds for one request size (lists aligned by round)."""

    rps: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    #: per round, the p50 of each phase of a request as the prefill saw it (ms; empty for the
    #: floor): init() -> the prefill's send() (the metadata arrived and its scheduler acted),
    #: send() -> the prefill's manager set Success, that -> the decode's poll() said Success
    phases: list[tuple[float, float, float]] = field(default_factory=list)
    #: per round, the calling thread's CPU time (µs) per ``request()`` (``init()`` and
    #: ``send_metadata()``) and per ``poll()``: what the decode costs its scheduler's thread,
    #: a figure the machine's load does not stretch as it stretches wall time
    cpu_us: list[tuple[float, float]] = field(default_factory=list)

    def add(self, elapsed_s: float, latencies_s: list[float]) -> None:
        ordered = sorted(latencies_s)
        self.rps.append(len(ordered) / elapsed_s)
        self.p50_ms.append(1000 * statistics.median(ordered))
        self.p99_ms.append(1000 * ordered[min(len(ordered) - 1, round(0.99 * len(ordered)))])

    def medians(self) -> tuple[float, float, float]:
        return (
            statistics.median(self.rps),
            statistics.median(self.p50_ms),
            statistics.median(self.p99_ms),
        )

    def cpu_medians(self) -> tuple[float, float] | None:
        if not self.cpu_us:
            return None
        request, poll = zip(*self.cpu_us, strict=True)
        return statistics.median(request), statistics.median(poll)

    def phase_medians(self) -> tuple[float, float, float] | None:
        if not self.phases:
            return None
        to_send, transfer, seen = zip(*self.phases, strict=True)
        return statistics.median(to_send), statistics.median(transfer), statistics.median(seen)


def paired(ours: Figures, sglang: Figures) -> tuple[float, float, float, int, int]:
    """Ours against SGLang's round by round (the two ran back to back, so a load swing on the
    shared machine hits both): the medians of the per-round ratios (> 1: ours is better), and
    in how many of the rounds ours had the higher requests/s."""
    rounds = list(zip(ours.rps, sglang.rps, ours.p50_ms, sglang.p50_ms, ours.p99_ms,
                      sglang.p99_ms, strict=True))  # fmt: skip
    return (
        statistics.median(o / s for o, s, *_ in rounds),
        statistics.median(s50 / o50 for _, _, o50, s50, _, _ in rounds),
        statistics.median(s99 / o99 for *_, o99, s99 in rounds),
        sum(o > s for o, s, *_ in rounds),
        len(rounds),
    )


class Bench:
    """The prefill, both decodes and the floor's engine for one backend."""

    def __init__(self, backend: str, batch: int) -> None:
        with _tests_on_path():
            from tests.real_prefill.harness import Layout, LibraryDecode, RealPrefill
            from tests.real_prefill.pattern import Geometry
            from tests.real_prefill.sglang_decode import SGLangDecode

        self.backend, self.batch = backend, batch
        slots = batch * max(SIZES)
        # 1 KiB pages (8 heads of 128 bytes), a prefill with room for two rounds in flight.
        self.layout = Layout(
            total_heads=8,
            geometry=Geometry(slots=2 * slots, head_bytes=128, aux_slots=2 * batch),
        )
        self.prefill = RealPrefill(backend, layout=self.layout).start()
        self.decodes: dict[str, Any] = {
            "ours": LibraryDecode(backend, layout=self.layout, health_probes=False),
            "sglang": SGLangDecode(backend, layout=self.layout),
        }
        self.rooms = iter(range(1, 1 << 40))
        self.wrong = 0
        self.failed: list[str] = []
        self.floor_engine: Any = None
        if backend == "mooncake":
            self._floor_setup()

    def _floor_setup(self) -> None:
        import numpy as np

        with _tests_on_path():
            from tests.real_prefill import engines

        g = self.layout.side(1)
        self.floor_engine, _ = engines.mooncake_engine()
        self.floor_src = np.ones(g.slots * g.item_len + g.aux_item_len, dtype=np.uint8)
        engines.register("mooncake", self.floor_engine, [self.floor_src])

    def destination(self, index: int, pages: int) -> list[int]:
        """Request ``index``'s destination pages: scattered, distinct within a round."""
        slots = self.layout.side(1).slots
        return [(index * pages + i) * 7 % slots for i in range(pages)]

    def round(self, name: str, pages: int, figures: Figures) -> None:
        decode = self.decodes[name]
        requests = []
        cpu = time.thread_time
        request_cpu = poll_cpu = 0.0
        polls = 0
        # time.monotonic: the prefill process stamps its events with the same clock
        started = time.monotonic()
        for index in range(self.batch):
            room = next(self.rooms)
            dst, aux = self.destination(index, pages), index
            self.prefill.transfer(room, pages)
            issued = time.monotonic()
            before = cpu()
            handle = decode.request(self.prefill.address, room, dst, aux)
            request_cpu += cpu() - before
            requests.append([room, dst, aux, handle, issued, None])
        pending = list(requests)
        while pending:
            for request in list(pending):
                before = cpu()
                state = int(request[3].poll())
                poll_cpu += cpu() - before
                polls += 1
                if state in (SUCCESS, FAILED):
                    request[5] = time.monotonic() if state == SUCCESS else -1.0
                    pending.remove(request)
            time.sleep(0.0005)  # a scheduler's iteration: the decodes' own threads get the GIL
        finished = time.monotonic()
        for room, dst, aux, handle, _issued, done in requests:
            if done == -1.0:
                self.failed.append(f"{name} room {room}: {getattr(handle, 'failure', None)}")
            else:
                self.wrong += len(decode.wrong_pages(room, dst, aux))
            if hasattr(handle, "clear"):
                handle.clear()
        latencies = [r[5] - r[4] for r in requests if r[5] != -1.0]
        if latencies:
            figures.add(finished - started, latencies)
            figures.cpu_us.append((1e6 * request_cpu / len(requests), 1e6 * poll_cpu / polls))
            self._phases([(r[0], r[4], r[5]) for r in requests if r[5] != -1.0], figures)

    def _phases(self, done: list[tuple[int, float, float]], figures: Figures) -> None:
        """Each request's phases from the prefill's own timestamps (its report lines arrive on
        a reader thread, shortly after the decode saw Success: waited for, a bounded time)."""
        prefill = self.prefill
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
            prefill.report(room).concluded_at is None for room, *_ in done
        ):
            time.sleep(0.005)
        rows = [(prefill.report(room), issued, seen) for room, issued, seen in done]
        rows = [
            (r, issued, seen)
            for r, issued, seen in rows
            if r.sent_at is not None and r.concluded_at is not None
        ]
        if not rows:
            return
        figures.phases.append((
            1000 * statistics.median(r.sent_at - issued for r, issued, _ in rows),
            1000 * statistics.median(r.concluded_at - r.sent_at for r, _, _ in rows),
            1000 * statistics.median(seen - r.concluded_at for r, _, seen in rows),
        ))  # fmt: skip

    def floor_round(self, pages: int, figures: Figures) -> None:
        """The same bytes, one ``transfer_sync_write`` per page per buffer and one for aux."""
        decode = self.decodes["ours"]
        g = self.layout.side(1)
        src = self.floor_src.ctypes.data
        latencies = []
        started = time.perf_counter()
        for index in range(self.batch):
            issued = time.perf_counter()
            for kv in decode.kv:
                for number, page in enumerate(self.destination(index, pages)):
                    dst = kv.ctypes.data + page * g.item_len
                    rc = self.floor_engine.transfer_sync_write(
                        decode.session_id, src + number * g.item_len, dst, g.item_len
                    )
                    if rc != 0:
                        self.failed.append(f"floor write returned {rc}")
            aux_dst = decode.aux.ctypes.data + index * g.aux_item_len
            self.floor_engine.transfer_sync_write(
                decode.session_id, src + g.slots * g.item_len, aux_dst, g.aux_item_len
            )
            latencies.append(time.perf_counter() - issued)
        figures.add(time.perf_counter() - started, latencies)

    def close(self) -> None:
        for decode in self.decodes.values():
            decode.close()
        self.prefill.close()


def run(backend: str, sizes: tuple[int, ...], rounds: int, batch: int, log: Callable[[str], None]
        ) -> tuple[dict[tuple[int, str], Figures], int, list[str]]:  # fmt: skip
    bench = Bench(backend, batch)
    results: dict[tuple[int, str], Figures] = {}
    try:
        for pages in sizes:  # warm-up: topology fetch, connections, first registrations
            for name in bench.decodes:
                bench.round(name, pages, Figures())
        for number in range(rounds):
            for pages in sizes:
                names = list(bench.decodes)
                if number % 2:
                    names.reverse()
                for name in names:
                    bench.round(name, pages, results.setdefault((pages, name), Figures()))
                if bench.floor_engine is not None:
                    bench.floor_round(pages, results.setdefault((pages, "floor"), Figures()))
            log(f"  {backend}: round {number + 1} of {rounds} done")
    finally:
        bench.close()
    return results, bench.wrong, bench.failed


def table(backend: str, results: dict[tuple[int, str], Figures], batch: int, rounds: int) -> str:
    lines = [
        f"{backend}: SGLang 0.5.23's real prefill (tp 1) -> one decode (tp 1), {batch} requests "
        f"a round, medians of {rounds} rounds",
        f"{'pages':>5}  {'decode':<28}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'to send':>9}{'xfer':>9}{'seen':>9}{'init µs':>9}{'poll µs':>9}",
    ]
    labels = {"floor": "floor (transfer_sync_write)", "sglang": "SGLang's decode", "ours": "ours"}
    for pages in sorted({p for p, _ in results}):
        for name in ("floor", "sglang", "ours"):
            if (pages, name) in results:
                rps, p50, p99 = results[pages, name].medians()
                phases = results[pages, name].phase_medians()
                cpu = results[pages, name].cpu_medians()
                tail = "".join(f"{ms:>9.2f}" for ms in phases) if phases else ""
                tail += "".join(f"{us:>9.1f}" for us in cpu) if cpu else ""
                lines.append(
                    f"{pages:>5}  {labels[name]:<28}{rps:>9.0f}{p50:>9.2f}{p99:>9.2f}{tail}"
                )
        if (pages, "ours") in results and (pages, "sglang") in results:
            ours, sglang = results[pages, "ours"], results[pages, "sglang"]
            rps_x, p50_x, p99_x, won, of = paired(ours, sglang)
            (o_init, o_poll), (s_init, s_poll) = (
                ours.cpu_medians() or (1, 1),
                sglang.cpu_medians() or (1, 1),
            )
            lines.append(
                f"{pages:>5}  {'ratio ours/SGLang (>1 better)':<28}{rps_x:>8.2f}x"
                f"{p50_x:>8.2f}x{p99_x:>8.2f}x{'':>27}"
                f"{s_init / o_init:>8.2f}x{s_poll / o_poll:>8.2f}x"
                f"   ours faster in {won} of {of} rounds"
            )
    lines.append(
        "  ratios: medians of the per-round ratios (each round runs both decodes back to back); "
        "phases (p50 ms, from the prefill's timestamps): init() -> the prefill's send(), "
        "send() -> its manager's Success, -> the decode's Success; init/poll µs: the calling "
        "thread's CPU time per request() (init + send_metadata) and per poll()"
    )
    return "\n".join(lines)


def load_average() -> str:
    return "load average " + " ".join(f"{load:.2f}" for load in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="mooncake,nixl", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=15, help="rounds per decode and size")
    parser.add_argument("--batch", type=int, default=32, help="requests per round")
    parser.add_argument("--smoke", action="store_true", help="seconds: Mooncake, 1 and 8 pages")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    backends, sizes, rounds, batch = args.backends.split(","), SIZES, args.rounds, args.batch
    if args.smoke:
        backends, sizes, rounds, batch = ["mooncake"], (1, 8), 1, 4
        print("smoke run: tiny counts, the figures are not judged")
    status = 0
    for backend in backends:
        reason = unavailable(backend)
        if reason is not None:
            print(f"bench_e2e {backend} skipped: {reason}")
            continue
        before = load_average()
        results, wrong, failed = run(backend, sizes, rounds, batch, lambda s: print(s, flush=True))
        print(table(backend, results, batch, rounds))
        print(f"  {before} before, {load_average()} after (2 cores here)")
        print(f"  wrong byte ranges: {wrong}; failed requests: {len(failed)}", flush=True)
        for failure in failed[:5]:
            print(f"    {failure}")
        if wrong or failed:
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
