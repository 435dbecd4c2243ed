"""Hand-written fakes for the collaborators of the decode parts (the one place they live).

Each fake does the least its part's contract needs and records what it was asked, so a test
asserts on the part's behaviour: a :class:`FakeReceiver` for a receiver in flight
(``rooms.InFlight``), a :class:`FakeSource` returning canned routes and topologies, a
:class:`FakeTransport` recording sends and failing the endpoints it is told to, a
:class:`FakeBackend` building readable frames, a :class:`ManualBackground` whose calls run when
the test says so, and a :class:`ManualClock`. None of them touches the network or sleeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from statemachine.decode.rooms import distinct_ranks
from statemachine.decode.source import NothingToReport
from statemachine.errors import BootstrapError, PeerLost, SendFailed
from statemachine.pool import Generation, PoolKey, RankInfo
from statemachine.validation import RouteReply, Topology
from statemachine.wire.endpoint import Endpoint, endpoint_url
from statemachine.wire.metadata import MetadataRequest

ADDR = "127.0.0.1:8998"
OTHER_ADDR = "127.0.0.1:8999"


class ManualClock:
    """A monotonic clock that moves only when the test calls :meth:`advance`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rank(port: int, *, ip: str = "127.0.0.1", pp_rank: int = 0, dummy: bool = False) -> RankInfo:
    return RankInfo(ip, port, pp_rank, dummy)


def generation(*ports: int, instance_id: str | None = "instance-a") -> Generation:
    """A generation of one rank per port on 127.0.0.1."""
    return Generation(tuple(rank(port) for port in ports), instance_id)


def key(dp_rank: int = 0, *, addr: str = ADDR, cp_rank: int = 0, tp_rank: int = 0) -> PoolKey:
    return PoolKey(addr, dp_rank, cp_rank, tp_rank)


def topology(
    *,
    dp_size: int = 1,
    tp_size: int = 1,
    follow_bootstrap_room: bool | None = None,
    instance_id: str | None = "instance-a",
    decode_allocation_policy: str | None = None,
) -> Topology:
    return Topology(
        attn_tp_size=tp_size,
        attn_cp_size=1,
        dp_size=dp_size,
        pp_size=1,
        page_size=None,
        kv_cache_dtype=None,
        follow_bootstrap_room=follow_bootstrap_room,
        instance_id=instance_id,
        decode_allocation_policy=decode_allocation_policy,
    )


@dataclass(eq=False)
class FakeReceiver:
    """A receiver in flight (``rooms.InFlight``) that records what the parts stored on it."""

    room: int
    addr: str = ADDR
    entries: dict[PoolKey, Generation] = field(default_factory=dict)
    awaiting_dp_rank: bool = False
    on_change: Callable[[], None] | None = None
    finished: bool = False
    #: the reasons the fan-out stored (the first one wins, as on a real receiver)
    lost: list[BootstrapError] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    succeeded: list[int] = field(default_factory=list)
    prefill_failures: list[BootstrapError] = field(default_factory=list)
    ready: int = 0

    @property
    def ended(self) -> bool:
        return self.finished

    def ranks(self) -> list[tuple[Generation, RankInfo]]:
        return distinct_ranks(self.entries.values())

    def mark_lost(self, error: BootstrapError) -> bool:
        if self.finished or self.lost:
            return False
        self.lost.append(error)
        return True

    def dp_rank_answered(self, dp_rank: int) -> None:
        self.dp_ranks.append(dp_rank)

    def rank_succeeded(self, prefill_rank: int) -> bool:
        first = prefill_rank not in self.succeeded
        if first:
            self.succeeded.append(prefill_rank)
        return first

    def failed_by_prefill(self, error: BootstrapError) -> None:
        self.prefill_failures.append(error)

    def prefill_ready(self) -> None:
        self.ready += 1


class FakeSource(NothingToReport):
    """A bootstrap source answering from canned tables, recording every question.

    ``ports[(addr, dp_rank, tp_rank, pp_rank)]`` is the port a rank listens on (127.0.0.1);
    ``instance`` the id every answer carries (change it to play a restart); a question whose
    address is in ``failing`` raises that error. ``refuse_publish`` plays a source whose
    watermark refuses every fetch."""

    def __init__(self, *, health_by_probes: bool = True) -> None:
        self.health_by_probes = health_by_probes
        self.ports: dict[tuple[str, int, int, int], int] = {}
        self.topologies: dict[str, Topology] = {}
        self.dp_answers: dict[str, dict[int, int]] = {}
        self.instance: str | None = "instance-a"
        self.failing: dict[str, BootstrapError] = {}
        self.refuse_publish = False
        self.rank_calls: list[tuple[str, int, int, int]] = []
        self.topology_calls: list[str] = []
        self.dp_calls: list[tuple[str, tuple[int, ...]]] = []
        #: the instance id per call, in order, when set: plays a restart between two answers
        self.instances: list[str | None] = []

    def get_rank(
        self, addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int
    ) -> RouteReply:
        self.rank_calls.append((addr, dp_rank, tp_rank, pp_rank))
        if addr in self.failing:
            raise self.failing[addr]
        instance = self.instances.pop(0) if self.instances else self.instance
        return RouteReply("127.0.0.1", self.ports[(addr, dp_rank, tp_rank, pp_rank)], instance)

    def get_topology(self, addr: str) -> Topology:
        self.topology_calls.append(addr)
        if addr in self.failing:
            raise self.failing[addr]
        return self.topologies[addr]

    def query_dp_ranks(self, addr: str, rooms: Sequence[int]) -> dict[int, int]:
        self.dp_calls.append((addr, tuple(rooms)))
        if addr in self.failing:
            raise self.failing[addr]
        answers = self.dp_answers.get(addr, {})
        return {room: answers[room] for room in rooms if room in answers}

    def publish(self, pool: Any, key: PoolKey, generation: Generation) -> Generation | None:
        if self.refuse_publish:
            return None
        published: Generation | None = pool.publish(key, generation)
        return published

    def refusal(self, addr: str, generation: Generation) -> BootstrapError:
        return PeerLost(f"{addr}: the fake source's watermark refused this fetch", addr=addr)


