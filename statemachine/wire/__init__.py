"""The wire formats shared by both sides: what goes over HTTP and ZMQ, written once."""
