"""SGLang 0.5.23's decode-side wire: Mooncake and NIXL (``spec/sglang-wire.md``).

Pick the backend named after the prefill's ``--disaggregation-transfer-backend``:
:class:`MooncakeBackend` for ``mooncake``, :class:`NixlBackend` for ``nixl``. Other 0.5.23
transfer backends (``mori``, ``ascend``, ``fake``) are not supported.

Inside SGLang's own decode worker, :mod:`statemachine.sglang.v0_5_23.decode_worker` (a layer
above: it composes a ``DecodeManager``) installs SGLang 0.5.23 decode classes built on this wire
(``docs/sglang-decode.md``).
"""

from statemachine.sglang.v0_5_23.kv_args import DecodeKVArgs
from statemachine.sglang.v0_5_23.mooncake import MooncakeBackend
from statemachine.sglang.v0_5_23.nixl import NixlBackend

#: The SGLang release whose wire this package speaks.
SGLANG_VERSION = "0.5.23"

__all__ = [
    "SGLANG_VERSION",
    "DecodeKVArgs",
    "MooncakeBackend",
    "NixlBackend",
]
