"""Bootstrap questions a scheduler starts now and collects later, off its own thread.

SGLang 0.5.23's decode scheduler submits its batched ``POST /query_dp_ranks`` to a shared
thread pool at the top of each event-loop iteration and consumes the answer in a later one
(``disaggregation/decode.py:3130-3133``, ``1225-1331``; the pool: ``common/conn.py:1138-1158``),
so the network never stalls the scheduler. :class:`Background` is that pool for a
:class:`~statemachine.decode.manager.DecodeManager`: a few worker threads, started on first use
(a manager that never asks anything in the background starts none), each running one source
call at a time. What a worker computes is only *handed back* (a ``Future``); the manager applies
it on the thread that collects it (``step``, ``init``), so receivers are still stepped by their
owner only (``spec/manager.md`` MGR-2).

Every call a worker runs is a source call, bounded by the source's own per-call deadline; on
:meth:`close` calls not yet started are cancelled, and a call in flight ends within that
deadline, after which its thread exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from statemachine.errors import ManagerClosed

__all__ = ["DEFAULT_WORKERS", "Background"]

T = TypeVar("T")

#: Worker threads: one per address with a query in flight is enough for a few prefills; SGLang
#: sizes its pool with ``SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`` (default 16).
DEFAULT_WORKERS = 4


class Background:
    """A lazily started thread pool for source calls (see the module docstring)."""

    def __init__(self, workers: int = DEFAULT_WORKERS, *, name: str = "decode-bootstrap") -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, not {workers!r}")
        self.workers = workers
        self.name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, call: Callable[..., T], *args: object) -> Future[T]:
        """Run ``call(*args)`` on a worker; its result (or exception) is the future's."""
        with self._lock:
            if self._closed:
                raise ManagerClosed("the decode manager is closed: create a new one")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._executor.submit(call, *args)

    @property
    def started(self) -> bool:
        """Whether a worker pool exists (it is made by the first :meth:`submit`)."""
        return self._executor is not None

    def close(self) -> None:
        """Cancel what has not started; idle workers exit now, busy ones when their call
        returns (within the source's deadline). Idempotent; submits after it raise."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
