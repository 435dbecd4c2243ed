"""Backends built without reading their registrations back: for tests and benchmarks whose
transfer engine is a stand-in, never for a decode that talks to a prefill.

:meth:`MooncakeBackend.from_engine` / :meth:`~MooncakeBackend.factory` and
:meth:`NixlBackend.from_agent` / :meth:`~NixlBackend.factory` are the public ways to make a
backend: they read every buffer back through the decode's engine or agent first, so a decode's
mistake is refused locally instead of failing (Mooncake) or killing (NIXL) a prefill's transfers
(SGW-12). Where no engine runs — a wire test comparing frames, a benchmark of the bootstrap path
with a made-up session — there is nothing to read back, and these functions say so by their
name. Not exported from :mod:`statemachine.sglang.v0_5_23`.
"""

from __future__ import annotations

from collections.abc import Callable

from statemachine.sglang.v0_5_23 import mooncake, nixl
from statemachine.sglang.v0_5_23.kv_args import DecodeKVArgs
from statemachine.sglang.v0_5_23.mooncake import MooncakeBackend
from statemachine.sglang.v0_5_23.nixl import NixlBackend


def unverified_mooncake_backend(
    decode_ip: str, decode_port: int, session_id: str, kv_args: DecodeKVArgs
) -> MooncakeBackend:
    """A :class:`MooncakeBackend` whose session nobody read back (its inputs' form is checked)."""
    return MooncakeBackend(decode_ip, decode_port, session_id, kv_args, _witness=mooncake._VERIFIED)


def unverified_mooncake_factory(
    session_id: str, kv_args: DecodeKVArgs
) -> Callable[[str, int], MooncakeBackend]:
    """A ``backend_factory`` of :func:`unverified_mooncake_backend`."""
    mooncake.check_session_id(session_id)
    return MooncakeBackend._builder(session_id, kv_args)


def unverified_nixl_backend(
    decode_ip: str, decode_port: int, agent_name: str, agent_metadata: bytes, kv_args: DecodeKVArgs
) -> NixlBackend:
    """A :class:`NixlBackend` whose metadata nobody read back (its inputs' form is checked)."""
    return NixlBackend(
        decode_ip, decode_port, agent_name, agent_metadata, kv_args, _witness=nixl._VERIFIED
    )
