"""SGLang 0.5.23's decode KV manager and receivers, built on a ``DecodeManager``.

:func:`install` makes SGLang 0.5.23's decode scheduler build its KV manager and receivers from
:mod:`.conn` for the chosen transfer backends; :func:`uninstall` (or leaving
``with install(...):``) undoes it. In an SGLang server, the ``sglang.srt.plugins`` entry point
(:mod:`.plugin`) installs them in every process SGLang starts when ``PD_BOOTSTRAP_SGLANG_DECODE``
names backends, and ``pd-bootstrap sglang-check`` (:mod:`.check`) says what a scheduler gets.
``docs/sglang-decode.md`` says how to deploy it.

This package sits above the decode runtime (it composes a ``DecodeManager`` with SGLang's
classes), so the wire package beside it (``statemachine.sglang.v0_5_23``) never imports it.
"""

from statemachine.sglang.v0_5_23.decode_worker.installer import install, installed, uninstall

__all__ = ["install", "installed", "uninstall"]
