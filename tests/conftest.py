"""Fixtures shared by every folder of tests/ (helpers imported by name are in tests/support/)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from statemachine.prefill.server import BootstrapServer
from tests.support.bootstrap_support import TOKEN


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "bootstrap_server(**options): BootstrapServer options for the `server` fixture "
        "(e.g. insecure=True instead of the shared token)",
    )


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[BootstrapServer]:
    """A real reference bootstrap server on 127.0.0.1 (a free port), requiring ``TOKEN``;
    stopped after the test. A ``bootstrap_server(**options)`` marker on the test or its module
    passes other ``BootstrapServer`` options (``insecure=True``: no token)."""
    marker = request.node.get_closest_marker("bootstrap_server")
    options = dict(marker.kwargs) if marker else {}
    if not options.get("insecure"):
        options.setdefault("token", TOKEN)
    with BootstrapServer("127.0.0.1", 0, **options) as running:
        yield running
