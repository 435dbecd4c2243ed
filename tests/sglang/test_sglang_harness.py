"""The SGLang interop setup works: SGLang's real code imports, serves, registers and builds.

Each test drives SGLang's own objects (tests/support/sglang_support.py); when these fail, every
interop
test fails for the same reason, so read these first.
"""

from __future__ import annotations

import importlib

import requests

from tests.support.sglang_support import (
    SGLANG_VERSION,
    import_sglang,
    requires_sglang,
    sglang_bootstrap_server,
    sglang_decode_manager,
    sglang_prefill_rank,
)

pytestmark = requires_sglang

# SGLang's decode asks for the topology with every coordinate -1 (common/conn.py:3201-3205).
_TOPOLOGY = {
    "prefill_dp_rank": -1,
    "prefill_cp_rank": -1,
    "target_tp_rank": -1,
    "target_pp_rank": -1,
}


def test_the_pinned_release_is_the_one_imported() -> None:
    conn = import_sglang()
    import sglang  # after import_sglang: the package import needs the stubs on sys.path

    assert sglang.__version__ == SGLANG_VERSION
    assert conn.__name__ == "sglang.srt.disaggregation.common.conn"
    assert import_sglang() is conn  # imported once per process


def test_the_transfer_backends_wire_modules_import_too() -> None:
    """Mooncake's and NIXL's conn modules (their frame builders and parsers) import on CPU:
    their engines are imported lazily, inside the managers' constructors."""
    import_sglang()
    for backend in ("mooncake", "nixl"):
        module = importlib.import_module(f"sglang.srt.disaggregation.{backend}.conn")
        assert module.__name__.endswith(f"{backend}.conn")


def test_sglang_server_starts_and_waits_for_prefill() -> None:
    with sglang_bootstrap_server() as url:
        # Nothing registered: SGLang's server answers the decode's topology query 503.
        reply = requests.get(f"http://{url}/route", params=_TOPOLOGY, timeout=5)
        assert reply.status_code == 503, reply.text


def test_sglang_prefill_ranks_register_to_sglang_server() -> None:
    with (
        sglang_bootstrap_server() as url,
        sglang_prefill_rank(url, tp_size=2, tp_rank=0) as rank0,
        sglang_prefill_rank(url, tp_size=2, tp_rank=1) as rank1,
    ):
        topology = requests.get(f"http://{url}/route", params=_TOPOLOGY, timeout=5)
        assert topology.status_code == 200, topology.text
        assert topology.json()["attn_tp_size"] == 2
        for tp, rank in ((0, rank0), (1, rank1)):
            reply = requests.get(
                f"http://{url}/route",
                params={
                    "prefill_dp_rank": 0,
                    "prefill_cp_rank": 0,
                    "target_tp_rank": tp,
                    "target_pp_rank": 0,
                },
                timeout=5,
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["rank_port"] == rank.rank_port


def test_sglang_decode_manager_builds_and_binds_loopback() -> None:
    with sglang_decode_manager(is_mla_backend=False) as manager:
        assert manager.local_ip == "127.0.0.1"
        assert manager.rank_port > 0
        assert manager.connection_pool == {}
    with sglang_decode_manager(tp_size=2, tp_rank=1) as manager:
        assert (manager.attn_tp_size, manager.attn_tp_rank) == (2, 1)


def test_stubs_say_no_gpu_and_leave_decorated_functions_intact() -> None:
    import_sglang()
    import torch  # the stub: import_sglang put tests/sglang_stubs first on sys.path
    import triton

    assert torch.__version__.endswith("+stub")
    assert not torch.cuda.is_available()
    assert torch.version.cuda is None and torch.version.hip is None
    assert not hasattr(torch, "npu")  # is_npu() raises when the attribute exists

    def kernel() -> int:
        return 7

    assert triton.jit(kernel) is kernel
    assert torch.compile(dynamic=True)(kernel)() == 7

    class Layer(torch.nn.Module):  # a real subclass of a stand-in constructs normally
        def __init__(self) -> None:
            super().__init__()
            self.width = 3

    assert Layer().width == 3
