"""Measurements taken from outside the code under test: kernel socket tables and pool samples.

``/proc/net/tcp`` and ``/proc/net/tcp6`` list every TCP socket of this network namespace with
its state; counting those whose port is the bootstrap port shows how many HTTP connections the
decode keeps (``ESTABLISHED``, counted once per connection, at the client end) and how many
closed ones linger (``TIME_WAIT``, on whichever end closed first).
"""

from __future__ import annotations

from dataclasses import dataclass

_ESTABLISHED = "01"
_TIME_WAIT = "06"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


@dataclass(frozen=True, slots=True)
class SocketCounts:
    established: int  # connections to the port, counted at their client end
    time_wait: int  # sockets in TIME-WAIT with the port at either end


def socket_counts(port: int) -> SocketCounts:
    """Count TCP sockets involving ``port`` on this host (zeros where /proc is unavailable)."""
    established = time_wait = 0
    for table in _TABLES:
        try:
            with open(table, encoding="ascii") as source:
                lines = source.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4:
                continue
            state = fields[3]
            if state == _ESTABLISHED:
                if _port(fields[2]) == port:
                    established += 1
            elif state == _TIME_WAIT and port in (_port(fields[1]), _port(fields[2])):
                time_wait += 1
    return SocketCounts(established, time_wait)


def _port(address: str) -> int:
    """``"0100007F:22B6"`` -> 8886 (the port is hexadecimal after the last colon)."""
    return int(address.rpartition(":")[2], 16)
