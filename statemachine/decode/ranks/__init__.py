"""ZMQ between a decode process and the prefill ranks.

``transport`` (cached PUSH sockets, the circuit breaker, sockets that follow generations),
``endpoints`` (what an endpoint is, IP literals only), ``liveness`` (the dead/alive rule),
``monitor`` (one thread reading every socket's ZMQ monitor), ``acks`` (the completion listener).
"""
