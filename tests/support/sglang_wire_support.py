"""SGLang 0.5.23's real Mooncake and NIXL managers on CPU, for the wire interop tests.

Builds on ``sglang_support`` (the pinned wheel, the import stubs, server args and ranks):

* the *prefill* managers, whose constructors start SGLang's real bootstrap thread on a real PULL
  socket: Mooncake with a transfer engine that only names its session (no buffer is ever
  registered or moved), NIXL with a stand-in agent module (``nixl`` is not installed; SGLang
  imports it inside the constructor);
* a *decode* ``CommonKVManager`` that borrows the Mooncake or NIXL frame builders (SGLang's own
  code, class attributes of a subclass), so a test can compare bytes with ours;
* a ``threading.excepthook`` recorder, because a bootstrap thread that dies is the very failure
  under test and must be observed, not reported as a stray thread exception.

Everything here is test-only; the product never imports SGLang.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import zmq

from tests.support.sglang_support import (
    import_sglang,
    make_kv_args,
    set_sglang_ranks,
    sglang_server_args,
)

#: The decode's Mooncake transfer-engine session in these tests (``host:port``).
SESSION_ID = "127.0.0.1:17001"


def mooncake_module() -> Any:
    import_sglang()
    return importlib.import_module("sglang.srt.disaggregation.mooncake.conn")


class _FakeNixlAgent:
    """What NixlKVManager calls on its agent on the bootstrap path; no transfer is made."""

    def __init__(self, name: str, config: object) -> None:
        self.name = name
        self.remote_metadata: list[bytes] = []

    def create_backend(self, backend: str, params: object) -> None:
        return None

    def get_plugin_list(self) -> list[str]:
        return ["UCX"]

    def get_agent_metadata(self) -> bytes:
        return b"agent-metadata:" + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        self.remote_metadata.append(metadata)
        return "peer"

    def prep_xfer_dlist(self, agent_name: str, descs: object, kind: str) -> object:
        return (agent_name, descs, kind)  # NixlBackend.from_agent's check: every buffer is known

    def release_dlist_handle(self, handle: object) -> None:
        return None


def _stand_in_nixl_api() -> dict[str, types.ModuleType]:
    api = types.ModuleType("nixl._api")
    api.nixl_agent = _FakeNixlAgent  # type: ignore[attr-defined]
    api.nixl_agent_config = lambda **fields: fields  # type: ignore[attr-defined]
    api.nixl_thread_sync_t = types.SimpleNamespace(NIXL_THREAD_SYNC_STRICT=1)  # type: ignore[attr-defined]
    package = types.ModuleType("nixl")
    package._api = api  # type: ignore[attr-defined]
    return {"nixl": package, "nixl._api": api}


@contextmanager
def stand_in_nixl() -> Iterator[None]:
    """The stand-in ``nixl._api`` for the block, whatever was imported before: SGLang's NIXL
    manager imports it inside its constructor, and the real package (installed for the
    real-bytes tests, ``make .venv/.engines``) may already be loaded by another test."""
    saved = {name: sys.modules.get(name) for name in ("nixl", "nixl._api")}
    sys.modules.update(_stand_in_nixl_api())
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def nixl_module() -> Any:
    """``sglang...nixl.conn``; where no ``nixl`` package is installed, a stand-in ``nixl._api``
    is put in ``sys.modules`` (and left there: nothing else can want the real one then)."""
    import_sglang()
    if "nixl._api" not in sys.modules and importlib.util.find_spec("nixl") is None:
        sys.modules.update(_stand_in_nixl_api())
    return importlib.import_module("sglang.srt.disaggregation.nixl.conn")


class _SessionOnlyEngine:
    def get_session_id(self) -> str:
        return "127.0.0.1:17002"


def _cpu_mooncake(base: type) -> type:
    class CpuMooncakeKVManager(base):  # type: ignore[misc,valid-type]
        def init_engine(self) -> None:
            self.engine = _SessionOnlyEngine()

        def register_buffer_to_engine(self) -> None:
            pass

        def deregister_buffer_to_engine(self) -> None:
            pass

    return CpuMooncakeKVManager


def _cpu_nixl(base: type) -> type:
    class CpuNixlKVManager(base):  # type: ignore[misc,valid-type]
        def register_buffer_to_engine(self) -> None:
            pass

    return CpuNixlKVManager


class ThreadDeaths:
    """Records exceptions that end threads while installed (``threading.excepthook``)."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            self.errors.append(args.exc_value)


@contextmanager
def thread_deaths() -> Iterator[ThreadDeaths]:
    recorder = ThreadDeaths()
    previous = threading.excepthook
    threading.excepthook = recorder
    try:
        yield recorder
    finally:
        threading.excepthook = previous


