"""Every public path to a NIXL backend refuses a decode's mistake locally (issue 32 item 2,
SGW-12): SGLang 0.5.23's own NIXL prefill never sees it, and SGLang's own decode completes
against that prefill afterwards.

Real parts: SGLang's prefill in its own processes on a real NIXL agent (``tests/real_prefill``),
a real NIXL agent per mistaken decode (UCX over TCP, DRAM buffers), and SGLang's own decode
(its ``NixlKVManager`` and receivers, ``tests/real_prefill/sglang_decode.py``) moving real bytes,
checked page by page. Without the refusal each of these mistakes ends the prefill's bootstrap
thread (``NIXL_ERR_NOT_FOUND`` from its ``prep_xfer_dlist`` of this decode's buffers), after which
SGLang's decode hangs and every other decode of that prefill fails (measured in issue 32).

The four mistakes x the two public paths (``NixlBackend.factory``, ``NixlBackend.from_agent``):
``from_agent`` takes the name and the metadata from the agent itself, after the registration,
so two of the mistakes cannot be made through it (``docs/sglang-interop.md`` has the table).
The constructor ``NixlBackend(...)`` is closed (it takes a witness only those two hold).

Mooncake: a KV or aux buffer unregistered, one registered shorter than claimed, and a session
that is not the decode's engine x ``MooncakeBackend.factory`` / ``from_engine`` /
``from_engine_session`` (and the closed constructor), against SGLang's real Mooncake prefill
the same way. Its prefill survives these (the transfer fails), so the harm refused is to the
mistaken decode: every request of it failed, reported as the prefill's failure.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from statemachine.errors import InvalidArgument
from statemachine.sglang.v0_5_23 import DecodeKVArgs, NixlBackend
from tests.real_prefill.engines import engine_unavailable
from tests.real_prefill.harness import PrefillPool, RealPrefill, wrong_pages
from tests.support.sglang_support import requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]

SRC = [5, 17, 3, 40, 41, 90]
DST = [60, 2, 33, 9, 8, 71]
KV_BUFFERS = 4
BUFFER_BYTES = 4096

UNREGISTERED = "buffers unregistered"
EARLY_METADATA = "metadata taken before registration"
KINDS_OMITTED = "kinds omitted"
WRONG_NAME = "a name that is not the agent's"

_names = itertools.count()
_rooms = itertools.count(9101)


@pytest.fixture(scope="module")
def prefill() -> Iterator[RealPrefill]:
    reason = engine_unavailable("nixl")
    if reason is not None:
        pytest.skip(reason)
    pool = PrefillPool(spawn=[("nixl", 1, False)])
    try:
        yield pool.get("nixl")
    finally:
        pool.close()


@pytest.fixture(scope="module")
def sglang_decode(prefill: RealPrefill) -> Iterator[Any]:
    from tests.real_prefill.sglang_decode import SGLangDecode

    decode = SGLangDecode("nixl", layout=prefill.layout)
    try:
        yield decode
    finally:
        decode.close()


def sglang_decode_completes(prefill: RealPrefill, decode: Any) -> None:
    """One request of SGLang's own decode through ``prefill``: Success, every page right."""
    room = next(_rooms)
    prefill.transfer(room, SRC, aux_index=3)
    request = decode.request(prefill.address, room, DST, aux_index=7)
    deadline = time.monotonic() + 60.0
    while (state := request.poll()) not in (decode.kv_poll.Success, decode.kv_poll.Failed):
        assert time.monotonic() < deadline, "SGLang's decode hangs: the prefill stopped serving"
        time.sleep(0.001)
    assert state == decode.kv_poll.Success, request.failure
    assert decode.wrong_pages(room, DST, 7) == []
    request.clear()


