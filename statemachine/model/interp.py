"""A small TLC-style interpreter for the TLA+ subset ``TLA/BootstrapCache.tla`` uses.

It exists to check the mirror against the *text* of the spec without a JVM: it evaluates the
parse tree of the ``tla`` parser (``tla==0.0.4``) directly — ``Init``, ``Next``, and any
state or action formula — and the tests compare every reachable state and every step with
:mod:`statemachine.model.spec`. A change to the ``.tla`` that the mirror does not follow (or
the reverse) then fails in CI, although TLC itself is not installed there.

Successor states are generated the way TLC generates them: the conjuncts of an action are
taken left to right, ``x' = e`` assigns ``x'`` when it is not yet assigned and compares
otherwise, ``UNCHANGED`` assigns each variable its old value, and ``\\/``, ``\\E`` and ``IF``
split the search. It supports exactly what the spec uses (``Naturals``, ``FiniteSets``,
functions, ``EXCEPT`` with ``@``, ``LET``, ``CASE``, ``CHOOSE``, set comprehension and
quantifiers over finite sets) and raises :class:`InterpError` on anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import tla


class InterpError(Exception):
    """The interpreter met something outside the supported subset, or a run-time error."""


@dataclass(frozen=True, order=True)
class Atom:
    """A TLC model value (an identifier the spec does not define)."""

    name: str

    def __str__(self) -> str:
        return self.name


class Fn:
    """A TLA+ function with a finite domain; hashable, compared by its graph."""

    __slots__ = ("_hash", "items", "mapping")

    def __init__(self, pairs: Iterable[tuple[Any, Any]]) -> None:
        self.mapping: dict[Any, Any] = dict(pairs)
        self.items = tuple(sorted(self.mapping.items(), key=lambda kv: _sort_key(kv[0])))
        self._hash = hash(self.items)

    def __call__(self, key: Any) -> Any:
        try:
            return self.mapping[key]
        except KeyError:
            raise InterpError(f"{key!r} is not in the domain of {self!r}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fn) and self.items == other.items

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return "[" + ", ".join(f"{k} |-> {v!r}" for k, v in self.items) + "]"


class _Nat:
    """The set ``Nat`` (membership only)."""

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0


NAT = _Nat()


def _sort_key(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, value)


@dataclass(frozen=True)
class _Def:
    """A definition with its parameter names and the environment it closes over."""

    params: tuple[str, ...]
    body: Any
    env: Mapping[str, Any]


@dataclass(frozen=True)
class _FunctionSet:
    """``[domain -> codomain]`` (membership only)."""

    domain: frozenset[Any]
    codomain: Any


Primed = dict[str, Any]


class Interpreter:
    """Evaluate a parsed module for given constant values."""

    def __init__(self, module_text: str, constants: Mapping[str, Any]) -> None:
        tree = tla.parse(module_text)
        self.variables: list[str] = []
        self.constants: dict[str, Any] = dict(constants)
        self.defs: dict[str, _Def] = {}
        for unit in tree.units:
            kind = type(unit).__name__
            if kind == "Variables":
                self.variables += [n.operator for n in unit.names]
            elif kind == "Constants":
                for n in unit.names:
                    if n.operator not in self.constants:
                        raise InterpError(f"no value for constant {n.operator}")
            elif kind == "OperatorDefinition":
                params = tuple(p.operator for p in unit.arity or ())
                self.defs[unit.name] = _Def(params, unit.definiens, {})

    # --- public API ---------------------------------------------------------------------------

    def init_states(self) -> list[dict[str, Any]]:
        """All states satisfying ``Init`` (its conjuncts assign the unprimed variables)."""
        results = self._act(self.defs["Init"].body, {}, {}, {}, init=True)
        return [r for r in results if set(r) == set(self.variables)]

    def successors(self, name: str, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every successor of ``state`` by the action named ``name`` (e.g. ``Next``)."""
        out = []
        for primed in self._act(self.defs[name].body, {}, dict(state), {}):
            if set(primed) != set(self.variables):
                missing = set(self.variables) - set(primed)
                raise InterpError(f"{name} leaves {sorted(missing)} unassigned")
            out.append(primed)
        return out

    def holds(
        self,
        name: str,
        state: Mapping[str, Any],
        next_state: Mapping[str, Any] | None = None,
        args: tuple[Any, ...] = (),
    ) -> bool:
        """Evaluate the definition ``name(args)`` on a state (or a step)."""
        definition = self.defs[name]
        env = dict(zip(definition.params, args, strict=True))
        value = self._ev(definition.body, env, dict(state), dict(next_state or {}))
        if not isinstance(value, bool):
            raise InterpError(f"{name} is not a predicate")
        return value

    def step_property(
        self, name: str, state: Mapping[str, Any], next_state: Mapping[str, Any]
    ) -> bool:
        """Evaluate a property ``name == [][A]_v`` on the step ``state -> next_state``."""
        body = self.defs[name].body
        if not (
            type(body).__name__ == "OperatorApplication"
            and body.operator == "[]"
            and type(body.arguments[0]).__name__ == "SubscriptedAction"
            and body.arguments[0].operator == "["
        ):
            raise InterpError(f"{name} is not of the form [][A]_v")
        sub = body.arguments[0]
        s, t = dict(state), dict(next_state)
        if self._ev(sub.subscript, {}, t, t) == self._ev(sub.subscript, {}, s, s):
            return True  # a stuttering step satisfies [A]_v
        return bool(self._ev(sub.action, {}, s, t))

    def evaluate(self, name: str, state: Mapping[str, Any]) -> Any:
        return self._ev(self.defs[name].body, {}, dict(state), {})

    # --- actions ----------------------------------------------------------------------------

    def _act(
        self,
        node: Any,
        env: Mapping[str, Any],
        state: dict[str, Any],
        primed: Primed,
        init: bool = False,
    ) -> list[Primed]:
        """All extensions of ``primed`` that make the action ``node`` true."""
        kind = type(node).__name__
        if kind == "Parentheses":
            return self._act(node.expression, env, state, primed, init)
        if kind == "VerticalList" or (
            kind == "OperatorApplication" and node.operator in ("/\\", "\\/")
        ):
            items = [
                (item.expression if type(item).__name__ == "VerticalItem" else item)
                for item in node.arguments
            ]
            if node.operator == "\\/":
                out: list[Primed] = []
                for item in items:
                    out += self._act(item, env, state, primed, init)
                return out
            partials = [primed]
            for item in items:
                partials = [done for p in partials for done in self._act(item, env, state, p, init)]
                if not partials:
                    break
            return partials
        if kind == "Quantification" and node.quantifier == "\\E":
            out = []
            for binding in self._bindings(node.declarations, env, state, primed):
                out += self._act(node.predicate, {**env, **binding}, state, primed, init)
            return out
        if kind == "If":
            cond = self._ev(node.predicate, env, state, primed)
            return self._act(node.then if cond else node.else_, env, state, primed, init)
        if kind == "Let":
            return self._act(node.expression, self._let(node, env), state, primed, init)
        if kind == "OperatorApplication":
            op = node.operator
            if op == "UNCHANGED":
                return self._unchanged(node.arguments[0], state, primed)
            if op == "=":
                target = self._assignable(node.arguments[0], env, init)
                if target is not None and target not in primed:
                    # In Init the assigned unprimed variables are the state so far.
                    value = self._ev(node.arguments[1], env, primed if init else state, primed)
                    return [{**primed, target: value}]
            definition = self._lookup_def(op, env)
            if definition is not None:
                args = [self._ev(a, env, state, primed) for a in node.arguments or ()]
                inner = {**definition.env, **dict(zip(definition.params, args, strict=True))}
                return self._act(definition.body, inner, state, primed, init)
        value = self._ev(node, env, primed if init else state, primed)
        if not isinstance(value, bool):
            raise InterpError(f"action conjunct is not boolean: {value!r}")
        return [primed] if value else []

    def _assignable(self, node: Any, env: Mapping[str, Any], init: bool) -> str | None:
        if type(node).__name__ != "OperatorApplication":
            return None
        if init and node.arguments is None and node.operator in self.variables:
            return str(node.operator) if node.operator not in env else None
        if node.operator == "'" and not init:
            inner = node.arguments[0]
            if type(inner).__name__ == "OperatorApplication" and inner.operator in self.variables:
                return str(inner.operator)
        return None

    def _unchanged(self, node: Any, state: dict[str, Any], primed: Primed) -> list[Primed]:
        names: list[str] = []
        self._collect_vars(node, names)
        result = dict(primed)
        for name in names:
            if name in result:
                if result[name] != state[name]:
                    return []
            else:
                result[name] = state[name]
        return [result]

    def _collect_vars(self, node: Any, names: list[str]) -> None:
        kind = type(node).__name__
        if kind == "Tuple":
            for item in node.items:
                self._collect_vars(item, names)
        elif kind == "OperatorApplication" and node.arguments is None:
            if node.operator in self.variables:
                names.append(node.operator)
            elif node.operator in self.defs:
                self._collect_vars(self.defs[node.operator].body, names)
            else:
                raise InterpError(f"UNCHANGED of {node.operator}")
        else:
            raise InterpError(f"unsupported UNCHANGED argument {kind}")

    # --- expressions ------------------------------------------------------------------------

    def _lookup_def(self, name: str, env: Mapping[str, Any]) -> _Def | None:
        local = env.get(name)
        if isinstance(local, _Def):
            return local
        if name in env:
            return None
        return self.defs.get(name)

    def _let(self, node: Any, env: Mapping[str, Any]) -> dict[str, Any]:
        inner = dict(env)
        for definition in node.definitions:
            params = tuple(p.operator for p in definition.arity or ())
            # Definitions may use earlier ones of the same LET: close over ``inner``.
            inner[definition.name] = _Def(params, definition.definiens, inner)
        return inner

    def _bindings(
        self, declarations: Any, env: Mapping[str, Any], state: dict[str, Any], primed: Primed
    ) -> Iterator[dict[str, Any]]:
        """Every assignment to the bound names of ``x \\in S, y \\in T``."""
        names: list[str] = []
        domains: list[list[Any]] = []
        for decl in declarations if isinstance(declarations, list) else [declarations]:
            if type(decl).__name__ != "OperatorApplication" or decl.operator != "\\in":
                raise InterpError("only bounded quantifiers are supported")
            bound, domain = decl.arguments
            values = self._ev(domain, env, state, primed)
            if not isinstance(values, frozenset):
                raise InterpError("a quantifier's domain must be a finite set")
            bound_names = (
                [b.operator for b in bound.items]
                if type(bound).__name__ == "Tuple"
                else [bound.operator]
            )
            for name in bound_names:
                names.append(name)
                domains.append(sorted(values, key=_sort_key))

        def product(k: int, acc: dict[str, Any]) -> Iterator[dict[str, Any]]:
            if k == len(names):
                yield dict(acc)
                return
            for value in domains[k]:
                acc[names[k]] = value
                yield from product(k + 1, acc)

        yield from product(0, {})

    def _ev(self, node: Any, env: Mapping[str, Any], state: dict[str, Any], primed: Primed) -> Any:
        kind = type(node).__name__
        if kind == "IntegralNumeral":
            return int(node.value)
        if kind == "StringLiteral":
            return str(node.value)[1:-1]
        if kind == "BooleanLiteral":
            return node.value == "TRUE"
        if kind == "Parentheses":
            return self._ev(node.expression, env, state, primed)
        if kind in ("VerticalList", "VerticalItem"):
            if kind == "VerticalItem":
                return self._ev(node.expression, env, state, primed)
            conj = node.operator == "/\\"
            for item in node.arguments:
                value = self._ev(item, env, state, primed)
                if value is not conj:
                    return value
            return conj
        if kind == "SetEnumeration":
            return frozenset(self._ev(i, env, state, primed) for i in node.items)
        if kind == "Tuple":
            return tuple(self._ev(i, env, state, primed) for i in node.items)
        if kind == "SetComprehension":
            return frozenset(
                self._ev(node.item, {**env, **b}, state, primed)
                for b in self._bindings(node.declarations, env, state, primed)
            )
        if kind == "SetSlice":
            found = []
            for binding in self._bindings(node.declaration, env, state, primed):
                if self._ev(node.predicate, {**env, **binding}, state, primed):
                    ((_, value),) = binding.items()
                    found.append(value)
            return frozenset(found)
        if kind == "Function":
            pairs = []
            for binding in self._bindings(node.declaration, env, state, primed):
                ((_, key),) = binding.items()
                pairs.append((key, self._ev(node.value, {**env, **binding}, state, primed)))
            return Fn(pairs)
        if kind == "FunctionApplication":
            fn = self._ev(node.function, env, state, primed)
            (arg,) = [self._ev(a, env, state, primed) for a in node.arguments]
            if not isinstance(fn, Fn):
                raise InterpError(f"applying a non-function {fn!r}")
            return fn(arg)
        if kind == "Except":
            fn = self._ev(node.function, env, state, primed)
            mapping = dict(fn.mapping)
            for change in node.changes:
                ((key_node,),) = change.item
                key = self._ev(key_node, env, state, primed)
                if key not in mapping:
                    return Fn(mapping.items())  # TLC: EXCEPT outside the domain changes nothing
                mapping[key] = self._ev(
                    change.expression, {**env, "@": mapping[key]}, state, primed
                )
            return Fn(mapping.items())
        if kind == "If":
            cond = self._ev(node.predicate, env, state, primed)
            return self._ev(node.then if cond else node.else_, env, state, primed)
        if kind == "Cases":
            for case in node.cases:
                if self._ev(case.predicate, env, state, primed):
                    return self._ev(case.expression, env, state, primed)
            if node.other is None:
                raise InterpError("no CASE arm applies")
            return self._ev(node.other, env, state, primed)
        if kind == "Let":
            return self._ev(node.expression, self._let(node, env), state, primed)
        if kind == "Quantification":
            universal = node.quantifier == "\\A"
            for binding in self._bindings(node.declarations, env, state, primed):
                if bool(self._ev(node.predicate, {**env, **binding}, state, primed)) != universal:
                    return not universal
            return universal
        if kind == "Choose":
            for binding in self._bindings(node.declaration, env, state, primed):
                if self._ev(node.predicate, {**env, **binding}, state, primed):
                    ((_, value),) = binding.items()
                    return value
            raise InterpError("CHOOSE found nothing")
        if kind == "SetOfFunctions":
            return _FunctionSet(
                self._ev(node.domain, env, state, primed),
                self._ev(node.codomain, env, state, primed),
            )
        if kind == "OperatorApplication":
            return self._apply(node, env, state, primed)
        if isinstance(node, str) and node == "@":
            return env["@"]
        raise InterpError(f"unsupported expression {kind}")

    def _apply(
        self, node: Any, env: Mapping[str, Any], state: dict[str, Any], primed: Primed
    ) -> Any:
        op = node.operator
        args = node.arguments
        if args is None:
            return self._name(op, env, state, primed)
        ev = self._ev
        if op == "'":
            (inner,) = args
            name = inner.operator
            if name not in primed:
                raise InterpError(f"{name}' is not assigned yet")
            return primed[name]
        if op == "/\\":
            return all(ev(a, env, state, primed) for a in args)
        if op == "\\/":
            return any(ev(a, env, state, primed) for a in args)
        if op == "=>":
            return (not ev(args[0], env, state, primed)) or bool(ev(args[1], env, state, primed))
        if op == "~":
            return not ev(args[0], env, state, primed)
        if op == "UNCHANGED":
            names: list[str] = []
            self._collect_vars(args[0], names)
            return all(primed[n] == state[n] for n in names)
        if op in ("\\in", "\\notin"):
            member = ev(args[0], env, state, primed)
            container = ev(args[1], env, state, primed)
            found = self._member(member, container, env, state, primed)
            return found if op == "\\in" else not found
        definition = self._lookup_def(op, env)
        if definition is not None:
            values = [ev(a, env, state, primed) for a in args]
            inner = {**definition.env, **dict(zip(definition.params, values, strict=True))}
            return ev(definition.body, inner, state, primed)
        values = [ev(a, env, state, primed) for a in args]
        return _builtin(op, values)

    def _member(
        self,
        member: Any,
        container: Any,
        env: Mapping[str, Any],
        state: dict[str, Any],
        primed: Primed,
    ) -> bool:
        if isinstance(container, _FunctionSet):
            return (
                isinstance(member, Fn)
                and frozenset(member.mapping) == container.domain
                and all(
                    self._member(v, container.codomain, env, state, primed)
                    for v in member.mapping.values()
                )
            )
        if isinstance(container, frozenset):
            return member in container
        if container is NAT:
            return member in NAT
        raise InterpError(f"membership in {container!r}")

    def _name(
        self, name: str, env: Mapping[str, Any], state: dict[str, Any], primed: Primed
    ) -> Any:
        if name in env:
            value = env[name]
            if isinstance(value, _Def):
                return self._ev(value.body, value.env, state, primed)
            return value
        if name in self.constants:
            return self.constants[name]
        if name in self.variables:
            if name not in state:
                raise InterpError(f"variable {name} has no value")
            return state[name]
        if name == "Nat":
            return NAT
        if name in self.defs:
            definition = self.defs[name]
            return self._ev(definition.body, definition.env, state, primed)
        raise InterpError(f"unknown name {name}")


def _builtin(op: str, values: list[Any]) -> Any:
    if op == "=":
        return values[0] == values[1]
    if op in ("#", "/="):
        return values[0] != values[1]
    if op == "+":
        return values[0] + values[1]
    if op == "-":
        return values[0] - values[1]
    if op == "<":
        return values[0] < values[1]
    if op in ("<=", "=<", "\\leq"):
        return values[0] <= values[1]
    if op == ">":
        return values[0] > values[1]
    if op in (">=", "\\geq"):
        return values[0] >= values[1]
    if op == "\\div":
        return values[0] // values[1]
    if op == "^":
        return values[0] ** values[1]
    if op == "..":
        return frozenset(range(values[0], values[1] + 1))
    if op == "\\cup":
        return values[0] | values[1]
    if op == "\\cap":
        return values[0] & values[1]
    if op == "\\":
        return values[0] - values[1]
    if op == "\\subseteq":
        return values[0] <= values[1]
    if op == "Cardinality":
        return len(values[0])
    raise InterpError(f"unsupported operator {op}")
