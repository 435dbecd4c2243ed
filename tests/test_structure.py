"""The package's shape, checked on its source (issue 19): one owner per concept.

Every module under ``statemachine/`` is parsed with ``ast`` (nothing is imported), and:

* no import crosses ``decode/`` <-> ``discovery/`` in either direction (``TYPE_CHECKING`` and
  ``importlib.import_module("...")`` imports included): the manager knows its source by the
  ``BootstrapSource`` protocol, and the one module that composes the two sides sits above
  both (``statemachine/decode_on_etcd.py``);
* no private name (one ``_``, not a dunder) crosses modules: never imported from another
  module, never read as ``module._name``; and in ``decode/receiver.py`` and
  ``decode/manager.py`` no ``obj._name`` on anything but ``self``; the receiver never imports
  the manager (it is handed its parts, ``decode/parts.py``'s ``Parts``);
* the topology's field list (``validation.TopologyClaim``) is written once: no other class
  declares those fields, no literal collection of strings spells them all out;
* one READY-line reader (``prefill/readiness.py``) and one rank-index check
  (``validation.require_rank``) for every caller;
* every ``from statemachine... import name`` in the package, the tests and the benchmarks
  names something that module has (a name moved to its one owner is imported from there).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from statemachine.validation import TopologyClaim

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "statemachine"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {
        _module_name(path): (path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


MODULES = _modules()


def _is_package(name: str) -> bool:
    return (REPO.joinpath(*name.split(".")) / "__init__.py").is_file()


def _is_module(name: str) -> bool:
    return name in MODULES


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in ``tree``; a name imported from a package
    counts as its submodule when it is one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            yield node.lineno, source
            for alias in node.names:
                if _is_module(f"{source}.{alias.name}"):
                    yield node.lineno, f"{source}.{alias.name}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def _within(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def crossing_imports(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    found = []
    sides = ("statemachine.decode", "statemachine.discovery")
    for module, (_, tree) in modules.items():
        for here, there in (sides, sides[::-1]):
            if not _within(module, here):
                continue
            for line, target in imports_of(module, tree):
                if _within(target, there):
                    found.append(f"{module}:{line} imports {target}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Private names taken from another module: ``from x import _y``, ``x._y`` on an imported
    module ``x``, and (in the receiver and the manager) ``obj._y`` on anything but ``self``."""
    found = []
    guarded = {"statemachine.decode.receiver", "statemachine.decode.manager"}
    for module, (_, tree) in modules.items():
        imported_modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                for alias in node.names:
                    bound = alias.asname or alias.name
                    if _is_module(f"{source}.{alias.name}"):
                        imported_modules.add(bound)
                    elif _private(alias.name) and source.startswith("statemachine"):
                        found.append(f"{module}:{node.lineno} imports {source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("statemachine"):
                        imported_modules.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in imported_modules:
                found.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
            elif module in guarded and not (
                isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            ):
                found.append(f"{module}:{node.lineno} reaches into {ast.unparse(node)}")
    return found


CLAIM_FIELDS = frozenset(f.name for f in dataclasses.fields(TopologyClaim))


def _strings(node: ast.expr) -> set[str]:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        }
    if isinstance(node, ast.Dict):
        return {
            k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
        }
    return set()


