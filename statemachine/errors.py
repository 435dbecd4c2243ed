"""Every typed error the library raises, grouped by the channel that failed.

Every error is a :class:`BootstrapError`. Each belongs to one family, named for where it
failed, so a caller can catch a channel:

==============================  ==============================================================
family                          channel
==============================  ==============================================================
:class:`SourceError`            the bootstrap source: the bootstrap server over HTTP
                                (:class:`BootstrapHTTPError`) or etcd (:class:`DiscoveryError`)
:class:`TransportError`         ZMQ to the prefill ranks (sends, frames, the transfer wait)
:class:`PeerLost`               a prefill rank or instance this request used is dead, restarted,
                                retired or reported the transfer failed
:class:`UsageError`             the caller's own mistake or decision (bad argument, wrong state,
                                abort, a closed manager): refused locally, nothing sent
:class:`SetupError`             configuration: wrong parts, layouts that do not match, a
                                missing extra; retrying does not help
:class:`ToolError`              the tools beside the library: model-check inputs, and the
                                processes tests and the demo start (etcd, prefill ranks)
==============================  ==============================================================

Whether a retry of the same request can succeed is the class attribute
:attr:`BootstrapError.retryable`, not a base class: ``if error.retryable: retry()``.
Every message says what to do next.
"""

from __future__ import annotations

from typing import ClassVar


class BootstrapError(Exception):
    """Base class of every error raised by this library."""

    #: True when the same request, issued again, can succeed without anyone changing anything
    #: (the condition is transient or the retry fetches fresh state); False when the caller or
    #: the deployment must change something first.
    retryable: ClassVar[bool] = False


# --- families ------------------------------------------------------------------------------


class SourceError(BootstrapError):
    """The bootstrap source (the bootstrap server over HTTP, or etcd) gave no usable answer."""


class TransportError(BootstrapError):
    """ZMQ to the prefill ranks failed: a send, a frame layout, or the wait for the transfer."""


class PeerLost(BootstrapError):
    """A prefill rank or instance this request depended on is known dead or restarted.

    The request cannot complete: retry it; the retry fetches the prefill's current ranks
    (the pool entries this request used were dropped). Also raised, with a generic message,
    by ``failure_exception()`` on a receiver that recorded no reason itself.
    """

    retryable = True

    def __init__(self, message: str, *, addr: str | None = None) -> None:
        super().__init__(message)
        self.addr = addr
        #: ``time.monotonic()`` when the manager got the evidence (None: no evidence, generic)
        self.evidence_at: float | None = None


class UsageError(BootstrapError):
    """The caller's own mistake or decision: refused (or ended) locally, nothing was sent."""


class SetupError(BootstrapError):
    """The configuration: a wrong part, layouts that do not match, a missing extra."""


class ToolError(BootstrapError):
    """A tool beside the library failed: a model-check input, or a process it starts."""


# --- usage ---------------------------------------------------------------------------------


class InvalidTransition(UsageError):
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


class InvalidArgument(UsageError, ValueError):
    """The caller passed a bad address, rank or room: rejected before anything is sent."""


class InvalidRoom(UsageError, ValueError):
    """A bootstrap room must be an int in [0, 2**64): SGLang's rooms are unsigned 64-bit."""


class InvalidKVIndices(UsageError, TypeError, ValueError):
    """``send_metadata`` was given page indices it cannot send (not ints, not 1-d, outside
    int32). Raised before anything is sent: the request is unchanged, call again with the
    request's page indices. A ``TypeError`` and a ``ValueError`` too, as before."""


class Aborted(UsageError):
    """The request was aborted by its owner (``abort()``, or ``clear()`` before it ended)."""


class ManagerClosed(UsageError):
    """The decode manager was closed: create a new one to serve more requests."""


class BadRequest(UsageError, ValueError):
    """A request to the reference bootstrap server failed validation (a registration's body,
    a query's parameters): the server answers 400 with this message, which names the field and
    its limits, and stores nothing. The client's mistake: correct the request (for a
    registration, the prefill rank's settings) and send it again; the same request is refused
    again."""


