"""Waiting for a child process's handshake line (``READY <port>``, ``WARM``) with a deadline.

The reference prefill processes announce themselves on stdout; their parents (the rank's
:class:`~statemachine.prefill.rank_process.PrefillRankProcess`, the demo's cluster) wait for a
line with a given prefix, skipping any other output, and must never wait past their deadline.
:func:`read_ready` is the one reader of ``READY ...`` lines, used by the product, the tests'
helper processes and the benchmarks' peers alike.
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


#: What a child process prints once it serves, followed by what it serves on (a port; the
#: etcd registrar: its instance id and lease id), if anything.
READY = b"READY"


def read_ready(fd: int, deadline: float, buffer: bytearray | None = None) -> list[bytes] | None:
    """The words after ``READY`` on the first ``READY ...`` line read from ``fd``; ``None`` at
    EOF (the child exited first). Other lines are skipped; :class:`TimeoutError` past
    ``deadline`` (``time.monotonic()``)."""
    line = read_prefixed_line(fd, READY, deadline, bytearray() if buffer is None else buffer)
    return None if line is None else line.split()[1:]
