"""Waiting for a child process's handshake line (``READY <port>``, ``WARM``) with a deadline.

The reference prefill processes announce themselves on stdout; their parents (the rank's
:class:`~statemachine.prefill.rank.PrefillRankProcess`, the demo's cluster) wait for a line with
a given prefix, skipping any other output, and must never wait past their deadline.
"""

from __future__ import annotations

import os
import selectors
import time


def read_prefixed_line(fd: int, prefix: bytes, deadline: float, buffer: bytearray) -> bytes | None:
    """The first whole line read from ``fd`` that starts with ``prefix``; ``None`` at EOF.

    Lines without the prefix are dropped; bytes after the line found stay in ``buffer`` for the
    next call. Raises :class:`TimeoutError` once ``time.monotonic()`` passes ``deadline``.
    """
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            while (end := buffer.find(b"\n")) >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                if line.startswith(prefix):
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {prefix!r} line in time")
            if not selector.select(left):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buffer += chunk
