"""The etcd source's local store of rank registrations, and its currency rule (docs/etcd.md).

What the watch has applied, by key and by prefill address, at one revision; and the rule that
says whether a generation (one pool entry) fetched from it is still *current*: while every rank
it holds is still registered with the same endpoint *and* has held that exact value since a
revision no newer than the generation's own ``revision``, the store revision read before its
fetch (:class:`~statemachine.discovery.changes.StampedGeneration`; an unstamped generation is
current while its endpoints are registered). The rule reads a bounded history of the changes of
each ``(addr, dp, cp)``: what a change replaced or removed, at which revision.

No etcd here, and no pool: :class:`~statemachine.discovery.etcd_source.EtcdBootstrapSource`
feeds the store from its watch and retires what the rule finds stale. Written by the watch
thread only; read lock-free (single dict and attribute loads).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass

from statemachine.discovery.layout import RankKey, RankRecord
from statemachine.pool import Generation, PoolKey

Ranks = tuple[int, int, int, int]  # (dp, cp, tp, pp)
Endpoint = tuple[str, int, int]  # (ip, port, pp)
Group = tuple[str, int, int]  # (addr, dp, cp)

#: Changes remembered per (addr, dp, cp) for the currency check: far more than one prefill
#: restart makes (two per rank); a generation older than what is kept counts as stale.
HISTORY_PER_GROUP = 256
#: Floors kept for the groups of prefills that vanished, before they fold into one.
MAX_FORGOTTEN = 100_000


@dataclass(frozen=True, slots=True)
class AddressView:
    """One prefill's registrations, rebuilt (copy-on-write) on each change of its keys."""

    records: Mapping[Ranks, RankRecord]
    #: (ip, port, dp, cp, pp) -> how many ranks registered it, for unstamped generations
    endpoints: Mapping[tuple[str, int, int, int, int], int]
    reference: RankRecord | None
    ready: bool

    @staticmethod
    def build(records: Mapping[Ranks, RankRecord]) -> AddressView:
        reference = max(records.values(), key=lambda r: r.mod_revision, default=None)
        ready = False
        if reference is not None:
            layout, instance = reference.layout, reference.instance_id
            # Ready when every rank of the newest registration's topology is registered by the
            # same instance: while a restart is half re-registered the prefill is NotReady
            # (retryable), never a mix of two instances' ranks.
            complete = sum(
                1
                for (dp, cp, tp, pp), record in records.items()
                if record.layout == layout
                and record.instance_id == instance
                and dp < reference.dp_size
                and cp < reference.attn_cp_size
                and tp < reference.attn_tp_size
                and pp < reference.pp_size
            )
            ready = complete == reference.world
        endpoints = Counter(
            (record.rank_ip, record.rank_port, dp, cp, pp)
            for (dp, cp, _tp, pp), record in records.items()
        )
        return AddressView(dict(records), endpoints, reference, ready)


class RankStore:
    """The registrations the watch applied, and what each change replaced (see the module doc).

    ``revision``: every change up to it is applied. ``floor``: the revision before which the
    store knows nothing (its first list, or a replaced cluster's).
    """

    def __init__(self) -> None:
        self.records: dict[RankKey, RankRecord] = {}
        self.addrs: dict[str, AddressView] = {}
        self.revision = 0
        self.floor = 0
        #: per (addr, dp, cp): (revision, replaced or removed endpoint) of the latest changes
        self.history: dict[Group, deque[tuple[int, Endpoint]]] = {}
        #: per group: the newest revision dropped from its history
        self.history_floor: dict[Group, int] = {}

    def put(self, key: RankKey, record: RankRecord | None) -> None:
        """``key`` now holds ``record`` (None: deleted); its prefill's view is rebuilt."""
        if record is None:
            self.records.pop(key, None)
        else:
            self.records[key] = record
        view = self.addrs.get(key.addr)
        records = dict(view.records) if view is not None else {}
        ranks = (key.dp_rank, key.cp_rank, key.tp_rank, key.pp_rank)
        if record is None:
            records.pop(ranks, None)
        else:
            records[ranks] = record
        if records:
            self.addrs[key.addr] = AddressView.build(records)
        else:
            self.addrs.pop(key.addr, None)

    def note_change(self, key: RankKey, revision: int, old: RankRecord) -> None:
        """The change of ``key`` at ``revision`` replaced or removed ``old``: remember its
        endpoint in the key's group history (the oldest entry folds into the group's floor
        past HISTORY_PER_GROUP); a prefill with no key left is forgotten."""
        group = (key.addr, key.dp_rank, key.cp_rank)
        history = self.history.get(group)
        if history is None:
            history = self.history[group] = deque()
        if len(history) == HISTORY_PER_GROUP:
            self.history_floor[group] = history.popleft()[0]
        history.append((revision, (old.rank_ip, old.rank_port, key.pp_rank)))
        if key.addr not in self.addrs:
            self._forget(key.addr, revision)

    def is_current(self, key: PoolKey, generation: Generation) -> bool:
        """No rank ``generation`` used has changed or gone since it was fetched.

        Stamped (:class:`~statemachine.discovery.changes.StampedGeneration`): no change of its
        ``(addr, dp, cp)`` after its revision replaced or removed an endpoint it holds (the
        per-group change history; a stamp older than the history reaches is not current).
        Unstamped: every endpoint it holds is registered now.
        """
        view = self.addrs.get(key.addr)
        if view is None:
            return False
        stamp: int | None = getattr(generation, "revision", None)
        if stamp is None:
            needed = Counter((rank.ip, rank.port, rank.pp_rank) for rank in generation.ranks)
            registered = view.endpoints
            return all(
                registered.get((ip, port, key.dp_rank, key.cp_rank, pp), 0) >= count
                for (ip, port, pp), count in needed.items()
            )
        group = (key.addr, key.dp_rank, key.cp_rank)
        if not max(self.floor, self.history_floor.get(group, 0)) <= stamp <= self.revision:
            return False  # from another cluster, or older than the history we keep
        history = self.history.get(group)
        if history:
            used = {(rank.ip, rank.port, rank.pp_rank) for rank in generation.ranks}
            for revision, endpoint in reversed(history):
                if revision <= stamp:
                    break
                if endpoint in used:
                    return False
        return True

    def _forget(self, addr: str, revision: int) -> None:
        """``addr`` has no key left: drop its history (prefills come and go), keeping only a
        floor per group - a generation stamped before ``revision`` is stale - so memory stays
        bounded by the live prefills plus one integer per vanished group. Past
        ``MAX_FORGOTTEN`` floors they fold into the source-wide floor (a generation stamped
        before it then counts as stale: one spurious retirement, never a missed one)."""
        for group in [group for group in self.history if group[0] == addr]:
            del self.history[group]
            self.history_floor[group] = revision
        if len(self.history_floor) > MAX_FORGOTTEN:
            self.floor = max(self.floor, *self.history_floor.values())
            self.history_floor.clear()

    def clear(self) -> None:
        """Another cluster: its revisions mean nothing here. Forget every registration and
        the change history (the floor stays until the new cluster's list sets it)."""
        self.records.clear()
        self.addrs.clear()
        self.history.clear()
        self.history_floor.clear()
        self.revision = 0
