"""Allreduces ``$TNT_TEST_BYTES`` (default 2 KiB) of float64 in a loop until the job ends it.
Once its first allreduce completed, each rank writes its pid into
``$TNT_TEST_DIR/looping.<rank>``. In an elastic job a failed allreduce rejoins; after 20
steps with fewer ranks than it started with, a rank prints its rank, size and generation
and ends."""
import os
import time
from pathlib import Path

import numpy as np

import tnt_core

folder = Path(os.environ["TNT_TEST_DIR"])
rt = tnt_core.init()
started_with, fewer = rt.size, 0
count = int(os.environ.get("TNT_TEST_BYTES", "2048")) // 8
while True:
    x = np.ones(count)
    try:
        rt.backend.allreduce(x)
    except tnt_core.CommError:
        if not rt.config.elastic:
            raise
        tnt_core.rejoin(timeout=30)
        continue
    if not (x == rt.size).all():
        raise SystemExit(f"rank {rt.rank}: wrong sum {x[0]} with {rt.size} ranks")
    marker = folder / f"looping.{rt.rank}"
    if not marker.exists():
        marker.write_text(str(os.getpid()))
    if rt.size < started_with:
        fewer += 1
        if fewer == 20:
            break
    time.sleep(0.005)
print(f"done rank {rt.rank} size {rt.size} generation {rt.generation}", flush=True)
tnt_core.shutdown()
