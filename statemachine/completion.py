"""What a prefill rank tells the decode about a room: completion events, independent of wire.

A transfer backend's listener turns the prefill's messages into these events (SGLang 0.5.23's
prefills push a *status* per room - Mooncake untagged, NIXL tagged ``KV_STATUS`` - and an
``ABORT_ACK`` after an aborted room drained; the reference prefill rank pushes a small ack). The
manager applies them to the room's receiver the way SGLang's decode manager does
(``spec/manager.md``): a success counts once per *distinct* prefill rank towards the room's
``required_prefill_response_num``; a failure fails the room with its reason; a late event for a
room that already ended changes nothing.

The status codes are SGLang's ``KVPoll`` integers (``base/conn.py`` in the 0.5.23 wheel),
:class:`KVPoll`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class KVPoll(IntEnum):
    """SGLang's ``KVPoll`` numbers (``base/conn.py``), written once: what a receiver's ``poll()``
    reports (``lifecycle.POLL_OF_STATE``) and the status a prefill sends in a status message
    (Failed, WaitingForInput, Success), so a decode worker can use our receiver in place of its
    own. WaitingForInput arrives in a status only under the ``prefill_complete`` allocation
    policy: the prefill finished computing and saw this decode's BOOTSTRAP message; the decode
    may now allocate KV and send its metadata."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(frozen=True, slots=True)
class PrefillStatus:
    """One prefill rank's report about ``room``.

    ``prefill_rank`` identifies the sender among the room's prefill ranks (SGLang:
    ``attn_tp_rank * (pp * cp) + pp_rank * cp + cp_rank``), so that repeated reports from one
    rank count once. ``reason`` is the prefill's text for a failure (None when none was sent).
    """

    room: int
    status: int
    prefill_rank: int
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class AbortAck:
    """A prefill rank drained an aborted room (SGLang's deferred KV release).

    ``abort_seq`` echoes the abort notice's sequence number (None from a prefill that sends the
    legacy two-frame form); ``prefill_rank`` is None when the sender did not name itself.
    """

    room: int
    prefill_rank: int | None
    abort_seq: int | None


#: What a backend's message decoder yields for one multipart message.
PrefillEvent = PrefillStatus | AbortAck