class FakeTransport:
    """What the decode parts use of ``ZmqTransport``: records sends, retains and releases; a
    send to an endpoint in ``failing`` raises ``SendFailed``; ``down`` is the breaker's set."""

    def __init__(self) -> None:
        self.sends: list[tuple[Endpoint, list[bytes]]] = []
        self.failing: set[Endpoint] = set()
        self.down: set[Endpoint] = set()
        self.retained: Counter[Endpoint] = Counter()
        self.released: list[Endpoint] = []

    def send(self, endpoint: Endpoint, frames: Sequence[bytes]) -> None:
        endpoint = (endpoint[0], endpoint[1])
        if endpoint in self.failing:
            raise SendFailed(
                f"{endpoint_url(endpoint)}: the fake transport refuses this endpoint",
                endpoint=endpoint_url(endpoint),
            )
        self.sends.append((endpoint, list(frames)))

    def is_down(self, endpoint: Endpoint) -> bool:
        return (endpoint[0], endpoint[1]) in self.down

    def retain(self, endpoints: Iterable[Endpoint]) -> None:
        self.retained.update(endpoints)

    def release(self, endpoints: Iterable[Endpoint]) -> None:
        for endpoint in endpoints:
            self.retained[endpoint] -= 1
            if not self.retained[endpoint]:
                del self.retained[endpoint]
            self.released.append(endpoint)

    def sent_to(self) -> list[Endpoint]:
        return [endpoint for endpoint, _ in self.sends]


class FakeBackend:
    """Frames a test can read back: ``[kind, port, room or b"", instance, abort_seq]``."""

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        return [b"register", str(rank.port).encode(), b"", _b(instance_id)]

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        return [b"metadata", str(rank.port).encode(), b"", _b(instance_id)]

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        return [b"bootstrap", str(rank.port).encode(), str(room).encode(), _b(instance_id)]

    def abort_frames(
        self,
        rank: RankInfo,
        room: int,
        *,
        instance_id: str | None = None,
        abort_seq: int | None = None,
    ) -> list[bytes]:
        return [
            b"abort",
            str(rank.port).encode(),
            str(room).encode(),
            _b(instance_id),
            _b(None if abort_seq is None else str(abort_seq)),
        ]


def _b(text: str | None) -> bytes:
    return b"" if text is None else text.encode()


class ManualBackground:
    """``Background`` whose submitted calls run only when the test calls :meth:`run` (or, with
    ``at_once``, inside ``submit``, as if a worker had finished before the caller looked)."""

    def __init__(self, *, at_once: bool = False) -> None:
        self.pending: list[tuple[Future[Any], Callable[..., Any], tuple[object, ...]]] = []
        self.submitted = 0
        self.at_once = at_once

    def submit(self, call: Callable[..., Any], *args: object) -> Future[Any]:
        future: Future[Any] = Future()
        self.pending.append((future, call, args))
        self.submitted += 1
        if self.at_once:
            self.run()
        return future

    def run(self) -> int:
        """Run every pending call now, on this thread; how many ran."""
        pending, self.pending = self.pending, []
        for future, call, args in pending:
            try:
                future.set_result(call(*args))
            except BaseException as error:  # the future carries it, as a worker's would
                future.set_exception(error)
        return len(pending)


class FakeHealth:
    """The health monitor as the fetcher uses it: records each watch."""

    def __init__(self) -> None:
        self.watched: list[tuple[str, str | None, bool]] = []

    def watch(self, addr: str, *, instance_id: str | None, baseline_now: bool) -> None:
        self.watched.append((addr, instance_id, baseline_now))


class FakeSocketMonitor:
    """``SocketMonitor`` as the socket cache uses it: takes each monitor socket it is handed
    and closes it on ``unwatch`` (what the monitor thread does), reading no event."""

    def __init__(self) -> None:
        self.watched: dict[object, Any] = {}
        self.unwatched: list[object] = []

    def watch(self, key: object, monitor_socket: Any, liveness: object) -> None:
        self.watched[key] = monitor_socket

    def unwatch(self, key: object) -> None:
        self.unwatched.append(key)
        socket = self.watched.pop(key, None)
        if socket is not None:
            socket.close(linger=0)

    def close(self) -> None:
        for key in list(self.watched):
            self.unwatch(key)
