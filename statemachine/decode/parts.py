"""``Parts``: what every receiver of one decode process is handed, and the check of its parts.

The manager makes the parts (``decode/manager.py``) and hands each receiver one frozen
:class:`Parts` value: the receiver reads its collaborators from it and never calls the manager.
:func:`check_parts` is the one check of the caller-given parts (a missing or wrong-typed part
is a :class:`~statemachine.errors.ConfigurationError` at construction, not an
``AttributeError`` on the first request).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from statemachine.decode.completions import Completions
from statemachine.decode.config import DecodeConfig
from statemachine.decode.dead_keys import DeadKeys
from statemachine.decode.dp_ranks import DpRankQueries
from statemachine.decode.fanout import FanOut
from statemachine.decode.fetcher import Fetcher
from statemachine.decode.ranks.outbox import Outbox
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.decode.rooms import Rooms
from statemachine.decode.routes import Routes
from statemachine.decode.silent import SilentAddresses
from statemachine.decode.source import BootstrapSource, as_source
from statemachine.errors import ConfigurationError
from statemachine.pool import BootstrapPool

__all__ = ["Parts", "check_parts"]


@dataclass(frozen=True, slots=True)
class Parts:
    """What every receiver of one decode process is handed (the manager makes one)."""

    config: DecodeConfig
    pool: BootstrapPool
    source: BootstrapSource
    #: every message to the prefill ranks (metadata, BOOTSTRAP, ABORT), built and sent
    outbox: Outbox
    rooms: Rooms
    routes: Routes
    dp_ranks: DpRankQueries
    fanout: FanOut
    fetcher: Fetcher
    #: bootstrap addresses judged silent: a request there fails at once (MGR-22)
    silent: SilentAddresses
    #: pool keys whose ranks are known dead: a miss on one fails at once (MGR-1)
    dead_keys: DeadKeys
    completions: Completions
    #: ``config.prefill_complete``, read once: init() runs the BOOTSTRAP handshake (MGR-16)
    prefill_complete: bool
    #: the source marks stale generations (etcd): check them before starting a transfer
    checks_stale_marks: bool


def _takes_keyword(function: object, keyword: str) -> bool:
    """Whether ``function`` accepts ``keyword=`` (a signature it cannot show is trusted)."""
    try:
        parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == keyword and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def check_parts(
    *,
    pool: object,
    source: object,
    transport: object,
    backend: object,
    waiting_timeout_s: object,
    clock: object,
) -> None:
    """Raise ConfigurationError naming the first missing or wrong-typed shared part."""
    if not isinstance(pool, BootstrapPool):
        raise ConfigurationError(
            f"pool must be a BootstrapPool, not {type(pool).__name__}: pass BootstrapPool()"
        )
    as_source(source)  # the three questions at least (the one rule, in source.py)
    if not isinstance(transport, ZmqTransport):
        raise ConfigurationError(
            f"transport must be a ZmqTransport, not {type(transport).__name__}"
        )
    for method in (
        "register_frames",
        "metadata_frames",
        "abort_frames",
        "bootstrap_frames",
        "decode_message",
    ):
        function = getattr(backend, method, None)
        if not callable(function):
            raise ConfigurationError(
                f"backend must be a KVBackend with {method}() (e.g. SimpleBackend), "
                f"not {type(backend).__name__}"
            )
        keywords = {"abort_frames": ("instance_id", "abort_seq"), "decode_message": ()}
        for keyword in keywords.get(method, ("instance_id",)):
            if not _takes_keyword(function, keyword):
                # Checked here, once: otherwise the first send would raise an untyped TypeError.
                raise ConfigurationError(
                    f"{type(backend).__name__}.{method}() must accept the keyword argument "
                    f"{keyword} (spec/zmq.md ZMQ-21, ZMQ-22); a backend that has no use for it "
                    "may ignore it"
                )
    if (
        isinstance(waiting_timeout_s, bool)
        or not isinstance(waiting_timeout_s, (int, float))
        or not waiting_timeout_s > 0
    ):
        raise ConfigurationError(
            f"waiting_timeout_s must be a positive number, not {waiting_timeout_s!r}"
        )
    if not callable(clock):
        raise ConfigurationError("clock must be a callable returning seconds")
