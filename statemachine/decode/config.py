"""``DecodeConfig``: every setting of a decode manager as one frozen value, checked once.

The parts a manager uses (source, pool, transport, backend) are objects the caller may own and
are passed beside it; everything else a decode worker tunes is here, with SGLang 0.5.23's
defaults where SGLang has the same setting. ``DecodeManager(config)`` takes it whole;
``DecodeManager(**settings)`` builds one from the same field names.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from statemachine.decode.liveness_bound import DEFAULT_LIVENESS_TIMEOUT_S, LivenessBound
from statemachine.decode.plan import DecodeLayout
from statemachine.errors import ConfigurationError, InvalidArgument

__all__ = [
    "DEFAULT_BOOTSTRAP_TIMEOUT_S",
    "DEFAULT_FETCH_DEADLINE_S",
    "DEFAULT_FLIGHT_TIMEOUT_S",
    "DEFAULT_KV_RELEASE_TIMEOUT_S",
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "DEFAULT_WAITING_TIMEOUT_S",
    "PREFILL_COMPLETE",
    "Completion",
    "DecodeConfig",
]

#: SGLang's default ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``.
DEFAULT_WAITING_TIMEOUT_S = 300.0
#: SGLang's default bootstrap timeout (a room whose dp rank stays unknown fails after it).
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0
#: How long a request waits for another request's fetch of the same key.
DEFAULT_FLIGHT_TIMEOUT_S = 30.0
#: How long one ``init()`` may spend asking its source (the topology and every rank together);
#: the HTTP client's own per-exchange deadline (HTTP-35) is the same by default.
DEFAULT_FETCH_DEADLINE_S = 5.0
#: SGLang's ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``: an aborted room's KV
#: is freed after this even if some prefill rank never acknowledged the ABORT.
DEFAULT_KV_RELEASE_TIMEOUT_S = 30.0
#: The policy under which the decode allocates KV only once the prefill finished (MGR-16).
PREFILL_COMPLETE = "prefill_complete"

Completion = Literal["acks", "external"]


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """A decode manager's settings (see ``DecodeManager`` for what each part does).

    ``completion="acks"`` listens for the prefill's statuses on ``ack_ip``; ``"external"`` is
    for a transfer engine that reports completion itself. ``layout``: this decode rank's
    parallel layout (plans and the allocation-policy check follow it). ``staging=True`` says
    the decode runs SGLang's staging buffer (not implemented here: a prefill whose attn-tp
    differs is refused). ``liveness_timeout_s``: the one bound on silence (ZMQ-25): a prefill
    rank or bootstrap server that stops answering without closing anything (a stopped process,
    a cut path) is judged dead within it, and every timeout of the rank sockets' heartbeats, the
    health probes and the fetches is derived from it
    (:class:`~statemachine.decode.liveness_bound.LivenessBound`); shorter bounds fail more
    requests that would have finished (docs/performance.md (h)). ``health_probes=False``: no
    health probes of the bootstrap servers (nor the hold-off of a silent one, MGR-22).
    ``dead_recheck_s`` (off by default): hold a key whose rank is known dead off for that long
    after each refetch that met it (``decode/dead_keys.py``, MGR-1).
    """

    completion: Completion = "acks"
    ack_ip: str = "127.0.0.1"
    session_id: str | None = None
    layout: DecodeLayout | None = None
    staging: bool = False
    #: seconds of silence after which a prefill rank or bootstrap server is judged dead
    liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S
    health_probes: bool = True
    waiting_timeout_s: float = DEFAULT_WAITING_TIMEOUT_S
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S
    flight_timeout_s: float = DEFAULT_FLIGHT_TIMEOUT_S
    #: init()'s questions to the source end by this many seconds after the first (MGR-21)
    fetch_deadline_s: float = DEFAULT_FETCH_DEADLINE_S
    kv_release_timeout_s: float = DEFAULT_KV_RELEASE_TIMEOUT_S
    dead_recheck_s: float | None = None
    send_timeout_ms: int = 1000
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if self.completion not in ("acks", "external"):
            raise ConfigurationError(
                f"completion must be 'acks' or 'external', not {self.completion!r}"
            )
        if self.layout is not None and not isinstance(self.layout, DecodeLayout):
            raise ConfigurationError(
                f"layout must be a DecodeLayout, not {type(self.layout).__name__}"
            )
        for name in (
            "waiting_timeout_s",
            "bootstrap_timeout_s",
            "flight_timeout_s",
            "kv_release_timeout_s",
            "fetch_deadline_s",
            "dead_recheck_s",
        ):
            value = getattr(self, name)
            if name == "dead_recheck_s" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(f"{name} must be a positive number, not {value!r}")
        try:
            LivenessBound.from_timeout(self.liveness_timeout_s)
        except InvalidArgument as exc:
            raise ConfigurationError(str(exc)) from None
        if not isinstance(self.health_probes, bool):
            raise ConfigurationError(
                f"health_probes must be True or False, not {self.health_probes!r}"
            )
        if not callable(self.clock):
            raise ConfigurationError("clock must be a callable returning seconds")

    @property
    def liveness(self) -> LivenessBound:
        """Every timeout of silence detection, derived from ``liveness_timeout_s``."""
        return LivenessBound.from_timeout(self.liveness_timeout_s)

    @property
    def prefill_complete(self) -> bool:
        """The ``prefill_complete`` allocation policy: init() runs the BOOTSTRAP handshake."""
        return self.layout is not None and self.layout.decode_allocation_policy == PREFILL_COMPLETE
