"""``ExitProofs``: the transport's verdicts as evidence about a failed room's KV (MGR-15).

A proven exit (ZMQ-26: the rank's port refused a connect) is recorded with the deferred KV
release (:mod:`statemachine.decode.holds`) for every generation that named that endpoint, so a
room whose every writer exited is released at once. Any other dead verdict is silence and
releases nothing (traced as ``SilenceSeen``). Which requests fail on a verdict is the fan-out's
(:mod:`statemachine.decode.fanout`); what may be freed is this module's.
"""

from __future__ import annotations

from statemachine import trace
from statemachine.decode.holds import RESET_SEEN, AbortHolds, instance_label
from statemachine.decode.ranks.exit_probe import connect_refused
from statemachine.decode.ranks.transport import Endpoint, endpoint_url
from statemachine.decode.rooms import Rooms, generations_at
from statemachine.pool import BootstrapPool, Generation

__all__ = ["ExitProofs"]


class ExitProofs:
    """The exit proofs of one decode process (see the module docstring)."""

    def __init__(self, *, pool: BootstrapPool, rooms: Rooms, holds: AbortHolds) -> None:
        self._pool = pool
        self._rooms = rooms
        self._holds = holds

    def process_exited(self, endpoint: Endpoint, reason: str) -> None:
        """Transport exit listener (ZMQ-26, before the dead verdict): the rank's process at
        ``endpoint`` is gone, proof for the KV of every room its generations told.

        The other ranks of those generations are asked at once too: ranks that die together
        (a whole prefill killed) would otherwise race their own verdicts, and the first one
        ends the requests and closes the others' sockets before theirs arrive, leaving those
        rooms held until the timeout. A refused connect is the proof either way."""
        url = endpoint_url(endpoint)
        generations = self._named(url)
        self._holds.proven_gone(url, generations, RESET_SEEN)
        others = {
            (rank.ip, rank.port)
            for generation in generations
            for rank in generation.ranks
            if (rank.ip, rank.port) != endpoint
        }
        for other in others:
            if connect_refused(other):
                other_url = endpoint_url(other)
                self._holds.proven_gone(other_url, self._named(other_url), RESET_SEEN)

    def trace_silence(self, url: str) -> None:
        """A dead verdict that is not an exit: silence about every process told at ``url``."""
        for generation in self._named(url):
            trace.emit("SilenceSeen", endpoint=url, instance=instance_label(generation))

    def _named(self, url: str) -> set[Generation]:
        """The generations naming ``url``: in the pool, held by a receiver, or held by a
        room's KV hold."""
        return generations_at(url, self._pool, self._rooms) | self._holds.generations_at(url)
