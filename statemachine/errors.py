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


class RankRetired(DiscoveryError):
    """A prefill rank's registration changed or vanished in etcd after this request's
    generation was fetched: the request fails; a retry fetches the new registration."""
