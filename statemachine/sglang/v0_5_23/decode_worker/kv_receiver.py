"""The decode KV receiver's part common to both transfer backends: one request's receiver, as
SGLang's decode scheduler uses one, wrapping one :class:`BootstrapReceiver` of its manager's
:class:`DecodeManager`.

:class:`DecodeKVReceiverBase` answers ``decode.py``'s calls on a receiver with SGLang's values:
its polls are SGLang's ``KVPoll`` ints, ``failure_exception()`` raises SGLang's
``KVTransferError`` naming the library's typed reason, and a second live receiver of one room is
refused as the allocation policy says. The classes SGLang picks per backend are in :mod:`.conn`.
"""

from __future__ import annotations

from typing import Any

from statemachine.completion import KVPoll
from statemachine.decode.receiver import BootstrapReceiver
from statemachine.errors import (
    BootstrapError,
    FailedOnAnotherRank,
    InvalidRoom,
    PeerLost,
    SGLangFeatureRefused,
)
from statemachine.sglang.v0_5_23.decode_worker.kv_manager import DecodeKVManagerBase
from statemachine.sglang.v0_5_23.decode_worker.sglang_imports import sglang_module

__all__ = ["DecodeKVReceiverBase"]

#: SGLang's KVPoll values for this library's receivers' polls. Transferring is
#: reported as WaitingForInput: 0.5.23's receiver never says Transferring (decode.py's
#: handshake check, decode.py:1153-1177, only knows Bootstrapping/WaitingForInput/Failed).
_POLL_OUT = {
    KVPoll.Failed: 0,
    KVPoll.Bootstrapping: 1,
    KVPoll.WaitingForInput: 2,
    KVPoll.Transferring: 2,
    KVPoll.Success: 4,
}


