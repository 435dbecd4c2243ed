"""docs/integration.md's worked example, run as written through a prefill restart.

The example's code block is extracted from the page and executed, against a real bootstrap
server and two real prefill rank processes (tp 2, page size 16, bfloat16) on 127.0.0.1; the
whole prefill is SIGKILLed and restarted behind the same address mid-run. Afterwards nothing
may be left behind: no request in flight, no ack expected, no endpoint retained, no socket
open, and after close() no thread.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from statemachine.errors import BootstrapError
from statemachine.prefill.rank_process import PrefillRankProcess
from statemachine.prefill.server import BootstrapServer
from tests.support.receiver_support import TOKEN, Prefill, stop_prefill

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"
FORMAT = ["--page-size", "16", "--kv-cache-dtype", "bfloat16"]
RECOVERY_LIMIT_S = 30.0


def example() -> dict[str, Any]:
    block = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert block is not None, "docs/integration.md lost its worked example"
    namespace: dict[str, Any] = {"__name__": "integration_example"}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)
    return namespace


def start(port: int = 0) -> Prefill:
    server = BootstrapServer("127.0.0.1", port, token=TOKEN).start()
    prefill = Prefill(server)
    try:
        for tp_rank in range(2):
            rank = PrefillRankProcess(
                server.address, TOKEN, tp_rank=tp_rank, tp_size=2, extra_args=FORMAT
            )
            prefill.ranks.append(rank)
            rank.start()
    except BaseException:
        stop_prefill(prefill)
        raise
    return prefill


def test_worked_example_survives_a_restart_and_leaves_nothing_behind() -> None:
    code = example()
    threads_before = threading.active_count()
    prefill = start()
    addr = prefill.addr
    port = int(addr.rsplit(":", 1)[1])
    manager = code["make_manager"]()
    run_request = code["run_request"]
    pages_free = code["pages_free"]
    rooms = iter(range(1, 10_000))
    try:
        for _ in range(5):
            assert run_request(manager, addr, next(rooms), [1, 2, 3]) is None
        plan = manager.plan_for(addr)
        assert plan.tp_ranks == (0, 1)  # derived from the tp=2 topology: the whole KV cache
        stop_prefill(prefill)
        prefill = start(port)
        failures: list[BootstrapError] = []
        deadline = time.monotonic() + RECOVERY_LIMIT_S
        failed_rooms = []
        while (failure := run_request(manager, addr, room := next(rooms), [4, 5])) is not None:
            assert isinstance(failure, BootstrapError)
            failures.append(failure)
            failed_rooms.append(room)
            assert time.monotonic() < deadline, failures
        # The failed rooms' pages come free without kv_release_timeout_s (30 s): each was held
        # only while a rank told its pages could still write (MGR-15).
        while not all(pages_free(manager, room) for room in failed_rooms):
            assert time.monotonic() < deadline, manager.kv_holds()
            time.sleep(0.01)
        assert manager.kv_holds().released_by_timeout == 0
        for _ in range(3):
            assert run_request(manager, addr, next(rooms), [6]) is None
        stats = manager.stats()
        assert stats.in_flight == 0 and stats.kv_held == 0
        assert manager.acks is not None and manager.acks.stats().expected == 0
        # Only the new instance's generation is retained; the old ranks' sockets are closed.
        live = {(r.ip, r.port) for g in manager.pool.snapshot().values() for r in g.ranks}
        assert live == {("127.0.0.1", rank.port) for rank in prefill.ranks}
        assert stats.endpoints_retained == len(live)
        assert stats.sockets_open <= len(live)
    finally:
        manager.close()
        stop_prefill(prefill)
    assert manager.stats().sockets_open == 0
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before
