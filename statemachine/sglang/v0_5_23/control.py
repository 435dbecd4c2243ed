"""The parts of SGLang 0.5.23's wire that Mooncake and NIXL share (``common/conn.py``).

Decode -> prefill: BOOTSTRAP and ABORT, built the same way for both backends (SGW-6, SGW-7).
Prefill -> decode: ABORT_ACK (SGW-9) and the KV status message, untagged for Mooncake and tagged
``KV_STATUS`` for NIXL (SGW-8), turned into :mod:`statemachine.completion` events.

The decoders accept what 0.5.23's own decode listener applies and return None for what it drops,
with one difference, on purpose: integers must be plain ASCII decimal (what every 0.5.23 sender
writes, ``str(int)``), where SGLang's ``int()`` would also take a sign, spaces or ``_``. They
never raise.
"""

from __future__ import annotations

from collections.abc import Sequence

from statemachine.completion import (
    AbortAck,
    KVPoll,
    PrefillEvent,
    PrefillStatus,
)
from statemachine.errors import InvalidArgument
from statemachine.validation import require_rank_ip

BOOTSTRAP_TAG = b"BOOTSTRAP"
ABORT_TAG = b"ABORT"
ABORT_ACK_TAG = b"ABORT_ACK"
#: Prefill -> decode messages of features this library does not run (TCP aux data, the staging
#: buffer): never a completion event (SGW-10).
UNSUPPORTED_TAGS = frozenset({b"AUX_DATA", b"CHUNK_READY", b"STAGING_REQ"})
#: The statuses a decode acts on (``apply_prefill_status``, ``common/conn.py:921-977``); any
#: other value is ignored there, so it is not an event here.
KNOWN_STATUSES = frozenset({KVPoll.Failed, KVPoll.WaitingForInput, KVPoll.Success})
#: Longest failure reason kept (characters); a longer one is cut, never dropped.
MAX_REASON_CHARS = 2048
_ROOM_MAX = 2**64 - 1
_INT_MAX = 2**63 - 1
_MAX_DIGITS = 20


def ascii_int(value: int) -> bytes:
    """An int as SGLang writes it on the wire: ``str(value)`` in ASCII."""
    return b"%d" % value


def check_room(room: object) -> int:
    if type(room) is not int or not 0 <= room <= _ROOM_MAX:
        raise InvalidArgument(f"room must be an int in 0..2**64-1, got {room!r}")
    return room


def check_abort_seq(abort_seq: object) -> int:
    if type(abort_seq) is not int or not 0 <= abort_seq <= _INT_MAX:
        raise InvalidArgument(
            f"abort_seq (SGLang's abort generation) must be an int in 0..2**63-1 (SGLang "
            f"counts from 1), got {abort_seq!r}"
        )
    return abort_seq


def decode_endpoint(ip: object, port: object) -> tuple[bytes, bytes]:
    """The decode's own PULL endpoint as the two ASCII frames every message carries (SGW-1).

    The prefill connects back to it for statuses and ABORT_ACKs, so it must be a peer IP literal
    (never a name, never 0.0.0.0) and a port in 1..65535.
    """
    checked = require_rank_ip("decode ip (the decode's own PULL endpoint)", ip)
    if type(port) is not int or not 1 <= port <= 65535:
        raise InvalidArgument(
            f"decode port must be the decode's own PULL port in 1..65535, got {port!r}"
        )
    return checked.encode("ascii"), ascii_int(port)


def ascii_text(name: str, value: object) -> bytes:
    """A non-empty ASCII text frame (SGLang decodes these with ``.decode("ascii")``)."""
    if not isinstance(value, str) or not value or not value.isascii():
        raise InvalidArgument(f"{name} must be a non-empty ASCII str, got {value!r}")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise InvalidArgument(f"{name} must not contain spaces or control characters: {value!r}")
    return value.encode("ascii")


