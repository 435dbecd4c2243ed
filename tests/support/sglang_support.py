"""Run SGLang's own release code inside a test: its bootstrap server, prefill ranks, decode manager.

The interop tests hold this library up against the real ``sglang`` wheel pinned in
``tests/sglang_interop/requirements.txt`` (installed by ``make .venv/.sglang``; see
docs/sglang-interop.md). SGLang is imported on CPU with the stand-ins in ``tests/sglang_stubs``
for torch and the other GPU packages; only this module puts them on ``sys.path``, and only when a
test asks for SGLang, so no other test (and never the product) sees them.

Each helper is a context manager that undoes what it did (server args restored, ZMQ contexts
destroyed, class-level sockets closed), because SGLang keeps that state process-wide.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import socket
import sys
import time
import types
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.http_support import free_port

__all__ = [
    "SGLANG_VERSION",
    "free_port",
    "import_sglang",
    "make_kv_args",
    "requires_sglang",
    "set_sglang_ranks",
    "sglang_bootstrap_server",
    "sglang_decode_manager",
    "sglang_prefill_rank",
    "sglang_server_args",
    "sglang_unavailable",
]

_HERE = Path(__file__).resolve().parents[1]  # tests/
_REQUIREMENTS = _HERE / "sglang_interop" / "requirements.txt"
_STUBS = _HERE / "sglang_stubs"
_INSTALL_HINT = "run `make .venv/.sglang` (docs/sglang-interop.md)"


def _pinned_version() -> str:
    for line in _REQUIREMENTS.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and name == "sglang":
            return version
    raise RuntimeError(f"{_REQUIREMENTS} pins no sglang==VERSION line; restore it")


SGLANG_VERSION = _pinned_version()


def _skip_reason() -> str | None:
    """Why the SGLang interop tests cannot run here, or None when they can."""
    if sys.version_info[:2] != (3, 11):
        found = f"{sys.version_info[0]}.{sys.version_info[1]}"
        return f"SGLang {SGLANG_VERSION}'s wheel is cp311 only and this is Python {found}"
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return f"sglang is not installed: {_INSTALL_HINT}"
    if installed != SGLANG_VERSION:
        return f"sglang {installed} is installed, the tests pin {SGLANG_VERSION}: {_INSTALL_HINT}"
    return None


_SKIP_REASON = _skip_reason()


def sglang_unavailable() -> str | None:
    """Why SGLang's wheel cannot run here, or None (what the benchmarks check before using it)."""
    return _SKIP_REASON


requires_sglang = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")


@functools.cache
def import_sglang() -> types.ModuleType:
    """``sglang.srt.disaggregation.common.conn``, imported once on CPU with the stubs."""
    if _SKIP_REASON is not None:
        pytest.skip(_SKIP_REASON)
    # get_local_ip_auto() returns this without probing the NICs, so every SGLang socket binds
    # to loopback; it must be set before SGLang's first bind.
    os.environ["SGLANG_HOST_IP"] = "127.0.0.1"
    if str(_STUBS) not in sys.path:
        sys.path.insert(0, str(_STUBS))
    with warnings.catch_warnings():
        # Import-time notices that quantization kernels need a GPU: true, and not ours to fix.
        warnings.simplefilter("ignore")
        conn = importlib.import_module("sglang.srt.disaggregation.common.conn")
    # sentencepiece's SWIG types warn once more as the interpreter exits (after every test).
    warnings.filterwarnings("ignore", "builtin type swig", DeprecationWarning)
    return conn


def _runtime_context() -> Any:
    import_sglang()
    return importlib.import_module("sglang.srt.runtime_context")


@contextmanager
def sglang_server_args(**fields: Any) -> Iterator[Any]:
    """Publish a dummy ``ServerArgs`` carrying ``fields`` for the block; restore the previous."""
    override = _runtime_context().get_context().override_server_args(**fields)
    server_args = override.install()
    try:
        yield server_args
    finally:
        override.restore()


