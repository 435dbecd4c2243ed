"""``Routes``: per prefill address, its topology, this decode's rank plan, and the checks passed.

The route cache of a decode process: topology (asked of the source once per prefill instance)
→ rank plan (:mod:`statemachine.decode.plan`) → :class:`AddressPlan` (the plan, its response
count, the pool keys per dp rank; its existence says SGLang's allocation-policy and staging
checks passed, MGR-16/17). The hit path reads ``Routes.known`` with one dict get; everything
else resolves here. An address's entries are forgotten together (:meth:`Routes.forget`): when
it dies or restarts, when a fetch is answered by another instance (MGR-20), and when it failed
a request with ``TopologyMismatch``. :meth:`Routes.prepare` resolves an address on the
background workers so that a scheduler never waits on the network.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass

from statemachine.decode.background import Background
from statemachine.decode.config import PREFILL_COMPLETE
from statemachine.decode.plan import DecodeLayout, RankPlan, derive_plan, plan_without_layout
from statemachine.decode.source import BootstrapQueries
from statemachine.errors import TopologyMismatch
from statemachine.pool import PoolKey
from statemachine.validation import Topology

__all__ = ["PREPARING", "AddressPlan", "Pending", "Routes"]

#: What a manager without a layout is, for the checks of MGR-16: SGLang's defaults (policy
#: unset = ``early``, tp 1).
_DEFAULT_LAYOUT = DecodeLayout()


@dataclass(frozen=True, slots=True)
class AddressPlan:
    """What ``init()`` needs to know of one prefill address before its pool lookup, resolved
    once per address: the rank plan derived from the prefill's topology, the plan's response
    count, and the pool keys per prefill dp rank. Its existence says the allocation-policy and
    staging checks passed (MGR-16, MGR-17) for the topology it was derived from; it is
    forgotten with that topology.
    """

    plan: RankPlan
    #: ``plan.required_prefill_response_num``, read once
    needed: int
    #: ``plan.keys_for(addr, dp_rank)`` for every dp rank of the prefill's topology
    keys: Mapping[int, tuple[PoolKey, ...]]


@dataclass(frozen=True, slots=True)
class Pending:
    """No route yet, and none is asked here: ``why``."""

    why: str


#: The address is being resolved on the background workers (:meth:`Routes.prepare`).
PREPARING = Pending("its route is being prepared in the background")


class Routes:
    """The route cache of one decode process (see the module docstring)."""

    def __init__(
        self,
        source: BootstrapQueries,
        layout: DecodeLayout | None,
        *,
        staging: bool,
        background: Background,
        check_topology: Callable[[str, Topology, DecodeLayout], None] | None = None,
    ) -> None:
        self._source = source
        self.layout = layout
        self._staging = staging
        #: the backend's own refusal of a prefill it cannot work with (raises TopologyMismatch)
        self._check_topology = check_topology
        self._background = background
        #: init() runs :meth:`check_prefill` on a given plan, fetching the topology if needed
        #: (a layout is known); without one, :meth:`check_known` checks once it is known
        self.policy_checked = layout is not None
        #: per address, the topology a manager without a layout last checked (MGR-16)
        self._checked: dict[str, Topology] = {}
        self._lock = threading.Lock()
        self._topologies: dict[str, Topology] = {}
        self._plans: dict[str, RankPlan] = {}
        #: per address, what init() needs before its lookup (written under the lock, read
        #: lock-free: one dict get per hit)
        self.known: dict[str, AddressPlan] = {}
        #: addresses being resolved by prepare() on the background workers
        self._preparing: dict[str, Future[AddressPlan]] = {}

    def route(
        self,
        addr: str,
        plan: RankPlan | None,
        *,
        window: Callable[[], AbstractContextManager[object]],
    ) -> RankPlan | Pending:
        """A request's plan when the hit path's :attr:`known` did not answer: the plan given,
        or the address's (resolved once), with SGLang 0.5.23's ``init()`` checks passed
        (MGR-16/17); :data:`PREPARING` while :meth:`prepare` resolves it. Questions to the
        source run inside ``window()``, the request's deadline window (MGR-21), opened only
        when one is asked. Raises the typed error of a refused or failed resolution."""
        if plan is None:
            if addr in self._preparing:
                return PREPARING  # resolved in the background: not fetched here
            known = self.known.get(addr)
            if known is None:  # the topology is asked: inside the request's window
                with window():
                    known = self.address_plan(addr)  # SGLang checks in init() too
            return known.plan
        if self.policy_checked:
            # SGLang checks in init(), before the routes
            if addr in self._topologies:
                self.check_prefill(addr)
            else:
                with window():
                    self.check_prefill(addr)
        else:  # no layout: SGLang's default policy, once the topology is known
            self.check_known(addr)
        return plan

    def dp_rank(
        self, addr: str, room: int, *, window: Callable[[], AbstractContextManager[object]]
    ) -> int | None:
        """The prefill dp rank of ``room`` in SGLang's order after a router-given one: 0 for a
        prefill of one dp rank, ``room % dp_size`` under ``follow_bootstrap_room``; ``None``
        when only the manager's batched ``POST /query_dp_ranks`` can tell (MGR-8)."""
        if addr in self._topologies:
            topology = self.topology(addr)
        else:
            with window():
                topology = self.topology(addr)
        if topology.dp_size == 1:
            return 0
        if topology.follow_bootstrap_room is not False:  # never set means True (SGLang)
            return room % topology.dp_size
        return None

    def topology(self, addr: str) -> Topology:
        """The prefill's topology, fetched once per instance of the prefill (MGR-20)."""
        topology = self._topologies.get(addr)
        if topology is None:
            topology = self._source.get_topology(addr)
            self._topologies[addr] = topology
        return topology

    def plan_for(self, addr: str) -> RankPlan:
        """This decode rank's plan against ``addr``, from the prefill's topology (spec/plans.md):
        derived from the layout; without one, only a one-rank prefill is planned (PLAN-9)."""
        plan = self._plans.get(addr)
        if plan is None:
            topology = self.topology(addr)
            try:
                if self.layout is None:
                    plan = plan_without_layout(addr, topology)
                else:
                    plan = derive_plan(addr, topology, self.layout)
            except TopologyMismatch:
                self.forget(addr, topology)
                raise
            self._plans[addr] = plan
        return plan

    def address_plan(self, addr: str) -> AddressPlan:
        """``addr``'s plan, response count, pool keys per dp rank, and the policy checks
        passed, resolved once and kept in :attr:`known`. Raises what :meth:`plan_for` or
        :meth:`check_prefill` raise (nothing is kept then)."""
        known = self.known.get(addr)
        if known is not None:
            return known
        topology = self.topology(addr)
        plan = self.plan_for(addr)
        self.check_prefill(addr)  # with or without a layout (MGR-16)
        keys = {dp: plan.keys_for(addr, dp) for dp in range(topology.dp_size)}
        known = AddressPlan(plan, plan.required_prefill_response_num, keys)
        with self._lock:
            # Kept only while the topology it was derived from is the one known: a refresh or
            # a restart that dropped it while we resolved must not leave a stale plan behind.
            if self._topologies.get(addr) is topology:
                self.known[addr] = known
        return known

    def forget(self, addr: str, topology: Topology | None = None) -> None:
        """Drop ``addr``'s topology (only ``topology``, if given: not a newer one another
        thread just fetched) and the plan and address plan derived from it: the next request
        asks again."""
        with self._lock:
            if topology is None or self._topologies.get(addr) is topology:
                self._topologies.pop(addr, None)
                self._checked.pop(addr, None)
                self._plans.pop(addr, None)
                self.known.pop(addr, None)

    def answered_by(self, addr: str, instance_id: str | None) -> None:
        """A fetch from ``addr`` was answered by ``instance_id``: a cached topology of another
        instance is forgotten, and so is the plan derived from it (MGR-20)."""
        topology = self._topologies.get(addr)
        if (
            topology is not None
            and instance_id is not None
            and topology.instance_id is not None
            and topology.instance_id != instance_id
        ):
            self.forget(addr, topology)

    def check_prefill(self, addr: str) -> None:
        """SGLang 0.5.23's ``init()`` checks (MGR-16, MGR-17): this decode's allocation policy
        equals the prefill's, ``prefill_complete`` needs a prefill of attn tp, cp and pp 1, and
        staging (not implemented here) is refused where it would be used; then the backend's own
        ``check_topology``, if it has one (it needs the decode's layout). Without a layout the
        decode's policy is SGLang's default, ``early``."""
        topology = self.topology(addr)
        try:
            self._check_policy(addr, topology, self.layout)
            if self._check_topology is not None and self.layout is not None:
                self._check_topology(addr, topology, self.layout)
        except TopologyMismatch:
            self.forget(addr, topology)  # not remembered past its deployment
            raise

    def check_known(self, addr: str) -> None:
        """A given plan in a manager without a layout: the checks of :meth:`check_prefill`
        once ``addr``'s topology is known (``plan_for``, ``prepare``, ``topology`` or a
        derived plan fetched it), once per topology passed; never a fetch of its own
        (MGR-16)."""
        topology = self._topologies.get(addr)
        if topology is None or self._checked.get(addr) is topology:
            return
        # Not forgotten on a refusal (as check_prefill does): the plan came from this
        # topology, and the next request is refused without a fetch.
        self._check_policy(addr, topology, self.layout)
        self._checked[addr] = topology

    def _check_policy(self, addr: str, topology: Topology, layout: DecodeLayout | None) -> None:
        if layout is None:
            layout = _DEFAULT_LAYOUT  # SGLang's default policy; tp 1, as PLAN-9 plans it
        if self._staging and topology.attn_tp_size != layout.tp_size:
            raise TopologyMismatch(
                f"{addr}: prefill attn tp size {topology.attn_tp_size} differs from this "
                f"decode's {layout.tp_size} and staging is on: SGLang's staging buffer is "
                "not implemented here; run without staging (the plan maps the ranks), or with "
                "equal attn tp sizes"
            )
        mine = layout.decode_allocation_policy
        theirs = topology.decode_allocation_policy
        if theirs is None:
            return  # a prefill that does not report it (older than the policy): nothing to check
        if mine is None:
            if theirs != PREFILL_COMPLETE:
                return  # unset here: SGLang's default, early, which needs nothing
            # Such a prefill sends its statuses only to decodes that sent BOOTSTRAP: without
            # the handshake this request would wait out its timeout.
            mine = (
                "early (DecodeLayout.decode_allocation_policy unset)"
                if self.layout is not None
                else "early (no DecodeLayout given: SGLang's default policy)"
            )
        if theirs != mine:
            here = (
                "DecodeLayout.decode_allocation_policy here"
                if self.layout is not None
                else f"here: DecodeManager(layout=DecodeLayout(decode_allocation_policy="
                f"{theirs!r}, ...)), with this decode rank's tp"
            )
            raise TopologyMismatch(
                f"{addr}: decode allocation policy mismatch: prefill={theirs}, decode={mine}; "
                f"set --disaggregation-decode-allocation-policy identically on both roles ({here})"
            )
        if mine == PREFILL_COMPLETE and (
            topology.attn_tp_size,
            topology.attn_cp_size,
            topology.pp_size,
        ) != (1, 1, 1):
            raise TopologyMismatch(
                f"{addr}: the {PREFILL_COMPLETE} policy needs a prefill of attention tp 1, cp 1 "
                f"and pp 1, not tp {topology.attn_tp_size}, cp {topology.attn_cp_size}, pp "
                f"{topology.pp_size}: use the policy 'early' for this prefill"
            )

    def prepare(self, addr: str) -> Future[AddressPlan]:
        """Start resolving ``addr`` on the background workers; see ``DecodeManager.prepare``."""
        with self._lock:
            known = self.known.get(addr)
            if known is None:
                future = self._preparing.get(addr)
                if future is None:
                    future = self._background.submit(self._prepared, addr)
                    self._preparing[addr] = future
                return future
        done: Future[AddressPlan] = Future()
        done.set_result(known)
        return done

    def _prepared(self, addr: str) -> AddressPlan:
        """A background worker resolves ``addr``; whatever happens, it is no longer being
        prepared (the next ``init()`` reads the result or resolves it again)."""
        try:
            return self.address_plan(addr)
        finally:
            with self._lock:
                self._preparing.pop(addr, None)

    def close(self) -> None:
        with self._lock:
            self._preparing.clear()
