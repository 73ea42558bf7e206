"""The replicas' gradient sum of a pipeline stage: eager calls or one ``tf.function``?

    python benchmarks/replica_sum.py [--calls 300]

A pipeline stage runs eagerly; under ALL it sums its gradients over its replicas through
``tarantella.comm.gradients.GradientReducer`` (the reducer of DATA's step). Its ops work both
ways: called eagerly they run one after another on the caller's thread; inside a
``tf.function`` (what ``StageStep`` does) the bucket pushes run side by side on
TensorFlow's threads and the call costs a function dispatch. Two ranks (``tnt run``, the
gloo backend) sum three gradient sets over a group split from the job, on the native path
and on the Python path (``TNT_NATIVE_OPS=false``), the two ways alternating call by call
so that the machine's load falls on both alike. Printed per case: the median wall time of
one sum and the rank's CPU time per sum (both on rank 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from launch import rank_reports

#: gradient sets: a small MLP's (1.4 KB), 8 x 256 x 256 layers (2.1 MB), 4 x 1024 x 1024 (16.8 MB)
CASES = {"1.4 KB": [(6, 12), (12,), (6, 4), (4,), (16, 10), (10,), (10, 8), (8,), (8, 3), (3,)],
         "2.1 MB": [(256, 256), (256,)] * 8,
         "16.8 MB": [(1024, 1024), (1024,)] * 4}
WAYS = ("eager", "tf.function")


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf

    import tarantella  # noqa: F401 - starts the runtime
    import tnt_core
    from tarantella.comm.gradients import GradientReducer

    runtime = tnt_core.init()
    group = runtime.backend.split(list(range(runtime.size)))
    one = tf.constant(1.0, tf.float64)
    report: dict[str, dict[str, list[float]]] = {}
    for case, shapes in CASES.items():
        grads = [tf.random.stateless_normal(s, seed=(1, i)) for i, s in enumerate(shapes)]
        calls = {}
        for way in WAYS:
            reducer = GradientReducer(runtime, f"bench_{len(report)}_{way}", group)

            def call(g, reducer=reducer):
                return reducer.reduce(g, one)
            calls[way] = call if way == "eager" else tf.function(call, autograph=False)
        wall: dict[str, list[float]] = {w: [] for w in WAYS}
        cpu = dict.fromkeys(WAYS, 0.0)
        for i in range(args.calls + 5):
            for way in WAYS:
                c0, t0 = time.process_time(), time.perf_counter()
                out = calls[way](grads)
                out[-1].numpy()
                if i >= 5:  # warm-up: traces, plan agreement
                    wall[way].append(time.perf_counter() - t0)
                    cpu[way] += time.process_time() - c0
                del out
        report[case] = {w: [float(np.median(wall[w])), cpu[w] / args.calls] for w in WAYS}
    Path(args.out, f"rank{runtime.rank}.json").write_text(json.dumps(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    print(f"2 ranks, gloo; medians of {args.calls} alternating calls (rank 0)")
    print(f"{'path':7} {'gradients':>9} {'way':>12} {'wall ms':>8} {'CPU ms':>7}")
    for native in ("true", "false"):
        report = rank_reports(__file__, 2, ["--calls", str(args.calls)],
                              options=["--backend", "gloo", "-x", f"TNT_NATIVE_OPS={native}"],
                              timeout=1800)[0]
        path = "native" if native == "true" else "Python"
        for case, ways in report.items():
            for way, (wall, cpu) in ways.items():
                print(f"{path:7} {case:>9} {way:>12} {wall * 1e3:8.2f} {cpu * 1e3:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
