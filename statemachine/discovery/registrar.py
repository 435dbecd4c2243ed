"""Prefill side: register ranks in etcd under one lease kept alive (docs/etcd.md).

An :class:`EtcdRegistrar` owns one lease (default TTL 10 s, refreshed every TTL/2 on a daemon
thread, as NVIDIA Dynamo does) and writes each registered rank's ``PUT /route`` body plus the
instance id under ``<prefix>/<bootstrap addr>/<dp>/<cp>/<tp>/<pp>`` attached to it:

* ``close()`` (graceful shutdown) revokes the lease: etcd deletes the keys at once and every
  watching decode retires what it cached from them;
* a crash stops the keep-alives: the keys vanish when the lease expires (TTL, plus etcd's
  expiry check, up to ~0.5 s);
* a failed keep-alive is retried with back-off (counted); a lease found gone (etcd was
  unreachable longer than the TTL) is replaced by a new one and every rank re-put with the
  same bytes, so decode sides that kept their cache keep it (docs/etcd.md, retirement rule).

Every etcd call is bounded by the gateway's timeouts; nothing blocks the caller longer than
``attempts`` tries. ``python -m statemachine.discovery.registrar`` runs one as a process.
"""

from __future__ import annotations

import argparse
import itertools
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from statemachine.discovery.gateway import EtcdGateway, TLSConfig
from statemachine.discovery.layout import (
    DEFAULT_PREFIX,
    RankKey,
    encode_value,
    normalise_prefix,
    parse_value,
    rank_key,
    registration_key,
)
from statemachine.errors import (
    BootstrapError,
    DiscoveryError,
    EtcdRequestFailed,
    EtcdUnavailable,
    InvalidArgument,
    MalformedValue,
)
from statemachine.validation import parse_addr
from statemachine.wire.http import route_payload

DEFAULT_TTL = 10


@dataclass(frozen=True, slots=True)
class RegistrarStats:
    lease_id: int | None
    ranks: int
    puts: int
    keepalives: int
    keepalive_failures: int
    #: leases granted again because the old one had expired (ranks re-put under the new one)
    lease_regrants: int
    revoked: bool
    last_error: str | None
    #: ``time.monotonic()`` of the last grant or keep-alive etcd acknowledged: the lease
    #: expires TTL seconds after it unless refreshed
    last_refresh: float | None


