"""Opt-in NDJSON tracing of lifecycle steps and pool operations, for trace validation.

Off by default. Call sites test the module flag first (``if trace.ENABLED: trace.emit(...)``),
so with tracing off the cost is one attribute load and a branch, and nothing is formatted.

Each event is one JSON object per line: ``{"seq", "action", ...fields}``. A generation is
written as a small integer token, stable for the life of the trace: the tracer keeps every
traced generation alive, so ``id()`` cannot be reused while tracing is on.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

ENABLED = False

_lock = threading.Lock()
_sink: IO[str] | None = None
_seq = itertools.count()
_tokens: dict[int, tuple[object, int]] = {}


def _token(generation: object) -> int:
    entry = _tokens.get(id(generation))
    if entry is None or entry[0] is not generation:
        entry = (generation, len(_tokens) + 1)
        _tokens[id(generation)] = entry
    return entry[1]


def _plain(value: Any) -> Any:
    """Turn keys, generations and entry maps into JSON-able values.

    A generation is recognised by its ``ranks`` attribute rather than by class, so a pool
    loaded from another module (the seeded mutants in the tests) traces the same way.
    """
    if hasattr(value, "ranks"):
        return _token(value)
    if isinstance(value, Mapping):
        return [[_plain(k), _plain(v)] for k, v in value.items()]
    if isinstance(value, (list, tuple)):  # PoolKey is a tuple: it becomes a list
        return [_plain(v) for v in value]
    return value


def token(generation: object) -> int:
    """The small integer a generation is written as in this trace (stable while tracing)."""
    with _lock:
        return _token(generation)


def reserve() -> int:
    """Take the next sequence number now, for an event written later with ``emit(seq=...)``.

    The pool calls this under its own lock, so pool events are numbered in the order the lock
    serialised them, while the (blocking) write happens after the lock is released (POOL-7).
    """
    with _lock:
        return next(_seq)


def emit(action: str, *, seq: int | None = None, **fields: Any) -> None:
    """Write one event. Only call when ``ENABLED`` is true.

    Lines may reach the file out of ``seq`` order (see :func:`reserve`); readers sort by it.
    """
    with _lock:
        if _sink is None:
            return
        record = {"seq": next(_seq) if seq is None else seq, "action": action}
        record.update({name: _plain(v) for name, v in fields.items()})
        _sink.write(json.dumps(record, separators=(",", ":")) + "\n")


@contextmanager
def tracing(path: str | Path) -> Iterator[Path]:
    """Trace everything inside the block to ``path`` (overwritten)."""
    global ENABLED, _sink, _seq
    target = Path(path)
    with target.open("w", encoding="utf-8") as sink:
        with _lock:
            _sink, _seq = sink, itertools.count()
            _tokens.clear()
            ENABLED = True
        try:
            yield target
        finally:
            with _lock:
                ENABLED = False
                _sink = None
                _tokens.clear()


def read(path: str | Path) -> list[dict[str, Any]]:
    """Load a trace written by :func:`tracing`, in ``seq`` order."""
    with Path(path).open(encoding="utf-8") as source:
        events = [json.loads(line) for line in source if line.strip()]
    events.sort(key=lambda event: event["seq"])
    return events
