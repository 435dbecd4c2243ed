"""Seeded bugs in ``statemachine/pool.py``, written as exact source rewrites.

Each :class:`Mutant` names the function it breaks and the (old, new) text replacements that
break it. :func:`write_mutant` applies them to the current text of ``statemachine/pool.py``
and refuses if any ``old`` text is not found exactly once, so a refactor of the pool makes the
mutant tests fail loudly instead of silently testing an unmutated copy.

A mutated copy is a stand-alone module (``pool_<name>.py``): it imports ``statemachine.trace``
like the original and nothing imports it back, so it can be checked by CrossHair
(``crosshair check pool_<name>.function``) or loaded with :func:`load_module` and driven by
the Hypothesis tests.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

POOL_SOURCE = Path(__file__).resolve().parents[2] / "statemachine" / "pool.py"

_IS_TEST = "        if current is generation:\n            del pool[key]\n"
_VALUE_GENERATION = (
    "@dataclass(frozen=True, eq=False, slots=True)\nclass Generation:",
    "@dataclass(frozen=True, eq=True, slots=True)\nclass Generation:",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    #: the function the rewrite breaks (what ``crosshair check module.function`` targets)
    function: str
    edits: tuple[tuple[str, str], ...]
    #: why it matters, for the report
    bug: str
    #: True when no test can tell it from the original (an equivalent mutant)
    equivalent: bool = False


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "delete_by_key",
        "invalidate_entries",
        ((_IS_TEST, "        if current is not None:\n            del pool[key]\n"),),
        "a stale receiver's failure deletes a fresh generation another receiver published",
    ),
    Mutant(
        "eq_not_is",
        "invalidate_entries",
        ((_IS_TEST, _IS_TEST.replace(" is generation", " == generation")),),
        "value comparison; harmless only because Generation has eq=False",
        equivalent=True,
    ),
    Mutant(
        "eq_not_is_value_generation",
        "invalidate_entries",
        (
            (_IS_TEST, _IS_TEST.replace(" is generation", " == generation")),
            _VALUE_GENERATION,
        ),
        "value comparison with value-equal generations: a refetch with equal ports is deleted",
    ),
    Mutant(
        "stop_after_first",
        "invalidate_entries",
        (("            removed += 1\n", "            removed += 1\n            break\n"),),
        "a failing receiver leaves its other stale entries in the pool",
    ),
    Mutant(
        "address_stop_after_first",
        "invalidate_address_entries",
        (
            (
                "    doomed = [key for key in pool if key.addr == addr]\n",
                "    doomed = [key for key in pool if key.addr == addr][:1]\n",
            ),
        ),
        "a node failure removes only one of the dead node's entries",
    ),
    Mutant(
        "overwrite_not_setdefault",
        "publish_entry",
        (
            (
                "    return pool.setdefault(key, fresh)\n",
                "    pool[key] = fresh\n    return fresh\n",
            ),
        ),
        "the last publisher wins: the earlier winner's adopters hold an orphaned generation",
    ),
    Mutant(
        "prefix_address",
        "invalidate_address_entries",
        (
            (
                "    doomed = [key for key in pool if key.addr == addr]\n",
                "    doomed = [key for key in pool if key.addr.startswith(addr)]\n",
            ),
        ),
        "SGLang's node-failure bug: host:80 also wipes host:8000",
    ),
    Mutant(
        "prefix_retire",
        "retire_instance_entries",
        (
            (
                "        if key.addr == addr and generation.instance_id",
                "        if key.addr.startswith(addr) and generation.instance_id",
            ),
        ),
        "a restart seen at host:80 retires host:8000's entries with that instance id",
        # Instance ids are unique per server process, so no entry of host:8000 carries an id of
        # host:80's: the address filter is redundant and no test can tell (CrossHair, which
        # picks the ids itself, still finds the contract broken).
        equivalent=True,
    ),
    Mutant(
        "retire_all_but_observed",
        "retire_instance_entries",
        (
            (
                "        if key.addr == addr and generation.instance_id == instance_id\n",
                "        if key.addr == addr\n"
                "        and generation.instance_id not in (None, instance_id)\n",
            ),
        ),
        "the old observe_instance rule on the new call: every instance but the one named goes,\n"
        "the live one included",
    ),
)

#: Not a bug: the design change under which ``eq_not_is`` stops being equivalent. Applied on
#: its own it must pass everything (the pool itself only ever compares with ``is``).
VALUE_GENERATION_ONLY = Mutant(
    "value_generation_only",
    "invalidate_entries",
    (_VALUE_GENERATION,),
    "control: Generation compares by value, pool unchanged",
    equivalent=True,
)

BY_NAME = {m.name: m for m in (*MUTANTS, VALUE_GENERATION_ONLY)}


class RewriteNotApplied(AssertionError):
    """A mutant's ``old`` text is not in the pool source exactly once."""


def mutated_source(mutant: Mutant, source: str | None = None) -> str:
    text = POOL_SOURCE.read_text() if source is None else source
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise RewriteNotApplied(f"{mutant.name}: {old!r} found {count} times, expected 1")
        text = text.replace(old, new)
    return text


def write_mutant(mutant: Mutant, directory: Path) -> Path:
    """Write ``pool_<name>.py`` into ``directory``; return its path."""
    path = directory / f"pool_{mutant.name}.py"
    path.write_text(mutated_source(mutant))
    return path


def load_module(path: Path) -> ModuleType:
    """Import a mutated pool file under its own module name (never as ``statemachine.pool``)."""
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look the module up in sys.modules while building the class.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
