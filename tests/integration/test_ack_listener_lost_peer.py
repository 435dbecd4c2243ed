"""The ack listener's ZMTP reader when a sender's connection is gone while its bytes are still
being parsed (ACK-6): a PONG that cannot be sent forgets the sender, and the rest of its bytes
must then be dropped, never read into a sender that is no longer there (before: a ``KeyError``
ended the listener's thread, and with it every later status of every prefill). Reachable since
the reference prefill's status sockets send PINGs (ZMQ-27). Driven by hand on a real
``ZMQ_STREAM`` socket and a real TCP sender, so that the disconnect is known to libzmq before
the bytes are parsed, as the listener's thread meets it by chance."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from statemachine.wire import zmtp

MESSAGE = b"\x00\x03ack"  # one frame, last of its message


def ping() -> bytes:
    body = b"\x04PING" + b"\x00\x0a"  # TTL 1 s, no context
    return bytes((0x04, len(body))) + body


@pytest.fixture
def stream() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.STREAM)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, port
    finally:
        sock.close(linger=0)
        context.term()


def receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(5000), "nothing from the STREAM socket within 5 s"
    return sock.recv_multipart()


def test_ack6_a_sender_gone_at_its_pong_is_forgotten_and_its_remaining_bytes_dropped(
    stream: tuple[zmq.Socket[bytes], int],
) -> None:
    sock, port = stream
    taken: list[list[bytes]] = []

    def on_message(frames: list[bytes]) -> int:
        taken.append(frames)
        return zmtp.TAKEN

    reader = zmtp.ZmtpPull(sock, on_message, lambda: None, max_peers=16)
    sender = socket.create_connection(("127.0.0.1", port), timeout=5)
    peer_id, hello = receive(sock)
    assert hello == b""
    reader.on_chunk(peer_id, hello)
    # A PUSH's greeting and READY, then one message: the sender delivered (proven).
    sender.sendall(zmtp._GREETING + zmtp._ready_command(b"PUSH") + MESSAGE)
    received = bytearray()
    while len(taken) < 1:
        chunk_id, data = receive(sock)
        received += data
        reader.on_chunk(chunk_id, data)
    assert reader.connected == 1
    # A PING and a message, then the sender is gone; libzmq learns it before we parse them.
    sender.sendall(ping() + MESSAGE)
    sender.close()
    chunks = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        chunk_id, data = receive(sock)
        chunks.append(data)
        if data == b"":  # the disconnect notification
            break
    assert chunks[-1] == b"" and len(chunks) >= 2
    # libzmq delivers the disconnect notification before it drops the peer's pipe: wait until
    # a send to the peer fails, as the PONG below then must (the peer itself is closed).
    while True:
        try:
            sock.send_multipart([peer_id, b"\x00"], zmq.NOBLOCK)
        except zmq.ZMQError:
            break
        assert time.monotonic() < deadline, "libzmq still routes to the closed sender after 5 s"
        time.sleep(0.01)
    for data in chunks[:-1]:
        reader.on_chunk(peer_id, data)  # the PONG fails: the sender is forgotten, not a KeyError
    assert reader.connected == 0
    assert len(taken) == 1  # nothing of a forgotten sender is delivered
    reader.on_chunk(peer_id, b"")  # its disconnect: nothing left to forget
    assert reader.connected == 0
