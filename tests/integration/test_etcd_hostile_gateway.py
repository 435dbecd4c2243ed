"""The etcd source against a broken gateway or proxy (issue 17): it decodes defensively.

A stand-in gateway on loopback (``tests/support/etcd_gateway_support.py``) serves what a real etcd
never
sends; what a real etcd can show (values failing validation) runs against the real one. Each
test names the finding it reproduces; bounds are generous correctness bounds, never timings.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.layout import RankKey, encode_value, rank_key
from statemachine.errors import EtcdUnavailable, NotReady
from tests.support.etcd_discovery_support import ADDR, BOUND, payload
from tests.support.etcd_gateway_support import (
    FakeGateway,
    created,
    event,
    hold_open,
    kv,
    line,
    range_reply,
)
from tests.support.etcd_support import EtcdServer, running_etcd, wait_until

PREFIX = "/hostile/ranks"


def key(tp: int) -> bytes:
    return rank_key(PREFIX, RankKey(ADDR, 0, 0, tp, 0))


def value(port: int, tp: int = 0, tp_size: int = 2, registration: str = "r") -> bytes:
    return encode_value(payload(port, tp=tp, tp_size=tp_size), "inst", registration)


def port_of(source: EtcdBootstrapSource, tp: int = 0) -> int:
    return source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0).rank_port


def listing(revision: int, kvs: list[dict[str, str]]) -> Any:
    def script(request: dict[str, Any]) -> Iterable[bytes | float]:
        return [range_reply(revision, kvs)]

    return script


def watching(*messages: bytes) -> Any:
    """A watch that sends ``messages`` (once per open) and then stays open, silent."""

    def script(request: dict[str, Any]) -> Iterator[bytes | float]:
        yield from messages
        yield from hold_open()

    return script


def source_on(gateway: FakeGateway, **kwargs: Any) -> EtcdBootstrapSource:
    options = {k: kwargs.pop(k) for k in ("call_deadline", "max_reply_bytes") if k in kwargs}
    return EtcdBootstrapSource(
        EtcdGateway([gateway.endpoint], **options), prefix=PREFIX, **kwargs
    ).start()


# --- 1. one bad key or event never blocks the rest ------------------------------------------


def test_a_key_with_bad_base64_in_the_list_is_skipped_and_the_rest_sync() -> None:
    kvs = [
        kv(key(0), value(5000, tp=0), 2),
        kv(key(1), value(5001, tp=1), 3),
        kv(key(1), b"", 3, sent={"key": "***not base64***"}),  # a proxy mangled two entries
        kv(key(0), b"", 3, sent={"value": "%%%"}),
    ]
    with FakeGateway({"kv/range": listing(3, kvs), "watch": watching(created(3))}) as gateway:
        source = source_on(gateway)
        try:
            assert source.wait_synced(BOUND), source.stats().last_error
            assert [port_of(source, 0), port_of(source, 1)] == [5000, 5001]
            assert source.stats().malformed == 2
        finally:
            source.close()


def test_a_watch_event_with_bad_base64_is_skipped_and_later_events_apply() -> None:
    bad = {"kv": kv(key(0), b"", 4, sent={"value": "!!!not base64!!!"})}
    script = watching(
        created(3),
        event(4, [bad]),
        event(5, [{"kv": kv(key(0), value(6000, tp=0, registration="new"), 5)}]),
    )
    kvs = [kv(key(0), value(5000, tp=0), 2), kv(key(1), value(5001, tp=1), 3)]
    with FakeGateway({"kv/range": listing(3, kvs), "watch": script}) as gateway:
        source = source_on(gateway)
        try:
            assert source.wait_synced(BOUND)
            assert wait_until(lambda: source.revision == 5, BOUND), source.stats()
            assert port_of(source, 0) == 6000
            stats = source.stats()
            assert stats.malformed == 1
            assert stats.reconnects == 0 and gateway.calls["watch"] == 1  # never re-opened
        finally:
            source.close()


# --- 2. back-off on every retry -------------------------------------------------------------

#: how long the storms below run, and the most list calls back-off allows in it: jittered
#: 25-50 ms doubling to 2 s gives 4-6 attempts in 1.5 s; without back-off there were 250-570.
STORM_S = 1.5
STORM_MAX_CALLS = 10


def test_a_compaction_storm_is_relisted_with_backoff() -> None:
    def compacted(request: dict[str, Any]) -> Iterable[bytes | float]:
        return [created(3), line({"canceled": True, "compact_revision": "9"})]

    with FakeGateway({"kv/range": listing(3, []), "watch": compacted}) as gateway:
        source = source_on(gateway)
        try:
            assert source.wait_synced(BOUND)
            time.sleep(STORM_S)
            stats = source.stats()
            assert stats.compactions >= 2  # the storm reached the source
            assert gateway.calls["kv/range"] <= STORM_MAX_CALLS, gateway.calls
        finally:
            source.close()


def test_a_list_reply_whose_header_is_not_an_object_is_a_counted_bad_reply() -> None:
    def headless(request: dict[str, Any]) -> Iterable[bytes | float]:
        return [json.dumps({"header": "nope", "kvs": []}).encode()]

    with FakeGateway({"kv/range": headless, "watch": watching(created(3))}) as gateway:
        source = source_on(gateway)
        try:
            time.sleep(STORM_S)
            stats = source.stats()
            assert not stats.synced and stats.lists == 0
            assert stats.bad_replies >= 2 and "header is not an object" in (stats.last_error or "")
            assert gateway.calls["kv/range"] <= STORM_MAX_CALLS, gateway.calls
            assert gateway.calls["watch"] == 0  # never a "cluster replaced" loop
            with pytest.raises(NotReady):
                port_of(source)
        finally:
            source.close()


# --- 3. size caps ---------------------------------------------------------------------------

REPLY_MB = 150


def huge_list(request: dict[str, Any]) -> Iterator[bytes | float]:
    """A 150 MB list reply, streamed without Content-Length (generated, never held whole)."""
    yield b'{"header":{"cluster_id":"7","revision":"3"},"kvs":[{"key":"'
    chunk = b"A" * (1 << 20)
    for _ in range(REPLY_MB):
        yield chunk
    yield b'"}]}'


def test_a_150_mb_list_reply_is_refused_without_reading_it_all() -> None:
    with FakeGateway({"kv/range": huge_list, "watch": watching(created(3))}) as gateway:
        source = source_on(gateway, max_reply_bytes=4 << 20)
        try:
            assert wait_until(lambda: source.stats().bad_replies >= 1, BOUND)
            assert wait_until(lambda: len(gateway.sent) >= 1, BOUND)
            # The cap, plus what the kernel's socket buffers took: far from the whole reply.
            assert max(gateway.sent) < (REPLY_MB << 20) // 4, gateway.sent
            assert "max_reply_bytes" in (source.stats().last_error or "")
            assert not source.stats().synced
        finally:
            source.close()


def test_a_watch_message_over_its_cap_is_refused() -> None:
    def endless_message(request: dict[str, Any]) -> Iterator[bytes | float]:
        yield created(3)
        yield b'{"result":{"header":{"revision":"4"},"events":[{"kv":{"key":"'
        while True:
            yield b"A" * (1 << 20)

    with FakeGateway({"kv/range": listing(3, []), "watch": endless_message}) as gateway:
        source = EtcdBootstrapSource(
            EtcdGateway([gateway.endpoint], max_watch_message_bytes=2 << 20), prefix=PREFIX
        ).start()
        try:
            assert wait_until(lambda: source.stats().bad_replies >= 1, BOUND)
            assert "max_watch_message_bytes" in (source.stats().last_error or "")
        finally:
            source.close()
        assert wait_until(lambda: len(gateway.sent) >= 1, BOUND)
        assert max(gateway.sent) < 64 << 20, gateway.sent


# --- 4. deadlines ---------------------------------------------------------------------------


def trickle(request: dict[str, Any]) -> Iterator[bytes | float]:
    """A list reply one byte at a time, never finished: every recv gets a byte in time."""
    yield b'{"header":{"cluster_id":"7","revision":"3"},"kvs":['
    while True:
        yield b" "
        yield 0.1


def test_a_trickled_first_list_ends_at_its_deadline_and_stats_say_why() -> None:
    with FakeGateway({"kv/range": trickle, "watch": watching(created(3))}) as gateway:
        source = source_on(gateway, call_deadline=0.5)
        try:
            answered: list[object] = []
            reader = threading.Thread(target=lambda: answered.append(source.stats()))
            reader.start()
            reader.join(BOUND)
            assert answered, "stats() blocked behind the trickled list"
            assert wait_until(lambda: source.stats().reconnects >= 1, BOUND)
            assert "call_deadline" in (source.stats().last_error or "")
            assert not source.stats().synced
        finally:
            source.close()


def test_close_ends_the_thread_during_a_trickled_list() -> None:
    with FakeGateway({"kv/range": trickle, "watch": watching(created(3))}) as gateway:
        source = source_on(gateway)  # default call_deadline (10 s): close() must not wait it
        assert wait_until(lambda: gateway.calls["kv/range"] == 1, BOUND)
        time.sleep(0.3)  # the list is mid-trickle
        thread = source._watch.thread
        assert thread is not None and thread.is_alive()
        source.close()  # joins for at most connect_timeout + 1 s
        assert not thread.is_alive()


def test_a_reply_trickling_its_headers_ends_at_the_call_deadline() -> None:
    """The deadline covers the whole exchange, headers too (not only the body's reads)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            with contextlib.suppress(OSError):
                while not stop.wait(0.1):
                    conn.sendall(b"a")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    gateway = EtcdGateway([f"http://127.0.0.1:{listener.getsockname()[1]}"], call_deadline=0.5)
    try:
        with pytest.raises(EtcdUnavailable, match="call_deadline"):
            gateway.get_prefix(PREFIX.encode() + b"/")
    finally:
        stop.set()
        server.join(BOUND)
        listener.close()


def test_a_watch_trickling_bytes_trips_the_idle_timeout() -> None:
    def trickled_watch(request: dict[str, Any]) -> Iterator[bytes | float]:
        yield created(3)
        yield b'{"result":{"header":{"revision":"4"},'  # a message that never completes
        while True:
            yield b" "
            yield 0.1  # a byte every 0.1 s: no recv ever waits the 0.5 s read timeout

    with FakeGateway({"kv/range": listing(3, []), "watch": trickled_watch}) as gateway:
        source = source_on(gateway, watch_idle_timeout=0.5)
        try:
            assert source.wait_synced(BOUND)
            assert wait_until(lambda: source.stats().idle_reopens >= 1, BOUND)
            # re-opened from revision + 1 (the server counts it a moment after the source)
            assert wait_until(lambda: gateway.calls["watch"] >= 2, BOUND)
        finally:
            source.close()


# --- 5. revisions only move forward ---------------------------------------------------------


def test_an_event_older_than_the_store_is_ignored() -> None:
    kvs = [kv(key(0), value(5000, tp=0), 2), kv(key(1), value(5001, tp=1), 3)]
    script = watching(
        created(3),
        event(7, [{"kv": kv(key(0), value(6000, tp=0, registration="new"), 7)}]),
        # A replay of an older revision (a proxy re-sending history): the dead port again.
        event(7, [{"kv": kv(key(0), value(4000, tp=0, registration="old"), 4)}]),
        event(8, [{"kv": kv(key(1), value(6001, tp=1, registration="new"), 8)}]),
    )
    with FakeGateway({"kv/range": listing(3, kvs), "watch": script}) as gateway:
        source = source_on(gateway)
        try:
            assert source.wait_synced(BOUND)
            assert wait_until(lambda: source.revision == 8, BOUND), source.stats()
            assert [port_of(source, 0), port_of(source, 1)] == [6000, 6001]
            assert source.stats().stale_events == 1
        finally:
            source.close()


def test_a_revision_beyond_its_message_header_is_refused() -> None:
    kvs = [kv(key(0), value(5000, tp=0), 2), kv(key(1), value(5001, tp=1), 3)]
    script = watching(
        created(3),
        event(4, [{"kv": kv(key(0), value(4000, tp=0, registration="x"), 1 << 62)}]),
        event(5, [{"kv": kv(key(1), value(6001, tp=1, registration="new"), 5)}]),
    )
    with FakeGateway({"kv/range": listing(3, kvs), "watch": script}) as gateway:
        source = source_on(gateway)
        try:
            assert source.wait_synced(BOUND)
            assert wait_until(lambda: source.stats().events_handled == 2, BOUND)
            assert source.revision == 5  # not 2^62: later real events still apply
            assert [port_of(source, 0), port_of(source, 1)] == [5000, 6001]
            assert source.stats().refused_revisions == 1
        finally:
            source.close()


# --- 6. values validated like HTTP replies (real etcd) -------------------------------------


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with running_etcd() as server:
        yield server


def test_values_failing_the_http_reply_rules_are_counted_and_skipped(etcd: EtcdServer) -> None:
    prefix = f"/test-{uuid.uuid4().hex[:12]}/ranks"
    writer = EtcdGateway([etcd.endpoint])
    other = "127.0.0.1:9000"

    def put(addr: str, tp: int, fields: dict[str, object]) -> int:
        body = {**payload(5000 + tp, tp=tp, tp_size=2), **fields}
        return writer.put(
            rank_key(prefix, RankKey(addr, 0, 0, tp, 0)), encode_value(body, "i", "r")
        )

    with EtcdBootstrapSource(EtcdGateway([etcd.endpoint]), prefix=prefix) as source:
        assert source.wait_synced(BOUND)
        put(ADDR, 0, {"rank_ip": "prefill-0.example"})  # a host name (HTTP-25: literals only)
        put(ADDR, 1, {"attn_tp_size": 5000, "attn_tp_rank": 1})  # beyond HTTP-22's 4096
        put(other, 0, {"kv_cache_dtype": "x" * 65})  # a label over 64 chars (HTTP-22)
        put(other, 1, {})  # good values still sync
        revision = put(other, 1, {"rank_port": 5005})
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert source.stats().malformed == 3
        for addr in (ADDR, other):
            with pytest.raises(NotReady):  # a skipped rank is a missing one: never served
                source.get_topology(addr)
        revision = put(other, 0, {})
        assert wait_until(lambda: source.revision >= revision, BOUND)
        assert source.get_rank(other, dp_rank=0, cp_rank=0, tp_rank=1, pp_rank=0).rank_port == 5005
