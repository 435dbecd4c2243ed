"""The backend seam: what the bootstrap layer asks a KV-transfer backend (:class:`KVBackend`).

The bootstrap layer only carries frames; their layout belongs to the transfer backend
(Mooncake, NIXL and MORI each have their own). The decode's transport
(:mod:`statemachine.decode.ranks.transport`) asks a backend for the frames of each message and
sends them, nothing more; the decode's ack listener asks it to turn each message a prefill
pushed back into a wire-independent completion event (:mod:`statemachine.completion`), so
neither ever knows a layout.

The implementations: the reference layout (:class:`~statemachine.wire.reference.SimpleBackend`,
``spec/zmq.md``) and SGLang's own layouts per SGLang release (:mod:`statemachine.sglang`,
``spec/sglang-wire.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from statemachine.completion import PrefillEvent
from statemachine.pool import RankInfo
from statemachine.wire.metadata import MetadataRequest

__all__ = ["KVBackend"]


class KVBackend(Protocol):
    """Builds the frames of the messages the bootstrap layer sends to a prefill rank, and decodes
    the messages a prefill rank pushes back to the decode.

    ``instance_id`` is the instance id of the generation the message goes to (None when the
    source gave none). The transport always passes it; a backend whose transfer engine has its
    own way to reject a stale peer, or whose prefill would misread the frame, may ignore it.
    """

    def register_frames(self, rank: RankInfo, *, instance_id: str | None = None) -> list[bytes]:
        """KV args, sent once per new generation to every rank in it (dummy flagged)."""
        ...

    def metadata_frames(
        self, rank: RankInfo, request: MetadataRequest, *, instance_id: str | None = None
    ) -> list[bytes]:
        """Per-request metadata, sent once per rank (dummy flagged)."""
        ...

    def abort_frames(
        self,
        rank: RankInfo,
        room: int,
        *,
        instance_id: str | None = None,
        abort_seq: int | None = None,
    ) -> list[bytes]:
        """The room was aborted: the prefill rank may free its slot. Sent once per rank.

        ``abort_seq`` None is SGLang's legacy abort (sent by ``abort()`` before the metadata:
        nothing to acknowledge); an int is the abort sequence number (SGLang's abort counter,
        which its code calls the generation) sent after the metadata, on the waiting timeout
        or on a failure, which the prefill echoes in its :class:`AbortAck` once
        the room's transfers drained.
        """
        ...

    def bootstrap_frames(
        self, rank: RankInfo, room: int, *, instance_id: str | None = None
    ) -> list[bytes]:
        """SGLang's BOOTSTRAP, sent in ``init()`` under the ``prefill_complete`` allocation
        policy: the prefill answers with a WaitingForInput status once it finished the prefill."""
        ...

    def decode_message(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        """One multipart message received on the decode's own endpoint, as a completion event.

        None when the message is not one of this backend's, or is malformed: the caller drops
        it. Never raises, whatever the frames.
        """
        ...
