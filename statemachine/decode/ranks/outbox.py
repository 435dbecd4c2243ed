"""``Outbox``: every message a decode process sends a prefill rank, built and sent in one place.

What the decode says to a rank (``spec/zmq.md``, ``spec/manager.md``): its KV args, to every
rank of a generation it fetched, dummy ranks included, so that a rank knows how many decode
peers to expect (ZMQ-14); a room's metadata, to every rank of every generation the room holds;
under the ``prefill_complete`` policy the BOOTSTRAP handshake (MGR-16); and a room's ABORT, told
once per room, best effort (MGR-15). The backend builds each message in its wire's layout
(SGLang's Mooncake or NIXL, or the reference one), every one addressed to the generation's
instance (ZMQ-21), so that a process that binds a dead rank's port later drops what was queued
for the old one; the transport (:mod:`statemachine.decode.ranks.transport`) only moves the bytes
and reports verdicts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from statemachine.backend import KVBackend
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.errors import SendFailed
from statemachine.pool import Generation, RankInfo
from statemachine.wire.metadata import MetadataRequest

__all__ = ["Outbox"]


class Outbox:
    """The messages of one decode process to the prefill ranks (see the module docstring)."""

    __slots__ = ("backend", "transport")

    def __init__(self, transport: ZmqTransport, backend: KVBackend) -> None:
        self.transport = transport
        self.backend = backend

    def register(self, generation: Generation) -> None:
        """The backend's KV args to every rank of ``generation``, dummy ranks included.

        Stops at the first failure (its :class:`SendFailed` propagates): the caller
        invalidates the generation."""
        instance_id = generation.instance_id
        build = self.backend.register_frames
        send = self.transport.send
        for rank in generation.ranks:
            send((rank.ip, rank.port), build(rank, instance_id=instance_id))

    def metadata(self, generation: Generation, request: MetadataRequest) -> None:
        """One metadata message to every rank of ``generation``, dummy ranks included
        (:class:`SendFailed` propagates)."""
        instance_id = generation.instance_id
        build = self.backend.metadata_frames
        send = self.transport.send
        for rank in generation.ranks:
            # rank[:2] is (ip, port) as a plain tuple, built in C.
            send(rank[:2], build(rank, request, instance_id=instance_id))

    def bootstrap(self, room: int, ranks: Sequence[tuple[Generation, RankInfo]]) -> None:
        """``prefill_complete``: BOOTSTRAP to every rank of the room (SendFailed propagates:
        a rank that cannot hear the handshake will never answer it)."""
        build = self.backend.bootstrap_frames
        for generation, rank in ranks:
            frames = build(rank, room, instance_id=generation.instance_id)
            self.transport.send((rank.ip, rank.port), frames)

    def abort(
        self,
        room: int,
        ranks: Sequence[tuple[Generation, RankInfo]],
        *,
        abort_seq: int | None,
    ) -> None:
        """The room's ABORT to every rank of ``ranks``, best effort, skipping the ones the
        transport judged dead: with ``abort_seq`` (the metadata went out, MGR-15), or SGLang's
        legacy ABORT without one."""
        transport = self.transport
        for generation, rank in ranks:
            endpoint = (rank.ip, rank.port)
            if transport.is_down(endpoint):
                continue
            # A failed send means the rank is gone: nothing left to free there.
            with contextlib.suppress(SendFailed):
                frames = self.backend.abort_frames(
                    rank, room, instance_id=generation.instance_id, abort_seq=abort_seq
                )
                transport.send(endpoint, frames)
