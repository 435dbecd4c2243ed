"""The decode side: what a decode worker runs to bootstrap its receivers.

``manager`` (one per process: the façade that makes and wires the parts, the worker's API;
settings in ``config``), ``receiver`` (one per request; its ``init()`` is the hit path), and
the parts below them, each with one job and none importing the manager or the receiver:
``rooms`` (the receivers in flight), ``routes`` (topology → plan → address plan), ``dp_ranks``
(batched dp-rank queries), ``fanout`` (evidence → invalidate → fail the dependants;
``dead_keys``), ``retention`` (the sockets of published generations), ``exits`` (exit proofs
for held KV), ``completions`` (prefill statuses in; the KV an ABORT holds, ``holds``),
``fetcher`` (the miss path's steps; ``flight`` for single-flight), ``silent``, ``tally``.
Beneath: ``client`` (HTTP to a prefill's bootstrap server) behind the ``source`` protocol,
``ranks/`` (ZMQ to and from the prefill ranks: outbox, transport and its parts, liveness,
socket monitor, completion listener), ``health`` (heartbeat), ``plan`` (rank plans from the
topology), ``background`` (worker threads), ``metrics`` (Prometheus export).
"""
