"""The bootstrap server as the tests meet it: one token, its header, and registering a prefill.

The server itself is a fixture (``server`` in tests/conftest.py); this module holds what tests and
helpers import by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import requests

from statemachine.prefill.server import BootstrapServer
from tests.support.http_support import rank_payload

#: The token every test's bootstrap server and prefill ranks share.
TOKEN = "test-token"
#: The header a prefill rank's ``PUT /route`` carries.
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def register_all(
    srv: BootstrapServer,
    tp_size: int = 2,
    dp_size: int = 1,
    *,
    body: Callable[..., dict[str, Any]] = rank_payload,
    **change: Any,
) -> None:
    """Register every rank of a ``tp_size`` x ``dp_size`` prefill with ``srv`` as SGLang's ranks
    do (``PUT /route`` with :data:`TOKEN`), rank ``(dp, tp)`` on port ``5000 + 10 * dp + tp``.

    ``body`` builds one rank's registration (``rank_payload`` by default); ``change`` overrides
    its fields. Each registration must be accepted (200)."""
    for dp in range(dp_size):
        for tp in range(tp_size):
            fields = {"rank_port": 5000 + 10 * dp + tp, **change}
            payload = body(tp=tp, tp_size=tp_size, dp=dp, dp_size=dp_size, **fields)
            reply = requests.put(
                f"http://{srv.address}/route", json=payload, headers=AUTH, timeout=10.0
            )
            assert reply.status_code == 200, reply.text
