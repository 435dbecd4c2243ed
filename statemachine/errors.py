"""Typed errors a caller can branch on.

Every failure the library reports is a subclass of :class:`BootstrapError`, so a decode worker
can catch one family and still tell a retryable condition (:class:`NotReady`) from a permanent
one (:class:`MalformedReply`) or a dead peer (:class:`TransportFailure`, :class:`SendFailed`).
"""

from __future__ import annotations


class BootstrapError(Exception):
    """Base class of every error raised by this library."""


# --- lifecycle -------------------------------------------------------------------------------


class InvalidTransition(BootstrapError):
    """An event was fired in a lifecycle state that does not allow it."""

    def __init__(self, state: str, event: str) -> None:
        super().__init__(f"event {event!r} is not allowed in state {state!r}")
        self.state = state
        self.event = event


# --- HTTP to the bootstrap server ------------------------------------------------------------


class BootstrapHTTPError(BootstrapError):
    """The bootstrap server could not give a usable answer."""

    def __init__(self, message: str, *, addr: str, status: int | None = None) -> None:
        super().__init__(message)
        self.addr = addr
        self.status = status


class NotReady(BootstrapHTTPError):
    """503: not every prefill rank has registered yet. Retryable."""


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
    """The request was aborted by its owner."""


# --- packaging (newcomer) ----------------------------------------------------------------------


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


# --- hostile peers: bootstrap HTTP (hostile branch) -------------------------------------------


class UnknownRoom(NotFound):
    """The bootstrap server knows no dp rank for this room (yet): ``POST /query_dp_ranks``
    answered without it. The prefill registers a room's dp rank when the request reaches it,
    so this can be temporary: ask again, or pass the dp rank explicitly."""

    def __init__(self, message: str, *, addr: str, room: int) -> None:
        super().__init__(message, addr=addr, status=200)
        self.room = room
