"""``BootstrapSource``: where a decode manager learns the prefill's ranks and topology.

:class:`~statemachine.decode.client.BootstrapClient` (HTTP to the prefill's bootstrap server) is
the default; any object with these three methods will do (an etcd-backed discovery implements
the same protocol). Every method raises a :class:`~statemachine.errors.BootstrapError`
subclass on failure and must return within its own documented deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from statemachine.validation import RouteReply, Topology


@runtime_checkable
class BootstrapSource(Protocol):
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
