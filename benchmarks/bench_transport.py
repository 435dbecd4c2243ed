"""ZMQ transport under peer failure: stalls, detection, resources (issues 8 and 10).

Three transports, measured in the same run against real peer processes on 127.0.0.1:

* ``sglang``: SGLang's options (``QueueingTransport``: no IMMEDIATE, SNDHWM=1000, no monitor);
* ``previous``: immediate mode without the monitor (a failed send closes the socket);
* ``ours``: immediate mode with the socket monitor, circuit breaker and retain/release.

Figures (medians over ``--reps``; ratios against ``sglang``):

0. **One send on a warm socket** (the hot path): what the monitor and circuit breaker cost when
   nothing fails.

1. **Caller stall per request during a one-rank outage**, after the first failure: a
   generation of two ranks, one SIGKILLed, every request refetching the same dead port (the
   bootstrap server still lists it). Each request retains both endpoints, sends to both, and
   on ``SendFailed`` releases them (the caller invalidated the generation).
2. **Kill -> alive=False** (ours only: nothing else reports it): time from SIGKILL-and-reap of a
   connected peer to the listener call.
3. **fds / sockets_open after N restarts vs after 1**: each restart is a new peer process on a
   new port (a new generation) that gets one message and is killed; the generation is then
   released.
4. **A healthy rank's message delay while another endpoint is a host name**: median one-way
   latency of messages to a live in-process peer, with and without a send to a name
   endpoint before each. SGLang's mode is not measured here: it would hand the name to
   libzmq, which would query this machine's resolver off loopback; issue 10 measured 6.71 s.
5. **Connection attempts per second to dead endpoints while idle**: SGLang's mode keeps every
   socket and reconnects every 100 ms; ours closes a dead endpoint nobody retains, and backs a
   retained one off to one attempt a second.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time

import zmq

from benchmarks.zmq_peer import LOOPBACK, PeerProcess, fd_count
from statemachine.decode.ranks.transport import ZmqTransport
from statemachine.demo.baselines import QueueingTransport, UnmonitoredTransport
from statemachine.errors import SendFailed

MODES = ("sglang", "previous", "ours")


def _transport(mode: str, send_timeout_ms: int) -> ZmqTransport:
    kind = {"sglang": QueueingTransport, "previous": UnmonitoredTransport, "ours": ZmqTransport}
    return kind[mode](send_timeout_ms=send_timeout_ms)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- 1. outage stall --------------------------------------------------------------------------


def outage_stalls(mode: str, requests: int, send_timeout_ms: int) -> dict[str, float]:
    """Stall of each request after the first failed one; requests until the first failure."""
    live, doomed = PeerProcess(), PeerProcess()
    try:
        with _transport(mode, send_timeout_ms) as transport:
            endpoints = [(LOOPBACK, live.port), (LOOPBACK, doomed.port)]
            for endpoint in endpoints:
                transport.send(endpoint, [b"warm"])
            doomed.kill()
            silent = 0  # requests "sent" before the first failure (lost, in SGLang's mode)
            stalls: list[float] = []
            dead_sends: list[float] = []  # the dead rank's send alone
            first = float("nan")
            while len(stalls) < requests and silent < 5000:
                transport.retain(endpoints)
                started = dead_started = time.perf_counter()
                try:
                    transport.send(endpoints[0], [b"metadata"])
                    dead_started = time.perf_counter()
                    transport.send(endpoints[1], [b"metadata"])
                    failed = False
                except SendFailed:
                    failed = True
                ended = time.perf_counter()
                transport.release(endpoints)
                if not failed:
                    if first != first:  # still before the first failure
                        silent += 1
                    continue
                if first != first:
                    first = ended - started
                else:
                    stalls.append(ended - started)
                    dead_sends.append(ended - dead_started)
    finally:
        live.kill()
        doomed.kill()
    return {
        "first_s": first,
        "stall_s": _median(stalls),
        "dead_send_s": _median(dead_sends),
        "silent": float(silent),
    }


# --- 0. hot path ----------------------------------------------------------------------------


def warm_send_us(mode: str, messages: int) -> float:
    """Mean thread CPU time (us) of one 9-frame send on a warm socket to a live peer: a sink
    process that drains in libzmq (``zmq_peer --sink``), so the peer never competes with the
    sender for the GIL and its queue never fills."""
    frames = [b"metadata", b"1", b"127.0.0.1", b"5555", b"s", b"0", b"\0" * 64, b"0", b"0"]
    peer = PeerProcess(sink=True)
    try:
        with _transport(mode, 1000) as transport:
            endpoint = (LOOPBACK, peer.port)
            transport.send(endpoint, frames)
            started = time.thread_time()
            for _ in range(messages):
                transport.send(endpoint, frames)
            elapsed = time.thread_time() - started
    finally:
        peer.kill()
    return elapsed / messages * 1e6


# --- 2. detection ---------------------------------------------------------------------------


def detection_s() -> float:
    """SIGKILL-and-reap of a connected peer -> the listener's alive=False (ours)."""
    seen = threading.Event()
    at: list[float] = []

    def listener(endpoint: tuple[str, int], alive: bool, reason: str) -> None:
        if not alive:
            at.append(time.perf_counter())
            seen.set()

    peer = PeerProcess()
    with ZmqTransport() as transport:
        transport.subscribe(listener)
        endpoint = (LOOPBACK, peer.port)
        transport.retain([endpoint])
        transport.send(endpoint, [b"warm"])
        time.sleep(0.05)
        killed = time.perf_counter()
        peer.kill()
        if not seen.wait(10):
            return float("nan")
        transport.release([endpoint])
    return at[0] - killed


