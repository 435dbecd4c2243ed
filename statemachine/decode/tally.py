"""``Tally``: a counter bumped lock-free on the request path and read, rarely, for stats.

``next()`` on an ``itertools.count`` is one C call under the GIL, so concurrent bumps never
lose a count; ``+= 1`` on an attribute could. Reading the count needs no parsing either: a read
takes one value from the same counter and subtracts the reads taken before it (the reads are
serialized by a lock of their own, which the bumps never touch).
"""

from __future__ import annotations

import itertools
import threading

__all__ = ["Tally"]


class Tally:
    """How many times :meth:`add` was called; :meth:`add` takes no lock."""

    __slots__ = ("_next", "_read_lock", "_reads")

    def __init__(self) -> None:
        self._next = itertools.count()
        self._reads = 0
        self._read_lock = threading.Lock()

    def add(self) -> None:
        next(self._next)

    def value(self) -> int:
        """The number of :meth:`add` calls so far (the count's next value minus the reads,
        this one included, that took a value from it)."""
        with self._read_lock:
            taken = next(self._next)
            value = taken - self._reads
            self._reads += 1
        return value
