"""``pd-bootstrap check [CFG] [--list]``: model-check the mirror for one cfg.

``CFG`` is a shipped cfg's name (``MCEtcd``, ``MCEtcd.cfg``) or the path of any cfg; ``--list``
names the shipped ones with their first comment line (which says what each checks and which
must fail), so a user of the wheel never needs its site-packages path.

Prints progress to stderr while it runs, then a summary (distinct states, depth, seconds, each
invariant/property held or violated) and, for the first violated one, the counterexample.
Exit status: 0 all hold, 1 something is violated, 2 usage or cfg error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from statemachine import cli_help
from statemachine.errors import CfgError
from statemachine.model.cfg import Cfg, CfgValue, ModelValue, read_cfg
from statemachine.model.checker import Result, check, format_counterexample
from statemachine.model.spec import (
    ACTION_PROPERTIES,
    CONSTANTS,
    INVARIANTS,
    LIVENESS_PROPERTIES,
    BootstrapCache,
    Constants,
)
from statemachine.progname import prog

#: ``TLA/`` next to the package (the repository layout; the package is installed editable), else
#: the copy an installed wheel carries as package data (``statemachine/model/tla``).
_REPO_TLA = Path(__file__).resolve().parents[2] / "TLA"
TLA_DIR = _REPO_TLA if _REPO_TLA.is_dir() else Path(__file__).resolve().parent / "tla"
DEFAULT_CONFIG = TLA_DIR / "MCSmall.cfg"


@dataclass
class Loaded:
    """A cfg turned into a mirror model and the names to check."""

    cfg: Cfg
    model: BootstrapCache
    invariants: list[str]
    properties: list[str]
    fair: bool


def _model_values(value: CfgValue, name: str, path: str) -> tuple[str, ...]:
    if not isinstance(value, frozenset) or not all(isinstance(v, ModelValue) for v in value):
        raise CfgError(f"{name} must be a set of model values", path=path)
    return tuple(sorted(str(v) for v in value))


def _naturals(value: CfgValue, name: str, path: str) -> tuple[int, ...]:
    if not isinstance(value, frozenset) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise CfgError(f"{name} must be a set of integers", path=path)
    return tuple(sorted(int(v) for v in value if isinstance(v, int)))


def _natural(value: CfgValue, name: str, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CfgError(f"{name} must be an integer", path=path)
    return value


def _string(value: CfgValue, name: str, path: str) -> str:
    if not isinstance(value, str) or isinstance(value, ModelValue):
        raise CfgError(f'{name} must be a string such as "Correct"', path=path)
    return value


def _boolean(value: CfgValue, name: str, path: str) -> bool:
    if not isinstance(value, bool):
        raise CfgError(f"{name} must be TRUE or FALSE", path=path)
    return value


def load(path: str | Path) -> Loaded:
    """Read a cfg and build the mirror. Raises :class:`CfgError` on anything it cannot check."""
    cfg = read_cfg(path)
    where = cfg.path
    if cfg.specification not in (None, "Spec"):
        raise CfgError(f"unknown SPECIFICATION {cfg.specification!r} (expected Spec)", path=where)
    if cfg.specification is None and (cfg.init, cfg.next) != ("Init", "Next"):
        raise CfgError("INIT/NEXT must be Init and Next", path=where)
    missing = [name for name in CONSTANTS if name not in cfg.constants]
    extra = [name for name in cfg.constants if name not in CONSTANTS]
    if missing or extra:
        raise CfgError(f"constants missing {missing}, unknown {extra}", path=where)
    c = cfg.constants
    try:
        constants = Constants(
            receivers=_model_values(c["Receivers"], "Receivers", where),
            addrs=_naturals(c["Addrs"], "Addrs", where),
            max_restarts=_natural(c["MaxRestarts"], "MaxRestarts", where),
            max_faults=_natural(c["MaxFaults"], "MaxFaults", where),
            mode=_string(c["Mode"], "Mode", where),
            variant=_string(c["Variant"], "Variant", where),
            discovery=_string(c["Discovery"], "Discovery", where),
            ranks=_model_values(c["Ranks"], "Ranks", where),
            policy=_string(c["Policy"], "Policy", where),
            kv_release=_boolean(c["KVRelease"], "KVRelease", where),
        )
    except ValueError as exc:
        raise CfgError(f"ASSUME violated: {exc}", path=where) from None
    for name in cfg.invariants:
        if name not in INVARIANTS:
            raise CfgError(f"unknown invariant {name!r}", path=where)
    for name in cfg.properties:
        if name not in ACTION_PROPERTIES and name not in LIVENESS_PROPERTIES:
            raise CfgError(f"unknown property {name!r}", path=where)
    fair = cfg.specification == "Spec"
    if not fair and any(p in LIVENESS_PROPERTIES for p in cfg.properties):
        raise CfgError("liveness properties need SPECIFICATION Spec (fairness)", path=where)
    return Loaded(cfg, BootstrapCache(constants), cfg.invariants, cfg.properties, fair)


def run(loaded: Loaded, *, progress: bool = False) -> Result:
    """Check a loaded cfg."""
    return check(
        loaded.model,
        invariants=loaded.invariants,
        properties=loaded.properties,
        check_deadlock=loaded.cfg.check_deadlock,
        fair=loaded.fair,
        progress=progress,
    )


def shown(path: str | Path) -> str:
    """A cfg's path as the user reads it: relative to the working folder when under it."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)


