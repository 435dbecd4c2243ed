"""Queued frames and a reused port (ZMQ-21; the model's ``ReusedPortAcks`` and its ``Correct``
counterpart, ``spec/model.md``): real processes, real sockets, SGLang's queueing mode.

In queueing mode (no ``IMMEDIATE``) a ``PUSH`` socket queues the frames sent towards a dead
prefill rank's port and delivers them to whatever process binds that port number next. The
scenario is the model's counterexample: a decode fetches the ranks of prefill instance X, the
prefill crashes (rank SIGKILLed, bootstrap server restarted: instance Y), the decode registers
and sends metadata to X's port (queued), and a new rank of Y binds the same port. With frames
that name their target instance the new rank drops X's frames and the requests fail on their
waiting timeout; the control run, with frames as a decode before ZMQ-21 sent them, shows the
frames really are delivered: the new rank registers the old session and acks, and the requests
"complete" although no transfer reached them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from statemachine import trace
from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.demo.baselines import QueueingTransport
from statemachine.errors import ConfigurationError, PrefillRankStartFailed, WaitingTimeout
from statemachine.model.validate import main as validate_main
from statemachine.model.validate import read_trace, validate
from statemachine.pool import RankInfo
from statemachine.prefill.rank import _Rank, parse_args
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.metadata import MetadataRequest
from statemachine.wire.reference import (
    ABORT_FRAMES,
    MAX_INSTANCE_ID_BYTES,
    METADATA_FRAMES,
    REGISTER_FRAMES,
    SimpleBackend,
    parse_abort,
    parse_metadata,
    parse_register,
)
from tests.support.bootstrap_support import TOKEN
from tests.support.zmq_support import LOOPBACK, pull_peer

PLAN = RankPlan(tp_ranks=(0,))
STALE_ROOMS = range(100, 105)
SYNC_ROOM = 999
BOUND_S = 20.0  # a generous correctness bound for one step on a loaded machine
WAITING_TIMEOUT_S = 2.0


class _Gated(SimpleBackend):
    """Holds the first register until the test has crashed the prefill: the fetch answered
    for instance X, and the register (then the metadata) goes to X's port after X died."""

    def __init__(self, *args: object, targeted: bool) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.targeted = targeted
        self.entered = threading.Event()
        self.proceed = threading.Event()

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        if not self.entered.is_set():
            self.entered.set()
            assert self.proceed.wait(BOUND_S), "the test never released the register"
        # Untargeted: the frames of a decode from before ZMQ-21 (no target instance frame).
        return super().register_frames(rank, instance_id=instance_id if self.targeted else None)

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        target = instance_id if self.targeted else None
        return super().metadata_frames(rank, request, instance_id=target)


@dataclass
class _Run:
    stale: list[BootstrapReceiver]
    #: the stale requests' states once the new rank had handled every queued frame
    at_sync: list[KVPoll]
    stats: dict[str, int]
    manager: DecodeManager


