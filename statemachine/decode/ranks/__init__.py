"""ZMQ between a decode process and the prefill ranks.

``outbox`` (everything the decode sends a rank), ``transport`` (moves the bytes, reports
verdicts), ``sockets`` (one socket and its ``SocketPolicy``), ``socket_cache`` (one socket per
endpoint, sockets that follow generations), ``breaker`` (verdicts remembered after a socket
closed), ``verdicts`` (the typed ``Verdict`` and its listeners), ``exit_probe`` (an exit told
from silence), ``endpoints`` (what an endpoint is, IP literals only), ``liveness`` (the
dead/alive rule), ``monitor`` (one thread reading every socket's ZMQ monitor), ``acks`` (the
completion listener, over ``statemachine.wire.zmtp``).
"""
