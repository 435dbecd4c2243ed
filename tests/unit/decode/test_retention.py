"""``SocketRetention`` (statemachine/decode/retention.py, spec/zmq.md ZMQ-20, spec/manager.md
MGR-10): a published generation keeps its sockets while the pool or a receiver in flight uses
it, over a fake transport counting retains and releases."""

from __future__ import annotations

from statemachine.decode.retention import SocketRetention
from statemachine.decode.rooms import Rooms
from statemachine.pool import BootstrapPool

from .fakes import FakeReceiver, FakeTransport, ManualClock, generation, key

A, B = ("127.0.0.1", 5001), ("127.0.0.1", 5002)


def retention() -> tuple[SocketRetention, BootstrapPool, Rooms, FakeTransport]:
    pool, rooms, transport = BootstrapPool(), Rooms(ManualClock()), FakeTransport()
    part = SocketRetention(pool=pool, rooms=rooms, transport=transport)  # type: ignore[arg-type]
    return part, pool, rooms, transport


def test_zmq_20_a_published_generation_retains_its_endpoints_once() -> None:
    part, _, _, transport = retention()
    published = generation(5001, 5002)
    part.retain(published)
    part.retain(published)
    assert transport.retained == {A: 1, B: 1} and part.endpoints_retained() == 2


def test_mgr_10_sockets_stay_while_the_pool_or_a_receiver_uses_the_generation() -> None:
    part, pool, rooms, transport = retention()
    published = generation(5001)
    pool.publish(key(0), published)
    part.retain(published)
    assert part.reconcile() == 0  # in the pool
    rooms.by_room[7] = FakeReceiver(7, entries={key(0): published})
    pool.invalidate({key(0): published})
    assert part.reconcile() == 0  # dropped from the pool, still used by a request in flight
    del rooms.by_room[7]
    assert part.reconcile() == 1  # nothing uses it: released
    assert transport.released == [A] and transport.retained == {}
    assert part.reconcile() == 0


def test_zmq_20_close_releases_every_retained_socket() -> None:
    part, pool, _, transport = retention()
    for port in (5001, 5002):
        published = generation(port)
        pool.publish(key(port), published)
        part.retain(published)
    part.close()
    assert sorted(transport.released) == [A, B] and part.endpoints_retained() == 0
