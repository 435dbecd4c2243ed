"""A decode manager on etcd: the one module that composes ``decode/`` with ``discovery/``.

The manager knows its source only by the ``BootstrapSource`` protocol
(:mod:`statemachine.decode.source`), and the etcd source knows no manager: this module makes
the etcd source, gives it to a manager and hands the manager its closing.
A decode worker on etcd calls :func:`manager_on_etcd` (docs/etcd.md); the manager never
imports this module, so the decode runtime does not depend on the etcd package.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from statemachine.decode.liveness_bound import DEFAULT_LIVENESS_TIMEOUT_S
from statemachine.decode.manager import DecodeManager
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import EtcdGateway, TLSConfig
from statemachine.discovery.layout import DEFAULT_PREFIX

__all__ = ["manager_on_etcd"]


def manager_on_etcd(
    endpoints: str | Iterable[str],
    *,
    prefix: str = DEFAULT_PREFIX,
    tls: TLSConfig | None = None,
    username: str | None = None,
    password: str | None = None,
    sync_timeout_s: float = 5.0,
    watch_idle_timeout_s: float = 10.0,
    liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
    manager_class: type[DecodeManager] = DecodeManager,
    **kwargs: Any,
) -> DecodeManager:
    """A manager whose bootstrap source is an etcd watch (docs/etcd.md).

    ``endpoints``: etcd client URLs (a list, or comma-separated). Makes, starts and (when the
    manager closes, after its other parts) closes the :class:`EtcdBootstrapSource`; waits for
    its first list to succeed or fail, at most ``sync_timeout_s`` (one failed attempt ends the
    wait at once: etcd refused, or gave no answer within the gateway's connect and read
    timeouts). Not synced then: requests get ``NotReady`` naming the cause (``connection
    refused``...) until it is, and the source keeps retrying. ``kwargs`` go to the manager's
    constructor.
    ``liveness_timeout_s`` is the manager's bound on silence (ZMQ-25): a prefill rank that stops
    answering (a stopped process, a cut path) is judged dead within it by its socket's
    heartbeats; a prefill that dies is also retired by its lease, and etcd needs no health
    probes.
    """
    urls = (
        [url.strip() for url in endpoints.split(",") if url.strip()]
        if isinstance(endpoints, str)
        else list(endpoints)
    )
    gateway = EtcdGateway(urls, tls=tls, username=username, password=password)
    source = EtcdBootstrapSource(gateway, prefix=prefix, watch_idle_timeout=watch_idle_timeout_s)
    try:
        manager = manager_class(source=source, liveness_timeout_s=liveness_timeout_s, **kwargs)
    except BaseException:
        source.close()
        raise
    manager.close_with(source.close)  # closed last: after the health and transport
    source.start()
    source.wait_first_list(sync_timeout_s)
    return manager
