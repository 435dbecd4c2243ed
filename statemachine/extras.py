"""The optional extras and what each installs, checked before a part that needs one starts.

``pip install 'pd-bootstrap-statemachine[server]'`` brings aiohttp for the reference bootstrap
server (``pd-bootstrap serve`` and ``demo``, :class:`~statemachine.BootstrapServer`);
``[plot]`` brings matplotlib for ``demo --plot``; ``[metrics]`` brings prometheus_client for
:class:`~statemachine.decode.metrics.PrometheusCollector`. Without them the library itself works.
"""

from __future__ import annotations

import importlib.util

from statemachine.errors import MissingExtra

#: extra -> the top-level modules it provides
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("aiohttp",),
    "plot": ("matplotlib",),
    "metrics": ("prometheus_client",),
}


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` naming the pip command if ``extra`` is not installed.

    Looks the modules up without importing them, so checking costs nothing when they are there.
    """
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(extra, what, module)
