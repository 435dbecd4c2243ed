"""Typed errors a caller can branch on.

Every failure the library reports is a subclass of :class:`BootstrapError`, so a decode worker
can catch one family and still tell a retryable condition (:class:`NotReady`) from a permanent
one (:class:`MalformedReply`) or a dead peer (:class:`TransportFailure`, :class:`SendFailed`,
:class:`PeerLost`). Every message says what to do next.
"""

from __future__ import annotations


class BootstrapError(Exception):
    """Base class of every error raised by this library."""


# --- lifecycle -------------------------------------------------------------------------------


class InvalidTransition(BootstrapError):
    """A receiver method (or a lifecycle event) was used in a state that does not allow it.

    A programming error in the caller: the message names the method called (or, for a raw
    :meth:`~statemachine.lifecycle.Lifecycle.fire`, the event), the state the receiver was in,
    and what must come first.
    """

    def __init__(
        self,
        state: str,
        event: str,
        *,
        method: str | None = None,
        requires: str | None = None,
    ) -> None:
        if method is not None:
            text = f"{method}() called in state {state!r}"
        else:
            text = f"lifecycle event {event!r} is not allowed in state {state!r}"
        if requires:
            text += f": {requires}"
        super().__init__(text)
        self.state = state
        self.event = event
        self.method = method
        self.requires = requires


class InvalidRoom(BootstrapError, ValueError):
    """A bootstrap room must be an int in [0, 2**64): SGLang's rooms are unsigned 64-bit."""


class ConfigurationError(BootstrapError, TypeError):
    """A decode manager (or ``Decode`` bundle) was built with a missing or wrong-typed part."""


class InvalidKVIndices(BootstrapError, TypeError, ValueError):
    """``send_metadata`` was given page indices it cannot send (not ints, not 1-d, outside
    int32). Raised before anything is sent: the request is unchanged, call again with the
    request's page indices. A ``TypeError`` and a ``ValueError`` too, as before."""


# --- HTTP to the bootstrap server ------------------------------------------------------------


class BootstrapHTTPError(BootstrapError):
    """The bootstrap server could not give a usable answer."""

    def __init__(self, message: str, *, addr: str, status: int | None = None) -> None:
        super().__init__(message)
        self.addr = addr
        self.status = status


class NotReady(BootstrapHTTPError):
    """503: not every prefill rank has registered yet. Retryable."""


class RanksUnreachable(NotReady):
    """The prefill's registered ranks cannot be reached and no newer registration is visible
    yet: the transport already judged an endpoint dead (its socket monitor), or registering
    with a rank failed. Nothing of this request was sent to a prefill. Retryable, as any
    ``NotReady``: the first request after the prefill registers again (new ports, or its
    ranks back) gets through. The same error on every source (HTTP and etcd alike)."""

    def __init__(self, message: str, *, addr: str, endpoint: str) -> None:
        super().__init__(message, addr=addr)
        self.endpoint = endpoint


class PrefillSilent(NotReady):
    """The prefill's bootstrap server at ``addr`` was judged dead by its health probes and has
    not answered one since: the request failed at once, without asking it (a fetch would wait
    out its timeout) and without sending anything to its ranks. Retryable, as any
    ``NotReady``: the first request after a probe answers again gets through (the server is
    probed every few hundred milliseconds meanwhile)."""


class NotFound(BootstrapHTTPError):
    """404: the server does not know the requested rank."""


class RequestRejected(BootstrapHTTPError):
    """Another 4xx answer (bad parameters, missing or wrong token, body too large)."""


class MalformedReply(BootstrapHTTPError):
    """The reply did not have the required keys or types. Never cached."""


class TransportFailure(BootstrapHTTPError):
    """Connection refused or reset, timeout, or an unexpected 5xx status."""


# --- ZMQ to the prefill ranks ----------------------------------------------------------------


class SendFailed(BootstrapError):
    """A ZMQ send to a prefill rank failed (dead peer with IMMEDIATE, or send timeout)."""

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


# --- receiver --------------------------------------------------------------------------------


class WaitingTimeout(BootstrapError):
    """No transfer completed within the waiting timeout after the metadata was sent."""


class Aborted(BootstrapError):
    """The request was aborted by its owner (``abort()``, or ``clear()`` before it ended)."""


class BootstrapTimeout(BootstrapError):
    """The prefill dp rank of a room stayed unknown past the bootstrap timeout.

    The bootstrap server never learned which dp rank serves the room (the prefill did not
    register it): retry the request, or route it with an explicit ``prefill_dp_rank``.
    """


class FetchWaitTimeout(BootstrapError):
    """This request waited for another request's fetch of the same key past its deadline.

    The fetch in flight is slow (a slow or dying bootstrap server): retry the request.
    """


