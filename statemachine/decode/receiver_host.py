"""The interface between a receiver and its manager, both directions, and nothing more.

:class:`ReceiverHost` is what a :class:`~statemachine.decode.receiver.BootstrapReceiver` may
read and call on the manager that made it (the
:class:`~statemachine.decode.manager.DecodeManager` implements it); :class:`HostedReceiver` is
what the manager may read, call or set on a receiver in flight (``BootstrapReceiver`` implements
it). Neither file reaches past these into the other's private names (``tests/test_structure.py``
checks it), so either side can change inside without the other noticing.

Threads: a receiver is driven by its owner's thread and calls its host from there. The host
calls the receiver's ``lose``/``resolved``/``responded``/``failed_by_prefill``/
``prefill_ready`` from other threads (the fan-out, the stepping thread, the ack listener):
each is a single store (``responded``: under the receiver module's lock) that the owner's next
call consumes (spec/manager.md MGR-2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from statemachine.backend import KVBackend
from statemachine.decode.flight import Flights
from statemachine.decode.plan import RankPlan
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.decode.source import BootstrapSource
from statemachine.errors import BootstrapError, RanksUnreachable, SendFailed
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.validation import Topology

__all__ = ["AddressPlan", "HostedReceiver", "ReceiverHost"]


@dataclass(frozen=True, slots=True)
class AddressPlan:
    """What ``init()`` needs to know of one prefill address before its pool lookup, resolved
    once per address by the host (``ReceiverHost.address_plan``) and read by every receiver
    of that address with one dict get (``ReceiverHost.address_plans``): the rank plan derived
    from the prefill's topology, the plan's response count, and the pool keys per prefill dp
    rank. Its existence says the allocation-policy and staging checks passed (MGR-16, MGR-17)
    for the topology it was derived from; the host forgets it with that topology.
    """

    plan: RankPlan
    #: ``plan.required_prefill_response_num``, read once
    needed: int
    #: ``plan.keys_for(addr, dp_rank)`` for every dp rank of the prefill's topology
    keys: Mapping[int, tuple[PoolKey, ...]]


class HostedReceiver(Protocol):
    """What a manager may read, call or set on a receiver it made."""

    #: The request's bootstrap room and its prefill's bootstrap address (set at creation).
    room: int
    addr: str
    #: The generation objects the receiver holds, by key (the owner's thread writes it; the
    #: manager copies it, retrying a copy that raced a resize).
    entries: dict[PoolKey, Generation]
    #: The room waits for the manager's batched dp-rank query (``ReceiverHost.await_dp_rank``).
    awaiting_dp_rank: bool
    #: Called (from any thread) when the receiver has news for its owner.
    on_change: Callable[[], None] | None

    @property
    def ended(self) -> bool:
        """The request reached a final state."""
        ...

    def ranks(self) -> list[tuple[Generation, RankInfo]]:
        """Every (generation, rank) of the room, each endpoint once."""
        ...

    def lose(self, error: BootstrapError) -> bool:
        """The fan-out: store ``error`` for the owner's next call and wake it. False when the
        receiver ended, was already lost, or every response arrived (nothing to fail)."""
        ...

    def resolved(self, dp_rank: int) -> None:
        """The batched dp-rank query answered for this room."""
        ...

    def responded(self, prefill_rank: int) -> bool:
        """A Success from ``prefill_rank``; True when it is the first from that rank."""
        ...

    def failed_by_prefill(self, error: BootstrapError) -> None:
        """A Failed status: terminal, it wins over any success."""
        ...

    def prefill_ready(self) -> None:
        """The prefill answered the BOOTSTRAP handshake."""
        ...


class ReceiverHost(Protocol):
    """What a receiver may read and call on the manager that made it."""

    # --- the shared parts and settings (read only) -------------------------------------------
    pool: BootstrapPool
    source: BootstrapSource
    transport: ZmqTransport
    backend: KVBackend
    #: Single-flight fetches per key; None: every miss fetches for itself.
    flights: Flights | None
    clock: Callable[[], float]
    waiting_timeout_s: float
    bootstrap_timeout_s: float
    flight_timeout_s: float
    #: ``prefill_complete`` policy: init() runs the BOOTSTRAP handshake (MGR-16).
    prefill_complete: bool
    #: init() runs :meth:`check_prefill` first (a layout is known).
    policy_checked: bool
    #: The source marks stale generations: check them before starting a transfer.
    watermarked: bool

    #: How long one init() call may spend asking the source, all questions together (MGR-21).
    fetch_deadline_s: float
    #: The plans and topologies known now, by address (read only).
    plans: Mapping[str, RankPlan]
    topologies: Mapping[str, Topology]

    @property
    def address_plans(self) -> Mapping[str, AddressPlan]:
        """The addresses whose plan and checks are resolved (a plain dict attribute on the
        host: one dict get on the hit path); an address not in it is resolved by
        :meth:`address_plan`."""
        ...

    # --- questions ------------------------------------------------------------------------
    def address_plan(self, addr: str) -> AddressPlan:
        """Resolve ``addr`` (topology, plan, policy checks) and keep it in ``address_plans``;
        a :class:`~statemachine.errors.BootstrapError` if it cannot be served."""
        ...

    def known_dead(self, addr: str, keys: Sequence[PoolKey]) -> BootstrapError | None:
        """The error a request missing ``keys`` fails with at once (one of them is known
        dead: no refetch per request), or ``None``."""
        ...

    def still_named_dead(
        self, fresh: Mapping[PoolKey, Generation], error: RanksUnreachable
    ) -> None:
        """A fetch named again a rank the transport judged dead (``error.endpoint``)."""
        ...

    def preparing(self, addr: str) -> bool:
        """``addr`` is being resolved in the background: init() must not fetch it too."""
        ...

    def plan_for(self, addr: str) -> RankPlan: ...

    def topology(self, addr: str) -> Topology: ...

    def check_prefill(self, addr: str) -> None: ...

    # --- what a receiver tells its manager ---------------------------------------------------
    #: A new receiver registers itself by room: ``admit_room(room, receiver)`` returns the
    #: receiver in flight for ``room`` (``receiver`` itself unless the room is taken), and
    #: raises ManagerClosed once the manager closed. While the manager is open it is the room
    #: table's own ``dict.setdefault``: the hit path's one store, no Python call around it.
    admit_room: Callable[[int, HostedReceiver], HostedReceiver]

    def receiver_ended(self, receiver: HostedReceiver, error: BootstrapError | None) -> None:
        """The receiver reached a final state (``error`` None: it completed)."""
        ...

    def entries_invalidated(
        self, entries: Mapping[PoolKey, Generation], removed: int, cause: str
    ) -> None:
        """The receiver dropped ``entries`` from the pool (``removed`` of them were there)."""
        ...

    def send_abort(self, receiver: HostedReceiver, *, armed: bool) -> bool:
        """Tell every rank of the room (MGR-15); False when it has no ranks yet."""
        ...

    def send_bootstrap(self, receiver: HostedReceiver) -> None:
        """``prefill_complete``: BOOTSTRAP to every rank of the room (SendFailed propagates)."""
        ...

    def await_dp_rank(self, receiver: HostedReceiver) -> None:
        """Ask the room's dp rank in the next batched query (:meth:`resolved` answers)."""
        ...

    def watch_address(self, addr: str, instance_id: str | None) -> None:
        """The receiver fetched from ``addr`` (answered by ``instance_id``, the baseline):
        watch its health if the source needs probes."""
        ...

    def send_failed(self, error: SendFailed) -> None:
        """A send failed: every other request using that endpoint is lost too."""
        ...

    def fetched_from(self, addr: str, instance_id: str | None) -> None:
        """A fetch from ``addr`` was answered by ``instance_id`` (a new one: re-plan)."""
        ...

    def callback_raised(self, receiver: HostedReceiver, error: Exception) -> None:
        """The receiver's ``on_change`` raised ``error`` (contained: counted, logged once)."""
        ...

    def retain_sockets(self, generation: Generation) -> None:
        """``generation`` was published by this process: keep its endpoints' sockets."""
        ...

    def instance_replaced(
        self,
        addr: str,
        old_ids: Iterable[str | None],
        new_id: str,
        finder: HostedReceiver,
    ) -> None:
        """``finder``'s fetch answered as ``new_id`` while it held entries of ``old_ids``."""
        ...
