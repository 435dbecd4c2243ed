"""``python sglang_launch_driver.py {tp,dp} MODEL_DIR [NAME=VALUE...]``: SGLang's own launcher.

A plain driver that imports nothing of this library; SGLang loads whatever plug-ins are
installed. ``tp``: SGLang 0.5.23's ``Engine._launch_subprocesses`` (the code
``sglang.launch_server``, ``sglang serve`` and ``sglang.Engine(...)`` run) as node 1 of a
two-node tp-2 deployment (``--nnodes 2 --node-rank 1``), whose launch path runs schedulers and
no tokenizer: its ``load_plugins()``, server-args checks, publication and ports, then
``_launch_scheduler_processes`` spawning tp rank 1, and its wait until the scheduler reported
ready. ``dp``: one node with dp attention (``--tp 2 --dp 2 --enable-dp-attention``): a dp-attention
follower node would wait for node 0's port broadcast, and node 0 goes on to a tokenizer, so the
driver makes the calls ``_launch_subprocesses`` makes before it spawns (engine.py, in its order),
then runs the real ``_launch_scheduler_processes``: the schedulers prelaunched and the
data-parallel controller (``run_data_parallel_controller_process``) that hands them their ranks,
and the wait for ready. The model directory holds a config.json only; the test's observer
plug-in stands in for the model-serving Scheduler and reports what each scheduler got. Prints
the init infos SGLang's launcher received as one JSON line, then ends the processes it started
(the dp controller serves until stopped). NAME=VALUE pairs are set for the spawned processes
only. Exits 3 with SGLang's error if the launch failed.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def launch_follower_node(server_args: Any) -> list[dict[str, Any]]:
    from sglang.srt.entrypoints.engine import Engine

    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"  # Engine's non-blocking follower
    _, _, _, result, _, _ = Engine._launch_subprocesses(
        server_args=server_args,
        init_tokenizer_manager_func=Engine.init_tokenizer_manager_func,
        run_scheduler_process_func=Engine.run_scheduler_process_func,
        run_detokenizer_process_func=Engine.run_detokenizer_process_func,
    )
    infos: list[dict[str, Any]] = result.scheduler_infos
    return infos


def launch_schedulers(server_args: Any) -> list[dict[str, Any]]:
    from sglang.srt.entrypoints import engine
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs
    from sglang.srt.utils.common import configure_logger

    # engine.py's _launch_subprocesses, up to its scheduler launch, in its order.
    configure_logger(server_args)
    server_args.resolve_once()
    engine._set_envs_and_config(server_args)
    load_plugins()
    server_args.check_server_args()
    engine.resolve_auto_parsers(server_args)
    publish(server_args, role="tokenizer")
    port_args = PortArgs.init_new(server_args)
    result, _ = engine.Engine._launch_scheduler_processes(
        server_args, port_args, engine.Engine.run_scheduler_process_func
    )
    result.wait_for_ready()
    infos: list[dict[str, Any]] = result.scheduler_infos
    return infos


def main() -> int:
    mode, model = sys.argv[1], sys.argv[2]
    child_env = dict(arg.split("=", 1) for arg in sys.argv[3:])
    if child_env:
        # Load the plug-ins here first (Engine.__init__ does the same; _launch_subprocesses's
        # own call is then a no-op), then give the processes SGLang spawns another environment:
        # a scheduler whose settings differ from its launcher's.
        from sglang.srt.plugins import load_plugins

        load_plugins()
        os.environ.update(child_env)
    from sglang.srt.server_args import ServerArgs

    fields: dict[str, Any] = {
        "model_path": model,
        "skip_tokenizer_init": True,
        "device": "cpu",
        "disaggregation_mode": "decode",
        "disaggregation_transfer_backend": "mooncake",
        "tp_size": 2,
        "log_level": "info",
    }
    if mode == "tp":
        fields.update(nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5757")
    else:
        fields.update(dp_size=2, enable_dp_attention=True)
    server_args = ServerArgs(**fields)
    from sglang.srt.utils.common import kill_process_tree

    try:
        infos = (
            launch_follower_node(server_args) if mode == "tp" else launch_schedulers(server_args)
        )
    except RuntimeError as exc:
        print(f"launch failed: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    print(json.dumps(infos), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
