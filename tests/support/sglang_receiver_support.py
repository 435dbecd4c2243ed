"""The receiver's SGLang 0.5.23 semantics on real parts: a prefill whose ranks push statuses, and a
manager for it."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import zmq

from statemachine.completion import (
    AbortAck,
    PrefillEvent,
    PrefillStatus,
)
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.pool import RankInfo
from statemachine.prefill.registration import register_rank
from statemachine.prefill.server import BootstrapServer
from statemachine.wire.http import route_payload
from statemachine.wire.reference import SimpleBackend
from tests.support.bootstrap_support import TOKEN

BOUND_S = 5.0  # generous bound for a message to cross loopback on a loaded 2-core machine


QUIET_S = 0.2  # how long "nothing more arrives" is watched


class SGLangStyleBackend(SimpleBackend):
    """SimpleBackend's register/metadata, with SGLang 0.5.23's control and status layouts:
    ``[ABORT, room, ip, port(, generation)]``, ``[BOOTSTRAP, room, ip, port]``; statuses
    ``[room, status, prefill_rank(, reason)]`` and ``[ABORT_ACK, room, prefill_rank,
    generation]`` decoded into completion events."""

    def abort_frames(
        self,
        rank: RankInfo,
        room: int,
        *,
        instance_id: str | None = None,
        abort_seq: int | None = None,
    ) -> list[bytes]:
        frames = [b"ABORT", b"%d" % room, self.decode_ip.encode(), b"%d" % self.decode_port]
        return frames if abort_seq is None else [*frames, b"%d" % abort_seq]

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        return [b"BOOTSTRAP", b"%d" % room, self.decode_ip.encode(), b"%d" % self.decode_port]

    def decode_message(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        try:
            if frames[0] == b"ABORT_ACK":
                generation = int(frames[3]) if len(frames) > 3 else None
                return AbortAck(int(frames[1]), int(frames[2]), generation)
            reason = frames[3].decode() if len(frames) > 3 and frames[3] else None
            return PrefillStatus(int(frames[0]), int(frames[1]), int(frames[2]), reason)
        except (IndexError, ValueError):
            return None


@dataclass
class Prefill:
    """A bootstrap server and ``tp`` ranks, each a PULL socket this test reads."""

    server: BootstrapServer
    context: zmq.Context[zmq.Socket[bytes]]
    ranks: list[zmq.Socket[bytes]]
    seen: list[list[list[bytes]]] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return self.server.address

    def received(self, rank: int, kind: bytes, *, quiet: float = QUIET_S) -> list[list[bytes]]:
        """Every message of ``kind`` rank ``rank`` got so far (waits ``quiet`` s for more)."""
        sock = self.ranks[rank]
        deadline = time.monotonic() + quiet
        while (left := deadline - time.monotonic()) > 0:
            if sock.poll(int(left * 1000) + 1):
                self.seen[rank].append(sock.recv_multipart())
        return [m for m in self.seen[rank] if m[0] == kind]

    def wait_for(self, rank: int, kind: bytes, count: int = 1) -> list[list[bytes]]:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            got = self.received(rank, kind, quiet=0.02)
            if len(got) >= count:
                return got
        return self.received(rank, kind, quiet=0)


@contextmanager
def prefill_of(tp: int = 2, **route: object) -> Iterator[Prefill]:
    server = BootstrapServer("127.0.0.1", 0, token=TOKEN).start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ranks = []
    try:
        for tp_rank in range(tp):
            sock = context.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            ranks.append(sock)
            payload = route_payload(
                rank_ip="127.0.0.1", rank_port=port, tp_rank=tp_rank, tp_size=tp
            )
            payload.update(route)
            register_rank(server.address, TOKEN, payload)
        yield Prefill(server, context, ranks, [[] for _ in ranks])
    finally:
        for sock in ranks:
            sock.close(linger=0)
        context.term()
        server.stop()


@contextmanager
def manager_of(**kwargs: object) -> Iterator[DecodeManager]:
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    kwargs.setdefault("health_probes", False)
    kwargs.setdefault("send_timeout_ms", 500)
    kwargs.setdefault("backend_factory", lambda ip, port: SGLangStyleBackend(ip, port, "s-1"))
    manager = DecodeManager(source=client, **kwargs)  # type: ignore[arg-type]
    try:
        yield manager
    finally:
        manager.close()
        client.close()


class Pusher:
    """The prefill's PUSH socket to the decode's listener (what SGLang's prefill sends)."""

    def __init__(self, manager: DecodeManager) -> None:
        assert manager.acks is not None
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(f"tcp://127.0.0.1:{manager.acks.port}")
        self.manager = manager

    def status(self, room: int, status: int, rank: int, reason: bytes = b"") -> None:
        frames = [b"%d" % room, b"%d" % status, b"%d" % rank]
        self.sock.send_multipart([*frames, reason] if reason else frames)

    def abort_ack(self, room: int, rank: int, generation: int) -> None:
        self.sock.send_multipart([b"ABORT_ACK", b"%d" % room, b"%d" % rank, b"%d" % generation])

    def settle(self, received: int) -> None:
        """Wait until the listener has taken ``received`` messages in all."""
        acks = self.manager.acks
        assert acks is not None
        deadline = time.monotonic() + BOUND_S
        while acks.stats().received < received and time.monotonic() < deadline:
            time.sleep(0.005)
        assert acks.stats().received >= received

    def close(self) -> None:
        self.sock.close()
        self.context.term()


@contextmanager
def pusher(manager: DecodeManager) -> Iterator[Pusher]:
    p = Pusher(manager)
    try:
        yield p
    finally:
        p.close()


PLAN2 = RankPlan(tp_ranks=(0, 1))