@contextmanager
def _reused_port_run(*, targeted: bool, rank_trace: Path | None = None) -> Iterator[_Run]:
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    old_rank = PrefillRankProcess(server.address, TOKEN)
    extra = ("--trace", str(rank_trace)) if rank_trace is not None else ()
    new_rank = PrefillRankProcess(server.address, TOKEN, extra_args=extra)
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    transport = QueueingTransport(send_timeout_ms=1000)
    backends: list[_Gated] = []

    def backend_for(ip: str, port: int) -> _Gated:
        backends.append(_Gated(ip, port, "decode-reused-port", targeted=targeted))
        return backends[-1]

    manager = DecodeManager(
        source=client,
        transport=transport,
        backend_factory=backend_for,
        health_probes=False,  # nothing tells the decode of the restart: it learns by timeout
        waiting_timeout_s=WAITING_TIMEOUT_S,
    )
    try:
        port = old_rank.start()
        old_instance = server.instance_id
        gate = backends[0]
        first = manager.receiver(server.address, STALE_ROOMS[0], PLAN, prefill_dp_rank=0)
        states: list[KVPoll] = []
        init = threading.Thread(target=lambda: states.append(first.init()), daemon=True)
        init.start()
        assert gate.entered.wait(BOUND_S), "the fetch never reached the register"
        # Instance X dies: its rank is SIGKILLed and its bootstrap server restarts (instance Y,
        # same address). The decode's register and metadata now go to a dead port: queued.
        old_rank.kill()
        server.stop()
        server.start()
        new_instance = server.instance_id
        assert new_instance != old_instance
        gate.proceed.set()
        init.join(BOUND_S)
        assert states == [KVPoll.WaitingForInput]
        assert first.send_metadata((1, 2, 3)) == KVPoll.Transferring
        stale = [first]
        for room in STALE_ROOMS[1:]:  # later requests hit X's cached generation
            receiver = manager.receiver(server.address, room, PLAN, prefill_dp_rank=0)
            assert receiver.init() == KVPoll.WaitingForInput
            assert receiver.send_metadata((room,)) == KVPoll.Transferring
            stale.append(receiver)
        # A new process of instance Y binds the very port X's rank had.
        assert new_rank.start(port=port) == port
        # Sync: a request on instance Y. The decode learns of the restart as its health probe
        # would (HEALTH-1: X was replaced, retire it), fetches Y's ranks - the same port - and
        # sends on the same socket (one pipe, in order): the rank handles it after every queued
        # frame, and its ack leaves the rank after any ack those frames caused.
        assert manager.pool.retire_instance(server.address, old_instance) == 1
        sync = manager.receiver(server.address, SYNC_ROOM, PLAN, prefill_dp_rank=0)
        assert sync.init() == KVPoll.WaitingForInput
        assert sync.entries and all(g.instance_id == new_instance for g in sync.entries.values())
        assert sync.send_metadata((7,)) == KVPoll.Transferring
        assert _finish(sync) == KVPoll.Success, sync.failure
        at_sync = [receiver.poll() for receiver in stale]
        stats = new_rank.terminate()
        assert stats is not None
        yield _Run(stale, at_sync, stats, manager)
    finally:
        for backend in backends:
            backend.proceed.set()
        manager.close()
        transport.close()
        client.close()
        old_rank.kill()
        new_rank.kill()
        server.stop()


def test_zmq21_a_new_process_on_a_reused_port_drops_the_old_instances_frames() -> None:
    """ZMQ-21 (NoStaleSuccess, ReusedPortAcks' Correct counterpart): the queued register and
    metadata frames of instance X reach the new process of instance Y on X's port; it drops
    them (``stale_instance``), acks none, and no stale request completes: each fails on its
    waiting timeout, typed."""
    with _reused_port_run(targeted=True) as run:
        assert run.at_sync == [KVPoll.Transferring] * len(STALE_ROOMS)
        stats = run.stats
        # Every queued frame was delivered and dropped: 1 register + one metadata per request.
        assert stats["stale_instance"] == 1 + len(STALE_ROOMS)
        # Only the sync request (addressed to Y) was registered, served and acked.
        assert (stats["register"], stats["metadata"], stats["acks_sent"]) == (1, 1, 1)
        assert stats["malformed"] == stats["unregistered"] == 0
        for receiver in run.stale:
            assert _finish(receiver) == KVPoll.Failed
            assert isinstance(receiver.failure, WaitingTimeout)
        assert run.manager.stats().completed == 1  # the sync request only


def test_zmq21_control_untargeted_frames_are_delivered_and_acked() -> None:
    """ZMQ-21 control: the same run with frames that name no instance (a decode from before
    ZMQ-21): the new process registers the old session from the queued register frame and acks
    every stale request, which completes on ports of a dead instance. This is the bug the
    model's ``ReusedPortAcks`` shows (``MCReusedPortAcks`` fails ``NoStaleSuccess``)."""
    with _reused_port_run(targeted=False) as run:
        stats = run.stats
        assert stats["stale_instance"] == 0
        assert stats["register"] == 2  # the queued (stale) one and the sync one
        assert stats["metadata"] == 1 + len(STALE_ROOMS)
        assert stats["acks_sent"] == 1 + len(STALE_ROOMS)
        assert run.at_sync == [KVPoll.Success] * len(STALE_ROOMS)
        assert run.manager.stats().completed == 1 + len(STALE_ROOMS)


@pytest.mark.parametrize("targeted", [True, False], ids=["targeted", "untargeted-control"])
def test_zmq21_trace_validation_joins_the_ranks_acks_with_the_completions(
    tmp_path: Path, targeted: bool
) -> None:
    """NoStaleSuccess on real traces of both processes: the decode's (lifecycle and pool) and
    the new rank's (one ``Ack`` event per ack). With targeted frames the trace is allowed: the
    new rank acked only its own instance's request, which completed on Y's generation, and
    nothing completed on X's. The
    control's trace (the code before ZMQ-21: the model's ``ReusedPortAcks``) is rejected at a
    completion acked by the new instance's process."""
    decode_path, rank_path = tmp_path / "decode.ndjson", tmp_path / "rank.ndjson"
    with (
        trace.tracing(decode_path),
        _reused_port_run(targeted=targeted, rank_trace=rank_path) as run,
    ):
        for receiver in run.stale:
            _finish(receiver)
    rank_events = read_trace(rank_path)
    assert [e["action"] for e in rank_events] == ["Ack"] * (1 if targeted else 6)
    report = validate(read_trace(decode_path) + rank_events)
    if targeted:
        assert report.ok, report.violation
    else:
        assert report.violation is not None
        assert report.violation.rule == "NoStaleSuccess"
        assert report.violation.event["action"] == "Complete"
        assert report.violation.event["room"] in STALE_ROOMS


