"""The command line and the package surface, in the development venv.

Usage lines name the command the user typed (``pd-bootstrap …`` as the console script,
``python -m statemachine …`` as a module); every name in ``statemachine.__all__`` imports;
``import statemachine`` stays free of zmq, requests and aiohttp; the missing-extra messages.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import statemachine
from statemachine.errors import BootstrapError, MissingExtra
from statemachine.extras import require

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "pd-bootstrap"
TIMEOUT_S = 120


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, cwd=REPO
    )


def _usage_line(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout or done.stderr).splitlines()[0]


# --- program name in usage lines ---------------------------------------------------------------

SUBCOMMAND_USAGE = [
    (["demo", "--help"], "demo"),
    (["serve", "--help"], "serve"),
    (["check", "--help"], "check"),
    (["table", "--bad"], "table"),
    (["etcd", "--help"], "etcd"),
]


def test_module_help_names_python_m() -> None:
    done = _run([sys.executable, "-m", "statemachine", "--help"])
    assert done.returncode == 0
    assert done.stdout.startswith("usage: python -m statemachine <command> [options]")


@pytest.mark.skipif(not SCRIPT.exists(), reason="the console script is not installed here")
def test_console_script_help_names_pd_bootstrap() -> None:
    done = _run([str(SCRIPT), "--help"])
    assert done.returncode == 0
    assert done.stdout.startswith("usage: pd-bootstrap <command> [options]")
    assert "'pd-bootstrap <command> --help' describes a command's options." in done.stdout


@pytest.mark.skipif(not SCRIPT.exists(), reason="the console script is not installed here")
@pytest.mark.parametrize(("args", "name"), SUBCOMMAND_USAGE)
def test_subcommand_usage_names_pd_bootstrap(args: list[str], name: str) -> None:
    assert _usage_line(_run([str(SCRIPT), *args])).startswith(f"usage: pd-bootstrap {name}")


@pytest.mark.parametrize(("args", "name"), SUBCOMMAND_USAGE)
def test_subcommand_usage_names_python_m(args: list[str], name: str) -> None:
    done = _run([sys.executable, "-m", "statemachine", *args])
    assert _usage_line(done).startswith(f"usage: python -m statemachine {name}")


# What each command's --help must show besides the usage line: its purpose (the description's
# first line) and the defaults of its options.
HELP_SHOWS = {
    "demo": ["Run the decode side through a prefill restart", "(default: 20.0)", "(default: 8)"],
    "serve": [
        "Run the reference prefill bootstrap server",
        "(default: 8998)",
        "(default: 127.0.0.1)",
    ],
    "check": ["Model-check the Python mirror", "(default: MCSmall)", "--list"],
    "table": ["Print the receiver lifecycle", "--mermaid"],
    "etcd": ["Start a local one-member etcd on 127.0.0.1", "(default: 2379)", "(default: 2380)"],
}


@pytest.mark.parametrize("command", sorted(HELP_SHOWS))
def test_every_help_exits_0_with_its_purpose_and_defaults(command: str) -> None:
    done = _run([sys.executable, "-m", "statemachine", command, "--help"])
    assert done.returncode == 0, done.stderr
    for text in HELP_SHOWS[command]:
        assert text in done.stdout, (command, text)
    assert "(default: None)" not in done.stdout and "(default: False)" not in done.stdout


def test_prefill_rank_help_shows_its_defaults() -> None:
    done = _run([sys.executable, "-m", "statemachine.prefill.rank", "--help"])
    assert done.returncode == 0, done.stderr
    assert "Run one reference prefill rank" in done.stdout
    assert "KV cache page size (tokens) (default: 1)" in done.stdout
    assert "(default: auto)" in done.stdout


def test_check_names_shipped_cfgs() -> None:
    listed = _run([sys.executable, "-m", "statemachine", "check", "--list"])
    assert listed.returncode == 0, listed.stderr
    for cfg in sorted((REPO / "TLA").glob("*.cfg")):
        assert re.search(rf"^  {cfg.stem} +\S", listed.stdout, flags=re.MULTILINE), cfg.stem
    done = _run([sys.executable, "-m", "statemachine", "check", "MCNoInvalidation", "--quiet"])
    assert done.returncode == 1  # a bug variant: must fail
    assert done.stdout.startswith("config: TLA/MCNoInvalidation.cfg\n")
    assert re.search(r"StaleEntryEvicted +VIOLATED", done.stdout)
    unknown = _run([sys.executable, "-m", "statemachine", "check", "MCNope"])
    assert unknown.returncode == 2
    assert "no shipped cfg named 'MCNope': pick one of MCEtcd," in unknown.stderr


def test_unknown_command_shows_usage() -> None:
    done = _run([sys.executable, "-m", "statemachine", "nope"])
    assert done.returncode == 2
    assert done.stderr.startswith("unknown command 'nope'")


def test_table_into_a_closed_pipe_is_quiet() -> None:
    """``pd-bootstrap table | head -1``: no BrokenPipeError traceback."""
    done = subprocess.run(
        f"'{sys.executable}' -m statemachine table | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=REPO,
    )
    assert done.stdout == "| event | from | to |\n"
    assert "Traceback" not in done.stderr


def test_version() -> None:
    assert statemachine.__version__ == importlib.metadata.version("pd-bootstrap-statemachine")
    done = _run([sys.executable, "-m", "statemachine", "--version"])
    assert done.stdout.strip() == f"pd-bootstrap-statemachine {statemachine.__version__}"


# --- exports -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", statemachine.__all__)
def test_every_exported_name_imports(name: str) -> None:
    value = getattr(statemachine, name)
    assert value is not None
    # The object is the one its home module defines, not a copy.
    assert getattr(sys.modules[value.__module__], name) is value


def _guide_imports() -> set[tuple[str, str]]:
    """(module, name) of every import from ``statemachine...`` in docs/integration.md's Python."""
    guide = (REPO / "docs" / "integration.md").read_text(encoding="utf-8")
    names: set[tuple[str, str]] = set()
    for block in re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("statemachine"):
                names |= {(node.module or "", alias.name) for alias in node.names}
    return names


