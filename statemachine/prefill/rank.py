"""A reference prefill rank as a real process, for tests, the demo and the benchmarks.

``python -m statemachine.prefill.rank --bootstrap 127.0.0.1:PORT --token T --tp-rank 0
--tp-size 2 [--pp-rank 0 --pp-size 1 --dp-rank 0 --dp-size 1 --cp-rank 0 --cp-size 1]
[--ack-delay-ms 0] [--liveness-timeout-s 3] [--port N]``

Like an SGLang prefill rank it binds one ``PULL`` socket on an ephemeral port of 127.0.0.1 (its
``rank_port``: a restart gets a new one; ``--port`` binds a given one instead, as a new process
that happens to get a dead rank's port number does), registers it with the bootstrap server by
``PUT /route`` (:func:`statemachine.prefill.registration.register_rank`, SGLang's retry
policy), keeps the instance id of the server's reply as its own, then prints ``READY <port>``
and serves the
:class:`~statemachine.wire.reference.SimpleBackend` messages (ZMQ-13):

* *register*: remember the decode session (by session id; bounded, oldest forgotten first);
* *metadata*: after ``--ack-delay-ms``, PUSH ``[b"ack", room, tp_rank, pp_rank]`` to the ack
  endpoint named in the metadata. Metadata from a session that never registered its KV args
  here is counted and not acked, as a real backend could not transfer without those args;
  so is metadata addressed to another pp rank. Metadata flagged *dummy* is counted and not
  acked: a dummy decode peer only tells the rank it exists; the KV goes to the non-dummy one;
* *abort*: the decode gave up on the room: the acks of *that session* still waiting in the heap
  are dropped, never another session's (an abort from a session that never registered here
  changes nothing: ``unregistered``; one for a room only other sessions have pending is counted
  in ``foreign_aborts``, ACK-8); an abort that carries a sequence number is answered
  with ``[b"abort_ack", room, tp_rank, pp_rank, abort_seq]`` to the endpoint the session registered
  (ZMQ-22);
* *bootstrap*: PUSH ``[b"ready", room, tp_rank, pp_rank]`` (WaitingForInput) at once to the
  endpoint named in it, as an SGLang prefill does under the ``prefill_complete`` policy once the
  prefill finished.

The decode ip in register, metadata and bootstrap messages must be an IP literal (HTTP-25):
connecting to a host name would make libzmq resolve it on the context's only I/O thread, where a
silent resolver delays every decode's acks. A message naming a host name is refused before any
socket exists, counted in ``refused_ip`` and logged (one stderr line per 10 s at most, ACK-7).

A message whose target instance frame names another instance than this rank's is dropped and
counted in ``stale_instance``, before anything else is looked at (ZMQ-21): in queueing mode
libzmq delivers frames queued for a dead rank's port to a new process on that port, which would
otherwise register the old decode session from the queued register frame and ack a transfer it
never did. A message without the frame (a decode that names no instance), or any message while
the rank knows no instance id of its own (the server sent none), is served as before.

Delayed acks wait in a heap, so a slow prefill still receives and counts messages on time.
Acks leave through :class:`~statemachine.prefill.status_sender.AckSender`: one queue and one
non-blocking ``PUSH`` socket per decode peer, flushed when the poller says the socket is
writable, so a dead decode never delays the acks of a live one (ACK-1; before, each ack to a
dead decode blocked the rank for ``SNDTIMEO`` and ten of them held a live decode's ack back
10 s). An ack not sent within ``--ack-send-timeout-ms`` (or pushed out of a full queue) is
dropped and counted in ``ack_failures``. A status connection silent past
``--liveness-timeout-s`` is dropped and redialled (ZMTP heartbeats, a bounded TCP
retransmission: ZMQ-27), so statuses sent while the path to a decode was cut never hold back
the statuses after it returns.
SIGTERM/SIGINT end it cleanly: sockets closed with LINGER=0, one ``STATS {json}`` line with
the message counters on stdout, exit 0. ``--trace PATH`` writes one ``Ack`` event per ack
(room, this rank's instance, the message's target instance) for trace validation
(:mod:`statemachine.model.validate` joins them with the decode's ``Complete`` steps).

:class:`~statemachine.prefill.rank_process.PrefillRankProcess` runs it as a subprocess and
can SIGKILL (a crash), terminate and restart it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import signal
import socket
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import zmq

from statemachine import cli_help, trace
from statemachine.discovery.layout import DEFAULT_PREFIX
from statemachine.discovery.registrar import DEFAULT_TTL, EtcdRegistrar, registrar_for
from statemachine.errors import (
    BootstrapError,
    MalformedFrames,
    NotReady,
    TransportFailure,
)
from statemachine.prefill.registration import register_rank
from statemachine.prefill.status_sender import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    AckSender,
    StatusSocketOptions,
)
from statemachine.validation import rank_ip_problem
from statemachine.wire.endpoint import Endpoint
from statemachine.wire.http import route_payload
from statemachine.wire.reference import (
    ABORT_KIND,
    BOOTSTRAP_KIND,
    METADATA_KIND,
    REGISTER_KIND,
    abort_ack_frames,
    ack_frames,
    message_kind,
    parse_abort,
    parse_bootstrap,
    parse_metadata,
    parse_register,
    ready_frames,
)

MAX_SESSIONS = 1024
COUNTERS = (
    "register",
    "metadata",
    "acks_sent",
    "ack_failures",
    "malformed",
    "unregistered",
    "misaddressed",
    "stale_instance",
    "bootstrap",
    "aborts",
    "refused_ip",
    "foreign_aborts",
)
#: Seconds between two stderr lines about refused messages (each says how many it stands for).
LOG_INTERVAL = 10.0


def build_payload(args: argparse.Namespace, port: int) -> dict[str, Any]:
    """The ``PUT /route`` body (reference §1) for this rank."""
    return route_payload(
        rank_ip=args.host,
        rank_port=port,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        cp_rank=args.cp_rank,
        cp_size=args.cp_size,
        dp_rank=args.dp_rank,
        dp_size=args.dp_size,
        pp_rank=args.pp_rank,
        pp_size=args.pp_size,
        page_size=args.page_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )


class _Rank:
    """The serving loop's state. One thread: sockets are never shared."""

    def __init__(
        self,
        args: argparse.Namespace,
        context: zmq.Context[zmq.Socket[bytes]],
        instance_id: str | None = None,
    ) -> None:
        self.args = args
        #: the instance this rank belongs to (the bootstrap server's instance id, set from its
        #: reply to PUT /route; an etcd registrar's instance id with etcd discovery). Messages
        #: addressed to another instance are dropped (ZMQ-21); None: serve every message.
        self.instance_id = instance_id
        self.pull = context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        if args.port:
            self.pull.bind(f"tcp://{args.host}:{args.port}")
            self.port = args.port
        else:
            self.port = self.pull.bind_to_random_port(f"tcp://{args.host}")
        if self.port == args.avoid_port and not args.port:
            # A restart must get a new port even if the random pick repeats the old one.
            old = self.port
            self.port = self.pull.bind_to_random_port(f"tcp://{args.host}")
            self.pull.unbind(f"tcp://{args.host}:{old}")
        self.sessions: dict[str, Endpoint] = {}
        #: (due time, sequence, ack endpoint, ack frames, room, session id)
        self.due: list[tuple[float, int, Endpoint, list[bytes], int, str]] = []  # heap
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self.seq = 0
        self.counts = dict.fromkeys(COUNTERS, 0)
        options = (
            None
            if args.liveness_timeout_s == 0
            else StatusSocketOptions.from_bound(args.liveness_timeout_s)
        )
        self.acks = AckSender(context, self.counts, args.ack_send_timeout_ms, options)

    def on_message(self, frames: list[bytes]) -> None:
        kind = message_kind(frames)
        try:
            if kind == REGISTER_KIND:
                register = parse_register(frames)
                if self.stale(register.instance_id):
                    return
                if register.target_pp_rank != self.args.pp_rank:
                    self.counts["misaddressed"] += 1
                    return
                if self.refused(register.decode_ip, "register", register.session_id):
                    return
                self.counts["register"] += 1
                self.sessions.pop(register.session_id, None)  # re-registration: now newest
                self.sessions[register.session_id] = (register.decode_ip, register.decode_port)
                if len(self.sessions) > MAX_SESSIONS:
                    del self.sessions[next(iter(self.sessions))]
            elif kind == METADATA_KIND:
                metadata = parse_metadata(frames)
                if self.stale(metadata.instance_id):
                    return
                if metadata.target_pp_rank != self.args.pp_rank:
                    self.counts["misaddressed"] += 1
                    return
                self.counts["metadata"] += 1
                if self.refused(metadata.decode_ip, "metadata", metadata.session_id):
                    return
                if metadata.session_id not in self.sessions:
                    self.counts["unregistered"] += 1
                    return
                if metadata.is_dummy:
                    return  # a dummy peer gets no transfer, so no ack
                ack = ack_frames(metadata.room, self.args.tp_rank, self.args.pp_rank)
                if trace.ENABLED:  # the model's Ack(r): this process finished r's transfer
                    trace.emit(
                        "Ack",
                        room=metadata.room,
                        instance=self.instance_id,
                        target=metadata.instance_id,
                        tp_rank=self.args.tp_rank,
                        pp_rank=self.args.pp_rank,
                    )
                endpoint = (metadata.decode_ip, metadata.decode_port)
                if self.args.ack_delay_ms <= 0:
                    self.send_ack(endpoint, ack)
                else:
                    self.seq += 1
                    due = time.monotonic() + self.args.ack_delay_ms / 1000.0
                    heapq.heappush(
                        self.due, (due, self.seq, endpoint, ack, metadata.room, metadata.session_id)
                    )
            elif kind == ABORT_KIND:
                abort = parse_abort(frames)
                if self.stale(abort.instance_id):
                    return
                self.counts["aborts"] += 1
                room = abort.room
                registered = self.sessions.get(abort.session_id)
                if registered is None:
                    # A session that never registered here has nothing here to abort; above
                    # all, it must not drop another session's pending ack (ACK-8).
                    self.counts["unregistered"] += 1
                    return
                self.drop_pending(room, abort.session_id)
                if abort.abort_seq is not None:
                    # Nothing of the room is in flight any more for this session (its pending
                    # ack is gone), so the acknowledgement goes at once, to the session's
                    # endpoint (ZMQ-22).
                    self.send_ack(
                        registered,
                        abort_ack_frames(
                            room, self.args.tp_rank, self.args.pp_rank, abort.abort_seq
                        ),
                    )
            elif kind == BOOTSTRAP_KIND:
                bootstrap = parse_bootstrap(frames)
                if self.stale(bootstrap.instance_id):
                    return
                if bootstrap.target_pp_rank != self.args.pp_rank:
                    self.counts["misaddressed"] += 1
                    return
                if self.refused(bootstrap.decode_ip, "bootstrap", bootstrap.session_id):
                    return
                self.counts["bootstrap"] += 1
                # The reference rank has no prefill to run: it is ready for the decode's
                # metadata at once (SGLang's WaitingForInput status under prefill_complete).
                self.send_ack(
                    (bootstrap.decode_ip, bootstrap.decode_port),
                    ready_frames(bootstrap.room, self.args.tp_rank, self.args.pp_rank),
                )
            else:
                self.counts["malformed"] += 1
        except MalformedFrames:
            self.counts["malformed"] += 1

    def drop_pending(self, room: int, session_id: str) -> None:
        """Drop ``session_id``'s acks for ``room`` still waiting in the heap; another
        session's are kept and the abort is counted as foreign (ACK-8)."""
        kept = [item for item in self.due if item[4] != room or item[5] != session_id]
        if len(kept) != len(self.due):
            self.due = kept
            heapq.heapify(self.due)
        elif any(item[4] == room for item in kept):
            self.counts["foreign_aborts"] += 1
            self.log_refusal(
                "foreign_abort",
                f"abort of room {room} from session {session_id!r}, which did not send its "
                "metadata here: ignored (only the session that sent the metadata can abort it)",
            )

    def refused(self, decode_ip: str, kind: str, session_id: str) -> bool:
        """True (counted, logged) if ``decode_ip`` is not an IP literal (HTTP-25, ACK-7)."""
        problem = rank_ip_problem(decode_ip)
        if problem is None:
            return False
        self.counts["refused_ip"] += 1
        self.log_refusal(
            "refused_ip",
            f"refused {kind} from session {session_id!r}: decode ip {decode_ip[:64]!r} {problem}"
            " (this rank never resolves names: configure the decode's ack ip as an address)",
        )
        return True

    def log_refusal(self, topic: str, message: str) -> None:
        """One stderr line per LOG_INTERVAL per topic, saying how many it stands for."""
        now = time.monotonic()
        last = self._logged_at.get(topic)
        if last is not None and now - last < LOG_INTERVAL:
            self._unlogged[topic] = self._unlogged.get(topic, 0) + 1
            return
        self._logged_at[topic] = now
        more = self._unlogged.pop(topic, 0)
        suffix = f" ({more} more since the last such line)" if more else ""
        print(f"prefill_rank: {message}{suffix}", file=sys.stderr, flush=True)

    def stale(self, target: str | None) -> bool:
        """True (and counted) if a message names an instance other than this rank's."""
        if target is None or self.instance_id is None or target == self.instance_id:
            return False
        self.counts["stale_instance"] += 1
        return True

    def send_ack(self, endpoint: Endpoint, frames: list[bytes]) -> None:
        self.acks.send(endpoint, frames)  # counts acks_sent / ack_failures itself

    def send_due_acks(self) -> int | None:
        """Send the acks whose time has come; return ms until the next one (None: none)."""
        while self.due:
            due, _, endpoint, frames, _, _ = self.due[0]
            wait = due - time.monotonic()
            if wait > 0:
                return max(1, int(wait * 1000.0 + 0.999))
            heapq.heappop(self.due)
            self.send_ack(endpoint, frames)
        return None

    def close(self) -> None:
        self.acks.close()
        self.pull.close(linger=0)


