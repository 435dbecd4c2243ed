"""``python -m statemachine.sglang.v0_5_23.decode_worker.launch_server <SGLang's arguments>``.

SGLang 0.5.23's own ``sglang.launch_server``, with this library's decode classes installed in
every process that imports SGLang's ``decode.py``. SGLang starts its scheduler processes with
the ``spawn`` method, and a spawned process runs the launching ``-m`` module again (as
``__mp_main__``) before its target: the hook registered below, at module level, is therefore
in place in each scheduler before its ``decode.py`` loads. ``PD_BOOTSTRAP_SGLANG_DECODE``
(comma-separated, default ``mooncake,nixl``) picks the transfer backends.
"""

from __future__ import annotations

import os
import runpy

from statemachine.sglang.v0_5_23.decode_worker.installer import install_on_import

#: The transfer backends whose decode classes are replaced, from the environment.
BACKENDS = tuple(
    name.strip()
    for name in os.environ.get("PD_BOOTSTRAP_SGLANG_DECODE", "mooncake,nixl").split(",")
    if name.strip()
)

install_on_import(BACKENDS)

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
