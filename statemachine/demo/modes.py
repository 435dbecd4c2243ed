"""The cache designs the demo compares, and the audited pool that checks them.

* ``ours``: immediate ZMQ sends (a dead rank fails the first send within the send timeout),
  identity-safe invalidation on every failure, instance-id retirement (a restarted bootstrap
  server answers with a new instance id; entries from the old one are dropped), and the decode
  manager's failure fan-out (every request in flight on a dead rank or instance fails at once)
  and single-flight fetches.
* ``sglang``: SGLang today - the same invalidation, but SGLang's default socket options (sends
  to a dead rank queue silently up to the high-water mark), no instance id (its heartbeat
  only notices a server that stops answering), no fan-out from a failed send (each request
  fails on its own send or its waiting timeout) and a fetch per missing request.
* ``before-36029``: the cache before SGLang PR #36029 - failures never drop pool entries.

:class:`AuditedPool` counts *lost live generations* without trusting the pool's own algorithm:
it compares the pool before and after every removing operation and checks each removed
generation against the caller's records and against the instance that is running right now.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from statemachine.pool import BootstrapPool, Generation, PoolKey

ZmqMode = Literal["immediate", "queueing"]


@dataclass(frozen=True)
class ModeConfig:
    """One cache design: socket options, invalidation on failure, instance-id retirement, and
    the manager's fan-out and single-flight fetches (on together: they are what ours adds)."""

    name: str
    zmq_mode: ZmqMode
    invalidation: bool
    instance_id: bool
    manager_fanout: bool = False

    def describe(self) -> str:
        inv = "invalidation" if self.invalidation else "no invalidation"
        iid = "instance id" if self.instance_id else "no instance id"
        fan = ", fan-out + single-flight" if self.manager_fanout else ""
        return f"{self.zmq_mode} ZMQ, {inv}, {iid}{fan}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


OURS = ModeConfig("ours", "immediate", invalidation=True, instance_id=True, manager_fanout=True)
SGLANG = ModeConfig("sglang", "queueing", invalidation=True, instance_id=False)
BEFORE_36029 = ModeConfig("before-36029", "queueing", invalidation=False, instance_id=False)
#: The order of ``--compare``: the fix last, so the table reads as a progression.
PRESETS: tuple[ModeConfig, ...] = (BEFORE_36029, SGLANG, OURS)


def mode_from_flags(
    zmq_mode: ZmqMode | None, invalidation: bool, instance_id: bool | None
) -> ModeConfig:
    """Resolve the CLI flags to a mode, naming it after the preset it equals.

    Defaults follow what each anchor really had: without invalidation (before #36029) the
    sockets were SGLang's queueing ones; instance-id retirement exists only in ours (and cannot
    work without invalidation).
    """
    if zmq_mode is None:
        zmq_mode = "immediate" if invalidation else "queueing"
    if instance_id is None:
        instance_id = invalidation and zmq_mode == "immediate"
    if instance_id and not invalidation:
        raise ValueError("instance-id retirement is an invalidation: it needs invalidation on")
    for preset in PRESETS:
        if (preset.zmq_mode, preset.invalidation, preset.instance_id) == (
            zmq_mode,
            invalidation,
            instance_id,
        ):
            return preset
    return ModeConfig("custom", zmq_mode, invalidation, instance_id, manager_fanout=instance_id)


# --- pools --------------------------------------------------------------------------------


class AuditedPool(BootstrapPool):
    """A :class:`BootstrapPool` that audits every removal.

    ``live_instance()`` names the bootstrap-server instance running now (``None`` while the
    prefill is down). A *lost live generation* is a generation of that instance removed by an
    operation that had no right to it: ``invalidate(entries)`` removing a generation that is not
    the caller's recorded object for that key, or ``retire_instance`` removing one of the live
    instance's generations. The audit lock serialises removals only (publish and lookup never
    remove), and the pool holds one entry per key, so the before/after copies are tiny.
    """

    def __init__(self, live_instance: Callable[[], str | None]) -> None:
        super().__init__()
        self._audit_lock = threading.Lock()
        self._live_instance = live_instance
        self.lost_live_generations = 0
        #: generations of the live instance dropped by the heartbeat declaring the node dead
        self.live_removed_by_heartbeat = 0
        self.removed_total = 0

    def invalidate(self, entries: Mapping[PoolKey, Generation]) -> int:
        with self._audit_lock:
            before = self.snapshot()
            removed = super().invalidate(entries)
            for key, generation in self._removed(before):
                if entries.get(key) is not generation and self._is_live(generation):
                    self.lost_live_generations += 1
        return removed

    def retire_instance(self, addr: str, instance_id: str) -> int:
        with self._audit_lock:
            before = self.snapshot()
            removed = super().retire_instance(addr, instance_id)
            for _, generation in self._removed(before):
                if self._is_live(generation):
                    self.lost_live_generations += 1
        return removed

    def invalidate_address(self, addr: str) -> int:
        with self._audit_lock:
            before = self.snapshot()
            removed = super().invalidate_address(addr)
            for _, generation in self._removed(before):
                if self._is_live(generation):
                    self.live_removed_by_heartbeat += 1
        return removed

    def _removed(self, before: dict[PoolKey, Generation]) -> list[tuple[PoolKey, Generation]]:
        after = self.snapshot()
        gone = [(k, g) for k, g in before.items() if after.get(k) is not g]
        self.removed_total += len(gone)
        return gone

    def _is_live(self, generation: Generation) -> bool:
        live = self._live_instance()
        return live is not None and generation.instance_id == live


class SglangPool(AuditedPool):
    """SGLang today: invalidation on failure, but no instance id to retire entries by."""

    def retire_instance(self, addr: str, instance_id: str) -> int:
        return 0


class NoInvalidationPool(AuditedPool):
    """Before SGLang PR #36029: nothing ever drops an entry."""

    def invalidate(self, entries: Mapping[PoolKey, Generation]) -> int:
        return 0

    def invalidate_address(self, addr: str) -> int:
        return 0

    def retire_instance(self, addr: str, instance_id: str) -> int:
        return 0


def make_pool(mode: ModeConfig, live_instance: Callable[[], str | None]) -> AuditedPool:
    if not mode.invalidation:
        return NoInvalidationPool(live_instance)
    if not mode.instance_id:
        return SglangPool(live_instance)
    return AuditedPool(live_instance)
