"""``Completions``: what the prefill says about a room → its receiver, and the KV an ABORT holds.

As SGLang 0.5.23's decode manager applies prefill statuses (``apply_prefill_status`` /
``handle_abort_ack_message``): every message on the decode's PULL endpoint becomes a
:class:`~statemachine.completion.PrefillEvent` through the backend's ``decode_message`` (the
ack listener decodes it); a room completes when ``required_prefill_response_num`` *distinct*
prefill ranks reported success (MGR-13); a Failed status fails it, terminally (MGR-14); under
the ``prefill_complete`` policy a WaitingForInput status answers the BOOTSTRAP handshake
(MGR-16). Messages for rooms not in flight, and stale ABORT_ACKs, are dropped and counted.

An ABORT with an abort sequence number (the outbox sends it,
:mod:`statemachine.decode.ranks.outbox`) holds the room's KV until every rank acknowledged it,
every rank is proven gone, or the release timeout passed (:mod:`statemachine.decode.holds`,
MGR-15): :meth:`Completions.hold` takes the hold and answers the number the ABORT carries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from statemachine.completion import AbortAck, KVPoll, PrefillEvent
from statemachine.decode.fanout import note_evidence
from statemachine.decode.holds import AbortHolds
from statemachine.decode.rooms import InFlight, Rooms
from statemachine.errors import BootstrapError, TransferFailed
from statemachine.pool import Generation, RankInfo
from statemachine.wire.endpoint import endpoint_url

__all__ = ["DEFAULT_FAILED_REASON", "Completions", "transfer_failed"]

#: SGLang's reason for a Failed status that carries none (``common/conn.py:312-314``).
DEFAULT_FAILED_REASON = "Failed to get kvcache from prefill instance, it might be dead"


class Completions:
    """Prefill statuses in, and the KV held by ABORTs (see the module docstring)."""

    def __init__(
        self,
        *,
        rooms: Rooms,
        holds: AbortHolds,
        prefill_complete: bool,
        clock: Callable[[], float],
    ) -> None:
        self._rooms = rooms
        self.holds = holds
        self._prefill_complete = prefill_complete
        self._clock = clock
        #: prefill messages for rooms not in flight, and stale ABORT_ACKs (MGR-13/15)
        self.dropped = 0

    # --- inbound --------------------------------------------------------------------------

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

    # --- the ABORT's hold (MGR-15) -------------------------------------------------------

    def hold(self, room: int, ranks: Sequence[tuple[Generation, RankInfo]]) -> int:
        """An ABORT with an abort sequence number is about to go to ``ranks``: hold the room's
        KV until every rank acknowledged it or is proven gone, or the release timeout passed
        (``holds.py``); the abort sequence number the ABORT carries."""
        writers = [(endpoint_url((rank.ip, rank.port)), g) for g, rank in ranks]
        return self.holds.hold(room, writers)


def transfer_failed(receiver: InFlight, reason: str | None, rank: int | None) -> BootstrapError:
    """The typed error of a prefill-reported failure, carrying the prefill's reason."""
    text = reason or DEFAULT_FAILED_REASON
    return TransferFailed(
        f"room {receiver.room}: the prefill reported a failed transfer ({text}); retry the request",
        addr=receiver.addr,
        reason=text,
        prefill_rank=rank,
    )
