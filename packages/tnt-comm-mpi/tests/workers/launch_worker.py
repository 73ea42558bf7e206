"""Report how the runtime came up in this rank: ``launch_worker.py OUT [--import-mpi4py-first]``.

Writes ``OUT/rank<R>.json`` (R from the backend, or ``error-<pid>.json`` if starting the
runtime failed) with backend, rank, size, local rank/size and an allreduce check.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import tnt_core


def main() -> int:
    out = Path(sys.argv[1])
    if "--import-mpi4py-first" in sys.argv:
        from mpi4py import MPI  # noqa: F401 - MPI now runs as a singleton job
    try:
        runtime = tnt_core.init()
    except tnt_core.TntError as exc:
        (out / f"error-{os.getpid()}.json").write_text(json.dumps(
            {"error": type(exc).__name__, "message": str(exc)}))
        return 3
    b = runtime.backend
    buf = np.full(5, b.rank + 1, np.int64)
    b.allreduce(buf)
    report = {"backend": b.name, "rank": runtime.rank, "size": runtime.size,
              "local_rank": b.local_rank, "local_size": b.local_size,
              "allreduce_ok": bool((buf == b.size * (b.size + 1) // 2).all())}
    (out / f"rank{runtime.rank}.json").write_text(json.dumps(report))
    tnt_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
