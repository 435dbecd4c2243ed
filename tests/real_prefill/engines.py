"""The real transfer engines on this machine: whether they run, and the decode's own engine.

Mooncake (``mooncake-transfer-engine-efa-non-cuda``) and NIXL (``nixl-cu12`` with the ``nixl``
meta package), pinned in ``tests/sglang_interop/engines.txt`` and installed by
``make .venv/.engines``. Both run over TCP on loopback here: no GPU memory, no RDMA.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import numpy.typing as npt

BACKENDS = ("mooncake", "nixl")
_HINT = (
    "run `make .venv/.engines` (Debian's libibverbs1 and libfabric1, then the wheels pinned in "
    "tests/sglang_interop/engines.txt)"
)


def loopback_environment() -> None:
    """What both engines need to move bytes over loopback TCP on a CPU machine (set before the
    first engine or agent exists in this process)."""
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["UCX_TLS"] = "tcp"
    os.environ["UCX_MODULES"] = "^ib"  # else NIXL's bundled libnl crashes the process at exit
    # UCX's crash handler writes a backtrace file (NAME.btr) into the working directory of any
    # process that aborts, i.e. into the repository; the crash still shows in the test's output.
    os.environ["UCX_HANDLE_ERRORS"] = "none"
    # libfabric loads libpsm2/libinfinipath, whose own crash handlers replace Python's
    # faulthandler (a C backtrace instead of every thread's Python stack): keep Python's.
    os.environ["HFI_NO_BACKTRACE"] = "1"
    os.environ["IPATH_NO_BACKTRACE"] = "1"
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")


@functools.cache
def engine_unavailable(backend: str) -> str | None:
    """Why ``backend``'s engine cannot run here (the skip reason), or None."""
    loopback_environment()
    try:
        if backend == "mooncake":
            import mooncake.engine  # noqa: F401
        else:
            import nixl._api  # noqa: F401
    except ImportError as err:  # a missing wheel, or libibverbs/libfabric not installed
        return f"the {backend} transfer engine does not import here ({err}): {_HINT}"
    return None


def mooncake_engine() -> tuple[Any, str]:
    """A Mooncake engine of this process over loopback TCP, and its session id, ``host:port``."""
    loopback_environment()
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine, f"127.0.0.1:{engine.get_rpc_port()}"


def nixl_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend (over TCP here)."""
    loopback_environment()
    from nixl._api import nixl_agent as make_agent
    from nixl._api import nixl_agent_config

    return make_agent(name, nixl_agent_config(backends=["UCX"]))


def register(backend: str, engine: Any, arrays: list[npt.NDArray[np.uint8]]) -> None:
    """Register CPU buffers with the decode's engine (Mooncake) or agent (NIXL, as DRAM)."""
    if backend == "mooncake":
        for array in arrays:
            rc = engine.register_memory(array.ctypes.data, array.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_memory returned {rc}")
    else:
        descs = engine.register_memory([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM")
        if not descs:
            raise RuntimeError("NIXL register_memory failed")
