"""KV of failed rooms released on proof, held on silence (issue 27 item 1; MGR-15, ZMQ-26).

Real parts: the reference prefill's bootstrap server and rank *processes* on 127.0.0.1,
SIGKILLed, SIGSTOPped and restarted; real ZMQ sockets with their monitors; the real ack
listener. Every run is traced and the trace replayed against the model
(``NoReleaseWhileWriterMayWrite``, ``statemachine/model/validate.py``), so the evidence steps
(``ResetSeen``, ``SilenceSeen``) and the releases (``ReleaseOnProvenGone``,
``ReleaseOnAbortAck``) the code emits are the model's.

``kv_release_timeout_s`` is 300 s in every test: a room released within a test was not released
by the timeout (and the counters say which rule released it).
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from statemachine import trace
from statemachine.decode.manager import DecodeManager
from statemachine.decode.ranks.exit_probe import connect_refused
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.errors import RankDead, WaitingTimeout
from statemachine.model.validate import read_trace, validate
from statemachine.prefill.server import BootstrapServer
from tests.support.manager_support import (
    SLOW_ACK_MS,
    in_flight_waiting,
    manager_for,
    poll_all_failed,
    wait_until,
)
from tests.support.receiver_support import TOKEN, Prefill, start_prefill, stop_prefill

#: Never reached in a test: a release seen here is by proof or by acks.
RELEASE_TIMEOUT_S = 300.0
ROOMS = range(1, 9)


@contextmanager
def slow_prefill() -> Iterator[Prefill]:
    prefill = start_prefill(ack_delay_ms=SLOW_ACK_MS)
    try:
        yield prefill
    finally:
        for rank in prefill.ranks:
            if rank.pid is not None and rank.alive():
                os.kill(rank.pid, signal.SIGCONT)  # a stopped child dies only once continued
        stop_prefill(prefill)


def held(manager: DecodeManager) -> int:
    return manager.kv_holds().held


def assert_trace_allowed(path: Path) -> list[str]:
    events = read_trace(path)
    report = validate(events)
    assert report.ok, report.violation
    return [str(e["action"]) for e in events]


# --- the exit probe: a refused connect, told from a listener and from no answer -----------------


def test_zmq26_only_a_refused_connect_is_an_exit() -> None:
    """The monitor's failed attempt (EVENT_CLOSED) may be a refusal, a connect timeout or an
    unreachable route: the probe reads the errno itself. A closed port is refused (proof); a
    listening one answers (a process is there); a listener whose accept queue is full drops
    the SYN, as a cut path does, and the probe hears nothing within its timeout (no proof)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert connect_refused(("127.0.0.1", port))

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        endpoint = ("127.0.0.1", listener.getsockname()[1])
        assert not connect_refused(endpoint)
        # Fill the accept queue (never accepted): further SYNs are dropped without a reply.
        queued = []
        try:
            while len(queued) < 16:
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex(endpoint)
                queued.append(filler)
            assert not connect_refused(endpoint, timeout_s=0.2)
        finally:
            for filler in queued:
                filler.close()


# --- SIGKILL: proof at once ---------------------------------------------------------------------


def test_mgr_15_a_killed_prefills_rooms_are_released_without_the_timeout(tmp_path: Path) -> None:
    """Every rank of the prefill SIGKILLed with eight rooms in flight: the transport's monitor
    sees the disconnect, the reconnect refused, and the probe confirms the refusal (an exit,
    ZMQ-26); every room fails with RankDead, its ABORT is armed (held: SGLang would hold it
    30 s, as no ABORT_ACK ever comes) and ``kv_release`` says True at the next ask — by proof,
    not by acks or the timeout. The trace replays against the model."""
    with (
        slow_prefill() as prefill,
        manager_for(kv_release_timeout_s=RELEASE_TIMEOUT_S) as manager,
        trace.tracing(tmp_path / "kill.ndjson") as path,
    ):
        victims = in_flight_waiting(manager, prefill, ROOMS)
        for rank in prefill.ranks:
            rank.kill()
        assert wait_until(lambda: poll_all_failed(victims))
        assert all(isinstance(v.failure, RankDead) for v in victims)
        assert "the process exited" in str(victims[0].failure)
        assert held(manager) == len(ROOMS)  # armed: the metadata had gone out
        # One verdict may end the requests and close the other rank's socket before its own
        # verdict: the fan-out then asks that rank's port itself (refused: proof too).
        assert manager.transport.stats().exits >= 1
        assert wait_until(lambda: all(manager.kv_release(room) for room in ROOMS))
        stats = manager.kv_holds()
        assert (stats.held, stats.released_by_proof) == (0, len(ROOMS))
        assert (stats.released_by_acks, stats.released_by_timeout) == (0, 0)
    actions = assert_trace_allowed(path)
    assert actions.count("ResetSeen") >= len(prefill.ranks)
    assert actions.count("ReleaseOnProvenGone") == len(ROOMS)
    assert "SilenceSeen" not in actions


def test_mgr_15_one_live_rank_keeps_the_room_held() -> None:
    """One of the two ranks killed: its exit is proof for that rank only; the other rank still
    runs and may still write, so no room is released by proof (``ReleaseOnOneRankGone`` is the
    model's mutation of exactly this). The live rank acknowledges the ABORT, but an ack names a
    backend rank id, not an endpoint, so acks and proofs are not mixed: the rooms wait."""
    with (
        slow_prefill() as prefill,
        manager_for(kv_release_timeout_s=RELEASE_TIMEOUT_S) as manager,
    ):
        victims = in_flight_waiting(manager, prefill, ROOMS)
        prefill.ranks[1].kill()
        assert wait_until(lambda: poll_all_failed(victims))
        assert wait_until(lambda: manager.transport.stats().exits == 1)
        assert held(manager) == len(ROOMS)
        assert not any(manager.kv_release(room) for room in ROOMS)
        assert manager.kv_holds().released_by_proof == 0


