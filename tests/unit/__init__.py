"""Fast tests of one part, in-process: no servers, sockets or processes."""
