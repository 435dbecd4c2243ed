"""A user's worker, as a new user meets it (issue 17, "A user's worker"; MGR-7, MGR-10).

Real parts: a bootstrap server on 127.0.0.1 and prefill rank processes, real HTTP sessions
counted on the server's side. What is checked: ``close()`` releases what *every* thread
opened, ``poll()`` before ``init()`` says what to do instead of ``Bootstrapping`` forever, and
every error a user can provoke with bad input is a ``BootstrapError`` (still the ``TypeError``
/ ``ValueError`` / ``ImportError`` it was) whose message says what to do next.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from statemachine.completion import KVPoll
from statemachine.decode.manager import DecodeManager
from statemachine.decode.plan import DecodeLayout
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.demo.baselines import FetchPerMissManager
from statemachine.errors import (
    BootstrapError,
    InvalidKVIndices,
    InvalidTransition,
    MissingExtra,
)
from tests.support.manager_support import wait_until
from tests.support.receiver_support import PLAN, Prefill, start_prefill, stop_prefill

THREADS = 4


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    instance = start_prefill()
    yield instance
    stop_prefill(instance)


def test_close_closes_every_threads_bootstrap_connection(prefill: Prefill) -> None:
    """4 threads each bootstrap once (a miss each: no single-flight), then one thread
    closes the manager: the server sees every connection closed. Before: only the closing
    thread's own session was closed (4 threads -> 4 connections left open until gc or thread
    exit). The threads stay alive here, so nothing but close() can close them."""
    manager = FetchPerMissManager(health_probes=False)
    server = prefill.server
    # Each rank registered over a connection of its own that it closed before READY; the
    # server may not have seen that close yet. Counting from there would count it as ours.
    assert wait_until(lambda: server.stats().connections_open == 0, 10)
    before = 0
    started = threading.Barrier(THREADS + 1)
    release = threading.Event()
    results: list[KVPoll] = []

    def worker(room: int) -> None:
        receiver = manager.receiver(prefill.addr, room, PLAN, prefill_dp_rank=0)
        results.append(receiver.init())
        receiver.abort()
        started.wait()
        release.wait(30)  # alive until the test is done: no thread-exit finalizer runs

    threads = [threading.Thread(target=worker, args=(room,)) for room in range(1, THREADS + 1)]
    try:
        for i, thread in enumerate(threads):
            thread.start()
            # one at a time, each after the pool was emptied: every thread opens a session
            wait_until(lambda i=i: len(results) > i, 10)
            manager.pool.invalidate(manager.pool.snapshot())
        started.wait(10)
        assert results == [KVPoll.WaitingForInput] * THREADS
        assert wait_until(lambda: server.stats().connections_open - before >= THREADS, 10)
        manager.close()
        assert wait_until(lambda: server.stats().connections_open == before, 10), (
            server.stats().connections_open,
            before,
        )
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
        manager.close()


def test_poll_before_init_raises_and_says_to_call_init(prefill: Prefill) -> None:
    """Before: Bootstrapping, forever. Now InvalidTransition naming poll(), the state and
    init(); the receiver is unchanged and init() then works."""
    with DecodeManager(health_probes=False) as manager:
        receiver = manager.receiver(prefill.addr, 1, PLAN, prefill_dp_rank=0)
        with pytest.raises(InvalidTransition) as caught:
            receiver.poll()
        text = str(caught.value)
        assert "poll() called in state 'idle'" in text and "call init() first" in text
        assert receiver.init() == KVPoll.WaitingForInput
        assert receiver.poll() == KVPoll.WaitingForInput


def test_bad_kv_indices_are_a_bootstrap_error_that_changes_nothing(prefill: Prefill) -> None:
    with DecodeManager(health_probes=False) as manager:
        receiver = manager.receiver(prefill.addr, 1, PLAN, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput
        for bad, words in (
            ([1, 2.5], "kv_indices items must be ints, not float"),
            ("123", "kv_indices must be a sequence of ints, not str"),
            ([2**40], "kv_indices item out of int32 range"),
        ):
            with pytest.raises(InvalidKVIndices) as caught:
                receiver.send_metadata(bad)
            assert isinstance(caught.value, BootstrapError)
            assert isinstance(caught.value, (TypeError, ValueError))  # callers' excepts still work
            text = str(caught.value)
            assert words in text, text
            assert "pass the request's KV page indices as a sequence of ints" in text
            assert "nothing was sent; the request is unchanged" in text
            assert receiver.poll() == KVPoll.WaitingForInput  # bad input changed nothing
        with pytest.raises(TypeError):
            receiver.send_metadata([object()])
        assert receiver.send_metadata([1, 2]) == KVPoll.Transferring


def test_layout_and_transport_arguments_are_bootstrap_errors_that_say_what_to_do() -> None:
    with pytest.raises(BootstrapError) as caught:
        DecodeLayout(tp_rank=2, tp_size=2)
    assert isinstance(caught.value, ValueError)
    assert "tp_rank must be in [0, 2), not 2" in str(caught.value)
    assert "give this decode process's own tp rank" in str(caught.value)

    with pytest.raises(BootstrapError) as caught:
        ZmqTransport(send_timeout_ms=0)
    assert isinstance(caught.value, ValueError)
    assert "send_timeout_ms must be a positive int" in str(caught.value)


def test_prometheus_collector_without_the_extra_says_which_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without prometheus_client: a MissingExtra (a BootstrapError and an ImportError) naming
    the pip command, not a bare ModuleNotFoundError from inside collect()."""
    import importlib.util

    from statemachine.decode.metrics import PrometheusCollector

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object, **kwargs: object) -> object:
        if name.split(".")[0] == "prometheus_client":
            return None
        return real_find_spec(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with DecodeManager(health_probes=False) as manager:
        collector = PrometheusCollector(manager)
        for call in (lambda: list(collector.collect()), collector.register):
            with pytest.raises(MissingExtra) as caught:
                call()
            assert isinstance(caught.value, ImportError)
            assert "pip install 'pd-bootstrap-statemachine[metrics]'" in str(caught.value)
