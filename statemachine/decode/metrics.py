"""Prometheus export of :meth:`DecodeManager.stats` (optional: the ``metrics`` extra).

A custom collector: the figures are read from the manager at scrape time, so nothing is added
to the request path (a hit costs the pool's one counter increment, as without the exporter).
Names follow Prometheus conventions: a ``pd_bootstrap_`` prefix, ``_total`` on counters,
base units (seconds), one label per breakdown (``cause``, ``reason``, ``evidence``)::

    from prometheus_client import start_http_server
    PrometheusCollector(manager).register()
    start_http_server(9400)

In Prometheus *multiprocess mode* (``PROMETHEUS_MULTIPROC_DIR`` set, as SGLang sets it for its
``/metrics`` endpoint) a collector registered in a worker process is never scraped: the endpoint
reads only the value files the processes' own Counters and Gauges write into that directory.
:class:`MultiprocessMetrics` writes the same figures there, from the process that owns the
manager::

    metrics = MultiprocessMetrics(manager, labels={"tp_rank": "0"}).start()
    ...
    metrics.close()  # a last write, then the thread stops

``prometheus_client`` is imported only when the collector or the writer is used.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from statemachine.decode.manager import DecodeManager
from statemachine.extras import require

PREFIX = "pd_bootstrap"
#: ``PROMETHEUS_MULTIPROC_DIR``: where multiprocess mode keeps the processes' value files
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


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


#: (name, help) of the plain counters written by :class:`MultiprocessMetrics`, from the
#: ``ManagerStats`` field of the same name (the collector's names, ``_total`` added by
#: prometheus_client).
_COUNTERS = (
    ("cache_hits", "hits", "Pool lookups that found a generation."),
    ("cache_misses", "misses", "Pool lookups that found none."),
    ("publishes", "publishes", "Fresh generations published."),
    ("adoptions", "adoptions", "Publishes that adopted a concurrent winner."),
    ("requests_completed", "completed", "Requests that succeeded."),
    (
        "prefill_events_dropped",
        "dropped_events",
        "Prefill messages for rooms not in flight, and stale ABORT acks.",
    ),
    ("callback_errors", "callback_errors", "Receivers' on_change callbacks that raised."),
    (
        "refused_known_dead",
        "refused_known_dead",
        "Requests failed at once on a pool key whose ranks are known dead.",
    ),
    (
        "refused_silent",
        "refused_silent",
        "Requests failed at once on a bootstrap server judged silent (PrefillSilent).",
    ),
)
_LABELLED_COUNTERS = (
    ("invalidations", "invalidations", "cause", "Pool entries removed, by cause."),
    ("requests_failed", "failures", "reason", "Requests that failed, by reason."),
    ("fanout_failures", "fanout", "evidence", "Requests failed by the fan-out, by evidence."),
)
_GAUGES = (
    ("requests_in_flight", "in_flight", "Receivers not yet ended."),
    ("kv_held_rooms", "kv_held", "Rooms whose KV waits for ABORT acks."),
    ("rooms_pending_dp", "pending_dp", "Rooms waiting for their dp rank."),
    ("dp_queries_in_flight", "dp_queries_in_flight", "Batched dp-rank queries not collected."),
    ("known_dead_keys", "known_dead_keys", "Pool keys whose ranks are known dead."),
    ("silent_addresses", "silent_addresses", "Bootstrap addresses judged silent."),
    ("zmq_sockets_open", "sockets_open", "Cached ZMQ sockets open."),
    ("endpoints_retained", "endpoints_retained", "Endpoint references held by generations."),
)


class MultiprocessMetrics:
    """The manager's figures as prometheus_client Counters and Gauges, for multiprocess mode.

    prometheus_client picks where values live when it is first imported: with
    ``PROMETHEUS_MULTIPROC_DIR`` set then, every value is a file in that directory, which the
    serving process merges on each scrape (``multiprocess.MultiProcessCollector``). So this
    must run in a process that had the variable set before prometheus_client was imported
    (SGLang sets it before it spawns its schedulers). The metrics are not registered with any
    registry of this process (the merge is the only reader): two writers in one process
    would overwrite each other's files, so give each its own ``labels``.

    Counters grow by what the manager counted since the last write; gauges are set (summed
    over live processes by the merge: ``livesum``). The failure-detection summary becomes two
    counters, ``failure_detections_total`` and ``failure_detection_seconds_total`` (a
    Summary's count and sum cannot be written from totals). :meth:`sync` writes once;
    :meth:`start` writes every ``interval_s`` on a daemon thread until :meth:`close`.
    """

    def __init__(
        self,
        manager: DecodeManager,
        *,
        labels: Mapping[str, str] | None = None,
        prefix: str = PREFIX,
        interval_s: float = 1.0,
    ) -> None:
        require("metrics", "MultiprocessMetrics")
        client = importlib.import_module("prometheus_client")
        self._manager = manager
        self._labels = dict(labels or {})
        self._interval_s = interval_s
        names = list(self._labels)
        p = prefix

        def counter(name: str, help_text: str, extra: list[str]) -> Any:
            return client.Counter(f"{p}_{name}", help_text, names + extra, registry=None)

        self._counters = {field: counter(name, h, []) for name, field, h in _COUNTERS}
        self._counters["detections"] = counter(
            "failure_detections", "Requests failed on evidence of a dead or restarted prefill.", []
        )
        self._counters["detection_s"] = counter(
            "failure_detection_seconds",
            "Time from evidence of a dead or restarted prefill to its requests failing.",
            [],
        )
        self._labelled = {
            field: counter(name, h, [label]) for name, field, label, h in _LABELLED_COUNTERS
        }
        self._gauges = {
            field: client.Gauge(f"{p}_{name}", h, names, registry=None, multiprocess_mode="livesum")
            for name, field, h in _GAUGES
        }
        #: the totals already written, per counter and label value
        self._written: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _add(self, key: tuple[str, str], metric: Any, total: float) -> None:
        delta = total - self._written.get(key, 0.0)
        if delta > 0:
            metric.inc(delta)
            self._written[key] = total

    def sync(self) -> None:
        """Write the manager's figures now."""
        stats = self._manager.stats()
        values = list(self._labels.values())
        with self._lock:
            for field, metric in self._counters.items():
                if field == "detections":
                    total: float = stats.detection.count
                elif field == "detection_s":
                    total = stats.detection.total_s
                else:
                    total = getattr(stats, field)
                self._add((field, ""), metric.labels(*values) if values else metric, total)
            for field, metric in self._labelled.items():
                for key, count in getattr(stats, field).items():
                    self._add((field, key), metric.labels(*values, key), count)
            for field, gauge in self._gauges.items():
                (gauge.labels(*values) if values else gauge).set(getattr(stats, field))

    def start(self) -> MultiprocessMetrics:
        """Write now and then every ``interval_s`` on a daemon thread."""
        self.sync()
        thread = threading.Thread(target=self._run, name="pd-bootstrap-metrics", daemon=True)
        self._thread = thread
        thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sync()

    def close(self) -> None:
        """Stop the thread after one last write (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval_s + 5.0)
        self.sync()
