"""Real network namespaces for the silence tests and benchmark (issue 27): a prefill cut off
without resets, a prefill stopped, a rank path cut alone.

:class:`NetNamespace` creates a namespace with a veth pair to the host side. Its two addresses
come from a /30 of ``10.213.0.0/16`` that no interface or route of this machine uses, so every
packet the tests send stays on that pair; everything is removed on exit (deleting the namespace
deletes the veth pair), also when the body fails. Faults are nftables rules on the *receiving*
end of the pair (``netdev`` family, ``ingress`` hook): what the host sends is dropped as it
enters the namespace, what the namespace sends as it reaches the host, so a rule that drops a
packet answers nothing and the sender sees silence, never a reset. Never at the sender's own
``egress``: a packet dropped there fails its send locally, and TCP then retries every 0.5 s
without back-off, which a cut somewhere on the network never does (measured: statuses in flight
at a both-ways cut healed 0.4 s after it, against 6.4 s when only the acks were dropped). (This
kernel kind has no ``netem`` qdisc and no ``tc`` drop action; nftables' hooks are built in.)

:class:`NetnsPrefill` runs the reference prefill inside it as processes (``ip netns exec``):
the bootstrap server and two tp ranks, which a test can stop (SIGSTOP) and continue, or kill
and replace behind the same bootstrap address.

Needs root and the ``ip`` and ``nft`` commands (``make`` installs iproute2 and nftables where
they are missing); :func:`netns_unavailable` says why not otherwise, for a skip.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from statemachine.prefill.readiness import read_prefixed_line, read_ready
from tests.support.bootstrap_support import TOKEN

#: The private range the namespaces' /30s come from.
SUBNETS = ipaddress.ip_network("10.213.0.0/16")
#: Every namespace and interface made here starts with this, followed by the creating pid.
PREFIX = "pdlv"
START_TIMEOUT_S = 30.0
_TABLE = "pdlv"
_serial = itertools.count()


@functools.cache
def netns_unavailable() -> str | None:
    """Why namespace tests cannot run here (a skip reason), or None if they can: root, the
    tools, and one namespace with its veth pair and fault table actually made and removed (a
    container without CAP_NET_ADMIN, or a kernel without nftables' netdev family, fails there)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return (
            "network namespaces need root (CI runs as root; run the tests as root to include them)"
        )
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is missing: install {package} (make does, as root)"
    try:
        with NetNamespace():
            pass
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot make a network namespace with a veth pair and nftables rules here: {exc}"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network an address or a route of this machine covers (the default excepted)."""
    used = []
    for line in _run("ip", "-4", "-o", "addr", "show").stdout.splitlines():
        words = line.split()
        if "inet" in words:
            used.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if not words:
            continue
        dest = words[1] if words[0] in ("unicast", "local", "broadcast", "blackhole") else words[0]
        if dest != "default":
            try:
                used.append(ipaddress.ip_network(dest, strict=False))
            except ValueError:
                continue
    return [net for net in used if isinstance(net, ipaddress.IPv4Network)]


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = list(SUBNETS.subnets(new_prefix=30))
    random.shuffle(candidates)
    for net in candidates[:2000]:
        if not any(net.overlaps(other) for other in used):
            return net
    raise RuntimeError(f"no free /30 in {SUBNETS}: every candidate is routed here")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(name: str) -> bool:
    """A namespace's or table's name made by a test process that is gone."""
    if not name.startswith(PREFIX):
        return False
    pid_text = name[len(PREFIX) :].split("x")[0]
    return pid_text.isdigit() and not _pid_alive(int(pid_text))


