"""A test-only SGLang plug-in: a stand-in for the model-serving ``Scheduler``, which reports
which KV classes the scheduler process SGLang spawned would use, and exits.

Loaded in the processes SGLang starts through SGLang's own plug-in discovery (the entry point
``sglang.srt.plugins: launch_observer``, declared by a dist-info that
tests/sglang/test_sglang_launch.py writes onto the children's path), it replaces
``sglang.srt.managers.scheduler.Scheduler`` with :class:`SchedulerStandIn` through SGLang's
``HookRegistry``. This is a stand-in for the model and the GPU pools only: a real Scheduler
loads the model onto a GPU before it builds its decode queues. Everything around it runs as
SGLang runs it: ``run_scheduler_process`` (its ``load_plugins()``, ``publish``,
``configure_scheduler_process``), the pipe back to the launcher and SGLang's wait for ready.

The stand-in asks ``decode.get_kv_class`` (the name SGLang's ``decode.py`` calls,
decode.py:765 and 905) for each backend's manager and receiver class and writes the answers,
with its ranks, to ``$LAUNCH_OBSERVER_DIR/<pid>.json`` (with dp attention the init info a
scheduler sends goes to the data-parallel controller, which passes on only its own summary),
then sends SGLang's launcher the ready message a real scheduler sends once its model is loaded.
"""

from __future__ import annotations

import json
import os
from typing import Any


class SchedulerStandIn:
    """Stands in for SGLang's ``Scheduler`` (model, GPU pools, event loop)."""

    gracefully_exit = False
    async_d2h_worker = None

    def __init__(self, server_args: Any, port_args: Any) -> None:
        from sglang.srt.disaggregation import decode
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
        from sglang.srt.runtime_context import get_parallel

        def name(cls: type) -> str:
            return f"{cls.__module__}.{cls.__qualname__}"

        self.kv_classes = {
            backend: [
                name(decode.get_kv_class(TransferBackend(backend), KVClassType.MANAGER)),
                name(decode.get_kv_class(TransferBackend(backend), KVClassType.RECEIVER)),
            ]
            for backend in ("mooncake", "nixl")
        }
        parallel = get_parallel()
        observation = {
            "pid": os.getpid(),
            "tp_rank": int(parallel.tp_rank),
            "attn_dp_rank": int(parallel.attn_dp_rank),
            "kv_classes": self.kv_classes,
        }
        path = os.path.join(os.environ["LAUNCH_OBSERVER_DIR"], f"{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as out:
            json.dump(observation, out)
        self.metrics_reporter = _MetricsReporterStandIn()

    def get_init_info(self) -> dict[str, Any]:
        # What SGLang's launcher reads of a scheduler's init info (engine.py, its wait for
        # ready; data_parallel_controller.py, its per-rank collection).
        return {"status": "ready", "max_total_num_tokens": 1, "max_req_input_len": 1}

    def run_event_loop(self) -> None:
        """A real scheduler serves here until shut down; the stand-in has reported and ends."""


class _MetricsReporterStandIn:
    def _shutdown_fpm(self) -> None:
        """run_scheduler_process's ``finally`` calls it (the metrics publisher thread)."""


def register() -> None:
    """The test plug-in's entry point (run by SGLang's ``load_plugins()`` in every process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler", SchedulerStandIn, HookType.REPLACE
    )
