"""Read the TLC ``.cfg`` files under ``TLA/`` — the same files TLC reads.

Supported: ``SPECIFICATION``, ``INIT``/``NEXT``, ``CONSTANT(S)`` with ``=`` assignments
(integers, strings, ``TRUE``/``FALSE``, model values, sets ``{...}`` and tuples ``<<...>>``),
``INVARIANT(S)``, ``PROPERTY``/``PROPERTIES``, ``CHECK_DEADLOCK``; comments ``\\*`` and
``(* ... *)``. Anything the mirror cannot reproduce exactly (``SYMMETRY``, ``VIEW``,
``CONSTRAINT``, ``<-`` substitutions, ...) is a :class:`CfgError`, because silently ignoring
it would make the mirror's state count differ from TLC's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from statemachine.errors import CfgError


class ModelValue(str):
    """A TLC model value: an identifier in a cfg that the spec does not define."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"ModelValue({str(self)!r})"


#: A constant's value as written in a cfg.
CfgValue = int | str | bool | ModelValue | frozenset["CfgValue"] | tuple["CfgValue", ...]

_KEYWORDS = {
    "SPECIFICATION",
    "INIT",
    "NEXT",
    "CONSTANT",
    "CONSTANTS",
    "INVARIANT",
    "INVARIANTS",
    "PROPERTY",
    "PROPERTIES",
    "CHECK_DEADLOCK",
}
_UNSUPPORTED = {
    "SYMMETRY",
    "VIEW",
    "CONSTRAINT",
    "CONSTRAINTS",
    "ACTION_CONSTRAINT",
    "ACTION_CONSTRAINTS",
    "ALIAS",
    "POSTCONDITION",
}
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<number>-?\d+)
      | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<punct><<|>>|<-|[{}=,])
    )""",
    re.VERBOSE,
)


@dataclass
class Cfg:
    """What a cfg says."""

    path: str
    specification: str | None = None
    init: str | None = None
    next: str | None = None
    constants: dict[str, CfgValue] = field(default_factory=dict)
    invariants: list[str] = field(default_factory=list)
    properties: list[str] = field(default_factory=list)
    check_deadlock: bool = True
    #: every ``\\*`` comment line, without the marker (records such as the state count)
    comments: list[str] = field(default_factory=list)


def _strip_comments(text: str, comments: list[str], path: str) -> str:
    out: list[str] = []
    depth = 0
    i = 0
    while i < len(text):
        if text.startswith("(*", i):
            depth += 1
            i += 2
        elif text.startswith("*)", i) and depth:
            depth -= 1
            i += 2
        elif depth:
            out.append("\n" if text[i] == "\n" else " ")
            i += 1
        elif text.startswith("\\*", i):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            comments.append(text[i + 2 : end].strip())
            i = end
        else:
            out.append(text[i])
            i += 1
    if depth:
        raise CfgError("unterminated (* comment", path=path)
    return "".join(out)


def _tokenize(text: str, path: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            bad = text[pos:].strip()[:20]
            raise CfgError(f"unexpected text {bad!r}", path=path)
        tokens.append(match.group(match.lastgroup or "punct"))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], path: str) -> None:
        self.tokens = tokens
        self.pos = 0
        self.path = path

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CfgError("unexpected end of file", path=self.path)
        self.pos += 1
        return token

    def expect(self, token: str) -> None:
        got = self.take()
        if got != token:
            raise CfgError(f"expected {token!r}, got {got!r}", path=self.path)

    def at_keyword(self) -> bool:
        token = self.peek()
        return token is not None and (token in _KEYWORDS or token in _UNSUPPORTED)

    def name(self) -> str:
        token = self.take()
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token) or token in _KEYWORDS:
            raise CfgError(f"expected a name, got {token!r}", path=self.path)
        return token

    def value(self) -> CfgValue:
        token = self.take()
        if token == "{":
            return frozenset(self._items("}"))
        if token == "<<":
            return tuple(self._items(">>"))
        if token.startswith('"'):
            return bytes(token[1:-1], "utf-8").decode("unicode_escape")
        if re.fullmatch(r"-?\d+", token):
            return int(token)
        if token in ("TRUE", "FALSE"):
            return token == "TRUE"
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token) and token not in _KEYWORDS:
            return ModelValue(token)
        raise CfgError(f"expected a value, got {token!r}", path=self.path)

    def _items(self, close: str) -> list[CfgValue]:
        items: list[CfgValue] = []
        if self.peek() == close:
            self.take()
            return items
        while True:
            items.append(self.value())
            token = self.take()
            if token == close:
                return items
            if token != ",":
                raise CfgError(f"expected ',' or {close!r}, got {token!r}", path=self.path)


def parse_cfg(text: str, path: str = "<cfg>") -> Cfg:
    """Parse cfg text. Raises :class:`CfgError` on anything malformed or unsupported."""
    cfg = Cfg(path=path)
    body = _strip_comments(text, cfg.comments, path)
    parser = _Parser(_tokenize(body, path), path)
    while parser.peek() is not None:
        keyword = parser.take()
        if keyword in _UNSUPPORTED:
            raise CfgError(f"{keyword} is not supported by the mirror", path=path)
        if keyword not in _KEYWORDS:
            raise CfgError(f"unknown keyword {keyword!r}", path=path)
        if keyword in ("SPECIFICATION", "INIT", "NEXT"):
            name = parser.name()
            attr = keyword.lower()
            if getattr(cfg, attr) is not None:
                raise CfgError(f"{keyword} given twice", path=path)
            setattr(cfg, attr, name)
        elif keyword == "CHECK_DEADLOCK":
            flag = parser.value()
            if not isinstance(flag, bool):
                raise CfgError("CHECK_DEADLOCK needs TRUE or FALSE", path=path)
            cfg.check_deadlock = flag
        elif keyword in ("CONSTANT", "CONSTANTS"):
            while parser.peek() is not None and not parser.at_keyword():
                name = parser.name()
                token = parser.take()
                if token == "<-":
                    raise CfgError(f"substitution {name} <- ... is not supported", path=path)
                if token != "=":
                    raise CfgError(f"expected '=' after {name}, got {token!r}", path=path)
                if name in cfg.constants:
                    raise CfgError(f"constant {name} assigned twice", path=path)
                cfg.constants[name] = parser.value()
        else:
            target = cfg.invariants if keyword.startswith("INVARIANT") else cfg.properties
            count = 0
            while parser.peek() is not None and not parser.at_keyword():
                target.append(parser.name())
                count += 1
            if not count:
                raise CfgError(f"{keyword} names nothing", path=path)
    if cfg.specification is None and (cfg.init is None or cfg.next is None):
        raise CfgError("needs SPECIFICATION, or INIT and NEXT", path=path)
    if cfg.specification is not None and (cfg.init is not None or cfg.next is not None):
        raise CfgError("give SPECIFICATION or INIT/NEXT, not both", path=path)
    return cfg


def read_cfg(path: str | Path) -> Cfg:
    """Read and parse a cfg file; a missing or unreadable file is a :class:`CfgError`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CfgError(f"cannot read: {exc}", path=str(path)) from None
    return parse_cfg(text, str(path))


def recorded_states(cfg: Cfg) -> int | None:
    """The distinct-state count recorded in a ``\\* mirror: N distinct states`` comment."""
    for line in cfg.comments:
        match = re.match(r"mirror:\s*(\d+)\s+distinct states", line)
        if match:
            return int(match.group(1))
    return None