class TopologyMismatch(BootstrapError):
    """The prefill's layout cannot serve this decode (page size, KV dtype or tp sizes differ).

    A deployment error, not a transient one: fix the decode's ``DecodeLayout`` or the
    prefill's configuration; retrying does not help.
    """


class ManagerClosed(BootstrapError):
    """The decode manager was closed: create a new one to serve more requests."""


# --- failure fan-out (the manager) -----------------------------------------------------------


class PeerLost(BootstrapError):
    """A prefill rank or instance this request depended on is known dead or restarted.

    The request cannot complete: retry it; the retry fetches the prefill's current ranks
    (the generations this request used were dropped from the pool). Also raised, with a
    generic message, by ``failure_exception()`` on a receiver that recorded no reason itself.
    """

    def __init__(self, message: str, *, addr: str | None = None) -> None:
        super().__init__(message)
        self.addr = addr
        #: ``time.monotonic()`` when the manager got the evidence (None: no evidence, generic)
        self.evidence_at: float | None = None


class RankDead(PeerLost):
    """One prefill rank's endpoint is dead (a failed send, or the ZMQ monitor's verdict)."""

    def __init__(self, message: str, *, endpoint: str, addr: str | None = None) -> None:
        super().__init__(message, addr=addr)
        self.endpoint = endpoint


class PrefillDead(PeerLost):
    """The prefill's bootstrap server stopped answering its health probes."""


class PrefillRestarted(PeerLost):
    """The prefill behind this address restarted (a new instance id answered)."""

    def __init__(self, message: str, *, addr: str, old_id: str, new_id: str) -> None:
        super().__init__(message, addr=addr)
        self.old_id = old_id
        self.new_id = new_id


class TransferFailed(PeerLost):
    """A prefill rank reported that the KV transfer of this room failed.

    ``reason`` is the prefill's own text (SGLang's status reason frame), or SGLang's default
    when the prefill sent none; ``prefill_rank`` the sender's id, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        addr: str | None = None,
        reason: str | None = None,
        prefill_rank: int | None = None,
    ) -> None:
        super().__init__(message, addr=addr)
        self.reason = reason
        self.prefill_rank = prefill_rank


class FailedOnAnotherRank(PeerLost):
    """``failure_exception()`` found no local reason: the room failed on another rank.

    SGLang's decode scheduler asks a receiver for its failure after a sibling rank of the room
    failed (its poll is reduced over the rank group); the receiver then fails too, even one
    that had succeeded, and its error says the failure came "from another rank"
    (SGLang's ``is_from_another_rank``). Retry the request.
    """

    is_from_another_rank = True

    """The request was aborted by its owner."""


# --- packaging ------------------------------------------------------------------------------------


class MissingExtra(BootstrapError, ImportError):
    """An optional part was used without the extra that installs its dependency.

    An ``ImportError`` too, so ``except ImportError`` around an optional import still works.
    """

    def __init__(self, extra: str, what: str, module: str) -> None:
        super().__init__(
            f"{what} needs {module}, which the {extra!r} extra installs: "
            f"pip install 'pd-bootstrap-statemachine[{extra}]'",
            name=module,
        )
        self.extra = extra
        self.module = module


# --- bootstrap HTTP: rooms ------------------------------------------------------------------------


class UnknownRoom(NotFound):
    """The bootstrap server knows no dp rank for this room (yet): ``POST /query_dp_ranks``
    answered without it. The prefill registers a room's dp rank when the request reaches it,
    so this can be temporary: ask again, or pass the dp rank explicitly."""

    def __init__(self, message: str, *, addr: str, room: int) -> None:
        super().__init__(message, addr=addr, status=200)
        self.room = room


# --- etcd discovery --------------------------------------------------------------------------


class DiscoveryError(BootstrapError):
    """An etcd discovery call could not be completed."""


class EtcdUnavailable(DiscoveryError):
    """No etcd endpoint answered within the call's timeout (refused, reset, timed out, 5xx).

    Retry with back-off; the decode side keeps serving its local store meanwhile.
    """


class EtcdRequestFailed(DiscoveryError):
    """etcd answered, but refused the request (lease not found, bad argument, auth)."""

    def __init__(self, message: str, *, status: int, code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class WatchCompacted(DiscoveryError):
    """The watch's start revision was compacted away: the watcher must re-list."""

    def __init__(self, message: str, *, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class RankRetired(PeerLost, DiscoveryError):
    """A prefill rank's registration changed or vanished in etcd after this request's
    generation was fetched: the request fails; a retry fetches the new registration.

    A :class:`PeerLost` (the manager's fan-out reason, counted with the others) learnt from
    etcd's watch."""