# --- 3. restarts ----------------------------------------------------------------------------


def restart_resources(
    mode: str, restarts: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(fds, threads, sockets_open) after restart 1 and after ``restarts``."""
    samples: list[tuple[int, int, int]] = []
    with _transport(mode, 1000) as transport:
        for _ in range(restarts):
            peer = PeerProcess()
            endpoint = (LOOPBACK, peer.port)
            transport.retain([endpoint])
            # The OS may reuse the port of a peer killed within down_hold_ms: that send fails
            # fast once (ZMQ-20); resources are what this figure counts.
            with contextlib.suppress(SendFailed):
                transport.send(endpoint, [b"register"])
            peer.kill()
            # A request right after the kill: queued (sglang) or failed fast (ours).
            with contextlib.suppress(SendFailed):
                transport.send(endpoint, [b"metadata"])
            transport.release([endpoint])
            samples.append(
                (_settled_fds(), threading.active_count(), transport.stats().sockets_open)
            )
    return samples[0], samples[-1]


def _settled_fds(limit_s: float = 1.0) -> int:
    """The fd count once it stopped changing for 50 ms: libzmq's reaper thread frees a
    closed socket's fds a moment after the close."""
    deadline = time.monotonic() + limit_s
    last = fd_count()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = fd_count()
        if now == last:
            return now
        last = now
    return last


# --- 4. names -------------------------------------------------------------------------------


def healthy_delay(messages: int, with_name: bool) -> float:
    """Median one-way latency (s) of messages to a live in-process peer."""
    context = zmq.Context()
    peer = context.socket(zmq.PULL)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port(f"tcp://{LOOPBACK}")
    latencies = []
    try:
        with ZmqTransport() as transport:
            endpoint = (LOOPBACK, port)
            transport.send(endpoint, [b"warm"])
            peer.recv_multipart()
            for i in range(messages):
                if with_name:
                    with contextlib.suppress(SendFailed):
                        transport.send((f"rank-{i}.does-not-resolve.invalid", 5555), [b"x"])
                started = time.perf_counter()
                transport.send(endpoint, [b"m"])
                if not peer.poll(10_000, zmq.POLLIN):
                    return float("inf")
                peer.recv_multipart()
                latencies.append(time.perf_counter() - started)
    finally:
        peer.close(linger=0)
        context.term()
    return _median(latencies)


# --- 5. idle reconnects ---------------------------------------------------------------------


def idle_connects_per_s(
    mode: str, endpoints: int, retained: bool, settle_s: float, window_s: float
) -> float:
    """Connection attempts per second to ``endpoints`` dead ports while nothing is sent.

    Each attempt that finds nobody listening ends in ``EVENT_CLOSED``. Ours counts its own
    monitor's events; SGLang's mode has no monitor, so one is attached to each of its sockets
    for the measurement (the transport never reads it). ``settle_s`` lets back-off reach its
    ceiling first; attempts are then counted over ``window_s``.
    """
    dead = [(LOOPBACK, _free_port()) for _ in range(endpoints)]
    readers: list[zmq.Socket[bytes]] = []
    with _transport(mode, 50) as transport:
        if retained:
            transport.retain(dead)
        for endpoint in dead:
            with contextlib.suppress(SendFailed):
                transport.send(endpoint, [b"lost"])  # queued (SGLang) or failed (ours)
        if mode == "sglang":
            for entry in transport._entries.values():  # instrumentation only
                readers.append(entry.socket.get_monitor_socket(zmq.EVENT_CLOSED))
        time.sleep(settle_s)
        before = transport.stats().monitor_events
        counted = 0
        ends = time.monotonic() + window_s
        while time.monotonic() < ends:
            for reader in readers:
                while reader.poll(0):
                    reader.recv_multipart()
                    counted += 1
            time.sleep(0.01)
        if mode != "sglang":
            counted = transport.stats().monitor_events - before
        for entry in list(transport._entries.values()) if mode == "sglang" else []:
            entry.socket.disable_monitor()
        for reader in readers:
            reader.close(linger=0)
        if retained:
            transport.release(dead)
    return counted / window_s


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
    return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_transport")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--restarts", type=int, default=100)
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--send-timeout-ms", type=int, default=1000)
    parser.add_argument("--window-s", type=float, default=3.0, help="figure 5's count window")
    parser.add_argument("--smoke", action="store_true", help="one short run of each figure")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.reps, args.requests, args.restarts, args.messages = 1, 1, 5, 20
        # Figure 1 waits out SNDTIMEO twice per mode where the send blocks (sglang, previous):
        # 100 ms instead of 1 s; figure 5 counts over 1 s instead of 3 (one retained attempt a
        # second still shows). Together 23 -> 11 s of the smoke run; nothing here is judged.
        args.send_timeout_ms, args.window_s = 100, 1.0

    sends = args.messages * 20
    print(
        f"0. one send on a warm socket (9 frames, live peer): thread CPU time, mean of {sends}, "
        "median of runs"
    )
    warm = {mode: _median([warm_send_us(mode, sends) for _ in range(args.reps)]) for mode in MODES}
    for mode in MODES:
        print(f"  {mode:>8}: {warm[mode]:.2f} us/send ({warm[mode] / warm['sglang']:.2f}x sglang)")

    print(
        f"\n1. caller stall per request, one rank of two SIGKILLed ({args.requests} requests "
        f"after the first failure, SNDTIMEO={args.send_timeout_ms} ms)"
    )
    outage: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for rep in range(args.reps):
        for mode in MODES:
            row = outage_stalls(mode, args.requests, args.send_timeout_ms)
            outage[mode].append(row)
            print(
                f"  rep {rep + 1} {mode:>8}: {row['silent']:.0f} requests lost silently before "
                f"the first failure; first failure {row['first_s'] * 1000:.2f} ms; "
                f"then {row['stall_s'] * 1000:.3f} ms per request "
                f"({row['dead_send_s'] * 1000:.3f} ms in the dead rank's send)",
                flush=True,
            )
    stall = {mode: _median([r["stall_s"] for r in rows]) for mode, rows in outage.items()}
    first = {mode: _median([r["first_s"] for r in rows]) for mode, rows in outage.items()}
    dead = {mode: _median([r["dead_send_s"] for r in rows]) for mode, rows in outage.items()}
    for mode in MODES:
        print(
            f"  median {mode:>8}: first {first[mode] * 1000:9.3f} ms, after it "
            f"{stall[mode] * 1000:9.3f} ms/request ({dead[mode] * 1e6:9.1f} us in the dead "
            f"rank's send), sglang/{mode} = {stall['sglang'] / stall[mode]:.0f}x"
        )
    print(
        f"  goal: ours <= 1 ms per request after the first failure: "
        f"{'met' if stall['ours'] <= 0.001 else 'NOT met'}"
    )

    print("\n2. SIGKILL of a connected peer -> alive=False (ours)")
    detections = [detection_s() for _ in range(max(args.reps, 1 if args.smoke else 5))]
    print(
        f"  median {_median(detections) * 1000:.2f} ms over {len(detections)} "
        f"(all: {', '.join(f'{d * 1000:.1f}' for d in detections)} ms)"
    )
    print(f"  goal: <= 20 ms: {'met' if _median(detections) <= 0.020 else 'NOT met'}")

    print(f"\n3. fds / threads / sockets_open after 1 and after {args.restarts} restarts")
    for mode in ("sglang", "ours"):
        (fd1, th1, so1), (fdn, thn, son) = restart_resources(mode, args.restarts)
        print(
            f"  {mode:>8}: fds {fd1} -> {fdn} ({fdn - fd1:+d}), threads {th1} -> {thn} "
            f"({thn - th1:+d}), sockets_open {so1} -> {son} ({son - so1:+d})",
            flush=True,
        )
        if mode == "ours":
            flat = fdn <= fd1 and thn <= th1 and son <= so1
            print(f"  goal: ours +0 / +0 / +0: {'met' if flat else 'NOT met'}")

    print("\n4. healthy rank's message latency while another endpoint is a host name (ours)")
    base = [healthy_delay(args.messages, with_name=False) for _ in range(args.reps)]
    named = [healthy_delay(args.messages, with_name=True) for _ in range(args.reps)]
    delay = _median(named) - _median(base)
    print(
        f"  without a name {_median(base) * 1e6:.1f} us, with one {_median(named) * 1e6:.1f} us "
        f"per message: delay {delay * 1e3:+.3f} ms"
    )
    print(f"  goal: <= 5 ms over baseline: {'met' if delay <= 0.005 else 'NOT met'}")

    window = args.window_s
    print(
        f"\n5. connection attempts per second to 20 dead endpoints while idle ({window:g} s window)"
    )
    sglang_rate = idle_connects_per_s("sglang", 20, retained=False, settle_s=0.5, window_s=window)
    ours_idle = idle_connects_per_s("ours", 20, retained=False, settle_s=0.5, window_s=window)
    ours_retained = idle_connects_per_s("ours", 20, retained=True, settle_s=2.0, window_s=window)
    print(f"    sglang: {sglang_rate:7.1f}/s (sockets kept, reconnecting every 100 ms)")
    print(
        f"      ours: {ours_idle:7.1f}/s unretained (closed at the verdict), "
        f"{ours_retained:.1f}/s retained (back-off to one attempt per second each)"
    )
    # Goals are reported, not gated: timings on a shared machine are indicative.
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
