"""SGLang's own launcher spawns schedulers, and each has this library's classes (issue 31).

Every test runs tests/support/sglang_launch_driver.py in a process of its own: a plain driver that
imports nothing of this library and runs SGLang 0.5.23's launch code (``Engine.
_launch_subprocesses`` for a tp-2 node started with ``--node-rank 1``; for dp attention the
calls it makes before spawning, then its real ``_launch_scheduler_processes``, which prelaunches
the schedulers and the data-parallel controller that hands them their ranks). SGLang spawns each
scheduler (``run_scheduler_process``, spawn start method); the scheduler's first act is SGLang's
``load_plugins()``, which finds this package's entry point in the installed metadata.

Stand-ins, only for what needs a GPU: the model is a directory holding a config.json, and the
model-serving ``Scheduler`` is replaced, through a second (test-only) plug-in from a dist-info
this test writes onto the children's path, by tests/support/sglang_launch_observer.py's
``SchedulerStandIn``, which records what ``decode.get_kv_class`` answers in that process and
reports ready. The negative cases show the observation tells the two apart: with
``PD_BOOTSTRAP_SGLANG_DECODE`` unset, or with the classes installed in the launching process
only (what the removed ``runpy`` wrapper amounted to), the spawned schedulers get SGLang's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from statemachine import __version__
from tests.support.sglang_support import SGLANG_VERSION, import_sglang, requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
OURS = "statemachine.sglang.v0_5_23.decode_worker.conn"
SGLANGS = "sglang.srt.disaggregation.mooncake.conn"
#: The scheduler's start-up line (statemachine/sglang/v0_5_23/decode_worker/plugin.py).
LINE = f"pd-bootstrap-statemachine {__version__} on SGLang {SGLANG_VERSION}: "
#: A tiny model's config: all the launcher reads of a model before the scheduler loads it.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
}
#: The old wrapper's effect: the classes installed in the launching process, then SGLang's
#: launch from there (the hook is never in the processes SGLang spawns).
LAUNCHER_ONLY = (
    "import runpy, sys\n"
    "from statemachine.sglang.v0_5_23 import decode_worker\n"
    "decode_worker.install(['mooncake'])\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def launch(
    tmp_path: Path,
    mode: str,
    env: dict[str, str],
    *,
    launcher_only: bool = False,
    child_env: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    """Run the driver; return its run and what each scheduler it spawned observed."""
    import_sglang()  # skips here, with the reason, where SGLang's wheel cannot run
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    dist = tmp_path / "observer" / "launch_observer-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: launch-observer\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nlaunch_observer = tests.support.sglang_launch_observer:register\n"
    )
    seen = tmp_path / "seen"
    seen.mkdir()
    full_env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PD_BOOTSTRAP_SGLANG_DECODE", "SGLANG_PLUGINS")
    }
    full_env.update(
        PYTHONPATH=os.pathsep.join([str(TESTS / "sglang_stubs"), str(REPO), str(dist.parent)]),
        SGLANG_HOST_IP="127.0.0.1",
        LAUNCH_OBSERVER_DIR=str(seen),
        **env,
    )
    driver = [str(TESTS / "support" / "sglang_launch_driver.py"), mode, str(model), *child_env]
    command = [sys.executable, "-W", "ignore"]
    command += ["-c", LAUNCHER_ONLY, *driver] if launcher_only else driver
    run = subprocess.run(
        command,
        env=full_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    observed = [json.loads(path.read_text()) for path in sorted(seen.glob("*.json"))]
    return run, observed


@pytest.mark.parametrize(("mode", "schedulers"), [("tp", 1), ("dp", 2)])
def test_every_scheduler_sglangs_launcher_spawns_gets_the_library_classes(
    tmp_path: Path, mode: str, schedulers: int
) -> None:
    run, observed = launch(tmp_path, mode, {"PD_BOOTSTRAP_SGLANG_DECODE": "mooncake"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(observed) == schedulers, run.stderr[-3000:]
    for seen in observed:
        assert seen["kv_classes"]["mooncake"] == [
            f"{OURS}.MooncakeKVManager",
            f"{OURS}.MooncakeKVReceiver",
        ]
        # Only the backends the variable names are replaced.
        assert seen["kv_classes"]["nixl"][0].startswith("sglang.srt.disaggregation.nixl.conn.")
    if mode == "dp":
        assert sorted(seen["attn_dp_rank"] for seen in observed) == [0, 1]
    else:
        assert [seen["tp_rank"] for seen in observed] == [1]  # node 1 of 2 runs tp rank 1
    # One start-up line per scheduler, in SGLang's log format (its rank prefix), none elsewhere.
    lines = [line for line in run.stderr.splitlines() if LINE in line]
    assert len(lines) == schedulers, run.stderr[-3000:]
    for line in lines:
        assert f"uses {OURS}.MooncakeKVManager and MooncakeKVReceiver" in line
        assert " TP" in line.split("]")[0]


@pytest.mark.parametrize("how", ["variable unset", "installed in the launcher only"])
def test_without_the_plugin_the_spawned_scheduler_keeps_sglangs_classes(
    tmp_path: Path, how: str
) -> None:
    run, observed = launch(tmp_path, "tp", {}, launcher_only=how != "variable unset")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [seen["kv_classes"]["mooncake"][1] for seen in observed] == [
        f"{SGLANGS}.MooncakeKVReceiver"
    ]
    assert LINE not in run.stderr


def test_an_unknown_backend_stops_the_launcher_before_it_spawns(tmp_path: Path) -> None:
    run, observed = launch(tmp_path, "tp", {"PD_BOOTSTRAP_SGLANG_DECODE": "mooncake,mori"})
    assert run.returncode == 1
    assert observed == []
    assert "PD_BOOTSTRAP_SGLANG_DECODE=mooncake,mori refused: backends ['mori'] not supported" in (
        run.stderr
    )
    assert "Executed general plugin: pd_bootstrap_decode" not in run.stderr


def test_a_scheduler_that_refuses_at_start_fails_sglangs_launch_naming_the_rank(
    tmp_path: Path,
) -> None:
    """The launcher's own environment is fine; the spawned scheduler's names a backend that
    does not exist: the scheduler exits at its load_plugins(), and SGLang's wait for ready
    (engine.py, ``_wait_for_scheduler_ready``) raises for the rank that died."""
    run, observed = launch(
        tmp_path,
        "tp",
        {"PD_BOOTSTRAP_SGLANG_DECODE": "mooncake"},
        child_env=("PD_BOOTSTRAP_SGLANG_DECODE=nixl,bogus",),
    )
    assert run.returncode == 3, run.stderr[-3000:]
    assert observed == []
    assert "PD_BOOTSTRAP_SGLANG_DECODE=nixl,bogus refused" in run.stderr
    assert "launch failed: Rank 0 scheduler died during initialization (exit code: 1)" in (
        run.stderr
    )


@pytest.mark.parametrize(
    ("env", "code", "says"),
    [
        (
            {"PD_BOOTSTRAP_SGLANG_DECODE": "mooncake"},
            0,
            f"  mooncake: {OURS}.MooncakeKVManager / MooncakeKVReceiver (the library's: as asked)",
        ),
        (
            {"PD_BOOTSTRAP_SGLANG_DECODE": "mooncake,bogus"},
            1,
            "error: SGLang's load_plugins() stops here, as it would stop a scheduler at start: "
            "pd-bootstrap-statemachine: PD_BOOTSTRAP_SGLANG_DECODE=mooncake,bogus refused",
        ),
        (
            {"PD_BOOTSTRAP_SGLANG_DECODE": "mooncake", "SGLANG_PLUGINS": "another_plugin"},
            1,
            f"  mooncake: {SGLANGS}.MooncakeKVManager / MooncakeKVReceiver "
            "(SGLang's: NOT as asked)",
        ),
        ({}, 0, "PD_BOOTSTRAP_SGLANG_DECODE is unset: the plug-in changes nothing"),
    ],
    ids=["active", "unknown backend", "filtered by SGLANG_PLUGINS", "unset"],
)
def test_sglang_check_says_what_a_scheduler_gets(
    tmp_path: Path, env: dict[str, str], code: int, says: str
) -> None:
    """``pd-bootstrap sglang-check`` (docs/sglang-decode.md), run as an operator runs it."""
    import_sglang()
    full_env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PD_BOOTSTRAP_SGLANG_DECODE", "SGLANG_PLUGINS")
    }
    full_env.update(PYTHONPATH=str(TESTS / "sglang_stubs"), SGLANG_HOST_IP="127.0.0.1", **env)
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "statemachine", "sglang-check"],
        env=full_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == code, run.stdout + run.stderr[-2000:]
    assert says in run.stdout, run.stdout
    assert (
        "plug-in: sglang.srt.plugins entry point pd_bootstrap_decode -> "
        "statemachine.sglang.v0_5_23.decode_worker.plugin:activate (discovered)"
    ) in run.stdout
    assert f"SGLang {SGLANG_VERSION}" in run.stdout


def test_another_sglang_release_stops_the_process_at_the_plugin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal a launcher and each scheduler meet in their load_plugins(): SystemExit,
    which SGLang's load_plugins() does not catch (it only logs an Exception), naming the
    release, the variable and what to do; nothing is installed. (The launch tests above show
    the same SystemExit ending SGLang's real launcher and scheduler processes.)"""
    from statemachine.sglang.v0_5_23.decode_worker import installer, plugin

    monkeypatch.setenv("PD_BOOTSTRAP_SGLANG_DECODE", "mooncake")
    monkeypatch.setattr(installer, "_installed_version", lambda: "0.5.24")
    with pytest.raises(SystemExit) as caught:
        plugin.activate()
    message = str(caught.value)
    assert "PD_BOOTSTRAP_SGLANG_DECODE=mooncake refused: SGLang 0.5.24 is installed" in message
    assert "install sglang==0.5.23" in message and "unset PD_BOOTSTRAP_SGLANG_DECODE" in message
    assert installer.installed() == frozenset()
    monkeypatch.setenv("PD_BOOTSTRAP_SGLANG_DECODE", " , ")
    plugin.activate()  # blank: off, whatever the release
    assert installer.installed() == frozenset()
