"""A prefill rank registers itself with a bootstrap server: ``PUT /route``, SGLang-style (HTTP-15).

The body is :func:`statemachine.wire.http.route_payload`; the exchange is bounded and its
failures worded as the decode's queries are (:mod:`statemachine.http_exchange`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping

from statemachine.errors import (
    BootstrapHTTPError,
    InvalidArgument,
    MalformedReply,
    NotReady,
    TransportFailure,
)
from statemachine.http_exchange import (
    DEFAULT_DEADLINE,
    JSON_HEADERS,
    TRANSPORT_ERRORS,
    bounded,
    new_session,
    read_body,
    status_error,
    transport_reason,
)
from statemachine.validation import parse_addr
from statemachine.wire.http import INSTANCE_HEADER, register_url

__all__ = ["register_rank"]


def register_rank(
    addr: str,
    token: str | None,
    payload: Mapping[str, object],
    *,
    attempts: int = 5,
    backoff_scale: float = 1.0,
    connect_timeout: float = 2.0,
    read_timeout: float = 5.0,
    deadline: float = DEFAULT_DEADLINE,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Register one prefill rank with ``PUT /route``, SGLang-style (HTTP-15).

    Retries transport failures and 503 up to ``attempts`` times in all, sleeping
    ``min(2**i, 30) * backoff_scale`` seconds times a jitter in [0.5, 1) between tries so that
    ranks restarted together do not retry in lock-step. A 4xx (wrong token, bad payload,
    topology conflict) is permanent and raised at once. Each attempt is bounded by ``deadline``
    seconds (HTTP-35). Returns the server's instance id.
    """
    parse_addr(addr)
    if type(attempts) is not int or attempts < 1:
        raise InvalidArgument(f"attempts must be an int >= 1, got {attempts!r}")
    if not isinstance(payload, Mapping):
        raise InvalidArgument(f"payload must be a mapping, got {type(payload).__name__}")
    try:
        body = json.dumps(dict(payload)).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"payload is not JSON-serialisable: {exc}") from None
    headers = dict(JSON_HEADERS)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    url = register_url(addr)
    timeouts = (connect_timeout, read_timeout, deadline)
    with new_session() as session:
        for attempt in range(attempts):
            exchange = None
            try:
                with bounded(deadline) as exchange:
                    response = session.put(
                        url,
                        data=body,
                        headers=headers,
                        timeout=(min(connect_timeout, deadline), read_timeout),
                        allow_redirects=False,
                        stream=True,
                    )
                    reply = read_body(response, addr)
                    if exchange.ended is not None:
                        # Shut down mid-reply: the EOF it caused can read as a short reply.
                        raise OSError(f"exchange ended ({exchange.ended})")
                if response.status_code == 200:
                    instance_id: str | None = response.headers.get(INSTANCE_HEADER)
                    return instance_id
                error: BootstrapHTTPError = status_error(
                    addr, response.status_code, "PUT /route", reply
                )
            except MalformedReply as exc:
                error = exc
            except TRANSPORT_ERRORS as exc:
                reason = transport_reason(exc, exchange, timeouts)
                error = TransportFailure(f"{addr}: PUT /route: {reason}", addr=addr)
                error.__cause__ = exc
            if not isinstance(error, (TransportFailure, NotReady)) or attempt + 1 == attempts:
                raise error
            delay = min(2.0**attempt, 30.0) * backoff_scale
            sleep(delay * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover
