"""etcd discovery's key layout as the tests write it: the address, the bound, a rank's payload and
a fetch."""

from __future__ import annotations

from statemachine.discovery.changes import (
    StampedGeneration,
    generation_for,
    revision_of,
    still_current,
)
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.pool import BootstrapPool, PoolKey, RankInfo
from statemachine.wire.http import route_payload

ADDR = "127.0.0.1:8998"


BOUND = 10.0  # generous correctness bound (s) for anything to show up through the watch


def payload(port: int, *, tp: int = 0, tp_size: int = 1, dp: int = 0, dp_size: int = 1) -> dict:
    return route_payload(
        rank_ip="127.0.0.1",
        rank_port=port,
        tp_rank=tp,
        tp_size=tp_size,
        dp_rank=dp,
        dp_size=dp_size,
    )


def fetch(
    source: EtcdBootstrapSource, pool: BootstrapPool, addr: str, tp_size: int, dp: int = 0
) -> StampedGeneration:
    """What a receiver does on a miss with the etcd source: stamp, fetch, publish, check."""
    stamp = revision_of(source)
    replies = [
        source.get_rank(addr, dp_rank=dp, cp_rank=0, tp_rank=tp, pp_rank=0) for tp in range(tp_size)
    ]
    generation = generation_for(
        tuple(RankInfo(r.rank_ip, r.rank_port, 0) for r in replies), replies[0].instance_id, stamp
    )
    key = PoolKey(addr, dp, 0, 0)
    held = pool.publish(key, generation)
    assert isinstance(held, StampedGeneration) and still_current(source, key, held)
    return held
