"""The comparison anchors the demo and the benchmarks run beside the product, as subclasses.

SGLang 0.5.23's decode has no failure fan-out (a request fails on its own send or timeout only)
and no single-flight (every miss fetches for itself). The demo's ``sglang`` mode and the
recovery benchmark compare against that behaviour; it lives here, beside them, so that the
product classes carry no switch for it (``DecodeManager`` makes its fan-out and fetcher from
the class attributes these override).
"""

from __future__ import annotations

from statemachine.completion import KVPoll
from statemachine.decode.fanout import FanOut
from statemachine.decode.fetcher import Fetcher, Missing
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import RankPlan
from statemachine.decode.rooms import InFlight
from statemachine.demo.modes import ModeConfig
from statemachine.pool import PoolKey

__all__ = [
    "EveryMissFetches",
    "FetchPerMissManager",
    "NoFanOut",
    "SGLangLikeManager",
    "manager_class",
]


class NoFanOut(FanOut):
    """Evidence fails nobody: the transport's and the health monitor's verdicts, a failed
    send and a restart only drop what they name from the caches (as SGLang: each request
    fails on its own send or timeout). A source's retirements still apply."""

    def endpoint_dead(self, url: str, reason: str) -> int:
        return 0

    def address_dead(self, addr: str, reason: str) -> None:
        return None

    def restarted(
        self,
        addr: str,
        old_id: str,
        new_id: str,
        *,
        cause: str,
        exclude: InFlight | None = None,
    ) -> int:
        self._routes.forget(addr)
        self.dead_keys.forget_address(addr)
        return 0


class EveryMissFetches(Fetcher):
    """No single-flight: each request that misses leads its own fetch."""

    def single_flight(self, receiver: Missing, plan: RankPlan, missing: list[PoolKey]) -> KVPoll:
        return self.lead(receiver, plan, missing, {})


class FetchPerMissManager(DecodeManager):
    """The product's fan-out, but every miss fetches for itself (a test that needs N
    concurrent fetches of one key, or two leaders on one key)."""

    fetcher_class = EveryMissFetches


class SGLangLikeManager(DecodeManager):
    """SGLang's behaviour for the anchors: no fan-out from evidence, no single-flight."""

    fanout_class = NoFanOut
    fetcher_class = EveryMissFetches


def manager_class(mode: ModeConfig) -> type[DecodeManager]:
    """The manager a demo mode runs: ours with fan-out and single-flight, else the anchor."""
    return DecodeManager if mode.manager_fanout else SGLangLikeManager
