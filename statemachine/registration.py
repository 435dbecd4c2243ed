"""The body a prefill rank registers itself with: SGLang's ``PUT /route`` payload.

Below both sides on purpose: the prefill rank process sends it to a bootstrap server
(``decode.client.register_rank``), the etcd registrar writes it under the rank's key
(``discovery.registrar``), and tests and examples build it. Pure: no I/O, no third-party import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["route_payload"]


def route_payload(
    *,
    rank_ip: str,
    rank_port: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    system_dp_rank: int | None = None,
    system_dp_size: int | None = None,
    page_size: int = 16,
    kv_cache_dtype: str = "bfloat16",
    load_balance_method: str = "follow_bootstrap_room",
    enable_dsa_cache_layer_split: bool = False,
    prefill_http_port: int | None = None,
    decode_allocation_policy: str = "early",
    dsv41_spec_layout: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """The ``PUT /route`` body an SGLang prefill rank sends (spec/protocol.md §2.1): the 14
    topology and endpoint fields plus the five layout/policy fields of current SGLang, with
    SGLang's defaults. The system dp rank/size default to the attention dp rank/size.
    """
    return {
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": cp_size,
        "attn_cp_rank": cp_rank,
        "attn_dp_size": dp_size,
        "attn_dp_rank": dp_rank,
        "pp_size": pp_size,
        "pp_rank": pp_rank,
        "system_dp_size": dp_size if system_dp_size is None else system_dp_size,
        "system_dp_rank": dp_rank if system_dp_rank is None else system_dp_rank,
        "rank_ip": rank_ip,
        "rank_port": rank_port,
        "page_size": page_size,
        "kv_cache_dtype": kv_cache_dtype,
        "load_balance_method": load_balance_method,
        "enable_dsa_cache_layer_split": enable_dsa_cache_layer_split,
        "prefill_http_port": prefill_http_port,
        "decode_allocation_policy": decode_allocation_policy,
        "dsv41_spec_layout": None if dsv41_spec_layout is None else dict(dsv41_spec_layout),
    }
