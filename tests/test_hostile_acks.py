"""The decode's ack listener against hostile senders (spec/protocol.md ACK-2, ACK-3).

Real sockets on 127.0.0.1: libzmq PUSH senders (in a child process where their own buffering
would otherwise be measured with the listener's), and raw TCP peers speaking junk.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import pytest
import zmq
from attack_support import rss_after_one_message
from http_support import wait_until
from zmq_support import AckRecorder

from statemachine.completion import PrefillEvent, PrefillStatus
from statemachine.decode.ranks.acks import MAX_FRAME_BYTES, AckListener, ack_frames
from statemachine.validation import InvalidArgument


@pytest.mark.slow
def test_ack2_one_200k_frame_message_does_not_grow_memory() -> None:
    """Before: RSS 19.5 -> 149 MB for one message of 200k frames of 200 bytes (MAXMSGSIZE is
    per frame). A generous correctness bound here; the +1 MB goal is measured in
    benchmarks/bench_hostile.py."""
    result = rss_after_one_message(200_000, "ours")
    assert result["peak"] - result["base"] <= 8.0, result
    assert result["malformed"] >= 1


def send_frames(port: int, messages: list[list[bytes]]) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        for frames in messages:
            sock.send_multipart(frames)
    finally:
        sock.close()
        context.term()


def test_ack2_too_many_frames_cuts_the_sender_and_the_listener_serves_on() -> None:
    """Past MAX_FRAMES (6: SGLang's 5-frame NIXL status fits) the sender is cut at that frame,
    so its next message, on the same connection, is never read."""
    with AckListener() as acks:
        done = AckRecorder()
        acks.expect(7, 1, done)
        send_frames(acks.port, [[b"ack", b"7", b"0", b"0", *[b"extra"] * 3], ack_frames(7, 0, 0)])
        assert wait_until(lambda: acks.stats().malformed == 1)
        time.sleep(0.2)
        assert done.rooms == [] and acks.stats().received == 0
        send_frames(acks.port, [ack_frames(7, 0, 0)])  # a new connection: served
        assert done.wait(5)


def test_ack2_oversized_frame_cuts_the_sender() -> None:
    with AckListener() as acks:
        send_frames(acks.port, [[b"ack", b"1" * (MAX_FRAME_BYTES + 1), b"0", b"0"]])
        assert wait_until(lambda: acks.stats().malformed == 1)
        assert acks.stats().received == 0


def test_ack2_a_five_frame_status_with_a_long_reason_reaches_the_decoder() -> None:
    """The bounds fit SGLang's NIXL status (5 frames, the last a reason of up to 2 KB)."""
    seen: list[list[bytes]] = []
    events: list[PrefillEvent] = []
    got = threading.Event()

    def decoder(frames: Sequence[bytes]) -> PrefillEvent | None:
        seen.append(list(frames))
        return PrefillStatus(int(frames[1]), int(frames[2]), int(frames[3]), frames[4].decode())

    def on_event(event: PrefillEvent) -> bool:
        events.append(event)
        got.set()
        return True

    reason = b"r" * MAX_FRAME_BYTES
    with AckListener(decoder=decoder, on_event=on_event) as acks:
        send_frames(acks.port, [[b"KV_STATUS", b"7", b"0", b"1", reason]])
        assert got.wait(5)
    assert seen == [[b"KV_STATUS", b"7", b"0", b"1", reason]]
    assert events == [PrefillStatus(7, 0, 1, reason.decode())]


def test_ack2_small_malformed_messages_are_dropped_not_cut() -> None:
    """A short non-ack message is counted and dropped; the same connection's next ack counts."""
    with AckListener() as acks:
        done = AckRecorder()
        acks.expect(3, 2, done)
        send_frames(
            acks.port,
            [[b"ack", b"3"], ack_frames(3, 0, 0), [b"hello"], ack_frames(3, 1, 0)],
        )
        assert done.wait(5)
        assert acks.stats().malformed == 2 and acks.stats().received == 2


@pytest.mark.parametrize(
    "junk",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\xff" + bytes(8) + b"\x7f\x03\x00CURVE" + bytes(47),  # another mechanism
        b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(44) + b"\x00\x05READY",  # no command
        b"\xff" * 200,
    ],
)
def test_ack2_raw_junk_is_cut_and_the_listener_serves_on(junk: bytes) -> None:
    with AckListener() as acks:
        with socket.create_connection(("127.0.0.1", acks.port), timeout=5) as raw:
            raw.sendall(junk)
            raw.settimeout(5)
            received = b""
            try:
                while chunk := raw.recv(4096):
                    received += chunk
            except (TimeoutError, ConnectionResetError):
                pytest.fail("the listener did not close a junk connection")
        assert received.startswith(b"\xff")  # it had sent its own greeting
        assert wait_until(lambda: acks.stats().malformed == 1)
        done = AckRecorder()
        acks.expect(9, 1, done)
        send_frames(acks.port, [ack_frames(9, 0, 0)])
        assert done.wait(5)


def test_ack2_many_senders_at_once_all_complete() -> None:
    with AckListener() as acks:
        done = threading.Event()
        rooms: list[int] = []

        def on_done(room: int) -> None:
            rooms.append(room)
            if len(rooms) == 20:
                done.set()

        for room in range(20):
            acks.expect(room, 2, on_done)
        threads = [
            threading.Thread(
                target=send_frames,
                args=(acks.port, [ack_frames(room, tp, 0) for room in range(20)]),
            )
            for tp in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert done.wait(10)
        assert sorted(rooms) == list(range(20))


@pytest.mark.parametrize("ip", ["not-an-ip", "0.0.0.0", "::", "224.0.0.1", "fe80::1%eth0", ""])
def test_ack3_listener_ip_is_validated_at_construction(ip: str) -> None:
    """Before: AckListener(ip='not-an-ip') raised a raw ZMQError from bind."""
    with pytest.raises(InvalidArgument, match=r"ack_ip \(DecodeManager\(ack_ip=\.\.\.\)"):
        AckListener(ip)


def test_ack3_listener_on_ipv6_loopback() -> None:
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with AckListener("::1") as acks:
        done = AckRecorder()
        acks.expect(1, 1, done)
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://[::1]:{acks.port}")
        sock.send_multipart(ack_frames(1, 0, 0))
        sock.close()
        context.term()
        assert done.wait(5)


def test_ack2_idle_connections_cannot_lock_senders_out() -> None:
    """A flood of connections that never speak ZMTP displaces no real sender: at the cap the
    longest-silent one still mid-handshake is cut to admit the newcomer."""
    with AckListener(max_peers=8) as acks:
        idle = [socket.create_connection(("127.0.0.1", acks.port)) for _ in range(20)]
        try:
            done = AckRecorder()
            acks.expect(11, 1, done)
            send_frames(acks.port, [ack_frames(11, 0, 0)])
            assert done.wait(5)
        finally:
            for sock in idle:
                sock.close()


def test_ack2_silent_connection_is_cut_after_the_handshake_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("statemachine.decode.ranks.acks.HANDSHAKE_TIMEOUT", 0.3)
    with (
        AckListener() as acks,
        socket.create_connection(("127.0.0.1", acks.port), timeout=5) as raw,
    ):
        raw.settimeout(5)
        received = b""
        start = time.monotonic()
        while chunk := raw.recv(4096):  # our greeting, then EOF when cut
            received += chunk
        assert received.startswith(b"\xff")
        assert time.monotonic() - start < 3.0