# --- configuration -------------------------------------------------------------------------


class ConfigurationError(SetupError, TypeError):
    """A decode manager was built with a missing or wrong-typed part."""


class SGLangFeatureRefused(ConfigurationError):
    """An SGLang feature the decode worker classes (``sglang/v0_5_23/decode_worker``) do not
    implement was switched on: refused when the manager is built (or the call is made), before
    anything is sent. The message names the flag or environment variable to turn off."""


class TopologyMismatch(SetupError):
    """The prefill's layout cannot serve this decode (page size, KV dtype or tp sizes differ).

    A deployment error, not a transient one: fix the decode's ``DecodeLayout`` or the
    prefill's configuration; retrying does not help.
    """


class MissingExtra(SetupError, ImportError):
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


# --- source: the bootstrap server over HTTP ------------------------------------------------


class BootstrapHTTPError(SourceError):
    """The bootstrap server could not give a usable answer."""

    def __init__(self, message: str, *, addr: str, status: int | None = None) -> None:
        super().__init__(message)
        self.addr = addr
        #: the HTTP status of the answer; None when there was none to blame (no answer, or a
        #: 200 whose content was unusable)
        self.status = status


class NotReady(BootstrapHTTPError):
    """503: not every prefill rank has registered yet. Retryable."""

    retryable = True


class PrefillSilent(NotReady):
    """The prefill's bootstrap server at ``addr`` was judged dead by its health probes, which
    have gone unanswered since (a stopped server, a cut path; one whose port refuses is not
    held off): the request failed at once, without asking it (a fetch would wait out its
    timeout) and without sending anything to its ranks. Retryable, as any ``NotReady``: the
    first request after a probe is answered gets through (the server is probed every 200 ms or
    less meanwhile)."""


class NotFound(BootstrapHTTPError):
    """404: the server does not know the requested rank."""


class UnknownRoom(NotFound):
    """The bootstrap server knows no dp rank for this room (yet): ``POST /query_dp_ranks``
    answered (200) without it, so ``status`` is None. The prefill registers a room's dp rank
    when the request reaches it, so this can be temporary: ask again, or pass the dp rank
    explicitly. A :class:`NotFound` (the server does not know it), unlike one retryable."""

    retryable = True

    def __init__(self, message: str, *, addr: str, room: int) -> None:
        super().__init__(message, addr=addr)
        self.room = room


class RequestRejected(BootstrapHTTPError):
    """Another 4xx answer (bad parameters, missing or wrong token, body too large)."""


class MalformedReply(BootstrapHTTPError):
    """The reply did not have the required keys or types. Never cached."""


class TransportFailure(BootstrapHTTPError):
    """Connection refused or reset, timeout, or an unexpected 5xx status."""

    retryable = True


class BootstrapTimeout(SourceError):
    """The prefill dp rank of a room stayed unknown past the bootstrap timeout.

    The bootstrap server never learned which dp rank serves the room (the prefill did not
    register it): retry the request, or route it with an explicit ``prefill_dp_rank``.
    """

    retryable = True


class FetchWaitTimeout(SourceError):
    """This request waited for another request's fetch of the same key past its deadline.

    The fetch in flight is slow (a slow or dying bootstrap server): retry the request.
    """

    retryable = True


# --- source: etcd --------------------------------------------------------------------------


class DiscoveryError(SourceError):
    """An etcd discovery call could not be completed."""


class EtcdUnavailable(DiscoveryError):
    """No etcd endpoint answered within the call's timeout (refused, reset, timed out, 5xx).

    Retry with back-off; the decode side keeps serving its local store meanwhile.
    """

    retryable = True