class MistakenDecode:
    """A decode's NIXL agent, its buffers and its kv_args, set up with one mistake."""

    def __init__(self, mistake: str | None) -> None:
        from tests.real_prefill import engines

        self.agent = engines.nixl_agent(f"mistaken-{os.getpid()}-{next(_names)}")
        self.kv = [np.zeros(BUFFER_BYTES, dtype=np.uint8) for _ in range(KV_BUFFERS)]
        self.aux = np.zeros(384, dtype=np.uint8)
        early = bytes(self.agent.get_agent_metadata())
        registered = self.kv[:-1] if mistake == UNREGISTERED else self.kv
        engines.register("nixl", self.agent, [*registered, self.aux])
        self.metadata = (
            early if mistake == EARLY_METADATA else bytes(self.agent.get_agent_metadata())
        )
        self.name = "another-agent" if mistake == WRONG_NAME else str(self.agent.name)
        self.kv_args = DecodeKVArgs(
            engine_rank=0,
            attn_tp_size=1,
            kv_data_ptrs=[b.ctypes.data for b in self.kv],
            kv_data_lens=[b.nbytes for b in self.kv],
            kv_item_lens=[128] * KV_BUFFERS,
            aux_data_ptrs=[self.aux.ctypes.data],
            kv_mem_kinds=() if mistake == KINDS_OMITTED else ["DRAM"] * KV_BUFFERS,
        )

    def factory(self) -> Callable[[str, int], NixlBackend]:
        return NixlBackend.factory(self.name, self.metadata, self.kv_args)

    def from_agent(self) -> Callable[[str, int], NixlBackend]:
        return NixlBackend.from_agent(self.agent, self.kv_args)


#: (mistake, path, what the refusal says): every combination a caller can make.
REFUSALS = [
    (UNREGISTERED, "factory", r"kv_data_ptrs\[3\] .* is not registered as DRAM in agent_metadata"),
    (UNREGISTERED, "from_agent", r"kv_data_ptrs\[3\] .* is not registered with NIXL agent"),
    (EARLY_METADATA, "factory", r"kv_data_ptrs\[0\] .* take agent.get_agent_metadata\(\) after"),
    (KINDS_OMITTED, "factory", r"kv_data_ptrs\[0\] .* is not registered as VRAM"),
    (KINDS_OMITTED, "from_agent", r"kv_data_ptrs\[0\] .* is not registered with NIXL agent"),
    (WRONG_NAME, "factory", r"agent_name 'another-agent' is not the name in agent_metadata"),
]


@pytest.mark.parametrize(
    ("mistake", "path", "message"), REFUSALS, ids=[f"{m}-{p}" for m, p, _ in REFUSALS]
)
def test_sgw15_a_mistake_is_refused_locally_and_sglangs_decode_completes_after(
    prefill: RealPrefill, sglang_decode: Any, mistake: str, path: str, message: str
) -> None:
    decode = MistakenDecode(mistake)
    with pytest.raises(InvalidArgument, match=message):
        getattr(decode, path)()
    # Nothing reached the prefill: its bootstrap thread still serves SGLang's own decode.
    sglang_decode_completes(prefill, sglang_decode)


def test_sgw15_a_correct_agent_passes_both_paths_with_the_same_registration(
    prefill: RealPrefill, sglang_decode: Any
) -> None:
    """The control: the metadata check refuses only mistakes. A correct agent's factory and
    from_agent build the same registration frames, byte for byte."""
    decode = MistakenDecode(None)
    by_factory = decode.factory()("127.0.0.1", 5555)
    by_agent = decode.from_agent()("127.0.0.1", 5555)
    from statemachine.pool import RankInfo

    rank = RankInfo("127.0.0.1", 1, 0)
    assert by_factory.register_frames(rank) == by_agent.register_frames(rank)
    sglang_decode_completes(prefill, sglang_decode)


# --- the constructors themselves: closed ------------------------------------------------------


def test_sgw12_nixl_constructor_is_refused_and_sglangs_decode_completes_after(
    prefill: RealPrefill, sglang_decode: Any
) -> None:
    """``NixlBackend(...)`` directly, with an agent whose metadata lacks a KV buffer (what
    killed the prefill's bootstrap thread through it): refused whatever its inputs, since it
    cannot tell; the same inputs through ``factory`` are refused for the mistake itself."""
    decode = MistakenDecode(UNREGISTERED)
    with pytest.raises(InvalidArgument, match=r"NixlBackend\(\.\.\.\) is not a public constructor"):
        NixlBackend("127.0.0.1", 5555, decode.name, decode.metadata, decode.kv_args)
    correct = MistakenDecode(None)
    with pytest.raises(InvalidArgument, match="not a public constructor"):
        NixlBackend("127.0.0.1", 5555, correct.name, correct.metadata, correct.kv_args)
    sglang_decode_completes(prefill, sglang_decode)


# --- Mooncake: every public path reads the buffers back through the session --------------------

UNREGISTERED_AUX = "aux buffer unregistered"
SHORT_KV = "a KV buffer registered shorter than claimed"
WRONG_SESSION = "a session id that is not the engine's"