def bootstrap_message(room: int, endpoint: tuple[bytes, bytes]) -> list[bytes]:
    """``[BOOTSTRAP, room, decode ip, decode port]`` (SGW-6; ``common/conn.py:2567-2584``)."""
    return [BOOTSTRAP_TAG, ascii_int(check_room(room)), *endpoint]


def abort_message(room: int, endpoint: tuple[bytes, bytes], abort_seq: int | None) -> list[bytes]:
    """``[ABORT, room, decode ip, decode port(, abort_seq)]`` (SGW-7;
    ``common/conn.py:182-247``): 4 frames for the legacy abort, 5 with the abort sequence
    number (SGLang's field: the generation)."""
    frames = [ABORT_TAG, ascii_int(check_room(room)), *endpoint]
    if abort_seq is not None:
        frames.append(ascii_int(check_abort_seq(abort_seq)))
    return frames


def _int(frame: object, high: int = _INT_MAX) -> int | None:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        return None
    raw = bytes(frame)
    if not 0 < len(raw) <= _MAX_DIGITS or not raw.isdigit():  # bytes.isdigit: ASCII only
        return None
    value = int(raw)
    return value if value <= high else None


def _reason(frame: object) -> str | None:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        return None
    raw = bytes(frame)
    if not raw:
        return None
    return raw.decode("utf-8", errors="replace")[:MAX_REASON_CHARS]


def decode_abort_ack(frames: Sequence[bytes]) -> AbortAck | None:
    """``[ABORT_ACK, room, prefill rank, abort_seq]`` -> AbortAck (SGW-9).

    The legacy two-frame form of a Mooncake prefill whose deferred release is off
    (``[ABORT_ACK, room]``) is ``AbortAck(room, None, None)``; three frames give no abort
    sequence number.
    Frames past the fourth are not read, as in SGLang's ``AbortAck.from_zmq``
    (``common/conn.py:255-268``).
    """
    if len(frames) < 2:
        return None
    room = _int(frames[1], _ROOM_MAX)
    if room is None:
        return None
    if len(frames) == 2:
        return AbortAck(room, None, None)
    rank = _int(frames[2])
    if rank is None:
        return None
    if len(frames) == 3:
        return AbortAck(room, rank, None)
    abort_seq = _int(frames[3])
    return None if abort_seq is None else AbortAck(room, rank, abort_seq)


def decode_status(fields: Sequence[bytes]) -> PrefillStatus | None:
    """``[room, status, prefill rank(, reason)]`` (the tag already removed) -> PrefillStatus.

    As ``parse_kv_status_message`` (``common/conn.py:757-782``): at least three frames; a fourth,
    when non-empty, is the reason (UTF-8, undecodable bytes replaced); later frames are not
    read. A status other than Failed, WaitingForInput or Success is None (SGLang ignores it).
    """
    if len(fields) < 3:
        return None
    room = _int(fields[0], _ROOM_MAX)
    status = _int(fields[1])
    rank = _int(fields[2])
    if room is None or status is None or rank is None or status not in KNOWN_STATUSES:
        return None
    reason = _reason(fields[3]) if len(fields) > 3 else None
    return PrefillStatus(room, status, rank, reason)


def decode_prefill_message(
    frames: Sequence[bytes], status_tag: bytes | None
) -> PrefillEvent | None:
    """One message on the decode's PULL endpoint, in 0.5.23's dispatch order (SGW-10).

    ``status_tag`` is None for Mooncake's untagged statuses, ``b"KV_STATUS"`` for NIXL's.
    """
    try:
        if not frames:
            return None
        head = bytes(frames[0])
        if head in UNSUPPORTED_TAGS:
            return None
        if head == ABORT_ACK_TAG:
            return decode_abort_ack(frames)
        if status_tag is None:
            return decode_status(frames)
        if head != status_tag:
            return None
        return decode_status(frames[1:])
    except (TypeError, ValueError):  # bytes() of a frame that is not bytes-like
        return None
