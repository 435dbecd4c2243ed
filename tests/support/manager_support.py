"""A DecodeManager on real parts, and the waits and bounds the manager tests share."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.client import BootstrapClient
from statemachine.decode.manager import DecodeManager
from statemachine.decode.receiver import BootstrapReceiver
from tests.support.receiver_support import (
    PLAN,
    Prefill,
    start_prefill,
    stop_prefill,
)

#: Generous bound for "failed quickly" under a loaded 2-core machine (the goal is 50 ms).
FAIL_BOUND_S = 5.0


SLOW_ACK_MS = 60_000  # a prefill that never acks within a test


@contextmanager
def manager_for(**kwargs: object) -> Iterator[DecodeManager]:
    kwargs.setdefault("health_probes", False)
    kwargs.setdefault("send_timeout_ms", 500)
    client = BootstrapClient(connect_timeout=1.0, read_timeout=2.0)
    kwargs.setdefault("source", client)
    manager = DecodeManager(**kwargs)  # type: ignore[arg-type]
    try:
        yield manager
    finally:
        manager.close()
        client.close()


def in_flight_waiting(
    manager: DecodeManager, prefill: Prefill, rooms: range
) -> list[BootstrapReceiver]:
    receivers = []
    for room in rooms:
        receiver = manager.receiver(prefill.addr, room, PLAN, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput
        assert receiver.send_metadata((room,)) == KVPoll.Transferring
        receivers.append(receiver)
    return receivers


def poll_all_failed(receivers: list[BootstrapReceiver]) -> bool:
    return all(r.poll() == KVPoll.Failed for r in receivers)


class WakeCounter:
    """Counts the ``on_change`` wake-ups of a set of receivers: a test waits for the event
    (every one of them was told something) instead of polling against the clock."""

    def __init__(self, receivers: list[BootstrapReceiver]) -> None:
        self._left = len(receivers)
        self._lock = threading.Lock()
        self.all_woken = threading.Event()
        for receiver in receivers:
            receiver.on_change = self._woken

    def _woken(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self.all_woken.set()


@pytest.fixture
def slow_prefill() -> Iterator[Prefill]:
    instance = start_prefill(ack_delay_ms=SLOW_ACK_MS)
    yield instance
    stop_prefill(instance)


def wait_until(predicate: object, timeout: float = FAIL_BOUND_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False
