"""Scheduler-thread CPU time per request through SGLang 0.5.23's own decode queues: this
library's KV manager and receiver classes against SGLang's own, in the same run (issue 31).

SGLang's decode scheduler is one thread running one event loop: every microsecond it spends in
the KV classes is a microsecond the GPU waits for the next batch. This measures only that
thread, with ``time.thread_time()`` around the queue calls; the classes' own background threads
(SGLang's status and heartbeat threads, the library's listener and health monitor) are not
counted, on either side.

Both sides run SGLang's ``DecodePreallocQueue`` and ``DecodeTransferQueue`` of the 0.5.23
wheel, built by their own constructors as ``tests/sglang/test_sglang_decode_queues.py`` builds them
(``tests/support/sglang_decode_support.py``: stand-ins only for the GPU pools, the scheduler and a
one-rank group; SGLang's shared Mooncake engine is a stand-in too, so no byte moves: a transfer
engine's work is on its own threads, not the scheduler's). One decode's queues get their
classes through ``get_kv_class`` with ``statemachine.sglang.v0_5_23.decode_worker.install()``
in place (ours: ``conn.MooncakeKVManager`` / ``MooncakeKVReceiver``), the other's without it
(SGLang's ``mooncake/conn.py`` classes). The prefill is SGLang's own bootstrap server and one
prefill-mode ``CommonKVManager`` rank (tp 1) registered by SGLang's ``register_to_bootstrap``;
outside the timed calls, this thread drains that rank's PULL socket, lands each request's aux
row (what the prefill's transfer writes) and reports Success with SGLang's own status sender.

Per request, the scheduler's calls in decode.py's order (timed, summed per phase):

* **bootstrap**: ``add`` (the receiver created through ``get_kv_class`` and ``init()`` on a
  cached topology), ``_resolve_pending_reqs``, ``_update_handshake_waiters`` until
  WaitingForInput;
* **send**: ``_send_kv_metadata`` (what ``pop_preallocated`` calls once pages are allocated,
  decode.py:1645), and the hand-over to the transfer queue (``extend``);
* **poll, waiting**: one ``pop_transferred`` with the whole batch in flight and no status yet
  (what every event-loop iteration pays per request until its KV lands), per request;
* **complete**: ``pop_transferred`` 20 ms after the statuses left the prefill, again every
  2 ms until it has returned the whole batch (the polls per batch are printed), and each
  request's ``clear()`` (``_commit_transfer_to_req``'s last step, decode.py:2774-2775);
* **request**: bootstrap + send + complete (one waiting poll added: at least one iteration
  passes while a transfer runs).

Rounds interleave the two decodes batch by batch (SGLang's first in even rounds, ours first in
odd ones); each
figure is the median over rounds; the ratio is SGLang's median over ours (> 1: ours spends less
scheduler CPU). The floor: the whole request's ratio must not fall below 1.0 (the library's
classes cost SGLang's scheduler no more than SGLang's own); reported, never asserted.

    .venv/bin/python -m benchmarks bench_decode_queues    # ~1 minute
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

_REPO = Path(__file__).resolve().parent.parent  # the repository: tests.support, tests.real_prefill

ROUNDS = 11
BATCH = 32  # requests per timed batch, all in flight at once
BATCHES = 4  # per decode and round
PAGES = 16  # KV pages per request
#: The ratio SGLang / ours of the whole request below which a change is a regression.
FLOOR = 1.0
PHASES = ("bootstrap", "send", "poll", "complete")
#: The table's rows: label, the phases summed (the last row is the floor's figure).
FIGURES = (
    ("bootstrap (add .. WaitingForInput)", ("bootstrap",)),
    ("send (_send_kv_metadata + extend)", ("send",)),
    ("poll while waiting (per iteration)", ("poll",)),
    ("complete (pop_transferred + clear)", ("complete",)),
    ("whole request (bootstrap..clear, one wait)", PHASES),
)
#: Between the statuses leaving the prefill and the first completion poll.
SETTLE_S = 0.02
SUCCESS = 4  # KVPoll.Success, the same value in SGLang and this library


def sglang_unavailable() -> str | None:
    """Why SGLang's wheel cannot run here (not installed, another version, not Python 3.11)."""
    sys.path.insert(0, str(_REPO))
    support = importlib.import_module("tests.support.sglang_support")
    reason: str | None = support.sglang_unavailable()
    return reason