class DecodeKVReceiverBase:
    """One request's receiver, as SGLang 0.5.23's decode scheduler uses one (:mod:`.conn`'s
    ``MooncakeKVReceiver`` and ``NixlKVReceiver`` are this class under SGLang's names).

    Built as ``cls(mgr=, bootstrap_addr=, bootstrap_room=)`` (``decode.py:905-911``); wraps one
    :class:`BootstrapReceiver` of the manager's :class:`DecodeManager`. The attributes are the
    ones ``decode.py`` reads: ``conclude_state`` (decode.py:1108), ``abort_notified`` and
    ``bootstrap_infos`` (decode.py:2899-2912, 3002-3006), ``require_staging`` (decode.py:1855),
    ``kv_mgr`` (decode.py:2897, 3027, 3059).
    """

    require_staging = False

    def __init__(
        self, mgr: DecodeKVManagerBase, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: int | None = None
        self.abort_notified = False
        #: every prefill rank of the room (what an ABORT goes to), known after init()
        self.bootstrap_infos: list[dict[str, object]] | None = None
        self._error: BootstrapError | None = None
        self._receiver: BootstrapReceiver | None = None
        live = None if bootstrap_room is None else mgr.decode_manager.get(bootstrap_room)
        if live is not None:
            self._refuse_duplicate(live)
            return
        try:
            self._receiver = mgr.decode_manager.receiver(bootstrap_addr, bootstrap_room)  # type: ignore[arg-type]
        except BootstrapError as error:  # a closed manager; a room taken since the look-up
            self._error = error
            self.conclude_state = _kvpoll(KVPoll.Failed)

    def _refuse_duplicate(self, live: BootstrapReceiver) -> None:
        """A second live receiver of one room: SGLang keys its decode manager's room state
        (status, responses, expected count) by room, so two receivers of one room share it.

        * ``prefill_complete``: SGLang fails the newcomer and sets the shared room Failed,
          which fails the first too unless it already concluded (``common/conn.py:2500-2507``).
          Matched: both fail, typed.
        * ``early``: SGLang has no guard, and the two would share one status while the
          prefill keeps one destination per (room, decode session) - the later metadata
          replaces the earlier (``mooncake/conn.py:3018-3024``) - so one request would be
          reported Success without its KV. Not matched: the newcomer fails, typed, the first
          goes on.
        """
        room = self.bootstrap_room
        advice = (
            "give each request its own bootstrap_room (a parallel-sampling request with a list "
            "of rooms repeats each room n times: managers/io_struct.py:925-931; pass one int "
            "room, which SGLang spreads as room + i)"
        )
        if self.kv_mgr.allocation_policy == "prefill_complete":
            error = InvalidRoom(
                f"room {room}: duplicate decode bootstrap room under the prefill_complete "
                "allocation policy, which fails every request of the room as SGLang does; " + advice
            )
            live.mark_lost(error)
        else:
            error = InvalidRoom(
                f"room {room} is already in flight on this decode: two requests of one room "
                "would share its status while the prefill writes the KV of only one of them, "
                "so this one is refused; " + advice
            )
        self._error = error
        self.conclude_state = _kvpoll(KVPoll.Failed)

    @property
    def supports_host_destination(self) -> bool:
        """decode.py:1469: host KV destinations are not implemented (refused when on)."""
        return False

    def init(self, prefill_dp_rank: int) -> None:
        """Resolve the room's prefill ranks (decode.py:1105)."""
        if self._receiver is None or self.conclude_state is not None:
            return
        if self._receiver.init(prefill_dp_rank) == KVPoll.Failed:
            self._conclude_failed()
            return
        self.bootstrap_infos = [
            {"rank_ip": rank.ip, "rank_port": rank.port} for _, rank in self._receiver.ranks()
        ]

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
        device_kv_indices: Any = None,
    ) -> None:
        """Send the room's page indices to every rank (decode.py:1863-1868), with SGLang's
        full signature (``common/conn.py:2839-2847``). ``state_indices``: a hybrid model's
        state slots, one list per state type of ``kv_args.state_types``, sent as SGLang
        sends them. What is not implemented fails the room, typed, instead of raising in the
        scheduler loop: a host destination, and HiSparse's ``device_kv_indices``
        (decode.py:1789-1816; both are refused when the manager is built, so these are a
        second line)."""
        if self._receiver is None or self.conclude_state is not None:
            return
        if destination is not None and getattr(destination, "name", "DEVICE") != "DEVICE":
            self.refuse(
                SGLangFeatureRefused(
                    f"room {self.bootstrap_room}: KV destination {destination!r} is not "
                    "supported (device pages only): set "
                    "--disaggregation-decode-host-receive-threshold to 1"
                )
            )
            return
        if device_kv_indices is not None:
            self.refuse(
                SGLangFeatureRefused(
                    f"room {self.bootstrap_room}: HiSparse device KV indices are not supported "
                    "by the statemachine decode classes: drop --enable-hisparse, or run this "
                    "decode with SGLang's own classes (unset PD_BOOTSTRAP_SGLANG_DECODE)"
                )
            )
            return
        poll = self._receiver.send_metadata(
            kv_indices,
            0 if aux_index is None else aux_index,
            prefix_len=decode_prefix_len or 0,
            state_indices=() if state_indices is None else state_indices,
        )
        if poll == KVPoll.Failed:
            self._conclude_failed()

    def poll(self) -> int | None:
        """SGLang's KVPoll (decode.py:1142-1145 and 2857-2860 through its all-reduce)."""
        if self.conclude_state is not None or self._receiver is None:
            return self.conclude_state
        poll = self._receiver.poll()
        if poll == KVPoll.Failed:
            self._conclude_failed()
        elif poll == KVPoll.Success:
            self.conclude_state = _kvpoll(KVPoll.Success)
        return _kvpoll(poll)

    def failure_exception(self) -> None:
        """Raise SGLang's ``KVTransferError`` for this room (decode.py:1162, 2870): the typed
        reason, its class named in the message; ``is_from_another_rank`` when this rank had no
        reason of its own. Like SGLang's, it fails a succeeded receiver too."""
        error = self._error
        if error is None and self._receiver is not None:
            try:
                self._receiver.failure_exception()
            except BootstrapError as raised:
                error = raised
        self._conclude_failed()
        if error is None:  # pragma: no cover - the receiver always raises
            error = FailedOnAnotherRank(f"room {self.bootstrap_room}: failed on another rank")
        self._error = error
        raise _transfer_error(self.bootstrap_room, error) from error

    def fail_from_any_thread(self, error: BootstrapError) -> None:
        """Fail the room with ``error`` from a thread that does not own it (the rebootstrap
        POST's answer): stored, and the owner's next ``poll`` ends the room with it. A room
        whose every response arrived is left alone."""
        receiver = self._receiver
        if receiver is not None:
            receiver.mark_lost(error)

    def refuse(self, error: BootstrapError) -> None:
        """Fail the room with ``error`` (a feature refused after construction)."""
        if self._receiver is not None and not self._receiver.ended:
            self._receiver.abort()
            self.abort_notified = self.abort_notified or bool(self.bootstrap_infos)
        self._error = error
        self.conclude_state = _kvpoll(KVPoll.Failed)

    def abort(self) -> None:
        """The scheduler gives up on the room (user abort, decode.py:1217, scheduler.py
        5760-5780): every rank of the room is told once."""
        if self._receiver is not None and not self._receiver.ended:
            self._receiver.abort()
        self.abort_notified = self.abort_notified or bool(self.bootstrap_infos)
        self.conclude_state = _kvpoll(KVPoll.Failed)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """decode.py:2906 after a failed transfer. The library's receiver already sent the
        room's ranks one ABORT with a generation when it failed after its metadata went out
        (MGR-15); an unfinished receiver is aborted now."""
        if self._receiver is not None and not self._receiver.ended:
            self._receiver.abort()
        self.abort_notified = self.abort_notified or bool(self.bootstrap_infos)

    def is_abort_release_safe(self) -> bool:
        """Host destinations only (decode.py:3056): never used, as SGLang's base class."""
        raise NotImplementedError("host KV destinations are not supported here")

    def clear(self) -> None:
        """Forget the request (decode.py:1401, 2651, 2774, 2925, 3028): a terminal result
        stays; an unfinished request becomes Failed."""
        if self._receiver is not None:
            self._receiver.clear()
        if self.conclude_state is None:
            self.conclude_state = _kvpoll(KVPoll.Failed)

    def _conclude_failed(self) -> None:
        self.conclude_state = _kvpoll(KVPoll.Failed)
        receiver = self._receiver
        failure = None if receiver is None else receiver.failure
        if isinstance(failure, PeerLost) and not isinstance(failure, FailedOnAnotherRank):
            self.kv_mgr.forget_prefill(self.bootstrap_addr)


def _kvpoll(poll: KVPoll) -> int:
    """SGLang's KVPoll value: its ``KVPoll`` is a plain class of int constants
    (base/conn.py:123-128), so its values are these ints."""
    return _POLL_OUT[poll]


def _transfer_error(room: int | None, error: BootstrapError) -> Exception:
    conn = sglang_module("sglang.srt.disaggregation.common.conn")
    transfer_error: Exception = conn.KVTransferError(
        room,
        f"{type(error).__name__}: {error}",
        is_from_another_rank=isinstance(error, FailedOnAnotherRank),
    )
    return transfer_error