# --- SIGSTOP: silence is no proof -------------------------------------------------------------


def test_mgr_15_a_stopped_prefill_holds_its_rooms_until_the_abort_ack(tmp_path: Path) -> None:
    """Every rank SIGSTOPped: the rooms time out and their ABORT goes out (into the stopped
    processes' socket buffers); nothing proves the processes gone, so every room stays held.
    After SIGCONT the ranks read the ABORT and acknowledge it: released by acks."""
    with (
        slow_prefill() as prefill,
        manager_for(waiting_timeout_s=0.3, kv_release_timeout_s=RELEASE_TIMEOUT_S) as manager,
        trace.tracing(tmp_path / "stop.ndjson") as path,
    ):
        victims = in_flight_waiting(manager, prefill, ROOMS)
        for rank in prefill.ranks:
            assert rank.pid is not None
            os.kill(rank.pid, signal.SIGSTOP)
        assert wait_until(lambda: poll_all_failed(victims))
        assert all(isinstance(v.failure, WaitingTimeout) for v in victims)
        assert held(manager) == len(ROOMS)
        assert not wait_until(lambda: any(manager.kv_release(r) for r in ROOMS), timeout=0.5)
        for rank in prefill.ranks:
            assert rank.pid is not None
            os.kill(rank.pid, signal.SIGCONT)
        assert wait_until(lambda: all(manager.kv_release(room) for room in ROOMS))
        stats = manager.kv_holds()
        assert (stats.released_by_acks, stats.released_by_proof) == (len(ROOMS), 0)
        assert stats.released_by_timeout == 0
    actions = assert_trace_allowed(path)
    assert actions.count("ReleaseOnAbortAck") == len(ROOMS)
    assert "ReleaseOnProvenGone" not in actions


def test_mgr_15_a_silence_verdict_is_no_proof_the_room_waits_for_the_timeout(
    tmp_path: Path,
) -> None:
    """Every rank SIGSTOPped with ZMTP heartbeats on: the heartbeats drop the silent
    connections and the monitor judges both ranks dead — silence, not an exit (the stopped
    process's kernel still accepts the reconnect; the probe is never asked or says no) — so the
    rooms fail with RankDead and stay held: their ABORT cannot reach a rank judged dead, so
    only ``kv_release_timeout_s`` frees them. The trace shows SilenceSeen and no proof."""
    transport = ZmqTransport(send_timeout_ms=500, heartbeat_ivl_ms=100, heartbeat_timeout_ms=200)
    release_s = 1.5
    try:
        with (
            slow_prefill() as prefill,
            manager_for(transport=transport, kv_release_timeout_s=release_s) as manager,
            trace.tracing(tmp_path / "silence.ndjson") as path,
        ):
            victims = in_flight_waiting(manager, prefill, ROOMS)
            for rank in prefill.ranks:
                assert rank.pid is not None
                os.kill(rank.pid, signal.SIGSTOP)
            assert wait_until(lambda: poll_all_failed(victims))
            assert all(isinstance(v.failure, RankDead) for v in victims)
            assert transport.stats().exits == 0
            assert held(manager) == len(ROOMS)
            assert not any(manager.kv_release(room) for room in ROOMS)
            assert wait_until(lambda: all(manager.kv_release(r) for r in ROOMS), release_s * 4)
            stats = manager.kv_holds()
            assert (stats.released_by_timeout, stats.released_by_proof) == (len(ROOMS), 0)
    finally:
        transport.close()
    actions = assert_trace_allowed(path)
    assert "SilenceSeen" in actions and "ResetSeen" not in actions
    assert actions.count("ReleaseOnTimeout") == len(ROOMS)
    assert "ReleaseOnProvenGone" not in actions


# --- a restart behind the same address ----------------------------------------------------------


def test_mgr_15_a_restart_behind_the_same_address_releases_the_old_rooms(tmp_path: Path) -> None:
    """The whole prefill (bootstrap server and ranks) crashes and a new instance starts behind
    the same bootstrap address and the same rank ports: the old ranks' exit was proven between
    the two (the ports refused the reconnect), so the old rooms are released at once, though
    processes answer at those ports again; the trace replays against the model."""
    first = start_prefill(ack_delay_ms=SLOW_ACK_MS)
    port = int(first.addr.rsplit(":", 1)[1])
    rank_ports = [rank.port for rank in first.ranks]
    server: BootstrapServer | None = None
    try:
        with (
            manager_for(kv_release_timeout_s=RELEASE_TIMEOUT_S) as manager,
            trace.tracing(tmp_path / "restart.ndjson") as path,
        ):
            victims = in_flight_waiting(manager, first, ROOMS)
            for rank in first.ranks:
                rank.kill()
            first.server.stop()
            server = BootstrapServer("127.0.0.1", port, token=TOKEN).start()
            first.server = server
            for rank, rank_port in zip(first.ranks, rank_ports, strict=True):
                rank.start(port=rank_port)
            assert wait_until(lambda: poll_all_failed(victims))
            assert held(manager) == len(ROOMS)
            assert all(manager.kv_release(room) for room in ROOMS)
            assert manager.kv_holds().released_by_proof == len(ROOMS)
        assert_trace_allowed(path)
    finally:
        stop_prefill(first)
