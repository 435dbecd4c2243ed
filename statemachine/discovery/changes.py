"""What a change in etcd means to a decode: stamped generations, change events, and the glue.

Kept apart from the source so that a receiver or manager can use these without caring which
source it has: every function here does nothing for a source other than the etcd one.

* :class:`StampedGeneration` - a :class:`~statemachine.pool.Generation` that knows the store
  revision it was fetched at (docs/etcd.md, "The retirement rule");
* :class:`RankChange` - one applied put or delete, with the pool entries it retired;
* ``revision_of`` / ``generation_for`` / ``still_current`` - stamp a fetch, build its
  generation, and check it after publishing;
* ``retiring_listener`` - an ``on_change`` that hands retired generations to the manager's
  fan-out with a :class:`~statemachine.errors.RankRetired` error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from statemachine.errors import BootstrapError, RankRetired
from statemachine.pool import Generation, PoolKey, RankInfo

__all__ = [
    "ChangeListener",
    "RankChange",
    "StampedGeneration",
    "generation_for",
    "rank_retired",
    "retiring_listener",
    "revision_of",
    "still_current",
]


@dataclass(frozen=True, eq=False, slots=True)
class StampedGeneration(Generation):
    """A generation fetched through the etcd source, stamped with the store's ``revision``
    read *before* its ranks were fetched (``EtcdBootstrapSource.revision``).

    A subclass rather than a field of :class:`Generation`: the pool's algorithms never look at
    it, and keeping ``Generation`` as it is keeps its symbolic checks (CrossHair on pool.py)
    as strong as they are. Compared by identity, like every generation.
    """

    revision: int | None = None


class RankChange(NamedTuple):
    """One put or delete of a rank key, as applied to the store (in revision order)."""

    addr: str
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int
    revision: int
    deleted: bool
    #: the pool entries this change retired (already invalidated by identity); the manager
    #: fails the in-flight receivers that use them (``DecodeManager.fail_generations``)
    retired: Mapping[PoolKey, Generation]


ChangeListener = Callable[[RankChange], None]


# --- the glue a receiver or manager needs (the HTTP client has none of these) -----------------


def revision_of(source: object) -> int | None:
    """The stamp for a fetch about to start: the etcd store's revision, None for other sources
    (the HTTP client has no ``revision``).

    Read it *before* the first ``get_rank`` of the fetch.
    """
    revision = getattr(source, "revision", None)
    return revision if type(revision) is int else None


def generation_for(
    ranks: tuple[RankInfo, ...], instance_id: str | None, stamp: int | None
) -> Generation:
    """The generation of a fetch: stamped when it came from the etcd source."""
    if stamp is None:
        return Generation(ranks, instance_id)
    return StampedGeneration(ranks, instance_id, stamp)


def still_current(source: object, key: PoolKey, published: Generation) -> bool:
    """After ``pool.publish``: False (and the entry invalidated) if an etcd change overtook the
    fetch; always True for other sources. See ``EtcdBootstrapSource.check_published``."""
    check: Callable[[PoolKey, Generation], bool] | None = getattr(source, "check_published", None)
    return True if check is None else check(key, published)


def rank_retired(change: RankChange) -> RankRetired:
    """The typed error for the requests that used a generation ``change`` retired."""
    what = "deregistered" if change.deleted else "re-registered"
    return RankRetired(
        f"{change.addr}: prefill rank dp={change.dp_rank} cp={change.cp_rank} "
        f"tp={change.tp_rank} pp={change.pp_rank} {what} in etcd at revision {change.revision} "
        "after this request fetched it: retry the request (it fetches the new registration)"
    )


def retiring_listener(
    fail_generations: Callable[[Sequence[Generation], BootstrapError], object],
) -> ChangeListener:
    """An ``on_change`` that hands each change's retired generations to the manager's fan-out
    (``DecodeManager.fail_generations``) with a :class:`RankRetired` error."""

    def on_change(change: RankChange) -> None:
        if change.retired:
            fail_generations(list(change.retired.values()), rank_retired(change))

    return on_change
