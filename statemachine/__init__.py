"""Decode-side bootstrap for prefill/decode disaggregated LLM serving.

The pieces, one module each:

* :mod:`statemachine.lifecycle` - the receiver lifecycle (a ``transitions`` Machine and the
  dispatch table derived from it);
* :mod:`statemachine.pool` - the shared, identity-safe bootstrap-info pool.
"""

from statemachine.errors import (
    Aborted,
    BootstrapError,
    BootstrapHTTPError,
    InvalidTransition,
    MalformedReply,
    NotFound,
    NotReady,
    RequestRejected,
    SendFailed,
    TransportFailure,
    WaitingTimeout,
)
from statemachine.lifecycle import KVPoll, Lifecycle
from statemachine.pool import BootstrapPool, Generation, PoolKey, PoolStats, RankInfo

__all__ = [
    "Aborted",
    "BootstrapError",
    "BootstrapHTTPError",
    "BootstrapPool",
    "Generation",
    "InvalidTransition",
    "KVPoll",
    "Lifecycle",
    "MalformedReply",
    "NotFound",
    "NotReady",
    "PoolKey",
    "PoolStats",
    "RankInfo",
    "RequestRejected",
    "SendFailed",
    "TransportFailure",
    "WaitingTimeout",
]
