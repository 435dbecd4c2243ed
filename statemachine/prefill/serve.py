"""``pd-bootstrap serve``: the reference bootstrap server (:mod:`statemachine.prefill.server`) as
a process, until Ctrl-C or SIGTERM.

Prints one parseable line once it listens (``listening on HOST:PORT instance ID``), so a parent
that passed ``--port 0`` learns the port; the demo's cluster starts its prefill this way.
"""

from __future__ import annotations

import signal
import sys
import threading
import warnings
from types import FrameType

from statemachine import cli_help
from statemachine.prefill.registry import DEFAULT_DP_TTL
from statemachine.prefill.server import BootstrapServer
from statemachine.progname import prog


def main(argv: list[str] | None = None) -> int:
    """``pd-bootstrap serve``: serve until SIGINT/SIGTERM, then exit 0."""
    parser = cli_help.parser(
        prog("serve"),
        "Run the reference prefill bootstrap server (SGLang's routes) until Ctrl-C or SIGTERM.\n\n"
        "Prefill ranks register with PUT /route (python -m statemachine.prefill.rank starts\n"
        "one); decodes ask GET /route. Prints 'listening on HOST:PORT instance ID' once it\n"
        "listens, and on stderr its fd limit (raised to the hard limit) and connection cap.\n"
        "State is in memory only: a restart forgets every rank. Needs the server\n"
        "extra (aiohttp).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8998, help="port to listen on; 0 picks one")
    parser.add_argument(
        "--token", default=None, help="bearer token the ranks must send to register"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="with no --token, accept registrations without one (otherwise they get 401)",
    )
    parser.add_argument(
        "--dp-ttl", type=float, default=DEFAULT_DP_TTL, help="seconds a room's dp rank is kept"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.token is None and not args.insecure:
        print(
            "warning: no --token: registration routes answer 401; pass --token TOKEN (and the "
            "same token to every prefill rank), or --insecure on a trusted network",
            file=sys.stderr,
        )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the CLI printed its own warning
            server = BootstrapServer(
                args.host, args.port, token=args.token, insecure=args.insecure, dp_ttl=args.dp_ttl
            )
        server.start()
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        # One parseable line, so a parent process started with --port 0 learns the port.
        print(f"listening on {server.address} instance {server.instance_id}", flush=True)
        # On stderr: the line above is what parents parse.
        print(f"bootstrap server: {server.limits()}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