@dataclass
class Decode:
    """One decode rank's queues and what this thread needs to drive them."""

    name: str
    prealloc: Any
    transfer: Any
    install: Callable[[], Any]  # a context manager: the classes get_kv_class answers meanwhile
    rooms: Iterator[int]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    polls: int = 0
    #: the receiver class get_kv_class gave the last request (checked: ours or SGLang's)
    receiver_class: type | None = None


class Prefill:
    """SGLang's bootstrap server and one prefill rank, answered from this thread."""

    def __init__(self, stack: ExitStack, support: Any) -> None:
        self.addr = stack.enter_context(support.sglang_bootstrap_server())
        self.rank = stack.enter_context(
            support.sglang_prefill_rank(self.addr, tp_size=1, tp_rank=0)
        )

    def drain(self, expected_rooms: set[int], timeout: float = 10.0) -> None:
        """Read the rank's PULL socket until every room in ``expected_rooms`` sent its metadata
        (registrations, whose first frame is not a room, are read and dropped)."""
        sock, deadline = self.rank.server_socket, time.monotonic() + timeout
        while expected_rooms:
            if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
                raise RuntimeError(f"the prefill rank never got rooms {sorted(expected_rooms)}")
            first = sock.recv_multipart()[0]
            if first.isdigit():
                expected_rooms.discard(int(first))

    def succeed(self, decode: Decode, requests: list[Any]) -> None:
        """What the prefill's transfer does, then its status: the aux row lands, then Success."""
        manager, metadata = decode.prealloc.kv_manager, decode.transfer.metadata_buffers
        for decode_req in requests:
            room = decode_req.req.bootstrap_room
            metadata.bootstrap_room[decode_req.metadata_buffer_index, 0] = room
            self.rank.send_kv_status_message(
                targets=[(manager.local_ip, manager.rank_port)], bootstrap_room=room,
                status=SUCCESS,
            )  # fmt: skip


def commit(decode_req: Any) -> None:
    """``_commit_transfer_to_req`` (decode.py:2600-2777) reads the first output token out of
    GPU tensors; its last step (2774-2775) is what it does with the receiver."""
    decode_req.kv_receiver.clear()
    decode_req.kv_receiver = None