@pytest.fixture(scope="module")
def mooncake_prefill() -> Iterator[RealPrefill]:
    reason = engine_unavailable("mooncake")
    if reason is not None:
        pytest.skip(reason)
    pool = PrefillPool(spawn=[("mooncake", 1, False)])
    try:
        yield pool.get("mooncake")
    finally:
        pool.close()


@pytest.fixture(scope="module")
def sglang_mooncake_decode(mooncake_prefill: RealPrefill) -> Iterator[Any]:
    from tests.real_prefill.sglang_decode import SGLangDecode

    decode = SGLangDecode("mooncake", layout=mooncake_prefill.layout)
    try:
        yield decode
    finally:
        decode.close()


class MooncakeDecode:
    """A decode's own Mooncake engine over loopback TCP, buffers as the prefill's layout needs
    them, set up with one mistake (or none)."""

    def __init__(self, prefill: RealPrefill, mistake: str | None) -> None:
        from tests.real_prefill import engines
        from tests.real_prefill.prefill_process import has_state

        #: what real_prefill.harness.wrong_pages reads of a decode
        self.layout, self.tp_rank, self.tp_size, self.backend = prefill.layout, 0, 1, "mooncake"
        g = prefill.layout.side(1)
        self.engine, session = engines.mooncake_engine()
        self.kv = [np.zeros(g.slots * g.item_len, dtype=np.uint8) for _ in range(g.buffers)]
        self.aux = np.zeros(g.aux_slots * g.aux_item_len, dtype=np.uint8)
        self.state = np.zeros(g.state_slots * g.state_item_len, dtype=np.uint8)
        registered = [*self.kv[:-1], self.state]
        if mistake != UNREGISTERED:
            registered.append(self.kv[-1][: len(self.kv[-1]) // 2 if mistake == SHORT_KV else None])
        if mistake != UNREGISTERED_AUX:
            registered.append(self.aux)
        engines.register("mooncake", self.engine, registered)
        self.session_id = "127.0.0.1:1" if mistake == WRONG_SESSION else session
        fields: dict[str, Any] = {}
        if has_state("mooncake"):
            fields = {
                "state_data_ptrs": [[self.state.ctypes.data]],
                "state_data_lens": [[self.state.nbytes]],
                "state_item_lens": [[g.state_item_len]],
                "state_dim_per_tensor": [[]],
                "state_layer_ids": [[]],
            }
        self.kv_args = DecodeKVArgs(
            engine_rank=0,
            attn_tp_size=1,
            kv_data_ptrs=[b.ctypes.data for b in self.kv],
            kv_data_lens=[b.nbytes for b in self.kv],
            kv_item_lens=[g.item_len] * g.buffers,
            aux_data_ptrs=[self.aux.ctypes.data],
            **fields,
        )

    def factory(self) -> Callable[[str, int], Any]:
        from statemachine.sglang.v0_5_23 import MooncakeBackend

        return MooncakeBackend.factory(self.session_id, self.kv_args)

    def from_engine(self) -> Callable[[str, int], Any]:
        from statemachine.sglang.v0_5_23 import MooncakeBackend

        return MooncakeBackend.from_engine(self.engine, "127.0.0.1", self.kv_args)

    def from_engine_session(self) -> Callable[[str, int], Any]:
        from statemachine.sglang.v0_5_23 import MooncakeBackend

        return MooncakeBackend.from_engine_session(self.engine, self.session_id, self.kv_args)

    def constructor(self) -> Any:
        from statemachine.sglang.v0_5_23 import MooncakeBackend

        return MooncakeBackend("127.0.0.1", 5555, self.session_id, self.kv_args)


_last_kv = (
    r"kv_data_ptrs\[\d+\] \(0x[0-9a-f]+\) is not registered with the Mooncake engine of session"
)
#: (mistake, path, what the refusal says): every combination a caller can make. Through
#: ``from_engine`` a KV buffer unregistered cannot be made (it registers them itself, at their
#: full length; one registered short before stays short: Mooncake answers "already registered"),
#: nor a session that is not the engine's (the port is the
#: engine's; a host other than the one it was initialized with that still reaches it, as
#: 127.0.0.2 does here, is the engine's session for a prefill too).
MOONCAKE_REFUSALS = [
    (UNREGISTERED, "factory", _last_kv),
    (SHORT_KV, "factory", _last_kv + r" .* \(its last byte"),
    (SHORT_KV, "from_engine", _last_kv + r" .* \(its last byte"),
    (
        UNREGISTERED_AUX,
        "factory",
        r"aux_data_ptrs\[0\] .* not registered with the Mooncake engine of",
    ),
    (UNREGISTERED_AUX, "from_engine", r"aux_data_ptrs\[0\] .* not registered with this Mooncake"),
    (WRONG_SESSION, "factory", r"no buffer kv_args names could be read through .*'127.0.0.1:1'"),
    (UNREGISTERED, "from_engine_session", _last_kv),
    (SHORT_KV, "from_engine_session", _last_kv + r" .* \(its last byte"),
    (UNREGISTERED_AUX, "from_engine_session", r"aux_data_ptrs\[0\] .* not registered with the"),
    (
        WRONG_SESSION,
        "from_engine_session",
        r"no buffer kv_args names could be read through .*'127.0.0.1:1'",
    ),
    (UNREGISTERED, "constructor", r"MooncakeBackend\(\.\.\.\) is not a public constructor"),
    (WRONG_SESSION, "constructor", r"MooncakeBackend\(\.\.\.\) is not a public constructor"),
]


@pytest.mark.parametrize(
    ("mistake", "path", "message"),
    MOONCAKE_REFUSALS,
    ids=[f"{m}-{p}" for m, p, _ in MOONCAKE_REFUSALS],
)
def test_sgw12_mooncake_mistake_is_refused_locally_and_sglangs_decode_completes_after(
    mooncake_prefill: RealPrefill,
    sglang_mooncake_decode: Any,
    mistake: str,
    path: str,
    message: str,
) -> None:
    """Before (issue 32, measured on main before this check): ``factory`` accepted the KV
    buffer unregistered and the wrong session; SGLang's prefill reported every room of that
    decode Failed (``TransferFailed`` within 0.03 s) and the decode blamed the prefill. Now
    each is refused typed before a manager exists, so no frame is built."""
    decode = MooncakeDecode(mooncake_prefill, mistake)
    with pytest.raises(InvalidArgument, match=message):
        getattr(decode, path)()
    sglang_decode_completes(mooncake_prefill, sglang_mooncake_decode)


def test_sgw12_mooncake_correct_engine_passes_both_paths_and_is_served(
    mooncake_prefill: RealPrefill, sglang_mooncake_decode: Any
) -> None:
    """The control: the read-back refuses only mistakes. A correct decode's ``factory`` and
    ``from_engine`` build the same registration, and a manager on ``factory`` is served by
    SGLang's prefill, every page right; SGLang's own decode completes after it. Prints what
    each path's check costs (once per decode process)."""
    from statemachine import DecodeLayout, DecodeManager
    from statemachine.completion import KVPoll
    from statemachine.pool import RankInfo

    decode = MooncakeDecode(mooncake_prefill, None)
    started = time.monotonic()
    by_factory = decode.factory()
    factory_s = time.monotonic() - started
    started = time.monotonic()
    by_engine = decode.from_engine()
    engine_s = time.monotonic() - started
    print(f"factory's read-back {factory_s:.3f} s, from_engine's {engine_s:.4f} s")
    rank = RankInfo("127.0.0.1", 1, 0)
    assert by_factory("127.0.0.1", 5555).register_frames(rank) == by_engine(
        "127.0.0.1", 5555
    ).register_frames(rank)
    g = mooncake_prefill.layout.side(1)
    manager = DecodeManager(
        layout=DecodeLayout(
            tp_rank=0,
            tp_size=1,
            page_size=g.page_size,
            kv_cache_dtype="bfloat16",
            is_mla=mooncake_prefill.layout.mla,
        ),
        backend_factory=by_factory,
        ack_ip="127.0.0.1",
        waiting_timeout_s=30.0,
    )
    try:
        room = next(_rooms)
        mooncake_prefill.transfer(room, SRC, aux_index=3)
        receiver = manager.receiver(mooncake_prefill.address, room, prefill_dp_rank=0)
        assert receiver.init() == KVPoll.WaitingForInput
        receiver.send_metadata(DST, 7)
        deadline = time.monotonic() + 40.0
        while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
            assert time.monotonic() < deadline, "neither Success nor Failed"
            time.sleep(0.001)
        assert state == KVPoll.Success, receiver.failure
        assert wrong_pages(decode, room, DST, 7, None) == []
    finally:
        manager.close()
    sglang_decode_completes(mooncake_prefill, sglang_mooncake_decode)
