"""The comparison anchors the demo and the benchmarks run beside the product, as subclasses.

SGLang 0.5.23's decode has no failure fan-out (a request fails on its own send or timeout only)
and no single-flight (every miss fetches for itself), and its PUSH sockets queue towards a dead
rank (no ``IMMEDIATE``, ``SNDHWM=1000``, no monitor, a blocking send). The demo's ``sglang``
mode and the recovery and transport benchmarks compare against that behaviour; it lives here,
beside them, so that the product classes carry no switch for it (``DecodeManager`` makes its
fan-out, fetcher and transport from the class attributes these override; a ``ZmqTransport``
takes the baseline's ``SocketPolicy``).
"""

from __future__ import annotations

from typing import Any

from statemachine.decode.fanout import FanOut
from statemachine.decode.fetcher import Claim, Fetcher
from statemachine.decode.manager import DecodeManager
from statemachine.decode.ranks.sockets import SocketPolicy
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.demo.modes import ModeConfig, ZmqMode
from statemachine.errors import BootstrapError
from statemachine.pool import Generation, PoolKey

__all__ = [
    "QUEUEING",
    "UNMONITORED",
    "EveryMissFetches",
    "FetchPerMissManager",
    "NoFanOut",
    "QueueingManager",
    "QueueingTransport",
    "SGLangLikeManager",
    "SGLangLikeQueueingManager",
    "UnmonitoredTransport",
    "manager_class",
    "transport_class",
]

#: libzmq's default send high-water mark, set explicitly so "queueing" means what SGLang has.
QUEUEING_SNDHWM = 1000


#: SGLang 0.5.23's PUSH sockets: no ``IMMEDIATE`` (a send towards a dead rank queues, up to
#: ``SNDHWM=1000`` messages), libzmq's reconnect defaults, no monitor, a blocking send.
QUEUEING = SocketPolicy(monitored=False, immediate=False, sndhwm=QUEUEING_SNDHWM)
#: The transport before the socket monitor: ``IMMEDIATE``, a blocking send bounded by
#: ``SNDTIMEO``, a failed send closes and evicts its socket (ZMQ-6, ZMQ-7).
UNMONITORED = SocketPolicy(monitored=False)


class QueueingTransport(ZmqTransport):
    """A transport on SGLang 0.5.23's sockets (:data:`QUEUEING`)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(policy=QUEUEING, **options)


class UnmonitoredTransport(ZmqTransport):
    """The transport before the socket monitor (:data:`UNMONITORED`). The benchmarks'
    "previous" anchor; tests use it to watch a detector other than the monitor alone."""

    def __init__(self, **options: Any) -> None:
        super().__init__(policy=UNMONITORED, **options)


def transport_class(zmq_mode: ZmqMode) -> type[ZmqTransport]:
    """The transport a demo mode runs: ours, or SGLang's queueing sockets."""
    return QueueingTransport if zmq_mode == "queueing" else ZmqTransport


class NoFanOut(FanOut):
    """Evidence fails nobody: the transport's and the health monitor's verdicts, a failed
    send and a restart only drop what they name from the caches (as SGLang: each request
    fails on its own send or timeout). A source's retirements still apply."""

    def endpoint_dead(self, url: str, reason: str, *, exit_proven: bool = False) -> int:
        return 0

    def address_dead(self, addr: str, reason: str) -> None:
        return None

    def restarted(
        self,
        addr: str,
        old_id: str,
        new_id: str,
        *,
        cause: str,
        spare_room: int | None = None,
    ) -> int:
        self._routes.forget(addr)
        self.dead_keys.forget_address(addr)
        return 0


class EveryMissFetches(Fetcher):
    """No single-flight: each request that misses leads its own fetch."""

    def claim(
        self,
        missing: list[PoolKey],
        entries: dict[PoolKey, Generation],
        deadline: float,
    ) -> Claim | BootstrapError:
        return Claim(missing, {}, followed=False)


class FetchPerMissManager(DecodeManager):
    """The product's fan-out, but every miss fetches for itself (a test that needs N
    concurrent fetches of one key, or two leaders on one key)."""

    fetcher_class = EveryMissFetches


class SGLangLikeManager(DecodeManager):
    """SGLang's behaviour for the anchors: no fan-out from evidence, no single-flight."""

    fanout_class = NoFanOut
    fetcher_class = EveryMissFetches


class QueueingManager(DecodeManager):
    """The product's manager on SGLang's queueing sockets (``--zmq-mode=queueing``)."""

    transport_class = QueueingTransport


class SGLangLikeQueueingManager(SGLangLikeManager):
    """SGLang's manager behaviour on SGLang's sockets: the demo's ``sglang`` anchor."""

    transport_class = QueueingTransport


def manager_class(mode: ModeConfig) -> type[DecodeManager]:
    """The manager a demo mode runs: ours with fan-out and single-flight, else the anchor,
    each on the mode's ZMQ sockets (ours, or SGLang's queueing ones)."""
    queueing = mode.zmq_mode == "queueing"
    if mode.manager_fanout:
        return QueueingManager if queueing else DecodeManager
    return SGLangLikeQueueingManager if queueing else SGLangLikeManager