def shipped() -> list[Path]:
    """The cfgs shipped with the package (the repository's ``TLA/``, or the wheel's copy)."""
    return sorted(TLA_DIR.glob("*.cfg"))


def describe(path: Path) -> str:
    """A cfg's first comment line (``\\* CI config: ...``), or nothing."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("\\*"):
            return line[2:].strip()
        if line.strip():
            break
    return ""


def resolve(name: str) -> Path:
    """A shipped cfg by name (``MCEtcd``, ``MCEtcd.cfg``), else ``name`` as a path."""
    if "/" not in name and "\\" not in name:
        candidate = TLA_DIR / (name if name.endswith(".cfg") else f"{name}.cfg")
        if candidate.is_file():
            return candidate
        if not name.endswith(".cfg"):
            names = ", ".join(p.stem for p in shipped())
            raise CfgError(f"no shipped cfg named {name!r}: pick one of {names} (or give a path)")
    return Path(name)


def listing() -> str:
    lines = [f"shipped cfgs (in {TLA_DIR}):"]
    lines += [f"  {p.stem:<26} {describe(p)}" for p in shipped()]
    lines.append(f"check one: {prog('check')} NAME (e.g. {prog('check')} MCEtcd)")
    return "\n".join(lines)


def summary(loaded: Loaded, result: Result) -> str:
    lines = [
        f"config: {shown(loaded.cfg.path)}",
        f"{result.distinct_states} distinct states found, depth {result.depth}, "
        f"{result.transitions} transitions, {result.seconds:.2f} s",
    ]
    for name, held in result.verdicts.items():
        lines.append(f"  {name:<30} {'held' if held else 'VIOLATED'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = cli_help.parser(
        prog("check"),
        "Model-check the Python mirror of the TLA+ spec (BootstrapCache.tla) for one cfg.\n\n"
        "Explores every reachable state and reports each invariant and property.\n"
        "Exit 0: all hold; 1: one is violated (the bug-variant cfgs must fail); 2: usage or\n"
        "cfg error.",
    )
    parser.add_argument(
        "cfg",
        nargs="?",
        default="MCSmall",
        help="a shipped cfg's name (see --list) or the path of a TLC .cfg",
    )
    parser.add_argument("--config", default=None, help="the same as CFG (kept for old scripts)")
    parser.add_argument("--list", action="store_true", help="list the shipped cfgs and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if args.list:
        print(listing())
        return 0
    try:
        loaded = load(resolve(args.config or args.cfg))
    except CfgError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"checking {shown(loaded.cfg.path)} ...", file=sys.stderr)
    result = run(loaded, progress=not args.quiet)
    print(summary(loaded, result))
    violation = result.first_violation()
    if violation is None:
        return 0
    variant = loaded.model.variant
    if variant != "Correct":
        print(
            f"expected: this cfg runs the bug variant {variant!r} (Variant in the cfg), which "
            "the model must catch; VIOLATED is this cfg's expected result (exit 1). The "
            "'Correct' cfgs (MCSmall, the default) are the ones that must hold."
        )
    print()
    print(format_counterexample(loaded.model, violation))
    return 1