def topology_field_lists(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Every place that writes out all of the claim's fields: a class declaring them as its
    own fields, or a literal tuple/list/set/dict of their names."""
    found = []
    for module, (_, tree) in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                declared = {
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }
                if declared >= CLAIM_FIELDS:
                    found.append(f"{module}.{node.name} (class, line {node.lineno})")
            elif isinstance(node, ast.expr) and _strings(node) >= CLAIM_FIELDS:
                found.append(f"{module}:{node.lineno} (literal {type(node).__name__.lower()})")
    return found


def _ready_constant(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and (
        (isinstance(node.value, bytes) and node.value.startswith(b"READY"))
        or (isinstance(node.value, str) and node.value.startswith("READY"))
    )


def ready_readers(paths: list[Path]) -> list[str]:
    """Code that matches a ``READY`` line itself instead of calling ``read_ready``: a bytes
    ``READY`` constant (what a reader of a child's stdout compares with), or a ``READY`` text
    compared with, or passed to a method (``startswith``, ``partition``, ...)."""
    found = []
    for path in paths:
        if path == PACKAGE / "prefill" / "readiness.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                operands = list(node.args)
            elif isinstance(node, ast.Constant) and isinstance(node.value, bytes):
                operands = [node]
            else:
                continue
            if any(_ready_constant(operand) for operand in operands):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    return found


RANK_NAMES = {"dp_rank", "cp_rank", "tp_rank", "pp_rank"}


def rank_checks(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """``require_index("<rank>", ...)`` outside ``validation.require_rank``."""
    found = []
    for module, (_, tree) in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if module == "statemachine.validation" and node.name == "require_rank":
                continue
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id == "require_index"
                    and call.args
                    and isinstance(call.args[0], ast.Constant)
                    and call.args[0].value in RANK_NAMES
                ):
                    found.append(f"{module}:{call.lineno} {ast.unparse(call)}")
    return found


# --- the checks ----------------------------------------------------------------------------------


def test_every_module_was_parsed() -> None:
    for name in (
        "statemachine.decode.manager",
        "statemachine.decode.receiver",
        "statemachine.decode.rooms",
        "statemachine.decode.fetcher",
        "statemachine.decode.source",
        "statemachine.discovery.etcd_source",
        "statemachine.discovery.registrar",
        "statemachine.decode_on_etcd",
    ):
        assert name in MODULES


def test_no_import_crosses_decode_and_discovery() -> None:
    assert crossing_imports(MODULES) == []


def test_the_composing_module_is_above_both_sides() -> None:
    """The negative control of the check above: decode_on_etcd imports both sides, and the
    check does see imports (one of each kind is found when seeded)."""
    targets = {
        target
        for _, target in imports_of(
            "statemachine.decode_on_etcd", MODULES["statemachine.decode_on_etcd"][1]
        )
    }
    assert "statemachine.decode.manager" in targets
    assert "statemachine.discovery.etcd_source" in targets
    seeded = {
        "statemachine.decode.seeded": (
            PACKAGE / "decode" / "seeded.py",
            ast.parse(
                "import importlib\n"
                "from statemachine.discovery import changes\n"
                "if TYPE_CHECKING:\n    from ..discovery.gateway import TLSConfig\n"
                "importlib.import_module('statemachine.discovery.etcd_source')\n"
            ),
        ),
        "statemachine.discovery.seeded": (
            PACKAGE / "discovery" / "seeded.py",
            ast.parse("import statemachine.decode.client\n"),
        ),
    }
    assert len(crossing_imports(seeded)) == 5


def test_the_receiver_does_not_import_the_manager() -> None:
    """The receiver is handed its parts and never imports the manager (not even for type
    checking); nor does any part it is handed."""
    tree = MODULES["statemachine.decode.receiver"][1]
    targets = {target for _, target in imports_of("statemachine.decode.receiver", tree)}
    assert "statemachine.decode.manager" not in targets
    assert "statemachine.decode.parts" in targets  # the check sees the receiver's imports
    for part in (
        "rooms",
        "routes",
        "fanout",
        "fetcher",
        "completions",
        "dp_ranks",
        "config",
        "parts",
    ):
        name = f"statemachine.decode.{part}"
        imported = {target for _, target in imports_of(name, MODULES[name][1])}
        assert not imported & {"statemachine.decode.manager", "statemachine.decode.receiver"}


def test_no_private_name_crosses_modules() -> None:
    assert private_crossings(MODULES) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("statemachine.prefill.seeded", "from statemachine.decode.client import _Deadline\n", 1),
        ("statemachine.demo.seeded", "from statemachine.decode import holds\nholds._x\n", 1),
        ("statemachine.demo.seeded", "import statemachine.pool\nstatemachine._x\n", 1),
        ("statemachine.decode.manager", "def f(receiver):\n    receiver._lost = 1\n", 1),
        ("statemachine.decode.receiver", "def f(self):\n    self._m._ended(self)\n", 1),
        ("statemachine.decode.receiver", "def f(self):\n    self._fire(1)\n", 0),
    ],
)
def test_the_private_name_check_sees_each_kind(module: str, source: str, expected: int) -> None:
    assert len(private_crossings({module: (PACKAGE / "seeded.py", ast.parse(source))})) == expected


def test_the_topology_field_list_is_written_once() -> None:
    assert topology_field_lists(MODULES) == [
        "statemachine.validation.TopologyClaim (class, line "
        f"{_line_of('statemachine.validation', 'TopologyClaim')})"
    ]


def _line_of(module: str, cls: str) -> int:
    tree = MODULES[module][1]
    return next(n.lineno for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)


@pytest.mark.parametrize(
    "source",
    [
        "class _Claim:\n" + "".join(f"    {name}: int\n" for name in sorted(CLAIM_FIELDS)),
        "KEYS = frozenset((" + ", ".join(repr(n) for n in sorted(CLAIM_FIELDS)) + ", 'x'))\n",
        "REPLY = {" + ", ".join(f"{n!r}: 0" for n in sorted(CLAIM_FIELDS)) + "}\n",
    ],
)
def test_the_field_list_check_sees_a_second_list(source: str) -> None:
    seeded = {"statemachine.seeded": (PACKAGE / "seeded.py", ast.parse(source))}
    assert len(topology_field_lists(seeded)) == 1


def test_one_ready_reader() -> None:
    paths = sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "tests").glob("*.py"))
    paths += sorted((REPO / "benchmarks").glob("*.py"))
    paths = [p for p in paths if p != Path(__file__).resolve()]
    assert ready_readers(paths) == []


def test_one_rank_index_check() -> None:
    assert rank_checks(MODULES) == []
    seeded = ast.parse("def get_rank(dp_rank):\n    require_index('dp_rank', dp_rank)\n")
    assert len(rank_checks({"statemachine.seeded": (PACKAGE / "seeded.py", seeded)})) == 1


def stale_imports(paths: list[Path]) -> list[str]:
    """``from statemachine.x import name`` where ``statemachine.x`` has no ``name``."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and node.module
                and node.module.split(".")[0] == "statemachine"
            ):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and not _is_module(
                    f"{node.module}.{alias.name}"
                ):
                    found.append(
                        f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{alias.name}"
                    )
    return found


def test_every_import_of_the_package_names_what_is_there() -> None:
    paths = sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "tests").rglob("*.py"))
    paths += sorted((REPO / "benchmarks").glob("*.py"))
    assert stale_imports(paths) == []
