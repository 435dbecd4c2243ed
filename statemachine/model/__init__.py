"""The formal model: an exact Python mirror of ``TLA/BootstrapCache.tla`` and its checker.

* :mod:`statemachine.model.spec` — the mirror (variables, actions, properties);
* :mod:`statemachine.model.cfg` — reads the TLC ``.cfg`` files;
* :mod:`statemachine.model.checker` — BFS, safety and fair-cycle liveness checking;
* :mod:`statemachine.model.check` — ``python -m statemachine check``;
* :mod:`statemachine.model.mutations` — seeded spec mutations, each breaking a named property;
* :mod:`statemachine.model.tlc` — ``make tlc``: the cfgs and mutations through real TLC;
* :mod:`statemachine.model.conformance` — the model against the lifecycle Machine.
"""
