"""SGLang 0.5.23's own bootstrap server and one prefill rank in one process, for the namespace
tests (``tests/sglang/test_liveness_sglang.py``): ``python tests/support/sglang_netns_prefill.py
HOST
[--transfer-ms N]`` run inside a namespace serves both on ``HOST``, prints ``listening on
HOST:PORT RANK_PORT`` once the rank registered, and serves until killed. One process, so one
SIGSTOP stops the whole prefill.

With ``--transfer-ms N`` it also answers transfers, as a stand-in for SGLang's transfer engine
(which cannot move KV into this namespace's decode without its RDMA/TCP engine set up here): a
thread reads the reference decode's metadata from the rank's own ``PULL`` socket (which nothing
of SGLang's reads in a ``CommonKVManager``) and, N ms later, pushes the reference ack
``[b"ack", room, 0, 0]`` through SGLang's own status path, ``CommonKVManager.
_send_multipart_locked`` (``common/conn.py``: the cached ``PUSH`` per decode endpoint with
SGLang's options and its disconnect monitor). The statuses' frames are the reference wire's;
the socket that carries them, and so its behaviour across a cut, is SGLang's."""

from __future__ import annotations

import heapq
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.support

from statemachine.errors import MalformedFrames
from statemachine.wire.reference import METADATA_KIND, ack_frames, message_kind, parse_metadata
from tests.support.sglang_support import (
    _wait_listening,
    free_port,
    import_sglang,
    sglang_prefill_rank,
)


def answer_transfers(rank: Any, transfer_s: float) -> None:
    """Forever: each metadata's ack, ``transfer_s`` after it, through SGLang's status path."""
    pull: zmq.Socket[bytes] = rank.server_socket
    due: list[tuple[float, int, str]] = []
    while True:
        timeout = None if not due else max(0, int((due[0][0] - time.monotonic()) * 1000) + 1)
        if pull.poll(timeout):
            frames = pull.recv_multipart()
            try:
                if message_kind(frames) == METADATA_KIND:
                    metadata = parse_metadata(frames)
                    if not metadata.is_dummy:
                        endpoint = f"tcp://{metadata.decode_ip}:{metadata.decode_port}"
                        heapq.heappush(
                            due, (time.monotonic() + transfer_s, metadata.room, endpoint)
                        )
            except MalformedFrames:
                pass
        while due and due[0][0] <= time.monotonic():
            _, room, endpoint = heapq.heappop(due)
            try:
                rank._send_multipart_locked(endpoint, ack_frames(room, 0, 0))
            except zmq.ZMQError as exc:  # SGLang logs and drops a failed status send too
                print(f"status of room {room} to {endpoint} failed: {exc}", file=sys.stderr)


def main() -> None:
    host = sys.argv[1]
    transfer_ms = int(sys.argv[3]) if sys.argv[2:3] == ["--transfer-ms"] else None
    conn = import_sglang()
    os.environ["SGLANG_HOST_IP"] = host  # the rank binds here (read at its bind)
    port = free_port()
    server = conn.CommonKVBootstrapServer(host, port)
    try:
        _wait_listening(host, port, timeout=20.0)
        with sglang_prefill_rank(f"{host}:{port}", tp_size=1, tp_rank=0) as rank:
            if transfer_ms is not None:
                threading.Thread(
                    target=answer_transfers, args=(rank, transfer_ms / 1000), daemon=True
                ).start()
            print(f"listening on {host}:{port} {rank.rank_port}", flush=True)
            threading.Event().wait()
    finally:
        server.close()


if __name__ == "__main__":
    main()
