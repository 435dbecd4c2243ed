"""The decode side: what a decode worker runs to bootstrap its receivers.

``manager`` (one per process: owns the parts below, makes the receivers, fans failures out),
``receiver`` (one per request), ``client`` (HTTP to a prefill's bootstrap server) behind the
``source`` protocol, ``ranks/`` (ZMQ to and from the prefill ranks: transport, liveness, socket
monitor, completion listener), ``health`` (heartbeat), ``flight`` (single-flight fetches),
``plan`` (rank plans from the topology), ``metrics`` (Prometheus export).
"""
