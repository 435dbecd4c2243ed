"""From a :class:`~statemachine.demo.run.RunResult` to numbers: metrics, table, JSON, plot.

Every metric is defined in ``docs/demo.md``; the comments here say how each is computed.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statemachine.demo.run import RunResult
from statemachine.errors import MissingExtra

#: Keys of the report that the table shows, in order, with their labels.
TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("requests_ok", "requests ok"),
    ("requests_failed", "requests failed"),
    ("failed_by_restart", "  failed after a restart"),
    ("failed_after_ready", "  failed after prefill was back"),
    ("in_flight_at_restart", "in flight at the restart"),
    ("started_while_down", "started while prefill down"),
    ("restart_to_first_success_s", "restart -> first success (s)"),
    ("ready_to_first_success_s", "prefill back -> first success (s)"),
    ("downtime_s", "prefill down (s)"),
    ("cache_hits", "cache hits"),
    ("cache_misses", "cache misses"),
    ("refetches", "refetches"),
    ("invalidations", "invalidations"),
    ("instance_retirements", "instance-id/heartbeat drops"),
    ("stale_entries_after_detection", "stale entries after detection"),
    ("lost_live_generations", "lost live generations"),
    ("bootstrap_retries", "bootstrap retries (prefill down)"),
    ("bootstrap_latency_p50_ms", "bootstrap latency p50 (ms)"),
    ("bootstrap_latency_p99_ms", "bootstrap latency p99 (ms)"),
    ("request_latency_p50_ms", "request latency p50 (ms)"),
    ("time_wait_sockets", "TIME-WAIT sockets (peak)"),
    ("peak_connections", "connections (peak)"),
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def _s(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def build_report(result: RunResult) -> dict[str, Any]:
    """The JSON report of one run."""
    outcomes = result.outcomes
    t0 = result.started_at
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    first_kill = result.restarts[0].killed_at if result.restarts else math.inf
    restarts: list[dict[str, Any]] = []
    for index, restart in enumerate(result.restarts):
        next_kill = (
            result.restarts[index + 1].killed_at if index + 1 < len(result.restarts) else math.inf
        )
        # A request that *started* after the kill and succeeded was served by the new instance.
        after = [o for o in outcomes if o.ok and restart.killed_at <= o.start < next_kill]
        first_success = min((o.end for o in after), default=None)
        ready = restart.ready_at
        window_failures = [o for o in failed if restart.killed_at <= o.end < next_kill]
        started_while_down = sum(
            1 for o in outcomes if ready is not None and restart.killed_at <= o.start < ready
        )
        restarts.append(
            {
                "killed_at_s": _s(restart.killed_at - t0),
                "in_flight": restart.in_flight,
                "started_while_down": started_while_down,
                "downtime_s": _s(None if ready is None else ready - restart.killed_at),
                "detection_s": _s(
                    None if restart.detected_at is None else restart.detected_at - restart.killed_at
                ),
                "restart_to_first_success_s": _s(
                    None if first_success is None else first_success - restart.killed_at
                ),
                "ready_to_first_success_s": _s(
                    None
                    if first_success is None or ready is None
                    else max(0.0, first_success - ready)
                ),
                "failed": len(window_failures),
                "failed_after_ready": sum(
                    1 for o in window_failures if ready is not None and o.start >= ready
                ),
                "failure_window_s": _s(
                    max((o.end for o in window_failures), default=restart.killed_at)
                    - restart.killed_at
                ),
                "stale_after_detection": restart.stale_after_detection,
                "old_instance": restart.old_instance,
                "new_instance": restart.new_instance,
            }
        )

    def worst(key: str) -> float | None:
        # None (never recovered) is worse than any number.
        values: list[float | None] = [r[key] for r in restarts]
        numbers = [v for v in values if v is not None]
        if not values or len(numbers) < len(values):
            return None
        return max(numbers)

    bootstrap = [o.bootstrap_s for o in outcomes if o.bootstrap_s is not None]
    latency = [o.end - o.start for o in ok]
    elapsed = result.ended_at - result.started_at
    stats = result.pool
    report: dict[str, Any] = {
        "mode": result.config.mode.name,
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "failed_by_restart": sum(1 for o in failed if o.end >= first_kill),
        "failed_after_ready": sum(r["failed_after_ready"] for r in restarts),
        "failures_by_error": dict(Counter(o.error or "unknown" for o in failed)),
        "in_flight_at_restart": sum(r.in_flight for r in result.restarts),
        "started_while_down": sum(r["started_while_down"] for r in restarts),
        "restart_to_first_success_s": worst("restart_to_first_success_s"),
        "ready_to_first_success_s": worst("ready_to_first_success_s"),
        "downtime_s": worst("downtime_s"),
        "cache_hits": stats.hits,
        "cache_misses": stats.misses,
        "refetches": stats.misses - result.misses_before_first_restart if restarts else 0,
        "invalidations": stats.invalidations,
        "instance_retirements": stats.address_invalidations,
        "invalidations_kept_newer": stats.kept_newer,
        "stale_entries_after_detection": max(
            (r.stale_after_detection for r in result.restarts), default=0
        ),
        "lost_live_generations": result.lost_live_generations,
        "live_removed_by_heartbeat": result.live_removed_by_heartbeat,
        "bootstrap_retries": result.retries,
        "bootstrap_latency_p50_ms": _ms(percentile(bootstrap, 50)),
        "bootstrap_latency_p99_ms": _ms(percentile(bootstrap, 99)),
        "request_latency_p50_ms": _ms(percentile(latency, 50)),
        "request_latency_p99_ms": _ms(percentile(latency, 99)),
        "requests_per_s": round(len(outcomes) / elapsed, 1) if elapsed > 0 else None,
        "time_wait_sockets": result.peak_time_wait,
        "time_wait_sockets_end": result.end_time_wait,
        "peak_connections": result.peak_connections,
        "zmq_sends": result.transport.sends,
        "zmq_send_failures": result.transport.failures,
        "zmq_sockets_created": result.transport.sockets_created,
        "acks_received": result.acks.received,
        "acks_unknown": result.acks.unknown,
        "health_restarts_seen": result.health_restarts_seen,
        "health_deaths_seen": result.health_deaths_seen,
        "elapsed_s": _s(elapsed),
        "bootstrap_port": result.bootstrap_port,
        "prefill_pids": result.prefill_pids,
        "restarts": restarts,
        "config": result.config.as_dict(),
    }
    return report


def format_table(reports: Sequence[dict[str, Any]]) -> str:
    """A plain-text table: one row per metric, one column per run."""
    width = max(len(label) for _, label in TABLE_ROWS)
    header = f"{'':<{width}}" + "".join(f"  {r['mode']:>14}" for r in reports)
    lines = [header, "-" * len(header)]
    for key, label in TABLE_ROWS:
        cells = "".join(f"  {_cell(r.get(key)):>14}" for r in reports)
        lines.append(f"{label:<{width}}{cells}")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "never"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:.1f}"
    return str(value)


def write_json(path: str | Path, payload: object) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# --- plot -------------------------------------------------------------------------------------


BIN_S = 0.25


def plot_timeline(results: Sequence[RunResult], path: str | Path) -> None:
    """Successes and failures per 250 ms around each restart, one panel per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingExtra("plot", "--plot", "matplotlib") from exc
    fig, axes = plt.subplots(
        len(results), 1, figsize=(10, 2.6 * len(results) + 0.6), sharex=True, squeeze=False
    )
    for ax, result in zip(axes[:, 0], results, strict=True):
        t0 = result.started_at
        # Whole bins only: a partial last bin would look like a drop in throughput.
        bins = max(1, int((result.ended_at - t0) / BIN_S))
        ok = [0] * bins
        bad = [0] * bins
        for outcome in result.outcomes:
            slot = int((outcome.end - t0) / BIN_S)
            if slot >= bins:
                continue
            if outcome.ok:
                ok[slot] += 1
            else:
                bad[slot] += 1
        xs = [i * BIN_S for i in range(bins)]
        rate = 1.0 / BIN_S
        ax.plot(xs, [v * rate for v in ok], color="tab:green", label="successes/s")
        ax.bar(
            xs,
            [v * rate for v in bad],
            width=BIN_S,
            align="edge",
            color="tab:red",
            label="failures/s",
        )
        for i, restart in enumerate(result.restarts):
            ax.axvline(
                restart.killed_at - t0,
                color="black",
                linestyle="--",
                label="prefill killed" if i == 0 else None,
            )
            if restart.ready_at is not None:
                ax.axvline(
                    restart.ready_at - t0,
                    color="tab:blue",
                    linestyle=":",
                    label="prefill back" if i == 0 else None,
                )
        ax.set_title(f"{result.config.mode.name}: {result.config.mode.describe()}", fontsize=10)
        ax.set_ylabel("requests/s")
        ax.legend(loc="center right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
