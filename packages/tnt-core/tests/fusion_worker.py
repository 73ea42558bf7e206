"""Run inside each rank by test_fusion.py: fused allreduce across real processes."""

import json
import sys

import numpy as np

import tnt_core


def inputs(rank: int):
    # backward order, mixed dtypes, one tensor far above the threshold, a zero-size one
    return [
        np.full((3, 4), rank + 1, np.float32),
        np.arange(5, dtype=np.float64) * (rank + 1),
        np.full((300, 100), rank + 2, np.float32),
        np.zeros((0,), np.float32),
        np.full(7, rank, np.int64),
        np.full((2, 2), 0.5 * (rank + 1), np.float16),
        np.full(9, rank + 1, np.float32),
    ]


def main() -> int:
    threshold, out = int(sys.argv[1]), sys.argv[2]
    rt = tnt_core.init()
    arrays = inputs(rt.rank)
    plan = tnt_core.plan_buckets(arrays, threshold)
    fused = tnt_core.FusedAllreducer(rt.backend, plan)
    results = {}
    for step in range(2):  # buffers are reused: the second step must be right too
        order = list(range(len(arrays)))
        if rt.rank % 2:  # odd ranks push in a different order: issue order must not change
            order.reverse()
        for tid in order:
            scale = 0.5 if arrays[tid].dtype.kind == "f" else None
            fused.push(tid, arrays[tid] * (step + 1), scale=scale)
        results[step] = [r.tolist() for r in fused.finish()]
    with open(f"{out}/rank{rt.rank}.json", "w") as f:
        json.dump({"results": results, "buckets": len(plan.buckets)}, f)
    tnt_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