def set_sglang_ranks(
    *, tp_rank: int = 0, attn_tp_rank: int | None = None, pp_rank: int = 0, attn_cp_rank: int = 0
) -> None:
    """Stamp this process's parallel ranks as SGLang's launcher would (no process groups).

    ``attn_tp_rank`` defaults to ``tp_rank``; with attention cp (``attn_cp_size`` in the
    server args) give both, e.g. tp rank 1 of tp 2 / cp 2 is attn tp rank 0, attn cp rank 1.
    """
    runtime = _runtime_context()
    parallel = runtime.get_parallel()
    wanted = {
        "attn_tp_rank": tp_rank if attn_tp_rank is None else attn_tp_rank,
        "attn_cp_rank": attn_cp_rank,
        "attn_dp_rank": 0,
        "attn_dcp_rank": 0,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "pp_group": None,
        "world_group": None,
    }
    # The accepted names move between releases; stamp only those this one knows.
    known = runtime._parallel_fields()
    parallel.clear_stamp()
    parallel.override_permanently(**{k: v for k, v in wanted.items() if k in known})


def make_kv_args(**overrides: Any) -> Any:
    """A ``KVArgs`` as a rank without GPU buffers would fill it: small fake pointers, no state.

    Nothing dereferences the pointers on the bootstrap path; the frame builders only pack them.
    """
    import_sglang()
    base_conn = importlib.import_module("sglang.srt.disaggregation.base.conn")
    values: dict[str, Any] = {
        "engine_rank": 0,
        "page_size": 1,
        "kv_cache_dtype_str": "bfloat16",
        "kv_layout": None,
        "pp_rank": 0,
        "system_dp_rank": 0,
        "is_hybrid_mla_backend": False,
        "mla_compression_ratios": None,
        "kv_data_ptrs": [0x1000, 0x2000],
        "kv_data_lens": [4096, 4096],
        "kv_item_lens": [64, 64],
        "kv_layer_ids": [0, 1],
        "kv_data_mem_kinds": ["VRAM", "VRAM"],
        "aux_data_ptrs": [0x3000],
        "aux_data_lens": [1024],
        "aux_item_lens": [8],
        "state_types": [],
        "state_data_ptrs": [],
        "state_data_lens": [],
        "state_item_lens": [],
        "state_layer_ids": [],
        "state_dim_per_tensor": [],
        "state_slice_outer_counts": [],
        "state_conv_shard_groups": [],
        "swa_kv_cache_layout": None,
        "ib_device": "",
        "gpu_id": 0,
        "kv_head_num": 1,
        "total_kv_head_num": 1,
        "rust_http_port": None,
        "prefill_start_layer": 0,
        "prefill_end_layer": None,
        "kv_buf_groups": 1,
        "hidden_kv_layers": 0,
        "draft_kv_layers": 0,
    }
    values.update(overrides)
    kv_args = base_conn.KVArgs()
    for name, value in values.items():
        setattr(kv_args, name, value)
    return kv_args


