"""GPipe or 1F1B? The two schedules of ``tarantella.pipeline.stage.StageStep`` side by side.

    python benchmarks/pipeline_schedules.py [--micro-batches 8] [--batch-size 512] [--steps 12]

Two stages on 2 ranks (``tnt run``, the gloo backend) train the same 4 x 1024 MLP; rounds
alternate between the schedules (one step each), and each prints, per rank, the median
step time and the most micro-batches whose activations the stage held at once (GPipe:
all of them at the turn; 1F1B: at most ``P - p``), with the bytes that is. Both schedules
make the same passes, so their step times differ only by how the waits fall.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from launch import rank_reports


def rank_main(args: argparse.Namespace) -> None:
    import keras
    import numpy as np

    import tarantella as tnt
    import tnt_core
    from tarantella.pipeline import schedule
    from tarantella.pipeline.partition import partition
    from tarantella.pipeline.stage import SCHEDULES, StageStep

    runtime = tnt_core.init()
    keras.utils.set_random_seed(1)
    inp = keras.Input((256,))
    x = inp
    for i in range(4):
        x = keras.layers.Dense(1024, activation="relu")(x)
        if i == 1:
            x = tnt.keras.layers.SplitLayer()(x)
    model = keras.Model(inp, keras.layers.Dense(10)(x))
    parts = partition(model)
    steps = {s: StageStep(parts, runtime.rank, runtime.backend, loss=keras.losses.MeanSquaredError(),
                          optimizer=keras.optimizers.SGD(0.01), num_micro_batches=args.micro_batches,
                          schedule=s) for s in SCHEDULES}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 256)).astype(np.float32)
    y = rng.standard_normal((args.batch_size, 10)).astype(np.float32)
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    # the activations each stage holds at once, from the schedule's dry run
    held = {s: schedule.dry_run(schedule.build(s, parts.num_partitions, args.micro_batches))
            .peak_in_flight[runtime.rank] for s in SCHEDULES}
    for i in range(args.steps + 2):
        for s in (SCHEDULES if i % 2 == 0 else SCHEDULES[::-1]):
            runtime.backend.barrier()
            start = time.perf_counter()
            steps[s].train(x, y)
            runtime.backend.barrier()
            if i >= 2:  # warm-up
                times[s].append(time.perf_counter() - start)
    activation_bytes = 4 * args.batch_size // args.micro_batches * 1024 * 3  # 2 hidden + input
    report = {s: {"median_s": statistics.median(times[s]), "held": held[s],
                  "held_mb": held[s] * activation_bytes / 1e6} for s in SCHEDULES}
    Path(args.out, f"rank{runtime.rank}.json").write_text(json.dumps(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    reports = rank_reports(__file__, 2, ["--micro-batches", str(args.micro_batches),
                                         "--batch-size", str(args.batch_size), "--steps",
                                         str(args.steps)], timeout=900)
    print(f"2 stages, {args.micro_batches} micro-batches, batch {args.batch_size}, "
          f"median of {args.steps} alternating steps")
    print(f"{'schedule':8} {'rank':>4} {'step ms':>8} {'held micro-batches':>19} {'held MB':>8}")
    for s in reports[0]:
        for r, rep in enumerate(reports):
            print(f"{s:8} {r:>4} {rep[s]['median_s'] * 1e3:8.1f} {rep[s]['held']:>19} "
                  f"{rep[s]['held_mb']:8.1f}")
    ratio = reports[0]["1f1b"]["median_s"] / reports[0]["gpipe"]["median_s"]
    print(f"step time 1f1b / gpipe (rank 0): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
