"""``python -m sglang_spawn_probe``: what a process SGLang spawns sees after the launcher.

Its body imports ``statemachine.sglang.v0_5_23.decode_worker.launch_server`` (registering the
hook, as that module's own ``-m`` run does), then starts a child with the ``spawn`` method, as
SGLang starts its schedulers. The spawned child runs this main module again (as ``__mp_main__``),
then
imports SGLang's ``decode.py`` and prints the module of the receiver class ``get_kv_class``
answers there. Run by tests/test_sglang_decode_queues.py with the CPU stubs on PYTHONPATH.
"""

from __future__ import annotations

import importlib
import multiprocessing

import statemachine.sglang.v0_5_23.decode_worker.launch_server  # noqa: F401  (the hook, at module level)


def report(queue: multiprocessing.Queue[str]) -> None:
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    receiver = decode.get_kv_class(utils.TransferBackend.MOONCAKE, utils.KVClassType.RECEIVER)
    queue.put(receiver.__module__)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[str] = context.Queue()
    child = context.Process(target=report, args=(results,))
    child.start()
    print(results.get(timeout=240))
    child.join(timeout=60)
