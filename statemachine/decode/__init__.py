"""The decode side: what a decode worker runs to bootstrap its receivers.

``client`` (HTTP to a prefill's bootstrap server), ``transport`` (ZMQ PUSH to prefill ranks),
``receiver`` (one per request), ``acks`` (completion listener), ``health`` (heartbeat).
"""
