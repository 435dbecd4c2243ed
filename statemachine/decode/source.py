"""``BootstrapSource``: where a decode manager learns the prefill's ranks, and what a source
tells its owner about them.

A source answers three questions (:class:`BootstrapQueries`: ``get_rank``, ``get_topology``,
``query_dp_ranks``) and reports what it knows about the answers it gave
(:class:`BootstrapSource`):

* **provenance** - ``stamp()`` before a fetch, ``generation(ranks, instance_id, stamp)`` after
  it: the generation object the pool will hold, carrying what the source needs to judge it
  later (the etcd source: the store revision it was fetched at);
* **the watermark** - ``publish(pool, key, generation)`` publishes unless the source already
  knows the fetch is stale (then ``None``, and ``refusal`` is the request's typed error);
* **staleness marks** - with ``marks_generations``, a generation may be marked stale after it
  was handed out; ``stale_mark`` is the typed error a receiver fails with instead of starting a
  transfer on a marked one;
* **retirements** - ``attach(pool, held=..., retire=...)``: the source retires stale entries
  from ``pool`` itself, asks ``held(addr)`` what the owner's requests in flight hold, and hands
  what it retired to ``retire(generations, error)`` (the manager's failure fan-out);
  ``detach()`` when the owner closes;
* **health** - ``health_by_probes``: True when the source learns of a dead or restarted prefill
  only when asked, so its owner probes every address it fetched from (the HTTP client); False
  when the source reports deaths and restarts itself (the etcd watch and leases).

Two implement it: :class:`~statemachine.decode.client.BootstrapClient` (HTTP to the prefill's
bootstrap server; it has nothing to report, :class:`NothingToReport`) and
``statemachine.discovery.etcd_source.EtcdBootstrapSource`` (a watch-fed store). Any object
with the three questions alone will do too: :func:`as_source` gives it the HTTP client's
reports. Every method raises a :class:`~statemachine.errors.BootstrapError` subclass on failure
and returns within its own documented deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from statemachine.errors import BootstrapError, ConfigurationError, PeerLost
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.validation import RouteReply, Topology

__all__ = [
    "BootstrapQueries",
    "BootstrapSource",
    "HeldBy",
    "NothingToReport",
    "Retire",
    "as_source",
]

#: The owner's answer to "which (key, generation) do your requests in flight hold for addr?"
HeldBy = Callable[[str], Iterable[tuple[PoolKey, Generation]]]
#: The owner's failure fan-out: fail every request in flight holding one of the generations.
Retire = Callable[[Sequence[Generation], BootstrapError], object]


@runtime_checkable
class BootstrapQueries(Protocol):
    """The three questions the decode side asks about a prefill at ``addr``."""

    def get_rank(
        self, addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int
    ) -> RouteReply:
        """Where one prefill rank listens (and the answering instance's id)."""
        ...

    def get_topology(self, addr: str) -> Topology:
        """The prefill's parallel layout, page size and KV dtype."""
        ...

    def query_dp_ranks(self, addr: str, rooms: Sequence[int]) -> dict[int, int]:
        """The dp rank of each room the prefill knows; unknown rooms are absent."""
        ...


@runtime_checkable
class BootstrapSource(BootstrapQueries, Protocol):
    """The questions, and everything a source reports to its owner (see the module doc)."""

    #: True: the owner must probe each address for deaths and restarts (HealthMonitor).
    health_by_probes: bool
    #: True: ``stale_mark`` may find a mark; a receiver checks before it starts a transfer.
    marks_generations: bool

    def shared_pool(self) -> BootstrapPool | None:
        """The pool this source already retires entries from (an owner given none uses it)."""
        ...

    def stamp(self) -> int | None:
        """Read before a fetch's first ``get_rank``; given back to :meth:`generation`."""
        ...

    def generation(
        self, ranks: tuple[RankInfo, ...], instance_id: str | None, stamp: int | None
    ) -> Generation:
        """The generation of one fetched key (its provenance included)."""
        ...

    def publish(
        self, pool: BootstrapPool, key: PoolKey, generation: Generation
    ) -> Generation | None:
        """``pool.publish(key, generation)``, or ``None`` when the source knows it is stale."""
        ...

    def refusal(self, addr: str, generation: Generation) -> BootstrapError:
        """The typed error of a request whose fetch :meth:`publish` refused."""
        ...

    def stale_mark(self, addr: str, generations: Iterable[Generation]) -> PeerLost | None:
        """The typed error if one of ``generations`` was marked stale, else ``None``."""
        ...

    def attach(self, pool: BootstrapPool, *, held: HeldBy, retire: Retire) -> None:
        """Serve an owner: retire from ``pool``, ask ``held``, report to ``retire``.
        Raises :class:`~statemachine.errors.BootstrapError` when it cannot."""
        ...

    def detach(self) -> None:
        """The owner closed: call it no more."""
        ...


class NothingToReport:
    """The reports of a source that keeps no state of its own about the prefill: every fetch is
    current when it is made, nothing is ever marked, and only probes find a dead prefill.
    :class:`~statemachine.decode.client.BootstrapClient` inherits them."""

    health_by_probes = True
    marks_generations = False

    def shared_pool(self) -> BootstrapPool | None:
        return None

    def stamp(self) -> int | None:
        return None

    def generation(
        self, ranks: tuple[RankInfo, ...], instance_id: str | None, stamp: int | None
    ) -> Generation:
        return Generation(ranks, instance_id)

    def publish(
        self, pool: BootstrapPool, key: PoolKey, generation: Generation
    ) -> Generation | None:
        return pool.publish(key, generation)

    def refusal(self, addr: str, generation: Generation) -> BootstrapError:  # pragma: no cover
        # publish above never refuses; a subclass that does must say why.
        return PeerLost(f"{addr}: the bootstrap source refused this fetch; retry the request")

    def stale_mark(self, addr: str, generations: Iterable[Generation]) -> PeerLost | None:
        return None

    def attach(self, pool: BootstrapPool, *, held: HeldBy, retire: Retire) -> None:
        return None

    def detach(self) -> None:
        return None


class _QueriesWithReports(NothingToReport):
    """An object with only the three questions, given :class:`NothingToReport`'s reports."""

    def __init__(self, queries: BootstrapQueries) -> None:
        self.queries = queries

    def get_rank(
        self, addr: str, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int
    ) -> RouteReply:
        return self.queries.get_rank(
            addr, dp_rank=dp_rank, cp_rank=cp_rank, tp_rank=tp_rank, pp_rank=pp_rank
        )

    def get_topology(self, addr: str) -> Topology:
        return self.queries.get_topology(addr)

    def query_dp_ranks(self, addr: str, rooms: Sequence[int]) -> dict[int, int]:
        return self.queries.query_dp_ranks(addr, rooms)


def as_source(queries: object) -> BootstrapSource:
    """``queries`` itself when it is a whole :class:`BootstrapSource`; an object with the three
    questions alone, wrapped with :class:`NothingToReport`'s reports; anything else is a
    :class:`~statemachine.errors.ConfigurationError`."""
    if isinstance(queries, BootstrapSource):
        return queries
    if isinstance(queries, BootstrapQueries):
        return _QueriesWithReports(queries)
    raise ConfigurationError(
        f"source/client must have get_rank, get_topology and query_dp_ranks (a "
        f"BootstrapClient), not {type(queries).__name__}"
    )
