"""``python -m statemachine demo``: the whole decode-side bootstrap, end to end, on loopback.

A real bootstrap server and real prefill rank processes, a decode side in this process with
concurrent request loops sharing one pool, client, transport and ack listener, and a prefill
restart midway. One module per job:

* :mod:`~statemachine.demo.modes` - the three cache designs compared (ours and two anchors),
  and the audited pool that measures lost live generations independently of the pool's code;
* :mod:`~statemachine.demo.cluster` - the prefill instance's processes (start, SIGKILL, restart);
* :mod:`~statemachine.demo.loops` - the decode request loops;
* :mod:`~statemachine.demo.sampling` - socket counts from ``/proc/net/tcp`` and pool sampling;
* :mod:`~statemachine.demo.run` - one run: wires the parts together and restarts the prefill;
* :mod:`~statemachine.demo.report` - metrics, the table, the JSON report and the plot;
* :mod:`~statemachine.demo.cli` - the command line.
"""
