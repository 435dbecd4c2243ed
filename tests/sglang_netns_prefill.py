"""SGLang 0.5.23's own bootstrap server and one prefill rank in one process, for the namespace
tests (``tests/test_liveness_sglang.py``): ``python tests/sglang_netns_prefill.py HOST`` run
inside a namespace serves both on ``HOST``, prints ``listening on HOST:PORT RANK_PORT`` once the
rank registered, and serves until killed. One process, so one SIGSTOP stops the whole prefill."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_support import (
    _wait_listening,
    free_port,
    import_sglang,
    sglang_prefill_rank,
)


def main() -> None:
    host = sys.argv[1]
    conn = import_sglang()
    os.environ["SGLANG_HOST_IP"] = host  # the rank binds here (read at its bind)
    port = free_port()
    server = conn.CommonKVBootstrapServer(host, port)
    try:
        _wait_listening(host, port, timeout=20.0)
        with sglang_prefill_rank(f"{host}:{port}", tp_size=1, tp_rank=0) as rank:
            print(f"listening on {host}:{port} {rank.rank_port}", flush=True)
            threading.Event().wait()
    finally:
        server.close()


if __name__ == "__main__":
    main()
