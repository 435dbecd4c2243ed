"""A two-rank SGLang 0.5.23 decode (tp 2, or dp attention 2) in front of SGLang's real prefill,
and the restart script both decode class sets run through.

:class:`DecodeRanks` starts the two rank processes of :mod:`real_prefill.decode_rank` (SGLang's
decode queues over a real gloo process group) and reads their events; :func:`restart_run` is the
script: requests complete, some are in flight when every prefill rank is SIGKILLed, a new prefill
starts behind the same bootstrap port, requests after its READY. Needs real torch
(``make .venv/.torch``): :func:`torch_unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.real_prefill.decode_rank import PAGES_PER_REQUEST, REAL_TORCH
from tests.real_prefill.harness import Layout, RealPrefill
from tests.support.http_support import free_port

_ROOT = Path(__file__).resolve().parents[2]
#: how long the requests started after the new prefill's READY are watched
OBSERVE_S = 10.0
LAYOUT = Layout()


def torch_unavailable() -> str | None:
    """Why the real torch CPU build is not here (the skip reason), or None."""
    if not (REAL_TORCH / "torch" / "__init__.py").is_file():
        return f"real torch is not installed in {REAL_TORCH}: run `make .venv/.torch`"
    return None


@dataclass
class Outcome:
    label: str
    room: int
    ranks: tuple[int, ...]  # the decode ranks holding the request
    states: dict[int, tuple[str, str, float]] = field(
        default_factory=dict
    )  # rank: state, detail, at
    since: float = 0.0  # the kill (in flight) or READY (after)

    @property
    def state(self) -> str:
        if any(self.states.get(r, ("",))[0] in ("failed", "wrong") for r in self.ranks):
            return "failed"
        if all(self.states.get(r, ("",))[0] == "done" for r in self.ranks):
            return "done"
        return "pending"

    @property
    def detail(self) -> str:
        details = {self.states[r][1] for r in self.ranks if r in self.states}
        return "; ".join(sorted(details))

    @property
    def seconds(self) -> float | None:
        if self.state == "pending":
            return None
        return max(at for _, _, at in self.states.values()) - self.since

    @property
    def verified(self) -> int:
        """Ranks whose pages were checked byte for byte and held the room's pattern."""
        return sum(1 for r in self.ranks if self.states.get(r, ("",))[0] == "done")


@dataclass
class Run:
    mode: str
    classes: str
    outcomes: list[Outcome] = field(default_factory=list)
    ready_after_s: float = 0.0
    ranks: list[dict[str, Any]] = field(default_factory=list)  # each rank's ready event