def _wait_listening(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                msg = f"SGLang's bootstrap server on {host}:{port} did not listen in {timeout} s"
                raise TimeoutError(msg) from err
            time.sleep(0.01)


@contextmanager
def sglang_bootstrap_server() -> Iterator[str]:
    """SGLang's real ``CommonKVBootstrapServer`` on a free loopback port; yields ``"ip:port"``."""
    conn = import_sglang()
    port = free_port()
    server = conn.CommonKVBootstrapServer("127.0.0.1", port)
    try:
        # It starts its aiohttp loop in a thread; a prefill that registers before it listens
        # would sleep a second and retry, so wait for the socket first.
        _wait_listening("127.0.0.1", port, timeout=10.0)
        yield f"127.0.0.1:{port}"
    finally:
        server.close()


def _destroy(manager: Any) -> None:
    """For ``CommonKVManager`` itself, which starts no thread: nothing reads its sockets."""
    manager._zmq_ctx.destroy(linger=0)


def stoppable_worker_threads(server_args: Any) -> None:
    """Make the KV manager built under ``server_args`` stoppable by its own ``teardown()``.

    ``enable_pd_role_switch`` only makes the manager's worker threads poll with a 500 ms timeout
    (common/conn.py ``_make_worker_recv``, its one use in the disaggregation code), so that
    Mooncake's ``teardown()`` joins them before closing their sockets. With the plain blocking
    recv, closing or destroying a socket under the thread blocked in it is undefined in libzmq:
    measured here, it aborted the whole pytest process (``Fatal Python error: Aborted`` in
    ``Context.term``) or, in CI, hung it until the job's time limit. What a request sees is
    unchanged. Set on the instance: the override's declared value does not reach the attribute
    the manager reads."""
    msgspec = importlib.import_module("msgspec")
    msgspec.Struct.__setattr__(server_args, "enable_pd_role_switch", True)


def retire_sglang_manager(manager: Any) -> None:
    """End a decode KV manager (this library's or SGLang's) without touching a socket that one
    of its threads may be reading.

    Ours has ``close()``. SGLang's Mooncake manager has ``teardown()`` (mooncake/conn.py
    440-525), safe when built under :func:`stoppable_worker_threads`. SGLang's NIXL manager has
    neither, and its listener is a ``while True`` blocking recv (nixl/conn.py 1017-1043): its
    heartbeat is stopped and the listener left blocked with its context (a daemon thread, ended
    with the process); its context is never destroyed under it. The receivers' class-level PUSH
    sockets, used only from the caller's thread, are closed in every case."""
    close = getattr(manager, "close", None)
    if close is not None:
        close()
    else:
        try:
            manager.teardown()
        except NotImplementedError:
            heartbeat = getattr(manager, "_heartbeat_shutdown", None)
            if heartbeat is not None:
                heartbeat.set()
    import_sglang().CommonKVReceiver.close_all_sockets()


@contextmanager
def sglang_prefill_rank(
    bootstrap_url: str,
    *,
    tp_size: int,
    tp_rank: int,
    attn_tp_rank: int | None = None,
    attn_cp_rank: int = 0,
    is_mla_backend: bool = False,
    kv_args: Any = None,
    **server_fields: Any,
) -> Iterator[Any]:
    """A prefill-mode ``CommonKVManager`` whose constructor registers to ``bootstrap_url``.

    ``server_fields`` are SGLang ``ServerArgs`` fields (``attn_cp_size``, ``dp_size``,
    ``disaggregation_decode_allocation_policy``, ``load_balance_method``, ``port`` ...); the
    ranks are stamped as :func:`set_sglang_ranks` does. A system-dp rank other than 0 is
    ``kv_args=make_kv_args(system_dp_rank=...)``, as SGLang's scheduler sets it.

    SGLang's ``register_to_bootstrap`` runs for real (``PUT /route``, up to 5 tries about 15 s
    in all when refused). pp>1 prefills need a torch pp group, so register them as SGLang's
    tests do: one rank at a time with ``pp_size=1`` and the pp rank in ``kv_args``.
    """
    conn = import_sglang()
    host, _, port = bootstrap_url.rpartition(":")
    fields = {
        "disaggregation_mode": "prefill",
        "host": host,
        "disaggregation_bootstrap_port": int(port),
        "tp_size": tp_size,
        **server_fields,
    }
    with sglang_server_args(**fields) as server_args:
        set_sglang_ranks(tp_rank=tp_rank, attn_tp_rank=attn_tp_rank, attn_cp_rank=attn_cp_rank)
        args = kv_args if kv_args is not None else make_kv_args(engine_rank=tp_rank)
        manager = conn.CommonKVManager(
            args, conn.DisaggregationMode.PREFILL, server_args, is_mla_backend=is_mla_backend
        )
        try:
            yield manager
        finally:
            _destroy(manager)


@contextmanager
def sglang_decode_manager(
    *,
    is_mla_backend: bool = False,
    tp_rank: int = 0,
    attn_tp_rank: int | None = None,
    attn_cp_rank: int = 0,
    kv_args: Any = None,
    **server_fields: Any,
) -> Iterator[Any]:
    """A decode-mode ``CommonKVManager`` (binds a PULL, starts no thread), torn down after.

    ``server_fields`` are ``ServerArgs`` fields (``tp_size``, ``attn_cp_size``, ...); the ranks
    are stamped as :func:`set_sglang_ranks` does.
    """
    conn = import_sglang()
    fields = {"disaggregation_mode": "decode", "host": "127.0.0.1", **server_fields}
    with ExitStack() as stack:
        server_args = stack.enter_context(sglang_server_args(**fields))
        set_sglang_ranks(tp_rank=tp_rank, attn_tp_rank=attn_tp_rank, attn_cp_rank=attn_cp_rank)
        args = kv_args if kv_args is not None else make_kv_args(engine_rank=tp_rank)
        manager = conn.CommonKVManager(
            args, conn.DisaggregationMode.DECODE, server_args, is_mla_backend=is_mla_backend
        )
        # Receivers share class-level PUSH sockets; close them so the next test starts clean.
        stack.callback(conn.CommonKVReceiver.close_all_sockets)
        stack.callback(_destroy, manager)
        yield manager
