"""Tests against real parts of this library: servers on 127.0.0.1, sockets, processes, etcd,
network namespaces."""
