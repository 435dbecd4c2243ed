"""SGLang 0.5.23's real prefill, in its own processes, moving real KV bytes to a decode.

The harness the end-to-end tests (``tests/sglang/test_real_bytes.py``,
``tests/sglang/test_real_restart.py``),
``pd-bootstrap demo --prefill sglang`` and ``benchmarks/bench_e2e.py`` share:

* :class:`~real_prefill.harness.RealPrefill` (``backend``, ``tp_size``, ``layout``,
  ``bootstrap_port``): ``start()``, ``transfer(room, src_pages, aux_index, state_index)``,
  ``kill()``, ``start()`` again behind the same port, ``close()``;
* :class:`~real_prefill.harness.LibraryDecode`: this library's ``DecodeManager`` with its own
  engine/agent and registered buffers; ``request(...)``, ``wrong_pages(...)``, ``reset()``;
* :class:`~real_prefill.sglang_decode.SGLangDecode`: SGLang's own decode (its KV manager in
  DECODE mode and its receiver, driven as ``decode.py`` drives them), the same two calls;
* :class:`~real_prefill.multirank.DecodeRanks` / :func:`~real_prefill.multirank.restart_run`:
  a two-rank SGLang decode (tp 2 or dp attention 2), each rank SGLang's decode queues in its own
  process (:mod:`real_prefill.decode_rank`) over a real gloo process group, through a prefill
  SIGKILL and replacement (needs real torch: ``make .venv/.torch``);
* :class:`~real_prefill.harness.Layout` / :class:`~real_prefill.pattern.Geometry`: the model
  both sides agree on; :func:`~real_prefill.engines.engine_unavailable`: the skip reason.

Needs Python 3.11, SGLang's wheel and the engines (``make .venv/.engines``).
"""
