"""What the collective agreement (docs/architecture.md) costs: each collective with its
header exchange against the same collective without it, side by side in one run.

    python benchmarks/agreement.py [--backend gloo|mpi] [--iters 2000]

Two ranks on this host. For each case, rounds alternate between agreement on and off (the
same ``WatchedBackend``, ``agree`` toggled), and the median time per call of each is
printed with their ratio. The cases are what a training step issues:

- ``metrics``: the blocking allreduce of 8 float64 metric states, once a step (it pays one
  header allgather: its cost is that of the smallest collective the backend has);
- ``bucket 2.7MB``: one fused gradient bucket the size of the ``mlp`` model's, first as an
  ad-hoc allreduce (header every call) and then as an agreed plan (the steady state of
  training: no header).

The header's cost is a latency, not a bandwidth: the row ``allreduce 160B max`` (one
header exchange alone, on the raw backend) is printed as the floor of the added time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _rank_main(out: str, iters: int) -> None:
    import tnt_core
    from tnt_core import WatchedBackend

    runtime = tnt_core.init()
    watched = runtime.backend
    assert isinstance(watched, WatchedBackend)
    raw = watched.inner
    small = np.ones(8, np.float64)
    big = np.ones(2_700_000 // 4, np.float32)
    planned = np.ones(2_700_000 // 4, np.float32)
    watched.agree_on_plan([planned])
    header = np.zeros(20, np.int64)
    cases = {
        "metrics 64B": lambda: watched.allreduce(small),
        "bucket 2.7MB, ad hoc": lambda: watched.allreduce_async(big).wait(),
        "bucket 2.7MB, planned": lambda: watched.allreduce_async(planned).wait(),
        "allreduce 160B max (a header alone)": lambda: raw.allreduce(header, "max"),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"on": [], "off": []} for k in cases}
    rounds = 10
    per_round = max(1, iters // rounds)
    for name, call in cases.items():
        for _ in range(20):
            call()
        for r in range(2 * rounds):
            watched.agree = r % 2 == 0
            raw.barrier()
            t0 = time.perf_counter()
            for _ in range(per_round):
                call()
            times[name]["on" if watched.agree else "off"].append((time.perf_counter() - t0) / per_round)
    watched.agree = True
    if runtime.rank == 0:
        Path(out).write_text(json.dumps({k: {m: statistics.median(v) for m, v in d.items()}
                                         for k, d in times.items()}))
    tnt_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    from tnt_core.testing import launch_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "result.json"))
        launcher = None
        if args.backend == "mpi":
            launcher = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2"]
        result = launch_ranks([__file__, "--rank-main", out, str(args.iters)], 2, backend=args.backend,
                              timeout=600, tnt_timeout_s=120, launcher=launcher)
        if not result.ok:
            raise SystemExit(result.describe())
        data = json.loads(Path(out).read_text())
    print(f"backend {args.backend}, 2 ranks, median per call over alternating rounds")
    print(f"{'case':34s} {'agreement on':>14s} {'off':>10s} {'on/off':>8s} {'added':>9s}")
    for name, d in data.items():
        on, off = d["on"], d["off"]
        print(f"{name:34s} {on * 1e6:11.1f} µs {off * 1e6:7.1f} µs {on / off:8.2f} "
              f"{(on - off) * 1e6:6.1f} µs")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        _rank_main(sys.argv[2], int(sys.argv[3]))
    else:
        main()
