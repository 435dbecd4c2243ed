"""docs/integration.md's "In front of an SGLang 0.5.23 prefill", run as written against SGLang.

The section's code block is extracted and executed against SGLang 0.5.23's own bootstrap server
with two of its prefill ranks (tp 2, ``CommonKVManager`` in prefill mode, registered by SGLang's
``register_to_bootstrap``). Those ranks start no thread, so the test reads their PULL sockets
itself and parses every frame with SGLang's own Mooncake parsers (spec/sglang-wire.md). The
decode's Mooncake engine is real (loopback TCP, numpy buffers), so the example's
``MooncakeBackend.from_engine`` reads its buffers back through its session as it would in a
deployment; no bytes move (those ranks transfer nothing: ``test_real_bytes.py`` moves them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from statemachine.completion import KVPoll
from statemachine.errors import TransferFailed
from tests.real_prefill.engines import engine_unavailable
from tests.support.sglang_support import import_sglang, requires_sglang, sglang_bootstrap_server
from tests.support.sglang_support import sglang_prefill_rank as prefill_rank
from tests.support.sglang_wire_support import mooncake_module

pytestmark = requires_sglang

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"
HEADING = "## In front of an SGLang 0.5.23 prefill"


def example() -> dict[str, Any]:
    text = DOC.read_text(encoding="utf-8")
    assert HEADING in text, "docs/integration.md lost its SGLang section"
    block = re.search(r"```python\n(.*?)```", text.split(HEADING, 1)[1], re.S)
    assert block is not None, "the SGLang section lost its code block"
    namespace: dict[str, Any] = {"__name__": "integration_sglang_example"}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)
    return namespace


@pytest.fixture
def prefill() -> Iterator[tuple[str, list[Any]]]:
    """SGLang's bootstrap server and its two tp ranks; yields the address and the managers."""
    with ExitStack() as stack:
        addr = stack.enter_context(sglang_bootstrap_server())
        ranks = [stack.enter_context(prefill_rank(addr, tp_size=2, tp_rank=r)) for r in (0, 1)]
        yield addr, ranks


def received(rank: Any) -> list[bytes]:
    sock = rank.server_socket
    assert sock.poll(5000, zmq.POLLIN), "the prefill rank received nothing within 5 s"
    frames: list[bytes] = sock.recv_multipart()
    return frames


@requires_sglang
def test_sglang_example_against_sglangs_server_parsers_and_status_sender(
    prefill: tuple[str, list[Any]],
) -> None:
    addr, ranks = prefill
    reason = engine_unavailable("mooncake")
    if reason is not None:
        pytest.skip(reason)
    from tests.real_prefill import engines

    conn, mooncake = import_sglang(), mooncake_module()
    code = example()
    engine, session = engines.mooncake_engine()
    kv = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(2)]
    aux = np.zeros(4096, dtype=np.uint8)
    engines.register("mooncake", engine, [aux])
    manager = code["make_sglang_manager"](engine, "127.0.0.1", kv, aux)
    try:
        acks = manager.acks
        assert acks is not None
        receiver = code["start_request"](manager, addr, 77, [5, 6, 7])
        assert receiver.failure is None
        assert manager.plan_for(addr).tp_ranks == (0, 1)  # decode tp 1 pulls from both ranks
        for rank in ranks:
            registration = mooncake.KVArgsRegisterInfo.from_zmq(received(rank))
            assert (registration.endpoint, registration.dst_port) == (acks.ip, acks.port)
            assert registration.mooncake_session_id == session
            assert registration.dst_kv_ptrs == [b.ctypes.data for b in kv]
            assert registration.dst_kv_item_lens == [4096, 4096]
            info = mooncake.TransferInfo.from_zmq(received(rank))
            assert (info.room, info.endpoint, info.dst_port) == (77, acks.ip, acks.port)
            assert info.mooncake_session_id == session
            assert list(info.dst_kv_indices) == [5, 6, 7]
            assert (info.dst_aux_index, info.is_dummy, info.required_dst_info_num) == (0, False, 1)
        # SGLang's own status sender on each rank: the room completes once both reported.
        for rank in ranks:
            assert receiver.poll() != KVPoll.Success
            rank.send_kv_status_message(
                targets=[(acks.ip, acks.port)], bootstrap_room=77, status=KVPoll.Success
            )
        assert code["finish_request"](receiver) is None
        assert receiver.poll() == KVPoll.Success
        # A second request: one rank reports a failed transfer. Mooncake's status carries no
        # reason (NIXL's does), so the failure says what SGLang's decode says then.
        failing = code["start_request"](manager, addr, 78, [8])
        for rank in ranks:
            received(rank)  # its metadata (the generation is cached: no registration)
        ranks[1].send_kv_status_message(
            targets=[(acks.ip, acks.port)],
            bootstrap_room=78,
            status=KVPoll.Failed,
            failure_reason="RDMA write failed on rank 1",
        )
        failure = code["finish_request"](failing)
        assert isinstance(failure, TransferFailed)
        assert conn.CommonKVManager.DEFAULT_PREFILL_FAILURE_REASON in str(failure)
        # The failure is told to every rank, in SGLang's ABORT layout, with a generation
        # (0.5.23 holds the KV until the ranks acknowledge it).
        for rank in ranks:
            notice = conn.AbortNotification.from_zmq(received(rank))
            assert (notice.room, notice.decode_ip, notice.decode_port) == (78, acks.ip, acks.port)
            assert notice.generation is not None
        assert manager.stats().in_flight == 0
    finally:
        manager.close()