class DecodeRanks:
    """The two decode rank processes of one run, their stdin and their events."""

    def __init__(self, mode: str, classes: str, log_dir: Path) -> None:
        self.mode = mode
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        init_port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.procs: list[subprocess.Popen[str]] = []
        for rank in (0, 1):
            command = [
                sys.executable, "-m", "tests.real_prefill.decode_rank", "--mode", mode,
                "--rank", str(rank), "--init-port", str(init_port), "--classes", classes,
            ]  # fmt: skip
            with open(log_dir / f"decode-{mode}-{classes}-rank{rank}.log", "w") as log:
                proc = subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                    text=True, env=env, cwd=log_dir, start_new_session=True,
                )  # fmt: skip
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                with self._changed:
                    self.events.append(json.loads(line))
                    self._changed.notify_all()
        with self._changed:
            self.events.append({"event": "exit", "code": proc.wait()})
            self._changed.notify_all()

    def wait_for(self, wanted: Any, timeout: float) -> list[dict[str, Any]]:
        """Wait until ``wanted(events)`` is true (then the events), or ``timeout``; a rank's
        exit ends the wait with an error naming it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not wanted(self.events):
                exits = [e for e in self.events if e["event"] == "exit"]
                if exits:
                    raise RuntimeError(f"a decode rank exited: {exits}")
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return list(self.events)

    def ready(self, timeout: float = 240.0) -> list[dict[str, Any]]:
        events = self.wait_for(lambda es: sum(e["event"] == "ready" for e in es) == 2, timeout)
        ready = sorted((e for e in events if e["event"] == "ready"), key=lambda e: e["rank"])
        if len(ready) != 2:
            raise RuntimeError(f"the decode ranks did not start in {timeout:.0f} s")
        return ready

    def send(self, rank: int, command: dict[str, Any]) -> None:
        proc = self.procs[rank]
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(command) + "\n")
        proc.stdin.flush()

    def start(self, outcome: Outcome, address: str) -> None:
        """The request reaches its group's leader, as from the tokenizer or the dp controller."""
        self.send(outcome.ranks[0], {"op": "start", "room": outcome.room, "address": address})

    def collect(self, outcomes: list[Outcome]) -> None:
        by_room = {o.room: o for o in outcomes}
        with self._changed:
            for e in self.events:
                if e["event"] == "outcome" and e["room"] in by_room:
                    by_room[e["room"]].states[e["rank"]] = (e["state"], e["detail"], e["at"])

    def close(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(BrokenPipeError, OSError):
                    self.send(rank, {"op": "stop"})
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def prefill_side(k: int, aux_slots: int) -> tuple[list[int], int]:
    """The k-th request's source pages and aux slot on the prefill (scattered, its own)."""
    base = 8 + k * PAGES_PER_REQUEST
    return [base + i for i in (2, 0, 3, 1)], k % aux_slots


def restart_run(mode: str, classes: str, port: int, rooms: Any) -> Run:
    """The script, for decode ``mode`` (``tp``: tp 2; ``dp``: tp 2 with dp attention 2) and
    ``classes`` (``sglang``: SGLang's own; ``installed``: the library's)."""
    run = Run(mode, classes)
    log_dir = Path(tempfile.mkdtemp(prefix=f"multirank-{mode}-{classes}-"))
    # tp 2: the prefill at tp 2, rank for rank; dp attention 2: each dp rank is attn tp 1 and
    # pulls whole pages from a tp 1 prefill.
    prefill = RealPrefill(
        "mooncake", tp_size=2 if mode == "tp" else 1, layout=LAYOUT, bootstrap_port=port,
        log_dir=log_dir,
    )  # fmt: skip
    aux_slots = LAYOUT.side(1).aux_slots
    prefill.spawn()
    decode = DecodeRanks(mode, classes, log_dir)
    try:
        run.ranks = decode.ready()
        prefill.wait_ready()

        def request(label: str, k: int, since: float) -> Outcome:
            room = next(rooms)
            holders = (0, 1) if mode == "tp" else (k % 2,)
            outcome = Outcome(label, room, holders, since=since)
            run.outcomes.append(outcome)
            decode.start(outcome, prefill.address)
            return outcome

        def settle(outcomes: list[Outcome], until: float) -> None:
            def ended(_: list[dict[str, Any]]) -> bool:
                decode.collect(outcomes)
                return all(o.state != "pending" for o in outcomes)

            decode.wait_for(ended, max(0.0, until - time.monotonic()))
            decode.collect(outcomes)

        now = time.monotonic()
        before = [request(f"before the kill, {i + 1}", i, now) for i in range(2)]
        for k, outcome in enumerate(before):
            src, aux = prefill_side(k, aux_slots)
            prefill.transfer(outcome.room, src, aux_index=aux)
        settle(before, time.monotonic() + 60.0)

        in_flight = [request(f"in flight at the kill, {i + 1}", i, 0.0) for i in range(2)]
        # every holder sent its metadata (no transfer: the prefill waits for nothing)
        wanted = {(o.room, r) for o in in_flight for r in o.ranks}
        decode.wait_for(
            lambda es: wanted <= {(e["room"], e["rank"]) for e in es if e["event"] == "sent"},
            60.0,
        )
        killed = time.monotonic()
        for outcome in in_flight:
            outcome.since = killed
        prefill.kill()
        prefill.spawn()  # behind the same bootstrap port; the ranks keep stepping meanwhile
        prefill.wait_ready()
        ready = time.monotonic()
        run.ready_after_s = ready - killed
        after = [request(f"after READY, {i + 1}", i, ready) for i in range(2)]
        for k, outcome in enumerate(after):
            src, aux = prefill_side(4 + k, aux_slots)
            prefill.transfer(outcome.room, src, aux_index=aux)
        settle(in_flight + after, ready + OBSERVE_S)
    finally:
        decode.close()
        prefill.close()
    return run


def table(runs: list[Run]) -> str:
    """The restart table: one row per run (mode, classes)."""
    lines = [
        "| decode | classes | requests ok | failed | failed after READY | hung "
        "| pages verified | first success after READY | in flight at the kill "
        "| new prefill READY after the kill |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        outs = run.outcomes
        after = [o for o in outs if o.label.startswith("after READY")]
        in_flight = [o for o in outs if o.label.startswith("in flight")]
        ok = [o for o in outs if o.state == "done"]
        firsts = [o.seconds for o in after if o.state == "done" and o.seconds is not None]
        pages = sum(o.verified for o in outs) * PAGES_PER_REQUEST
        flight = "; ".join(
            f"{o.state}{'' if o.seconds is None else f' after {o.seconds:.1f} s'}"
            for o in in_flight
        )
        mode = "tp 2" if run.mode == "tp" else "dp attention 2 (tp 2)"
        classes = "SGLang's own" if run.classes == "sglang" else "library (installed)"
        lines.append(
            f"| {mode} | {classes} | {len(ok)}/{len(outs)} "
            f"| {sum(o.state == 'failed' for o in outs)} "
            f"| {sum(o.state == 'failed' for o in after)} "
            f"| {sum(o.state == 'pending' for o in outs)} "
            f"| {pages} "
            f"| {f'{min(firsts):.2f} s' if firsts else 'none'} | {flight} "
            f"| {run.ready_after_s:.1f} s |"
        )
    return "\n".join(lines)