def remove_stale_namespaces() -> None:
    """Delete namespaces (and the host's fault tables) left by a test process that died without
    cleaning up (SIGKILL)."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _stale(name):
            _run("ip", "netns", "del", name, check=False)
    for line in _run("nft", "list", "tables", "netdev", check=False).stdout.splitlines():
        words = line.split()  # "table netdev NAME"
        if len(words) == 3 and _stale(words[2]):
            _run("nft", "delete", "table", "netdev", words[2], check=False)


class NetNamespace:
    """A namespace joined to the host by a veth pair; faults are nftables rules inside it.

    ``host_ip`` is the host's end (where a decode's ack listener binds), ``ns_ip`` the
    namespace's end (where the prefill listens). Use as a context manager.
    """

    def __init__(self) -> None:
        serial = next(_serial)
        self.name = f"{PREFIX}{os.getpid()}x{serial}"
        # Interface names are at most 15 bytes.
        tag = f"{os.getpid() % 100000}{serial % 100}"
        self.host_if = f"{PREFIX}h{tag}"
        self.ns_if = f"{PREFIX}n{tag}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.host_ip = ""
        self.ns_ip = ""
        self._created = False
        self._host_table = False
        self._blackhole = ""

    def __enter__(self) -> NetNamespace:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        remove_stale_namespaces()
        subnet = _free_subnet()
        host, peer = list(subnet.hosts())
        self.subnet, self.host_ip, self.ns_ip = subnet, str(host), str(peer)
        # While the namespace lives, a blackhole route for its /30 (behind the veth's own
        # route) keeps any packet for these addresses on this machine once the veth is gone.
        _run("ip", "route", "add", "blackhole", str(subnet), "metric", "4000")
        self._blackhole = str(subnet)
        _run("ip", "netns", "add", self.name)
        self._created = True
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _run("ip", "link", "set", self.ns_if, "netns", self.name)
        _run("ip", "addr", "add", f"{host}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        self.exec("ip", "addr", "add", f"{peer}/30", "dev", self.ns_if)
        self.exec("ip", "link", "set", self.ns_if, "up")
        self.exec("ip", "link", "set", "lo", "up")
        self._nft(
            f"table netdev {_TABLE} {{\n"
            f'  chain in {{ type filter hook ingress device "{self.ns_if}" priority 0; }}\n'
            "}\n"
        )
        # What the namespace sends is dropped where it reaches the host (the host's end of the
        # pair, in the host's namespace): a table per namespace, named like it.
        self._host_nft(
            f"table netdev {self.name} {{\n"
            f'  chain in {{ type filter hook ingress device "{self.host_if}" priority 0; }}\n'
            "}\n"
        )
        self._host_table = True

    def close(self) -> None:
        """Delete the namespace (and with it both ends of the veth pair)."""
        if self._created:
            _run("ip", "netns", "del", self.name, check=False)
            self._created = False
        if self._host_table:
            _run("nft", "delete", "table", "netdev", self.name, check=False)
            self._host_table = False
        if _run("ip", "link", "show", self.host_if, check=False).returncode == 0:
            _run("ip", "link", "del", self.host_if, check=False)
        if self._blackhole:
            _run("ip", "route", "del", "blackhole", self._blackhole, "metric", "4000", check=False)
            self._blackhole = ""

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", self.name, *argv)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def _nft(self, script: str) -> None:
        """Run an nft script in the namespace."""
        self._nft_in(self.command(["nft", "-f", "-"]), script)

    def _host_nft(self, script: str) -> None:
        """Run an nft script in the host's namespace (its tables named after this namespace)."""
        self._nft_in(["nft", "-f", "-"], script)

    @staticmethod
    def _nft_in(argv: list[str], script: str) -> None:
        result = subprocess.run(
            argv,
            input=script,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nft failed ({result.returncode}): {result.stderr.strip()}")

    # --- faults -------------------------------------------------------------------------------

    def partition(self, direction: str = "both") -> None:
        """Drop every IP packet: a cut without resets. ``direction``: ``both``; ``to-ns`` (what
        the host sends the namespace: a decode's requests and its TCP acks of the prefill's
        statuses) or ``from-ns`` (what the namespace sends: statuses, replies). ARP still
        passes, as it does between a host and its router when a cut is further on: a neighbour
        entry that failed makes the kernel drop a host's retransmissions before they leave,
        which a routed network's cut never does."""
        if direction not in ("both", "to-ns", "from-ns"):
            raise ValueError(f"direction {direction!r}: both, to-ns or from-ns")
        if direction != "from-ns":
            self._nft(f"add rule netdev {_TABLE} in meta protocol {{ ip, ip6 }} drop\n")
        if direction != "to-ns":
            self._host_nft(f"add rule netdev {self.name} in meta protocol {{ ip, ip6 }} drop\n")

    def cut_ports(self, ports: Sequence[int]) -> None:
        """Drop TCP to and from ``ports`` of the namespace only; everything else still flows."""
        listed = ", ".join(str(port) for port in ports)
        self._nft(f"add rule netdev {_TABLE} in meta l4proto tcp tcp dport {{ {listed} }} drop\n")
        self._host_nft(
            f"add rule netdev {self.name} in meta l4proto tcp tcp sport {{ {listed} }} drop\n"
        )

    def sysctl(self, name: str, value: int) -> None:
        """Set a per-namespace kernel setting (``net.ipv4.tcp_*``) inside the namespace only:
        what an operator would set on the prefill's host."""
        self.exec("sysctl", "-q", "-w", f"{name}={value}")

    def heal(self) -> None:
        """Remove every fault rule."""
        self._nft(f"flush chain netdev {_TABLE} in\n")
        self._host_nft(f"flush chain netdev {self.name} in\n")


class NamespaceProcess:
    """One prefill process in the namespace; its stderr goes to a file (shown on a failed start)."""

    def __init__(self, ns: NetNamespace, argv: Sequence[str], log: Path) -> None:
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            ns.command(argv),
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            stdin=subprocess.DEVNULL,
        )

    def read_line(self, prefix: bytes) -> bytes:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            line = read_prefixed_line(self.proc.stdout.fileno(), prefix, deadline, bytearray())
        except TimeoutError:
            line = None
        if line is None:
            self.kill()
            raise RuntimeError(
                f"prefill process {self.proc.args!r} did not start: {self.log.read_text()[-2000:]}"
            )
        return line

    def read_port(self) -> int:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            words = read_ready(self.proc.stdout.fileno(), deadline)
        except TimeoutError:
            words = None
        if not words:
            self.kill()
            raise RuntimeError(
                f"prefill rank {self.proc.args!r} did not start: {self.log.read_text()[-2000:]}"
            )
        return int(words[0])

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL ends a stopped child too
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()


