"""Decode-side bootstrap for prefill/decode disaggregated LLM serving.

The pieces, one module each:

* :mod:`statemachine.lifecycle` - the receiver lifecycle (a ``transitions`` Machine and the
  dispatch table derived from it);
* :mod:`statemachine.pool` - the shared, identity-safe bootstrap-info pool;
* :mod:`statemachine.client` - the pooled HTTP client for a prefill's bootstrap server;
* :mod:`statemachine.server` - the reference bootstrap server (needs the ``server`` extra);
* :mod:`statemachine.transport` and :mod:`statemachine.backend` - ZMQ sends and frame layouts;
* :mod:`statemachine.receiver` - ``BootstrapReceiver``, one per request.
"""

from typing import TYPE_CHECKING, Any

from statemachine.client import BootstrapClient
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
from statemachine.receiver import BootstrapReceiver, Decode, RankPlan
from statemachine.transport import ZmqTransport

if TYPE_CHECKING:
    from statemachine.server import BootstrapServer


def __getattr__(name: str) -> Any:
    # The server needs aiohttp (an optional extra): import it only when asked for.
    if name == "BootstrapServer":
        from statemachine.server import BootstrapServer

        return BootstrapServer
    raise AttributeError(f"module 'statemachine' has no attribute {name!r}")


__all__ = [
    "Aborted",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapHTTPError",
    "BootstrapPool",
    "BootstrapReceiver",
    "BootstrapServer",
    "Decode",
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
    "RankPlan",
    "RequestRejected",
    "SendFailed",
    "TransportFailure",
    "WaitingTimeout",
    "ZmqTransport",
]
