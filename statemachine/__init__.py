"""Decode-side bootstrap for prefill/decode disaggregated LLM serving.

The pieces, one module each:

* :mod:`statemachine.lifecycle` - the receiver lifecycle (a ``transitions`` Machine and the
  dispatch table derived from it);
* :mod:`statemachine.pool` - the shared, identity-safe bootstrap-info pool;
* :mod:`statemachine.decode.client` - the pooled HTTP client for a prefill's bootstrap server;
* :mod:`statemachine.prefill.server` - the reference bootstrap server (needs the ``server`` extra);
* :mod:`statemachine.decode.ranks.transport` and :mod:`statemachine.backend` - ZMQ sends and
  frame layouts;
* :mod:`statemachine.decode.receiver` - ``BootstrapReceiver``, one per request;
* :mod:`statemachine.decode.ranks.acks` and :mod:`statemachine.decode.health` - the completion
  listener and the heartbeat.

Every name in ``__all__`` imports from here. The import name is shared with the unrelated
``python-statemachine`` package: see the README.
"""

import importlib
from typing import TYPE_CHECKING, Any

from statemachine.backend import KVBackend
from statemachine.completion import KVPoll
from statemachine.errors import (
    Aborted,
    BootstrapError,
    BootstrapHTTPError,
    BootstrapTimeout,
    ConfigurationError,
    FetchWaitTimeout,
    InvalidArgument,
    InvalidKVIndices,
    InvalidRoom,
    InvalidTransition,
    MalformedReply,
    ManagerClosed,
    MissingExtra,
    NotFound,
    NotReady,
    PeerLost,
    PrefillDead,
    PrefillRestarted,
    PrefillSilent,
    RankDead,
    RanksUnreachable,
    RequestRejected,
    SendFailed,
    SetupError,
    SourceError,
    TopologyMismatch,
    TransferFailed,
    TransportError,
    TransportFailure,
    UnknownRoom,
    UsageError,
    WaitingTimeout,
)
from statemachine.lifecycle import Lifecycle
from statemachine.pool import BootstrapPool, Generation, PoolKey, PoolStats, RankInfo
from statemachine.validation import RouteReply, Topology
from statemachine.wire.metadata import MetadataRequest
from statemachine.wire.reference import SimpleBackend

#: The package version, written only here (pyproject.toml reads it statically, without an import).
__version__ = "0.1.0"

if TYPE_CHECKING:
    from statemachine.decode.client import BootstrapClient
    from statemachine.decode.config import DecodeConfig
    from statemachine.decode.health import HealthMonitor
    from statemachine.decode.manager import DecodeManager
    from statemachine.decode.plan import DecodeLayout, RankPlan
    from statemachine.decode.ranks.acks import AckListener
    from statemachine.decode.ranks.transport import ZmqTransport
    from statemachine.decode.receiver import BootstrapReceiver
    from statemachine.prefill.server import BootstrapServer
    from statemachine.wire.http import route_payload

# The runtime parts are imported on first use: the server needs aiohttp (an optional extra: its
# module raises MissingExtra, naming the pip command, when aiohttp is absent), and keeping zmq
# and requests out of `import statemachine` lets the pure cores (lifecycle, pool) load alone —
# CrossHair's importer, for one, cannot load pyzmq's compiled backend.
_LAZY = {
    "AckListener": "statemachine.decode.ranks.acks",
    "BootstrapClient": "statemachine.decode.client",
    "BootstrapReceiver": "statemachine.decode.receiver",
    "BootstrapServer": "statemachine.prefill.server",
    "DecodeConfig": "statemachine.decode.config",
    "DecodeLayout": "statemachine.decode.plan",
    "DecodeManager": "statemachine.decode.manager",
    "HealthMonitor": "statemachine.decode.health",
    "RankPlan": "statemachine.decode.plan",
    "ZmqTransport": "statemachine.decode.ranks.transport",
    # A prefill's PUT /route body; exported here so that examples (docs/etcd.md) need not
    # know which module builds it.
    "route_payload": "statemachine.wire.http",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'statemachine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Aborted",
    "AckListener",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapHTTPError",
    "BootstrapPool",
    "BootstrapReceiver",
    "BootstrapServer",
    "BootstrapTimeout",
    "ConfigurationError",
    "DecodeConfig",
    "DecodeLayout",
    "DecodeManager",
    "FetchWaitTimeout",
    "Generation",
    "HealthMonitor",
    "InvalidArgument",
    "InvalidKVIndices",
    "InvalidRoom",
    "InvalidTransition",
    "KVBackend",
    "KVPoll",
    "Lifecycle",
    "MalformedReply",
    "ManagerClosed",
    "MetadataRequest",
    "MissingExtra",
    "NotFound",
    "NotReady",
    "PeerLost",
    "PoolKey",
    "PoolStats",
    "PrefillDead",
    "PrefillRestarted",
    "PrefillSilent",
    "RankDead",
    "RankInfo",
    "RankPlan",
    "RanksUnreachable",
    "RequestRejected",
    "RouteReply",
    "SendFailed",
    "SetupError",
    "SimpleBackend",
    "SourceError",
    "Topology",
    "TopologyMismatch",
    "TransferFailed",
    "TransportError",
    "TransportFailure",
    "UnknownRoom",
    "UsageError",
    "WaitingTimeout",
    "ZmqTransport",
    "route_payload",
]
