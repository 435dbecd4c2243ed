"""The anchors' code paths that several benchmarks compare against, written once."""

from __future__ import annotations

import threading

#: A bootstrap address as SGLang keys its cache with it.
ADDR = "10.0.0.5:8998"

SGLangCache = dict[str, list[dict[str, object]]]


def sglang_cache() -> tuple[threading.Lock, SGLangCache]:
    """SGLang's bootstrap-infos cache holding one entry for ``ADDR``, and its lock."""
    return threading.Lock(), {
        f"{ADDR}_0_0_0": [{"rank_ip": "10.0.0.5", "rank_port": 5000, "pp_rank": 0}]
    }


def sglang_hits(lock: threading.Lock, cache: SGLangCache, n: int) -> None:
    """``n`` cache hits the way SGLang does them: string key built per request, lock, get,
    record the entry."""
    entries: SGLangCache = {}
    dp, cp, tp = 0, 0, 0
    for _ in range(n):
        key = f"{ADDR}_{dp}_{cp}_{tp}"
        with lock:
            info = cache.get(key)
        if info is not None:
            entries[key] = info
