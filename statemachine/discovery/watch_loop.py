"""The etcd source's watch loop: list once, then watch from the list's revision + 1, forever.

One background thread, as Kubernetes' reflector runs: it lists the prefix (``list_and_diff``),
opens a watch from the store's revision + 1 and hands every message to ``apply``, in revision
order. A quiet prefix re-opens the watch at once (``WatchIdle``: how a half-open connection to
a dead etcd is found); a broken stream or an unreachable etcd resumes from revision + 1 (no
list: etcd keeps the history until compaction); a compacted resume, another cluster answering
(``same_cluster`` says no) or a bug re-lists. Every retry waits its jittered back-off
(``backoff_initial`` doubling to ``backoff_max``), reset only by a stream that stayed up for
``backoff_max``: a gateway that fails the same way each time costs at most one attempt per
back-off, never a busy loop. ``close()`` ends the exchange in progress, so the thread ends
within ``connect_timeout + 1`` s.

What a message changes is the source's (:mod:`statemachine.discovery.etcd_source`); the loop
only keeps it fed and counts how it went.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from statemachine.call_deadline import Exchange
from statemachine.discovery.etcd_wire import WatchMessage
from statemachine.discovery.gateway import EtcdGateway
from statemachine.discovery.watch_stream import WatchStream
from statemachine.errors import DiscoveryError, EtcdBadReply, WatchCompacted, WatchIdle


class WatchLoop:
    """Feeds a store from an etcd watch on one prefix (see the module doc).

    ``list_and_diff`` lists the prefix and loads or diffs the store (passing :meth:`track` to
    the gateway); ``revision`` is the store's revision; ``same_cluster`` says whether a watch's
    first message comes from the cluster the store was listed from; ``apply`` applies one
    message; ``first_list_failed`` is called when a first list failed (its waiters hear the
    cause); ``report_error`` gets each failure's text.
    """

    def __init__(
        self,
        gateway: EtcdGateway,
        prefix: bytes,
        *,
        list_and_diff: Callable[[], None],
        revision: Callable[[], int],
        same_cluster: Callable[[WatchMessage], bool],
        apply: Callable[[WatchMessage], None],
        first_list_failed: Callable[[], None],
        report_error: Callable[[str], None],
        backoff_initial: float,
        backoff_max: float,
        idle_timeout: float,
    ) -> None:
        self.gateway = gateway
        self._prefix = prefix
        self._list_and_diff = list_and_diff
        self._revision = revision
        self._same_cluster = same_cluster
        self._apply = apply
        self._first_list_failed = first_list_failed
        self._report_error = report_error
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._idle_timeout = idle_timeout
        self._stop = threading.Event()
        self._stream_lock = threading.Lock()
        self._stream: WatchStream | None = None
        #: the exchange with etcd in progress (a list, a watch open), for close() to end
        self._exchange: Exchange | None = None
        self.thread: threading.Thread | None = None
        #: a watch stream is open (False while etcd is unreachable)
        self.connected = False
        self.compactions = 0
        self.reconnects = 0
        self.idle_reopens = 0
        self.bad_replies = 0

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="etcd-source", daemon=True)
            self.thread.start()

    def close(self) -> None:
        """Stop the thread: within ``connect_timeout + 1`` s (the gateway's), whatever etcd or a
        proxy does - the exchange in progress is ended at once (its socket shut down); only a
        TCP connect in progress cannot be, and it has its own timeout."""
        self._stop.set()
        with self._stream_lock:
            stream, exchange = self._stream, self._exchange
        if exchange is not None:
            exchange.end("closed")
        if stream is not None:
            stream.close()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.gateway.timeout[0] + 1.0)

    def track(self, exchange: Exchange) -> None:
        """The gateway's ``on_exchange``: remember the exchange for ``close()``."""
        with self._stream_lock:
            self._exchange = exchange
        if self._stop.is_set():  # close() ran before the exchange was visible to it
            exchange.end("closed")

    def _run(self) -> None:
        backoff = self._backoff_initial
        need_list = True
        while not self._stop.is_set():
            opened: float | None = None  # when the current watch stream was accepted
            pause = True  # every way out of a stream but a healthy idle re-open waits
            try:
                if need_list:
                    self._list_and_diff()
                    need_list = False
                stream = self.gateway.watch_prefix(
                    self._prefix,
                    start_revision=self._revision() + 1,
                    read_timeout=self._idle_timeout,
                    on_exchange=self.track,
                )
                with self._stream_lock:
                    self._stream = stream
                if self._stop.is_set():  # close() ran before the stream was visible to it
                    stream.close()
                    break
                opened = time.monotonic()
                with stream:
                    for message in stream:
                        if message.created:
                            self.connected = True
                            if not self._same_cluster(message):
                                # Another cluster (etcd replaced, or restored from a backup):
                                # our revisions mean nothing there. Start over.
                                self._report_error("etcd cluster replaced: re-listing")
                                need_list = True
                                break
                        self._apply(message)
            except WatchIdle:
                # Quiet prefix: re-open from revision + 1, no re-list, no wait.
                self.idle_reopens += 1
                pause = False
            except WatchCompacted as exc:
                self.compactions += 1
                self._report_error(str(exc))
                need_list = True
            except EtcdBadReply as exc:
                # Not etcd's reply: a broken gateway or proxy. Resume as after a broken
                # stream (revision + 1); the back-off keeps a repeat from becoming a loop.
                self.connected = False
                self.bad_replies += 1
                self._report_error(str(exc))
            except Exception as exc:  # DiscoveryError, or a bug: the store must keep serving
                if self._stop.is_set():
                    break
                self.connected = False
                self.reconnects += 1
                self._report_error(
                    str(exc) if isinstance(exc, DiscoveryError) else f"{type(exc).__name__}: {exc}"
                )
                if need_list:
                    self._first_list_failed()  # a caller waiting for it hears the cause now
                # Resume from revision + 1 (etcd keeps the history until compaction, so no
                # change is missed); only a compacted resume costs a re-list.
                need_list = need_list or not isinstance(exc, DiscoveryError)
            finally:
                with self._stream_lock:
                    self._stream = None
                    self._exchange = None
            if opened is not None and time.monotonic() - opened >= self._backoff_max:
                # The stream served for a while: whatever ended it is news, not a repeat.
                backoff = self._backoff_initial
            if pause and not self._stop.is_set():
                self._stop.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2.0, self._backoff_max)
        self.connected = False
