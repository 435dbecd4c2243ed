"""``Completions``: what the prefill says about a room → its receiver; what a room says back.

Inbound, as SGLang 0.5.23's decode manager applies prefill statuses
(``apply_prefill_status`` / ``handle_abort_ack_message``): every message on the decode's PULL
endpoint becomes a :class:`~statemachine.completion.PrefillEvent` through the backend's
``decode_message``; a room completes when ``required_prefill_response_num`` *distinct* prefill
ranks reported success (MGR-13); a Failed status fails it, terminally (MGR-14); under the
``prefill_complete`` policy a WaitingForInput status answers the BOOTSTRAP handshake (MGR-16).
Messages for rooms not in flight, and stale ABORT_ACKs, are dropped and counted.

Outbound, to the room's prefill ranks: the BOOTSTRAP handshake and the ABORT, told once per
room (legacy before the metadata, with an abort sequence number after it); an ABORT with one
holds the room's KV until every rank acknowledged it, every rank is proven gone, or the release
timeout passed (:mod:`statemachine.decode.holds`, MGR-15).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from statemachine.backend import KVBackend
from statemachine.completion import AbortAck, KVPoll, PrefillEvent
from statemachine.decode.fanout import note_evidence
from statemachine.decode.holds import AbortHolds
from statemachine.decode.ranks.transport import ZmqTransport, endpoint_url
from statemachine.decode.rooms import InFlight, Rooms
from statemachine.errors import BootstrapError, SendFailed, TransferFailed
from statemachine.wire.reference import decode_reply

__all__ = ["DEFAULT_FAILED_REASON", "Completions", "transfer_failed"]

#: SGLang's reason for a Failed status that carries none (``common/conn.py:312-314``).
DEFAULT_FAILED_REASON = "Failed to get kvcache from prefill instance, it might be dead"


class Completions:
    """Prefill statuses in, BOOTSTRAP and ABORT out (see the module docstring)."""

    def __init__(
        self,
        *,
        rooms: Rooms,
        holds: AbortHolds,
        transport: ZmqTransport,
        prefill_complete: bool,
        clock: Callable[[], float],
    ) -> None:
        self._rooms = rooms
        self.holds = holds
        self._transport = transport
        #: set by the manager once made (it needs the ack listener's port, and the listener
        #: needs this object): until then messages decode as the reference wire's
        self.backend: KVBackend | None = None
        self._prefill_complete = prefill_complete
        self._clock = clock
        #: prefill messages for rooms not in flight, and stale ABORT_ACKs (MGR-13/15)
        self.dropped = 0

    # --- inbound --------------------------------------------------------------------------

    def decode(self, frames: Sequence[bytes]) -> PrefillEvent | None:
        """The ack listener's decoder: the backend's (read as each message arrives)."""
        if self.backend is None:
            return decode_reply(frames)
        return self.backend.decode_message(frames)

    def on_event(self, event: PrefillEvent) -> bool:
        """One message from a prefill rank (the ack listener's thread); False when it was
        dropped (no such room in flight, or a stale ABORT_ACK)."""
        if isinstance(event, AbortAck):
            if self.holds.acked(event):
                return True
            self.dropped += 1
            return False
        receiver = self._rooms.get(event.room)
        if receiver is None:  # cleared or never here: dropped, as SGLang drops it
            self.dropped += 1
            return False
        status = event.status
        if status == KVPoll.Success:
            receiver.rank_succeeded(event.prefill_rank)
        elif status == KVPoll.Failed:
            self.fail_room(event.room, event.reason, prefill_rank=event.prefill_rank)
        elif status == KVPoll.WaitingForInput and self._prefill_complete:
            receiver.prefill_ready()
        # anything else: not a status the decode acts on (SGLang logs and ignores it)
        return True

    def complete(self, room: int, prefill_rank: int) -> bool:
        """Prefill rank ``prefill_rank`` sent ``room``'s KV; see ``DecodeManager.complete``."""
        receiver = self._rooms.get(room)
        if receiver is None:
            return False
        return receiver.rank_succeeded(prefill_rank)

    def fail_room(self, room: int, reason: str | None, *, prefill_rank: int | None) -> bool:
        """A prefill rank reported ``room``'s transfer failed: terminal (MGR-14)."""
        receiver = self._rooms.get(room)
        if receiver is None:
            return False
        error = transfer_failed(receiver, reason, prefill_rank)
        note_evidence(error, self._clock())
        receiver.failed_by_prefill(error)
        return True

    # --- outbound -------------------------------------------------------------------------

    def send_abort(self, receiver: InFlight, *, armed: bool) -> bool:
        """Tell every rank of the room (MGR-15; the receiver asks once), best effort, skipping
        known-dead ones.

        ``armed``: the metadata went out, so the prefill may be writing our pages: the ABORT
        carries a new abort sequence number and the room's KV is held until every rank
        acknowledged it
        or is proven gone (``holds.py``).
        Otherwise SGLang's legacy ABORT (no sequence number), nothing held. Nothing is sent for a
        room that has no ranks yet (before ``init``): returns False.
        """
        ranks = receiver.ranks()
        backend = self.backend
        if not ranks or backend is None:
            return False
        abort_seq = None
        if armed:
            writers = [(endpoint_url((rank.ip, rank.port)), g) for g, rank in ranks]
            abort_seq = self.holds.hold(receiver.room, writers)
        for generation, rank in ranks:
            endpoint = (rank.ip, rank.port)
            if self._transport.is_down(endpoint):
                continue
            # A failed send means the rank is gone: nothing left to free there.
            with contextlib.suppress(SendFailed):
                frames = backend.abort_frames(
                    rank,
                    receiver.room,
                    instance_id=generation.instance_id,
                    abort_seq=abort_seq,
                )
                self._transport.send(endpoint, frames)
        return True

    def send_bootstrap(self, receiver: InFlight) -> None:
        """``prefill_complete``: BOOTSTRAP to every rank of the room (SendFailed propagates:
        a rank that cannot hear the handshake will never answer it)."""
        backend = self.backend
        assert backend is not None  # set before the first receiver exists
        for generation, rank in receiver.ranks():
            frames = backend.bootstrap_frames(
                rank, receiver.room, instance_id=generation.instance_id
            )
            self._transport.send((rank.ip, rank.port), frames)


def transfer_failed(receiver: InFlight, reason: str | None, rank: int | None) -> BootstrapError:
    """The typed error of a prefill-reported failure, carrying the prefill's reason."""
    text = reason or DEFAULT_FAILED_REASON
    return TransferFailed(
        f"room {receiver.room}: the prefill reported a failed transfer ({text}); retry the request",
        addr=receiver.addr,
        reason=text,
        prefill_rank=rank,
    )