def _finish(receiver: BootstrapReceiver) -> KVPoll:
    """Poll until the receiver leaves ``Transferring`` (bounded)."""
    deadline = time.monotonic() + BOUND_S
    while (state := receiver.poll()) == KVPoll.Transferring:
        if time.monotonic() > deadline:
            pytest.fail(f"{receiver} still transferring after {BOUND_S} s")
        time.sleep(0.01)
    return state


def test_zmq21_frames_name_their_target_instance_or_keep_the_old_layout() -> None:
    """ZMQ-21: one optional last frame; without an instance id the layout is the old one."""
    backend = SimpleBackend(LOOPBACK, 5555, "s")
    rank = RankInfo(LOOPBACK, 1, 0)
    request = MetadataRequest(7, (1, 2), 0)
    assert len(backend.register_frames(rank)) == REGISTER_FRAMES
    assert len(backend.metadata_frames(rank, request)) == METADATA_FRAMES
    assert len(backend.abort_frames(rank, 7)) == ABORT_FRAMES
    assert parse_register(backend.register_frames(rank)).instance_id is None
    assert parse_metadata(backend.metadata_frames(rank, request)).instance_id is None
    assert parse_abort(backend.abort_frames(rank, 7)).instance_id is None
    for instance in ("0123abcd" * 4, "ü-instance", "i" * MAX_INSTANCE_ID_BYTES):
        register = backend.register_frames(rank, instance_id=instance)
        assert len(register) == REGISTER_FRAMES + 1
        assert parse_register(register).instance_id == instance
        metadata = backend.metadata_frames(rank, request, instance_id=instance)
        assert parse_metadata(metadata).instance_id == instance
        assert parse_abort(backend.abort_frames(rank, 7, instance_id=instance)).instance_id == (
            instance
        )
    # Cached register frames are per instance: a restart's new id is not served the old one.
    assert parse_register(backend.register_frames(rank, instance_id="a")).instance_id == "a"
    assert parse_register(backend.register_frames(rank, instance_id="b")).instance_id == "b"
    # An id no frame can carry goes as an untargeted message, never as an untyped error.
    for unusable in ("", "i" * (MAX_INSTANCE_ID_BYTES + 1), "\ud800"):
        assert len(backend.metadata_frames(rank, request, instance_id=unusable)) == (
            METADATA_FRAMES
        )


def test_zmq21_rank_drops_register_metadata_and_abort_of_another_instance() -> None:
    """ZMQ-21, in process: the rank's rule for each message kind, and its two exceptions (an
    untargeted message, a rank that knows no instance of its own) served as before."""
    args = parse_args(["--bootstrap", "127.0.0.1:1", "--token", "t", "--ack-delay-ms", "60000"])
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rank = _Rank(args, context, instance_id="Y")
    try:
        backend = SimpleBackend(LOOPBACK, 5555, "s")
        info = RankInfo(LOOPBACK, rank.port, 0)
        rank.on_message(backend.register_frames(info, instance_id="X"))
        rank.on_message(backend.metadata_frames(info, MetadataRequest(1, (), 0), instance_id="X"))
        assert rank.sessions == {} and rank.due == []
        assert (rank.counts["stale_instance"], rank.counts["register"]) == (2, 0)
        rank.on_message(backend.register_frames(info, instance_id="Y"))
        rank.on_message(backend.metadata_frames(info, MetadataRequest(2, (), 0), instance_id="Y"))
        rank.on_message(backend.metadata_frames(info, MetadataRequest(3, (), 0)))  # old decode
        assert [item[3][1] for item in sorted(rank.due)] == [b"2", b"3"]  # acks due later
        rank.on_message(backend.abort_frames(info, 2, instance_id="X"))  # not ours: kept
        assert len(rank.due) == 2 and rank.counts["stale_instance"] == 3
        rank.on_message(backend.abort_frames(info, 2, instance_id="Y"))
        assert [item[3][1] for item in rank.due] == [b"3"]
        rank.instance_id = None  # the server named no instance: nothing can be judged
        rank.on_message(backend.metadata_frames(info, MetadataRequest(4, (), 0), instance_id="X"))
        assert len(rank.due) == 2 and rank.counts["stale_instance"] == 3
    finally:
        rank.close()
        context.term()


