"""What a change in etcd means to a decode: stamped generations, change events, and the glue.

The etcd source's side of the ``BootstrapSource`` protocol (``statemachine/decode/source.py``)
is built from these: its ``stamp``/``generation``/``refusal``/``stale_mark``/``attach`` call
them, so the decode side never imports this module. They stay public for code that drives a
pool with an etcd source and no manager (the tests, the benchmarks).

* :class:`StampedGeneration` - a :class:`~statemachine.pool.Generation` that knows the store
  revision it was fetched at (docs/etcd.md, "The retirement rule");
* :class:`RankChange` - one applied put or delete, with the pool entries it retired;
* ``revision_of`` / ``generation_for`` / ``still_current`` - stamp a fetch, build its
  generation, and check it after publishing;
* ``retiring_listener`` - an ``on_change`` that hands retired generations to the manager's
  fan-out with a :class:`~statemachine.errors.RankRetired` error;
* ``mark_retired`` / ``retired_at`` - the fan-out *mark* a watch event puts on a stamped
  generation at the moment it retires it (the model's ``marked``, ``spec/model.md``): every
  receiver holding the object is marked at once, and fails at its next call instead of
  starting a transfer on it.

``DecodeManager(source=EtcdBootstrapSource(...))`` (or
``statemachine.decode_on_etcd.manager_on_etcd``) uses all of this through the protocol
(docs/etcd.md, "Running a decode on etcd").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from statemachine.errors import BootstrapError, RankRetired
from statemachine.pool import Generation, PoolKey, RankInfo

__all__ = [
    "ChangeListener",
    "HeldGenerations",
    "RankChange",
    "StampedGeneration",
    "generation_for",
    "mark_retired",
    "rank_retired",
    "refused_publish",
    "retired_at",
    "retiring_listener",
    "revision_of",
    "stale_start",
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
    #: The fan-out mark: the revision of the watch event that retired this generation, set
    #: once by the watch thread (``mark_retired``) in the same step as the retirement. The
    #: one mutable part of a generation; read by the owner of each receiver before it starts
    #: a transfer (``send_metadata``), so marking the object marks every receiver holding it.
    retired_at: int | None = field(default=None, compare=False, repr=False)


def mark_retired(generation: Generation, revision: int) -> bool:
    """Put the fan-out mark on ``generation`` (stamped ones only; the first mark stays).
    Returns whether it carries a mark now."""
    if not isinstance(generation, StampedGeneration):
        return False
    if generation.retired_at is None:
        # A frozen dataclass: set the one field meant to change, as __init__ itself does. One
        # attribute store, atomic for every thread that reads it.
        object.__setattr__(generation, "retired_at", revision)
    return True


def retired_at(generation: Generation) -> int | None:
    """The revision of the watch event that retired ``generation``, or None."""
    return getattr(generation, "retired_at", None)


#: The manager's answer to "which generations do your receivers in flight hold for ``addr``?"
#: (key, generation) pairs, pool entries or not: the watch marks the stale ones too.
HeldGenerations = Callable[[str], Iterable[tuple[PoolKey, Generation]]]


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
    #: every generation this change marked retired (``retired``'s and those only receivers in
    #: flight held): what the manager's fan-out fails the receivers of
    marked: tuple[Generation, ...] = ()


ChangeListener = Callable[[RankChange], None]


# --- the etcd source's reports to its owner (the HTTP client has none of these) ---------------


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
        "after this request fetched it: retry the request (it fetches the new registration)",
        addr=change.addr,
    )


def stale_start(addr: str, revision: int) -> RankRetired:
    """The typed error for a request about to start on a generation the watch marked."""
    return RankRetired(
        f"{addr}: a prefill rank this request fetched was re-registered or deregistered in "
        f"etcd at revision {revision}: retry the request (it fetches the new registration)",
        addr=addr,
    )


def refused_publish(addr: str, stamp: int | None, revision: int) -> RankRetired:
    """The typed error for a fetch the watermark refused to publish."""
    return RankRetired(
        f"{addr}: the prefill's registration in etcd changed (now at revision {revision}) "
        f"while this request fetched it (at revision {stamp}): retry the request (it fetches "
        "the new registration)",
        addr=addr,
    )


def retiring_listener(
    fail_generations: Callable[[Sequence[Generation], BootstrapError], object],
) -> ChangeListener:
    """An ``on_change`` that hands each change's retired generations to the manager's fan-out
    (``DecodeManager.fail_generations``) with a :class:`RankRetired` error."""

    def on_change(change: RankChange) -> None:
        doomed = list(change.marked) or list(change.retired.values())
        if doomed:
            fail_generations(doomed, rank_retired(change))

    return on_change
