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


class SGLangDecodeManagerAnchor:
    """The shared state SGLang's decode-side KV manager keeps for its receivers' hit path:
    the bootstrap-infos cache and its lock, the per-room status map, the target ranks."""

    def __init__(self) -> None:
        self.connection_lock, self.connection_pool = sglang_cache()
        self.request_status: dict[int, int] = {}
        # Rooms in flight per bootstrap address: what its node-failure handling fails
        # (reference §7, "every in-flight room bound to that address").
        self.addr_to_rooms: dict[str, set[int]] = {ADDR: set()}
        self.session_id = "decode-anchor"
        self.target_cp_ranks = (0,)
        self.target_tp_rank = 0

    def update_status(self, room: int, status: int) -> None:
        # Status only moves up (reference §4): keep the larger one.
        current = self.request_status.get(room)
        self.request_status[room] = status if current is None else max(current, status)


class SGLangReceiverAnchor:
    """One request on a cache hit, the steps SGLang's receiver takes (reference §4-§5):
    created Bootstrapping (status recorded, room tracked under its address), per target cp rank
    the string key built, the lock taken around ``cache.get``, the entry adopted and recorded,
    WaitingForInput recorded; ``clear()`` forgets the room."""

    def __init__(self, mgr: SGLangDecodeManagerAnchor, addr: str, room: int, dp_rank: int) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = addr
        self.bootstrap_room = room
        self.session_id = mgr.session_id
        self.conclude_state: int | None = None
        self.init_time: float | None = None
        mgr.update_status(room, 1)  # Bootstrapping
        mgr.addr_to_rooms[addr].add(room)
        self.prefill_dp_rank = dp_rank
        self.bootstrap_infos: list[dict[str, object]] = []
        self.required_entries: dict[str, list[dict[str, object]]] = {}
        for cp_rank in mgr.target_cp_ranks:
            key = f"{addr}_{dp_rank}_{cp_rank}_{mgr.target_tp_rank}"
            with mgr.connection_lock:
                infos = mgr.connection_pool.get(key)
            if infos is not None:
                self.bootstrap_infos.extend(infos)
                self.required_entries[key] = infos
        mgr.update_status(room, 2)  # WaitingForInput

    def clear(self) -> None:
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.addr_to_rooms[self.bootstrap_addr].discard(self.bootstrap_room)


def sglang_receiver_hits(mgr: SGLangDecodeManagerAnchor, first_room: int, n: int) -> None:
    """``n`` requests on a hit through SGLang's receiver steps: create, look up, clear."""
    for room in range(first_room, first_room + n):
        SGLangReceiverAnchor(mgr, ADDR, room, 0).clear()