class EtcdRequestFailed(DiscoveryError):
    """etcd answered, but refused the request (lease not found, bad argument, auth)."""

    def __init__(self, message: str, *, status: int, code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class WatchCompacted(DiscoveryError):
    """The watch's start revision was compacted away: the watcher must re-list."""

    retryable = True

    def __init__(self, message: str, *, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class MalformedValue(DiscoveryError, ValueError):
    """A key or value under the etcd prefix that is not a valid rank registration (the message
    says which part). A decode never serves it (the key is skipped, as if absent) and a
    registrar refuses to write it (as :class:`InvalidArgument`). Not retryable: fix the
    process that wrote the key, or delete the key."""


class EtcdBadReply(EtcdUnavailable):
    """An endpoint answered what etcd never sends (a reply without a header, not JSON, too
    large): a broken gateway or proxy between us and etcd. Retried with back-off like an
    unreachable etcd; check what sits in front of the endpoint."""


class EtcdReplyTooLarge(EtcdBadReply):
    """A reply or watch message longer than its cap (``max_reply_bytes``,
    ``max_watch_message_bytes``): refused before it was read to its end."""


class WatchIdle(EtcdUnavailable):
    """The watch stream sent no complete message for its idle timeout (bytes trickling in do
    not count): re-open it from revision + 1.

    Not a failure by itself (a quiet prefix is silent): re-opening is how a half-open
    connection to a dead etcd is found without waiting for TCP to notice.
    """


# --- transport: ZMQ to the prefill ranks ---------------------------------------------------


class SendFailed(TransportError):
    """A ZMQ send to a prefill rank failed (dead peer with IMMEDIATE, or send timeout).

    Retryable: the pool entry holding the rank was dropped, so the retry fetches the prefill's
    current ranks (and fails fast with :class:`RanksUnreachable` while none is live)."""

    retryable = True

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class RanksUnreachable(TransportError):
    """The prefill's registered ranks cannot be reached and no newer registration is visible
    yet: the transport already judged an endpoint dead (its socket monitor), or registering
    with a rank failed. Nothing of this request was sent to a prefill. Retryable: the first
    request after the prefill registers again (new ports, or its ranks back) gets through.
    The same error on every source (HTTP and etcd alike): a transport error, not the
    source's. ``addr`` is the prefill's bootstrap address, ``endpoint`` the dead rank's."""

    retryable = True

    def __init__(self, message: str, *, addr: str, endpoint: str) -> None:
        super().__init__(message)
        self.addr = addr
        self.endpoint = endpoint


class WaitingTimeout(TransportError):
    """No transfer completed within the waiting timeout after the metadata was sent.

    Retryable: the prefill was slow or lost the request; a retry starts it again."""

    retryable = True


class MalformedFrames(TransportError, ValueError):
    """A ZMQ message did not have the layout its kind requires. Nothing was acted on."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


# --- peer lost (the failure fan-out) -------------------------------------------------------


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


class RankRetired(PeerLost):
    """A prefill rank's registration changed or vanished in etcd after this request's pool
    entry was fetched: the request fails; a retry fetches the new registration.

    Learnt from etcd's watch, but a :class:`PeerLost` (the manager's fan-out reason, counted
    with the others), not a :class:`DiscoveryError`: etcd answered fine."""


# --- tools ---------------------------------------------------------------------------------


class CfgError(ToolError):
    """A .cfg file that cannot be read, or that the mirror cannot check exactly."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class DumpError(ToolError):
    """TLC's state dump holds something this reader does not know; compare by counts only."""


class TraceFormatError(ToolError):
    """The trace is not well-formed (not JSON, missing or mistyped fields)."""


class EtcdStartFailed(ToolError):
    """The etcd binary exited, or did not serve within ``ready_timeout``."""


class PrefillRankStartFailed(ToolError):
    """The prefill rank process exited or stayed silent before printing ``READY``.

    ``stderr_tail`` holds the child's last stderr lines (also in the message): the reason.
    """

    def __init__(self, message: str, stderr_tail: str = "") -> None:
        if stderr_tail:
            message = f"{message}; its last stderr lines:\n{stderr_tail}"
        super().__init__(message)
        self.stderr_tail = stderr_tail


class ClusterError(ToolError):
    """A prefill process did not start (or did not say where it listens) in time."""