def test_zmq13_a_rank_on_a_taken_port_fails_to_start_with_the_reason() -> None:
    """``--port`` binds exactly that port; a taken one is a typed start failure (ACK-4)."""
    with pytest.raises(SystemExit):
        parse_args(["--bootstrap", "127.0.0.1:1", "--token", "t", "--port", "70000"])
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with (
            BootstrapServer("127.0.0.1", 0, token=TOKEN) as server,
            pull_peer(context) as (_, port),
        ):
            rank = PrefillRankProcess(server.address, TOKEN, ready_timeout=BOUND_S)
            with pytest.raises(PrefillRankStartFailed) as caught:
                rank.start(port=port)
            assert f"cannot bind 127.0.0.1:{port}" in caught.value.stderr_tail
    finally:
        context.term()


def _acked_trace(*acks: dict[str, object]) -> list[dict[str, object]]:
    """A decode trace of one request on a generation of instance "X" (room 5), then acks."""
    key = ["127.0.0.1:1", 0, 0]
    decode: list[dict[str, object]] = [
        {"seq": 0, "action": "Miss", "receiver": 1, "room": 5, "state": "fetching"},
        {"seq": 1, "action": "FetchOk", "receiver": 1, "entries": [[key, 1]], "state": "fetched"},
        {"seq": 2, "action": "RegisterOk", "receiver": 1, "entries": [[key, 1]]},
        {"seq": 3, "action": "PoolPublish", "key": key, "generation": 1, "fresh": 1,
         "instance": "X", "fresh_instance": "X"},
        {"seq": 4, "action": "Publish", "receiver": 1, "entries": [[key, 1]], "state": "cached"},
        {"seq": 5, "action": "SendOk", "receiver": 1, "entries": [[key, 1]], "state": "waiting"},
        {"seq": 6, "action": "Complete", "receiver": 1, "room": 5, "entries": [[key, 1]],
         "state": "done"},
    ]  # fmt: skip
    return decode + [{"seq": i, "action": "Ack", **ack} for i, ack in enumerate(acks)]


def test_nostalesuccess_judges_only_acks_that_could_be_for_the_request(tmp_path: Path) -> None:
    """The Ack join: an ack by the request's instance, an ack by a rank that knows no instance,
    and an ack for another instance's request of the same room are allowed; an ack by another
    instance for a message that named this one, or named none, is NoStaleSuccess."""
    allowed = (
        {"room": 5, "instance": "X", "target": "X"},
        {"room": 5, "instance": None, "target": "Y"},
        {"room": 5, "instance": "Y", "target": "Y"},  # another request that reused room 5
        {"room": 6, "instance": "Y", "target": None},
    )
    assert validate(_acked_trace(*allowed)).ok
    for stale in ({"instance": "Y", "target": "X"}, {"instance": "Y", "target": None}):
        report = validate(_acked_trace({"room": 5, **stale}))
        assert report.violation is not None and report.violation.rule == "NoStaleSuccess"
        assert report.violation.event["action"] == "Complete"
    # The command line takes the decode's trace and the ranks' traces as separate files.
    events = _acked_trace({"room": 5, "instance": "Y", "target": None})
    decode, rank = tmp_path / "decode.ndjson", tmp_path / "rank.ndjson"
    decode.write_text("".join(json.dumps(e) + "\n" for e in events[:-1]))
    rank.write_text(json.dumps(events[-1]) + "\n")
    assert validate_main([str(decode)]) == 0
    assert validate_main([str(decode), str(rank)]) == 1


class _BeforeZmq21(SimpleBackend):
    """A custom backend written against the protocol before ZMQ-21 (no ``instance_id``)."""

    def metadata_frames(self, rank: RankInfo, request: MetadataRequest) -> list[bytes]:  # type: ignore[override]
        return super().metadata_frames(rank, request)


def test_zmq21_a_backend_without_instance_id_is_a_configuration_error() -> None:
    """Caught at construction, with what to change, not as a TypeError on the first send."""
    with pytest.raises(ConfigurationError, match=r"metadata_frames\(\) must accept .*instance_id"):
        DecodeManager(
            backend=_BeforeZmq21(LOOPBACK, 5555, "s"),
            completion="external",
            health_probes=False,
        )