class Prefill:
    """A real prefill-mode Mooncake or NIXL manager and its bootstrap thread."""

    def __init__(
        self, backend: str, manager: Any, thread: threading.Thread, deaths: ThreadDeaths
    ) -> None:
        self.backend = backend
        self.manager = manager
        self.thread = thread
        #: exceptions that ended threads while this prefill ran (its bootstrap thread's included)
        self.deaths = deaths

    @property
    def port(self) -> int:
        return int(self.manager.rank_port)

    def wait(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Poll ``predicate`` until true, the thread died, or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if not self.thread.is_alive():
                return predicate()
            time.sleep(0.005)
        return predicate()


def prefill_kv_args(backend: str) -> Any:
    # NIXL's registration handler prepares transfer descriptors for every prefill KV region the
    # decode must match (nixl/conn.py:1482-1500); a prefill without KV regions skips that, and
    # needs no real agent.
    if backend == "nixl":
        return make_kv_args(
            kv_data_ptrs=[], kv_data_lens=[], kv_item_lens=[], kv_layer_ids=[], kv_data_mem_kinds=[]
        )
    return make_kv_args()


@contextmanager
def sglang_prefill(backend: str, bootstrap_url: str, **server_fields: Any) -> Iterator[Prefill]:
    """A real prefill-mode ``MooncakeKVManager`` / ``NixlKVManager`` (tp 1), registered with the
    bootstrap server at ``bootstrap_url``, its bootstrap thread running on a real PULL socket."""
    conn = import_sglang()
    host, _, port = bootstrap_url.rpartition(":")
    fields = {
        "disaggregation_mode": "prefill",
        "host": host,
        "disaggregation_bootstrap_port": int(port),
        "tp_size": 1,
        **server_fields,
    }
    with sglang_server_args(**fields) as server_args, thread_deaths() as deaths:
        set_sglang_ranks(tp_rank=0)
        before = set(threading.enumerate())
        if backend == "mooncake":
            cls = _cpu_mooncake(mooncake_module().MooncakeKVManager)
        else:
            cls = _cpu_nixl(nixl_module().NixlKVManager)
        with stand_in_nixl() if backend == "nixl" else nullcontext():
            manager = cls(
                prefill_kv_args(backend),
                conn.DisaggregationMode.PREFILL,
                server_args,
                is_mla_backend=False,
            )
        if backend == "mooncake":
            thread = manager._worker_threads[0]
        else:
            (thread,) = [
                t for t in threading.enumerate() if t not in before and "bootstrap_thread" in t.name
            ]
        try:
            yield Prefill(backend, manager, thread, deaths)
        finally:
            stop_bootstrap_thread(backend, manager, thread)
            manager._zmq_ctx.destroy(linger=0)


def stop_bootstrap_thread(backend: str, manager: Any, thread: threading.Thread) -> None:
    """End a prefill's bootstrap thread before its sockets close: a ZMQ socket closed under a
    thread that is reading it aborts the process.

    Neither thread has a stop flag that works in every mode (Mooncake's is polled only with role
    switching on and never under ``prefill_complete``; NIXL has none), so each ends as it does
    in production: on a foreign message, which it cannot parse (recorded by thread_deaths).
    """
    if thread.is_alive():
        push = manager._zmq_ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{manager.rank_port}")
        push.send_multipart([b"end of test"])
        thread.join(5.0)
        push.close(linger=0)
    if thread.is_alive():
        raise RuntimeError(f"SGLang's {backend} bootstrap thread did not stop within 5 s")
    if backend == "mooncake":
        manager.teardown()  # stops its transfer workers, closes its sockets


@contextmanager
def sglang_decode_builders(
    backend: str,
    *,
    deferred_release: bool = False,
    server_fields: dict[str, Any] | None = None,
    **kv_overrides: Any,
) -> Iterator[Any]:
    """A decode ``CommonKVManager`` with SGLang's own Mooncake or NIXL frame builders
    (``build_receiver_registration_message`` and ``build_receiver_metadata_message`` borrowed as
    class attributes), so that SGLang's real ``CommonKVReceiver`` can run on it.
    ``deferred_release`` turns on what Mooncake and NIXL turn on: the ABORT generation."""
    conn = import_sglang()
    module = mooncake_module() if backend == "mooncake" else nixl_module()
    source = module.MooncakeKVManager if backend == "mooncake" else module.NixlKVManager
    agent = _FakeNixlAgent("decode-agent-0", None)

    class Borrowed(conn.CommonKVManager):  # type: ignore[misc,name-defined]
        build_receiver_registration_message = source.build_receiver_registration_message
        build_receiver_metadata_message = source.build_receiver_metadata_message
        supports_deferred_decode_kv_release = deferred_release

        def get_session_id(self) -> str:
            return SESSION_ID

    fields = {"disaggregation_mode": "decode", "host": "127.0.0.1", **(server_fields or {})}
    with sglang_server_args(**fields) as server_args:
        set_sglang_ranks(tp_rank=0)
        manager = Borrowed(
            make_kv_args(**kv_overrides), conn.DisaggregationMode.DECODE, server_args
        )
        manager.agent = agent
        try:
            yield manager
        finally:
            # Receivers share class-level PUSH sockets: close them before the context.
            conn.CommonKVReceiver.close_all_sockets()
            manager._zmq_ctx.destroy(linger=0)