def test_integration_guide_names_are_exported() -> None:
    """What docs/integration.md imports from the package root is in ``__all__``; the only other
    module it may import from is a version folder of SGLang's wire (``statemachine.sglang.v...``),
    whose names must exist there."""
    imported = _guide_imports()
    from_root = {name for module, name in imported if module == "statemachine"}
    assert {"DecodeManager", "DecodeLayout", "KVPoll"} <= from_root
    assert from_root <= set(statemachine.__all__), from_root - set(statemachine.__all__)
    for module, name in imported - {("statemachine", name) for name in from_root}:
        assert re.fullmatch(r"statemachine\.sglang\.v\d+_\d+_\d+", module), module
        assert hasattr(importlib.import_module(module), name), (module, name)


def test_import_statemachine_loads_no_runtime_dependency() -> None:
    """CrossHair imports the pure cores; pyzmq's compiled backend must not come with them."""
    code = (
        "import sys, statemachine\n"
        "print(sorted(m for m in ('zmq', 'requests', 'aiohttp') if m in sys.modules))"
    )
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        statemachine.Nope  # noqa: B018


# --- missing extras ------------------------------------------------------------------------------


def test_missing_extra_is_typed_and_names_the_pip_command() -> None:
    exc = MissingExtra("plot", "--plot", "matplotlib")
    assert isinstance(exc, BootstrapError) and isinstance(exc, ImportError)
    assert exc.name == "matplotlib" and exc.extra == "plot"
    assert str(exc) == (
        "--plot needs matplotlib, which the 'plot' extra installs: "
        "pip install 'pd-bootstrap-statemachine[plot]'"
    )


def test_require_passes_for_an_installed_extra() -> None:
    require("server", "the test")  # aiohttp is in the dev extra


# Runs the demo's CLI with matplotlib made unimportable (``sys.modules[name] = None`` is how
# Python itself marks a module as absent), in a child process so this one is untouched.
_NO_MATPLOTLIB = """
import sys, time
sys.modules["matplotlib"] = None
from statemachine.demo import cli
started = time.monotonic()
code = cli.main(["--duration", "30", "--plot", "out.png", "--quiet"])
print(code, round(time.monotonic() - started, 1))
"""


def test_plot_without_matplotlib_is_reported_before_the_run() -> None:
    done = _run([sys.executable, "-c", _NO_MATPLOTLIB])
    code, seconds = done.stdout.split()
    assert code == "2"
    assert float(seconds) < 10.0  # a 30 s run never started
    assert done.stderr.strip() == (
        "error: --plot needs matplotlib, which the 'plot' extra installs: "
        "pip install 'pd-bootstrap-statemachine[plot]'"
    )