class NetnsPrefill:
    """The reference prefill (a bootstrap server, ``tp`` ranks) as processes in ``ns``.

    ``addr`` is the bootstrap server's ``ip:port`` inside the namespace; ``rank_ports`` the
    ranks' ZMQ ports. Use as a context manager: every process is killed on exit.
    """

    def __init__(
        self,
        ns: NetNamespace,
        *,
        tp: int = 2,
        ack_delay_ms: int = 0,
        status_liveness_s: float | None = None,
    ) -> None:
        self.ns = ns
        self.tp = tp
        self.ack_delay_ms = ack_delay_ms
        #: the ranks' ``--liveness-timeout-s`` (None: their default; 0: libzmq's defaults, the
        #: status sockets as they were before ZMQ-26)
        self.status_liveness_s = status_liveness_s
        self.addr = ""
        self.instance_id = ""
        self.rank_ports: list[int] = []
        self._children: list[NamespaceProcess] = []
        self._logs = Path(tempfile.mkdtemp(prefix="netns-prefill-"))

    def __enter__(self) -> NetnsPrefill:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, server_port: int = 0) -> None:
        """Start the server (on ``server_port`` if given) and the ranks; return once all serve."""
        server = self._spawn(
            [
                *("-m", "statemachine", "serve"),
                *("--host", self.ns.ns_ip, "--port", str(server_port), "--token", TOKEN),
            ],
            "server",
        )
        words = server.read_line(b"listening on").split()
        self.addr = words[2].decode()
        self.instance_id = words[4].decode() if len(words) > 4 else ""
        self.rank_ports = []
        for tp_rank in range(self.tp):
            rank = self._spawn(
                [
                    *("-m", "statemachine.prefill.rank", "--token", TOKEN),
                    *("--bootstrap", self.addr, "--host", self.ns.ns_ip),
                    *("--tp-rank", str(tp_rank), "--tp-size", str(self.tp)),
                    *("--ack-delay-ms", str(self.ack_delay_ms)),
                    *(
                        ()
                        if self.status_liveness_s is None
                        else ("--liveness-timeout-s", str(self.status_liveness_s))
                    ),
                ],
                f"rank{tp_rank}",
            )
            self.rank_ports.append(rank.read_port())

    def _spawn(self, args: list[str], what: str) -> NamespaceProcess:
        child = NamespaceProcess(self.ns, [sys.executable, *args], self._logs / f"{what}.log")
        self._children.append(child)
        return child

    @property
    def pids(self) -> list[int]:
        return [child.proc.pid for child in self._children if child.proc.poll() is None]

    @property
    def rank_endpoints(self) -> list[tuple[str, int]]:
        return [(self.ns.ns_ip, port) for port in self.rank_ports]

    # --- faults -------------------------------------------------------------------------------

    def hang(self) -> None:
        """SIGSTOP every prefill process: connections stay up, nothing answers."""
        for child in self._children:
            child.signal(signal.SIGSTOP)

    def resume(self) -> None:
        for child in self._children:
            child.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL every prefill process (the kernel resets their connections)."""
        for child in self._children:
            child.kill()
        self._children = []

    def replace(self) -> None:
        """Kill every process, then start a new instance behind the same bootstrap address."""
        port = int(self.addr.rsplit(":", 1)[1])
        self.kill()
        self.start(server_port=port)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._logs, ignore_errors=True)


class SGLangNetnsPrefill:
    """SGLang's ``CommonKVBootstrapServer`` and one SGLang prefill rank, one process in ``ns``
    (``tests/support/sglang_netns_prefill.py``): stopped and continued as a whole, or cut off. With
    ``transfer_ms`` it answers each transfer that long after its metadata through SGLang's own
    status sockets (a stand-in for its transfer engine: see that script)."""

    def __init__(self, ns: NetNamespace, *, transfer_ms: int | None = None) -> None:
        self.ns = ns
        self._logs = Path(tempfile.mkdtemp(prefix="netns-sglang-"))
        argv = [sys.executable, str(_SGLANG_SCRIPT), ns.ns_ip]
        if transfer_ms is not None:
            argv += ["--transfer-ms", str(transfer_ms)]
        self._child = NamespaceProcess(ns, argv, self._logs / "sglang.log")
        words = self._child.read_line(b"listening on").split()
        self.addr = words[2].decode()
        self.rank_port = int(words[3])

    def hang(self) -> None:
        self._child.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._child.signal(signal.SIGCONT)

    def close(self) -> None:
        self._child.kill()
        shutil.rmtree(self._logs, ignore_errors=True)

    def __enter__(self) -> SGLangNetnsPrefill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SGLANG_SCRIPT = Path(__file__).resolve().parent / "sglang_netns_prefill.py"