class EtcdRegistrar:
    """Registers one prefill instance's ranks under a lease with keep-alive.

    ``instance_id`` names the prefill instance: every rank of one instance must register with
    the same id (the decode side treats ranks of one key fetched from two instances as a
    restart mid-fetch). Default: a fresh uuid, right for an instance whose ranks share this
    registrar.
    """

    def __init__(
        self,
        gateway: EtcdGateway,
        bootstrap_addr: str,
        *,
        instance_id: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        ttl: int = DEFAULT_TTL,
        keepalive_interval: float | None = None,
        attempts: int = 5,
        backoff: float = 0.1,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        parse_addr(bootstrap_addr)
        if type(ttl) is not int or ttl < 1:
            raise InvalidArgument(f"ttl must be an int >= 1 (seconds), got {ttl!r}")
        interval = ttl / 2.0 if keepalive_interval is None else keepalive_interval
        if not 0 < interval < ttl:
            raise InvalidArgument("keepalive_interval must be in (0, ttl)")
        if type(attempts) is not int or attempts < 1:
            raise InvalidArgument("attempts must be an int >= 1")
        self.gateway = gateway
        self.bootstrap_addr = bootstrap_addr
        self.instance_id = instance_id or uuid.uuid4().hex
        self.registration_id = uuid.uuid4().hex
        if len(self.instance_id) > 128:
            raise InvalidArgument("instance_id longer than 128 chars")
        self.prefix = normalise_prefix(prefix)
        self.ttl = ttl
        self.keepalive_interval = interval
        self._attempts = attempts
        self._backoff = backoff
        self._sleep = sleep
        self._lock = threading.Lock()  # lease id and the registered values
        self._grant_lock = threading.Lock()  # one lease even if ranks register concurrently
        self._lease: int | None = None
        self._values: dict[bytes, bytes] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._puts = 0
        self._keepalives = 0
        self._keepalive_failures = 0
        self._regrants = 0
        self._revoked = False
        self._last_error: str | None = None
        self._last_refresh: float | None = None
        self._reput_pending = False

    # --- registration --------------------------------------------------------------------------

    def register(self, payload: Mapping[str, Any]) -> int:
        """Write one rank's ``PUT /route`` body under the lease; return the put's revision.

        Grants the lease and starts the keep-alive thread on the first call. Raises
        :class:`InvalidArgument` for a payload the decode side would reject, and
        :class:`EtcdUnavailable` when ``attempts`` tries with back-off all failed.
        """
        if self._revoked:
            raise DiscoveryError("registrar closed: create a new one (a new instance)")
        try:
            dp, cp, tp, pp = registration_key(payload)
            key = rank_key(self.prefix, RankKey(self.bootstrap_addr, dp, cp, tp, pp))
            value = encode_value(payload, self.instance_id, self.registration_id)
            # The decode side's check, run here, so a bad registration fails at its source.
            parse_value(RankKey(self.bootstrap_addr, dp, cp, tp, pp), value, mod_revision=0)
        except (MalformedValue, TypeError, ValueError) as exc:
            raise InvalidArgument(f"bad rank registration: {exc}") from None
        revision = self._retry("put", lambda: self._put(key, value))
        with self._lock:
            self._values[key] = value
        self._start_keepalive()
        return revision

    def _put(self, key: bytes, value: bytes) -> int:
        lease = self._ensure_lease()
        try:
            revision = self.gateway.put(key, value, lease=lease)
        except EtcdRequestFailed as exc:
            if "lease not found" not in str(exc):
                raise
            # The lease expired before the keep-alive thread noticed (etcd was unreachable
            # for longer than the TTL): replace it, and have the others re-put under the new one.
            with self._lock:
                if self._lease == lease:
                    self._lease = None
                    self._regrants += 1
                    self._reput_pending = bool(self._values)
            lease = self._ensure_lease()
            revision = self.gateway.put(key, value, lease=lease)
        with self._lock:
            self._puts += 1
        return revision

    def _ensure_lease(self) -> int:
        with self._grant_lock:
            with self._lock:
                lease = self._lease
            if lease is not None:
                return lease
            sent = time.monotonic()
            lease, _ = self.gateway.lease_grant(self.ttl)
            with self._lock:
                self._lease = lease
                self._last_refresh = sent
            return lease

    def _retry(self, what: str, call: Callable[[], int]) -> int:
        for attempt in range(self._attempts):
            try:
                return call()
            except EtcdUnavailable as exc:
                self._last_error = f"{what}: {exc}"
                if attempt + 1 == self._attempts:
                    raise
                delay = min(self._backoff * 2.0**attempt, self.ttl / 4.0)
                self._sleep(delay * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")  # pragma: no cover

    # --- keep-alive ----------------------------------------------------------------------------

    def _start_keepalive(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._keepalive_loop, name="etcd-registrar-keepalive", daemon=True
            )
        self._thread.start()

    def _keepalive_loop(self) -> None:
        wait = self.keepalive_interval
        failures = 0
        while not self._stop.wait(wait):
            try:
                self._refresh()
            except DiscoveryError as exc:
                failures += 1
                with self._lock:
                    self._keepalive_failures += 1
                    self._last_error = f"keep-alive: {exc}"
                # Back off, but never past the interval: a lease must be refreshed before TTL.
                wait = min(self._backoff * 2.0 ** (failures - 1), self.keepalive_interval)
                wait *= random.uniform(0.5, 1.0)
            else:
                failures = 0
                wait = self.keepalive_interval

    def _refresh(self) -> None:
        with self._lock:
            lease = self._lease
        if lease is None:
            return
        sent = time.monotonic()
        ttl = self.gateway.lease_keepalive(lease)
        if ttl > 0:
            with self._lock:
                self._keepalives += 1
                self._last_refresh = sent
                reput = self._reput_pending
            if reput:
                self._reput(lease)  # a re-put after a regrant failed midway: finish it
            return
        # The lease expired (etcd unreachable for longer than the TTL, or this process
        # stalled): its keys are gone. A new lease, and the same bytes put again.
        sent = time.monotonic()
        new_lease, _ = self.gateway.lease_grant(self.ttl)
        with self._lock:
            if self._stop.is_set():
                return
            self._lease = new_lease
            self._regrants += 1
            self._last_refresh = sent
            self._reput_pending = True
        self._reput(new_lease)

    def _reput(self, lease: int) -> None:
        """Put every registered value under ``lease``; pending again if any put fails."""
        with self._lock:
            values = list(self._values.items())
        for key, value in values:
            self.gateway.put(key, value, lease=lease)
            with self._lock:
                self._puts += 1
        with self._lock:
            self._reput_pending = False

    # --- shutdown ------------------------------------------------------------------------------

    def close(self, *, revoke: bool = True) -> None:
        """Stop the keep-alives and (graceful shutdown) revoke the lease: keys vanish now.

        A revoke that fails (etcd unreachable) is recorded; the lease then expires by itself
        within its TTL. ``revoke=False`` leaves the keys to expire, like a crash.
        """
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=sum(self.gateway.timeout) + 1.0)
        with self._lock:
            lease, self._lease = self._lease, None
            self._revoked = True
        if revoke and lease is not None:
            try:
                self.gateway.lease_revoke(lease)
            except DiscoveryError as exc:
                self._last_error = f"revoke: {exc}"
        self.gateway.close()

    def __enter__(self) -> EtcdRegistrar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> RegistrarStats:
        with self._lock:
            return RegistrarStats(
                lease_id=self._lease,
                ranks=len(self._values),
                puts=self._puts,
                keepalives=self._keepalives,
                keepalive_failures=self._keepalive_failures,
                lease_regrants=self._regrants,
                revoked=self._revoked,
                last_error=self._last_error,
                last_refresh=self._last_refresh,
            )


def registrar_for(
    endpoints: str,
    bootstrap_addr: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    ttl: int = DEFAULT_TTL,
    instance_id: str | None = None,
    tls: TLSConfig | None = None,
) -> EtcdRegistrar:
    """A registrar from command-line style settings (``endpoints``: comma-separated URLs)."""
    urls = [url.strip() for url in endpoints.split(",") if url.strip()]
    return EtcdRegistrar(
        EtcdGateway(urls, tls=tls), bootstrap_addr, instance_id=instance_id, prefix=prefix, ttl=ttl
    )


# --- as a process (tests SIGKILL it to check lease expiry) ----------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m statemachine.discovery.registrar")
    parser.add_argument("--endpoints", required=True, help="comma-separated etcd URLs")
    parser.add_argument("--bootstrap", required=True, help="the prefill's bootstrap host:port")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--instance-id", default=None)
    parser.add_argument("--ttl", type=int, default=DEFAULT_TTL)
    parser.add_argument("--rank-ip", default="127.0.0.1")
    parser.add_argument("--rank-port", type=int, required=True, help="first rank's port")
    for name in ("tp", "pp", "dp", "cp"):
        parser.add_argument(f"--{name}-size", type=int, default=1)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Register every rank of the given layout (ports ``rank_port + i``), print ``READY``,
    keep the lease alive until SIGTERM/SIGINT, then revoke it and print ``REVOKED``."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        registrar = registrar_for(
            args.endpoints,
            args.bootstrap,
            prefix=args.prefix,
            ttl=args.ttl,
            instance_id=args.instance_id,
        )
    except BootstrapError as exc:
        print(f"registrar: {exc}", file=sys.stderr, flush=True)
        return 2
    sizes = (args.dp_size, args.cp_size, args.tp_size, args.pp_size)
    try:
        for offset, (dp, cp, tp, pp) in enumerate(itertools.product(*map(range, sizes))):
            registrar.register(
                route_payload(
                    rank_ip=args.rank_ip,
                    rank_port=args.rank_port + offset,
                    **{"dp_rank": dp, "dp_size": args.dp_size},
                    **{"cp_rank": cp, "cp_size": args.cp_size},
                    **{"tp_rank": tp, "tp_size": args.tp_size},
                    **{"pp_rank": pp, "pp_size": args.pp_size},
                )
            )
    except BootstrapError as exc:
        print(f"registrar: {exc}", file=sys.stderr, flush=True)
        registrar.close()
        return 1
    print(f"READY {registrar.instance_id} {registrar.stats().lease_id}", flush=True)
    while not stop.wait(0.2):
        pass
    registrar.close()
    print("REVOKED", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
