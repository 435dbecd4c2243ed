"""Prometheus export of :meth:`DecodeManager.stats` (optional: the ``metrics`` extra).

A custom collector: the figures are read from the manager at scrape time, so nothing is added
to the request path (a hit costs the pool's one counter increment, as without the exporter).
Names follow Prometheus conventions: a ``pd_bootstrap_`` prefix, ``_total`` on counters,
base units (seconds), one label per breakdown (``cause``, ``reason``, ``evidence``)::

    from prometheus_client import start_http_server
    PrometheusCollector(manager).register()
    start_http_server(9400)

``prometheus_client`` is imported only when the collector is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from statemachine.decode.manager import DecodeManager
from statemachine.extras import require

PREFIX = "pd_bootstrap"


class PrometheusCollector:
    """Yields the manager's figures as Prometheus metric families on every scrape."""

    def __init__(self, manager: DecodeManager, *, prefix: str = PREFIX) -> None:
        self._manager = manager
        self._prefix = prefix

    def register(self, registry: Any = None) -> PrometheusCollector:
        """Register with ``registry`` (default: prometheus_client's global registry)."""
        require("metrics", "PrometheusCollector")
        if registry is None:
            registry = importlib.import_module("prometheus_client").REGISTRY
        registry.register(self)
        return self

    def collect(self) -> Iterator[Any]:
        require("metrics", "PrometheusCollector")
        core = importlib.import_module("prometheus_client.core")
        counter, gauge = core.CounterMetricFamily, core.GaugeMetricFamily
        p = self._prefix
        stats = self._manager.stats()
        yield counter(f"{p}_cache_hits", "Pool lookups that found a generation.", stats.hits)
        yield counter(f"{p}_cache_misses", "Pool lookups that found none.", stats.misses)
        yield counter(f"{p}_publishes", "Fresh generations published.", stats.publishes)
        yield counter(
            f"{p}_adoptions", "Publishes that adopted a concurrent winner.", stats.adoptions
        )
        yield counter(f"{p}_requests_completed", "Requests that succeeded.", stats.completed)
        for name, help_text, label, values in (
            ("invalidations", "Pool entries removed, by cause.", "cause", stats.invalidations),
            ("requests_failed", "Requests that failed, by reason.", "reason", stats.failures),
            (
                "fanout_failures",
                "Requests failed by the manager's fan-out, by evidence.",
                "evidence",
                stats.fanout,
            ),
        ):
            family = counter(f"{p}_{name}", help_text, labels=[label])
            for key, value in sorted(values.items()):
                family.add_metric([key], value)
            yield family
        yield core.SummaryMetricFamily(
            f"{p}_failure_detection_seconds",
            "Time from evidence of a dead or restarted prefill to a request failing.",
            count_value=stats.detection.count,
            sum_value=stats.detection.total_s,
        )
        yield gauge(f"{p}_requests_in_flight", "Receivers not yet ended.", stats.in_flight)
        yield gauge(f"{p}_kv_held_rooms", "Rooms whose KV waits for ABORT acks.", stats.kv_held)
        yield counter(
            f"{p}_prefill_events_dropped",
            "Prefill messages for rooms not in flight, and stale ABORT acks.",
            stats.dropped_events,
        )
        yield counter(
            f"{p}_callback_errors",
            "Receivers' on_change callbacks that raised (contained).",
            stats.callback_errors,
        )
        yield gauge(f"{p}_rooms_pending_dp", "Rooms waiting for their dp rank.", stats.pending_dp)
        yield gauge(
            f"{p}_dp_queries_in_flight",
            "Batched dp-rank queries started by step() and not yet collected.",
            stats.dp_queries_in_flight,
        )
        yield gauge(
            f"{p}_known_dead_keys",
            "Pool keys whose ranks are known dead (requests on them fail at once).",
            stats.known_dead_keys,
        )
        yield counter(
            f"{p}_refused_known_dead",
            "Requests failed at once on a pool key whose ranks are known dead.",
            stats.refused_known_dead,
        )
        yield gauge(
            f"{p}_silent_addresses",
            "Bootstrap addresses judged dead by their probes and not answering since (held off).",
            stats.silent_addresses,
        )
        yield counter(
            f"{p}_refused_silent",
            "Requests failed at once on a bootstrap server judged silent (PrefillSilent).",
            stats.refused_silent,
        )
        yield gauge(f"{p}_zmq_sockets_open", "Cached ZMQ sockets open.", stats.sockets_open)
        yield gauge(
            f"{p}_endpoints_retained",
            "Endpoint references held by live generations.",
            stats.endpoints_retained,
        )