def serve(args: argparse.Namespace) -> int:
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    # The signal handler only sets a flag; the wake-up fd makes the poll below return at once.
    wake_rx, wake_tx = socket.socketpair()
    wake_rx.setblocking(False)
    wake_tx.setblocking(False)
    signal.set_wakeup_fd(wake_tx.fileno())
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        rank = _Rank(args, context)
    except zmq.ZMQError as exc:  # --port already taken, or --host not an address of ours
        print(f"prefill_rank: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        context.destroy(linger=0)
        signal.set_wakeup_fd(-1)
        wake_rx.close()
        wake_tx.close()
        return 1
    registrar: EtcdRegistrar | None = None
    try:
        try:
            # Messages wait in the PULL socket until the loop below: none is judged before the
            # rank knows its instance.
            if args.discovery == "etcd":
                # Under a lease kept alive on the registrar's thread (docs/etcd.md).
                registrar = registrar_for(
                    args.etcd_endpoints,
                    args.bootstrap,
                    prefix=args.etcd_prefix,
                    ttl=args.etcd_ttl,
                    instance_id=args.instance_id,
                )
                registrar.register(build_payload(args, rank.port))
                # Decodes address frames to the instance they found in etcd (ZMQ-21).
                rank.instance_id = registrar.instance_id
            else:
                rank.instance_id = register_saying_why(args, build_payload(args, rank.port))
        except BootstrapError as exc:
            print(f"prefill_rank: registration failed: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"READY {rank.port}", flush=True)
        timeout: int | None = None
        while not stop:
            # A fresh poller each round: the ack sockets polled for POLLOUT are those with
            # queued acks, which changes as acks go out or expire (a handful at most).
            poller = zmq.Poller()
            poller.register(rank.pull, zmq.POLLIN)
            poller.register(wake_rx.fileno(), zmq.POLLIN)
            for sock in rank.acks.waiting():
                poller.register(sock, zmq.POLLOUT)
            events = dict(poller.poll(timeout))
            if rank.pull in events:
                # Drain without a poll per message.
                while True:
                    try:
                        frames = rank.pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    rank.on_message(frames)
            rank.acks.flush({s for s, ev in events.items() if ev & zmq.POLLOUT})
            timeout = _soonest_ms(rank.send_due_acks(), rank.acks.expire())
        print("STATS " + json.dumps(rank.counts, sort_keys=True), flush=True)
        return 0
    finally:
        if registrar is not None:
            registrar.close()  # graceful: revoke the lease (a SIGKILL lets it expire)
        rank.close()
        context.term()
        signal.set_wakeup_fd(-1)
        wake_rx.close()
        wake_tx.close()


def _soonest_ms(due_ms: int | None, expiry_s: float | None) -> int | None:
    """The poll timeout: until the next delayed ack or the next ack expiry (None: neither)."""
    expiry_ms = None if expiry_s is None else max(1, int(expiry_s * 1000.0 + 0.999))
    if due_ms is None:
        return expiry_ms
    return due_ms if expiry_ms is None else min(due_ms, expiry_ms)


def register_saying_why(args: argparse.Namespace, payload: dict[str, Any]) -> str | None:
    """``register_rank`` with the rank's retries, but the first failed try is reported at once:
    a bootstrap server that is not running would otherwise cost seconds of silence."""
    try:
        return register_rank(args.bootstrap, args.token, payload, attempts=1)
    except (TransportFailure, NotReady) as exc:
        if args.register_attempts <= 1:
            raise
        print(
            f"prefill_rank: registration with {args.bootstrap} failed ({exc}); is the bootstrap "
            f"server running there ('pd-bootstrap serve --port {args.bootstrap.rsplit(':', 1)[-1]}"
            f"')? Retrying {args.register_attempts - 1} more time(s).",
            file=sys.stderr,
            flush=True,
        )
    time.sleep(args.register_backoff_scale * random.uniform(0.5, 1.0))
    return register_rank(
        args.bootstrap,
        args.token,
        payload,
        attempts=args.register_attempts - 1,
        backoff_scale=args.register_backoff_scale,
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = cli_help.parser(
        "python -m statemachine.prefill.rank",
        "Run one reference prefill rank: bind a ZMQ PULL socket, register it, acknowledge\n"
        "every transfer request it receives.\n\n"
        "It registers with the bootstrap server at --bootstrap (start one with\n"
        "'pd-bootstrap serve'), or in etcd with --discovery etcd, then prints 'READY <port>'.\n"
        "Page size, KV dtype and the parallel sizes must match what the decode expects: a\n"
        "bootstrap server keeps the first complete topology it saw until it restarts.",
    )
    parser.add_argument(
        "--bootstrap",
        required=True,
        help="bootstrap server host:port (with --discovery etcd: the prefill's name in etcd)",
    )
    parser.add_argument(
        "--token", help="bearer token for PUT /route (required with --discovery http)"
    )
    parser.add_argument(
        "--discovery",
        choices=("http", "etcd"),
        default="http",
        help="register with the bootstrap server (http) or in etcd under a lease",
    )
    parser.add_argument(
        "--etcd-endpoints",
        default="http://127.0.0.1:2379",
        help="comma-separated etcd client URLs (--discovery etcd)",
    )
    parser.add_argument("--etcd-prefix", default=DEFAULT_PREFIX, help="etcd key prefix")
    parser.add_argument("--etcd-ttl", type=int, default=DEFAULT_TTL, help="lease TTL (s)")
    parser.add_argument(
        "--instance-id",
        default=None,
        help="the prefill instance's id, shared by every rank of the instance (etcd; default: "
        "a new random id per process)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="ip to bind and register")
    for name in ("tp", "pp", "dp", "cp"):
        parser.add_argument(f"--{name}-rank", type=int, default=0, help=f"this rank's {name} rank")
        parser.add_argument(
            f"--{name}-size", type=int, default=1, help=f"the prefill's {name} size"
        )
    parser.add_argument("--page-size", type=int, default=1, help="KV cache page size (tokens)")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="KV cache dtype, as SGLang names it"
    )
    parser.add_argument(
        "--ack-delay-ms", type=int, default=0, help="wait this long before each completion ack"
    )
    parser.add_argument(
        "--ack-send-timeout-ms", type=int, default=1000, help="give up sending an ack after this"
    )
    parser.add_argument(
        "--liveness-timeout-s",
        type=float,
        default=DEFAULT_LIVENESS_TIMEOUT_S,
        help="the bound on silence of the status connections to decodes: a connection that "
        "answers nothing this long is dropped and redialled (the decode's liveness_timeout_s; "
        "0: libzmq's defaults, no heartbeats)",
    )
    parser.add_argument(
        "--register-attempts", type=int, default=5, help="registration tries before giving up"
    )
    parser.add_argument(
        "--register-backoff-scale",
        type=float,
        default=1.0,
        help="scales the back-off between tries (1, 2, 4 ... s, jittered)",
    )
    parser.add_argument(
        "--avoid-port",
        type=int,
        default=0,
        help="never bind this port (a restart passes its old one)",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="write an NDJSON trace of the acks (one Ack event each) to this file",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="bind exactly this port (0: an ephemeral one)",
    )
    args = parser.parse_args(list(argv))
    for name in ("tp", "pp", "dp", "cp"):
        size, rank = getattr(args, f"{name}_size"), getattr(args, f"{name}_rank")
        if size < 1 or not 0 <= rank < size:
            parser.error(f"--{name}-rank {rank} must be in [0, --{name}-size {size})")
    if args.discovery == "http" and not args.token:
        parser.error("--token is required with --discovery http")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} must be in [0, 65535] (0: an ephemeral port)")
    if not (args.liveness_timeout_s == 0 or args.liveness_timeout_s >= 0.5):
        parser.error(
            f"--liveness-timeout-s {args.liveness_timeout_s} must be 0 (libzmq's defaults) or "
            "at least 0.5 s, the decode's smallest bound"
        )
    if args.ack_delay_ms < 0 or args.ack_send_timeout_ms < 1:
        parser.error("--ack-delay-ms must be >= 0 and --ack-send-timeout-ms >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.trace is None:
        return serve(args)
    # Trace validation joins these Ack events with the decode's Complete steps (NoStaleSuccess).
    with trace.tracing(args.trace):
        return serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
