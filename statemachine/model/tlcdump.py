"""Read the states TLC writes with ``-dump FILE`` as the mirror's :class:`State` values.

``make tlc`` compares TLC's reachable states with the mirror's *as sets*, not only their
counts: a drift of the mirror that happened to keep every count and verdict would still show
as a state one side has and the other has not. TLC writes each distinct state as

    State 7:
    /\\ rstate = (r1 :> "idle" @@ r2 :> "cached")
    /\\ objEpoch = <<0, 1, 0>>
    /\\ acked = (r1 :> (p1 :> 0))
    /\\ marked = {r2}
    /\\ fate = <<"open", "free", "free">>

so values are integers, strings, model values (bare names), sets ``{...}``, sequences
``<<...>>`` (a function with domain ``1..n``) and functions ``(k :> v @@ ...)``; that is all
the spec's variables hold. Anything else is a :class:`DumpError`.
"""

from __future__ import annotations

import re
from pathlib import Path

from statemachine.errors import DumpError
from statemachine.model.spec import VARIABLES, BootstrapCache, State

#: A TLC value: int, str (a string), ModelName (a model value), frozenset, tuple, or dict.
Value = object

_TOKEN = re.compile(r'\s*(?:(-?\d+)|("(?:[^"\\]|\\.)*")|([A-Za-z_]\w*)|(<<|>>|:>|@@|[{}(),]))')


class ModelName(str):
    """A model value in a dump (``r1``), kept apart from a string (``"idle"``)."""

    __slots__ = ()


def _tokens(text: str) -> list[str | int]:
    out: list[str | int] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise DumpError(f"unexpected text in a TLC value: {text[pos : pos + 40]!r}")
        number, string, name, punct = match.groups()
        if number is not None:
            out.append(int(number))
        elif string is not None:
            out.append(string)  # kept quoted: told apart from names and punctuation
        elif name is not None:
            out.append(ModelName(name))
        else:
            out.append(punct)
        pos = match.end()
    return out


def parse_value(text: str) -> Value:
    """One TLC value, as printed in a dump."""
    tokens = _tokens(text)
    value, rest = _value(tokens, 0)
    if rest != len(tokens):
        raise DumpError(f"trailing text after a TLC value: {text!r}")
    return value


def _value(tokens: list[str | int], i: int) -> tuple[Value, int]:
    if i >= len(tokens):
        raise DumpError("a TLC value ends too early")
    token = tokens[i]
    if isinstance(token, int):
        return token, i + 1
    if isinstance(token, ModelName):
        return token, i + 1
    if token.startswith('"'):
        return token[1:-1], i + 1
    if token in ("{", "<<"):
        close = "}" if token == "{" else ">>"
        items: list[Value] = []
        i += 1
        while tokens[i] != close:
            item, i = _value(tokens, i)
            items.append(item)
            if tokens[i] == ",":
                i += 1
        return (frozenset(items) if close == "}" else tuple(items)), i + 1
    if token == "(":
        mapping: dict[Value, Value] = {}
        i += 1
        while True:
            key, i = _value(tokens, i)
            if tokens[i] != ":>":
                raise DumpError("a function in a dump without ':>'")
            mapping[key], i = _value(tokens, i + 1)
            if tokens[i] == ")":
                return mapping, i + 1
            if tokens[i] != "@@":
                raise DumpError("a function in a dump without '@@'")
            i += 1
    raise DumpError(f"unexpected token {token!r} in a TLC value")


def read_dump(path: str | Path) -> list[dict[str, Value]]:
    """Every state of a ``-dump`` file, as ``{variable: value}``."""
    states: list[dict[str, Value]] = []
    current: dict[str, Value] | None = None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if re.match(r"State \d+:", line):
            current = {}
            states.append(current)
        elif line.startswith("/\\ ") and current is not None:
            name, _, text = line[3:].partition(" = ")
            current[name] = parse_value(text)
    return states


def to_state(model: BootstrapCache, values: dict[str, Value]) -> State:
    """A dumped state in the mirror's encoding (receivers, addresses, ranks in sorted order)."""
    if set(values) != set(VARIABLES):
        raise DumpError(f"dumped variables {sorted(values)} are not the spec's")

    def function(name: str) -> dict[Value, Value]:
        value = values[name]
        if not isinstance(value, dict):
            raise DumpError(f"{name} is not a function in the dump")
        return value

    def names(name: str) -> frozenset[str]:
        value = values[name]
        if not isinstance(value, frozenset):
            raise DumpError(f"{name} is not a set in the dump")
        return frozenset(str(v) for v in value)

    def ints(items: tuple[Value, ...] | list[Value]) -> tuple[int, ...]:
        if not all(isinstance(v, int) for v in items):
            raise DumpError("expected integers in the dump")
        return tuple(v for v in items if isinstance(v, int))

    def per(name: str, domain: tuple[str, ...] | tuple[int, ...]) -> list[Value]:
        table = function(name)
        return [table[ModelName(d) if isinstance(d, str) else d] for d in domain]

    acked = []
    for row in per("acked", model.receivers):
        if not isinstance(row, dict):
            raise DumpError("acked[r] is not a function in the dump")
        acked.append(ints([row[ModelName(p)] for p in model.ranks]))
    obj_epoch = values["objEpoch"]
    pooled = values["pooled"]
    faults = values["faults"]
    fate = values["fate"]
    if not isinstance(obj_epoch, tuple) or not isinstance(pooled, frozenset):
        raise DumpError("objEpoch or pooled has an unexpected form in the dump")
    if not isinstance(fate, tuple) or not all(
        isinstance(v, str) and not isinstance(v, ModelName) for v in fate
    ):
        raise DumpError("fate is not a sequence of strings in the dump")
    if not isinstance(faults, int):
        raise DumpError("faults is not an integer in the dump")

    def rank_states(name: str) -> tuple[tuple[str, ...], ...]:
        rows = []
        for row in per(name, model.addrs):
            if not isinstance(row, dict):
                raise DumpError(f"{name}[a] is not a function in the dump")
            rows.append(tuple(str(row[ModelName(p)]) for p in model.ranks))
        return tuple(rows)

    told = []
    for ranks in per("told", model.receivers):
        if not isinstance(ranks, frozenset):
            raise DumpError("told[r] is not a set in the dump")
        told.append(frozenset(str(p) for p in ranks))
    return State(
        rstate=tuple(str(v) for v in per("rstate", model.receivers)),
        rkey=ints(per("rkey", model.receivers)),
        rgen=ints(per("rgen", model.receivers)),
        pool=ints(per("pool", model.addrs)),
        objEpoch=ints(obj_epoch),
        epoch=ints(per("epoch", model.addrs)),
        faults=faults,
        acked=tuple(acked),
        pooled=frozenset(ints(tuple(pooled))),
        watched=ints(per("watched", model.addrs)),
        marked=names("marked"),
        notified=names("notified"),
        flight=ints(per("flight", model.addrs)),
        rflight=ints(per("rflight", model.receivers)),
        fate=tuple(str(v) for v in fate),
        kv=tuple(str(v) for v in per("kv", model.receivers)),
        told=tuple(told),
        kvAddr=ints(per("kvAddr", model.receivers)),
        kvEpoch=ints(per("kvEpoch", model.receivers)),
        proc=rank_states("proc"),
        heard=rank_states("heard"),
    )