class Timer:
    """This thread's CPU time, summed per phase for one batch."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.thread_time()
        try:
            yield
        finally:
            self.spent[name] += time.thread_time() - start


def run_batch(decode: Decode, prefill: Prefill, support: Any) -> None:
    """``BATCH`` requests through the queues, every scheduler call timed by its phase."""
    prealloc, transfer = decode.prealloc, decode.transfer
    timer = Timer()
    reqs = [support.Req(prefill.addr, room=next(decode.rooms)) for _ in range(BATCH)]
    with decode.install():
        with timer.phase("bootstrap"):
            for req in reqs:
                prealloc.add(req)
            prealloc._resolve_pending_reqs()
            decode.receiver_class = type(prealloc.queue[-1].kv_receiver)
            prealloc._update_handshake_waiters()
        while not all(d.waiting_for_input for d in prealloc.queue):
            time.sleep(0.001)  # the registration on the manager's threads (not this one's)
            with timer.phase("bootstrap"):
                prealloc._update_handshake_waiters()
        in_flight = list(prealloc.queue)
        with timer.phase("send"):
            for number, decode_req in enumerate(in_flight):
                first = number * PAGES
                kv_pages = support.pages(list(range(first, first + PAGES)))
                prealloc._send_kv_metadata(decode_req, kv_pages, page_size=1)
                prealloc.queue.remove(decode_req)
            transfer.extend(in_flight)
        prefill.drain({d.req.bootstrap_room for d in in_flight})
        with timer.phase("poll"):
            if transfer.pop_transferred():
                raise RuntimeError(f"{decode.name}: a request completed with no status sent")
        prefill.succeed(decode, in_flight)
        done: list[Any] = []
        deadline = time.monotonic() + 10.0
        # The statuses cross to the manager's listener thread: one wait long enough for all of
        # them (as a forward pass would be), so both decodes normally complete in one poll.
        time.sleep(SETTLE_S)
        while len(done) < BATCH:
            with timer.phase("complete"):
                done += transfer.pop_transferred()
            decode.polls += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{decode.name}: {BATCH - len(done)} requests never completed")
            if len(done) < BATCH:
                time.sleep(0.002)
    failed = [r.rid for r in reqs if r.finished_reason is not None]
    if failed or transfer.queue or prealloc.queue:
        raise RuntimeError(f"{decode.name}: requests failed or left queued: {failed}")
    transfer.released.clear()
    for name, seconds in timer.spent.items():
        decode.seconds.setdefault(name, []).append(seconds)


@contextmanager
def decodes(stack: ExitStack) -> Iterator[tuple[Prefill, list[Decode]]]:
    sys.path.insert(0, str(_REPO))
    support = importlib.import_module("tests.support.sglang_decode_support")
    sglang_support = importlib.import_module("tests.support.sglang_support")
    decode_worker = importlib.import_module("statemachine.sglang.v0_5_23.decode_worker")
    sglang_support.import_sglang()
    prefill = Prefill(stack, sglang_support)
    stack.enter_context(support.mooncake_engine(support.StandInMooncakeEngine()))
    built = []
    for name, rooms in (("sglang", 1 << 40), ("ours", 2 << 40)):
        install = (lambda: decode_worker.install(["mooncake"])) if name == "ours" else ExitStack
        with install():
            prealloc, transfer = stack.enter_context(
                support.decode_queues(
                    "mooncake",
                    pool=support.KVPool(pages=BATCH * PAGES),
                    metadata=support.MetadataBuffers(slots=BATCH),
                )
            )
        transfer._commit_transfer_to_req = commit
        built.append(Decode(name, prealloc, transfer, install, itertools.count(rooms)))
    yield prefill, built


def check_classes(built: list[Decode]) -> None:
    """Each decode runs the classes it is named for (the benchmark would mean nothing else)."""
    for decode in built:
        manager = type(decode.prealloc.kv_manager).__module__
        receiver = decode.receiver_class.__module__ if decode.receiver_class else "nothing"
        expected = "statemachine." if decode.name == "ours" else "sglang."
        if not (manager.startswith(expected) and receiver.startswith(expected)):
            raise RuntimeError(f"{decode.name} runs {manager} / {receiver}")


def median_us(decode: Decode, phases: tuple[str, ...], rounds: int, batches: int) -> float:
    """Median over rounds of ``phases`` summed, microseconds per request (``batches`` batches a
    round; a batch's waiting poll counts once per request: one iteration passes meanwhile)."""
    per_round = []
    for r in range(rounds):
        taken = slice(r * batches, (r + 1) * batches)
        total = sum(sum(decode.seconds[phase][taken]) for phase in phases)
        per_round.append(total / (batches * BATCH))
    return statistics.median(per_round) * 1e6


def report(built: list[Decode], rounds: int, batches: int, smoke: bool) -> None:
    sglang, ours = built
    print(
        f"scheduler-thread CPU time per request (time.thread_time), SGLang 0.5.23's decode "
        f"queues, Mooncake, tp 1, {PAGES} pages; medians of {rounds} interleaved rounds of "
        f"{batches} x {BATCH} requests; ratio = SGLang's classes / ours (> 1: ours cheaper)"
    )
    header = f"{'phase':<44}{'SGLang':>11}{'ours':>11}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    ratio = 0.0
    for label, phases in FIGURES:
        theirs = median_us(sglang, phases, rounds, batches)
        mine = median_us(ours, phases, rounds, batches)
        ratio = theirs / mine if mine else float("inf")
        print(f"{label:<44}{theirs:>9.1f}us{mine:>9.1f}us{ratio:>7.2f}x")
    runs = batches * rounds
    print(
        f"completion polls per batch: SGLang {sglang.polls / runs:.1f}, "
        f"ours {ours.polls / runs:.1f} (the first {SETTLE_S * 1000:g} ms after the statuses, "
        "then 2 ms apart)"
    )
    print("load average " + " ".join(f"{load:.2f}" for load in os.getloadavg()))
    if smoke:
        print(f"floor: whole request >= {FLOOR:.1f}x SGLang's: not judged (smoke run)")
    else:
        verdict = "met" if ratio >= FLOOR else "NOT met"
        print(f"floor: whole request >= {FLOOR:.1f}x SGLang's: {ratio:.2f}x ({verdict})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode_queues")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--smoke", action="store_true", help="one round of one batch each")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    batches = BATCHES
    if args.smoke:
        args.rounds, batches = 1, 1
    reason = sglang_unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    logging.getLogger("sglang").setLevel(logging.ERROR)
    with ExitStack() as stack:
        prefill, built = stack.enter_context(decodes(stack))
        support = importlib.import_module("tests.support.sglang_decode_support")
        for decode in built:  # the first request of each: topology fetch and registration
            run_batch(decode, prefill, support)
            decode.seconds.clear()
            decode.polls = 0
        check_classes(built)
        gc.collect()
        for number in range(args.rounds):
            order = built if number % 2 == 0 else built[::-1]
            for _ in range(batches):
                for decode in order:
                    run_batch(decode, prefill, support)
        report(built, args.rounds, batches, args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
