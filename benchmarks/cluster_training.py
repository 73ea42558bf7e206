"""One training step across emulated hosts, overlap on against off, side by side.

    .venv/bin/python benchmarks/cluster_training.py --rate-mbit 400     # as root

Where the link, not the CPU, is the bottleneck, reducing a layer's gradients while the
backward pass computes the layers before it should pay. This runs the same data-parallel
Keras training on tnt-core's emulated cluster (``tnt_core.testing.cluster``: hosts as
network namespaces, every link limited to ``--rate-mbit`` each way, an sshd and a host name
per host), 2 hosts × 2 ranks by default, through ``tnt run --hostfile ... --launcher ssh``.

Each round is two jobs:

* ``paired``: two copies of the model in one job, one whose gradient reducer overlaps
  (the default: each bucket's allreduce starts when backprop has produced it) and one
  without (as ``TNT_OVERLAP=false``: every allreduce after backprop), taking turns,
  ``--per-fit`` steps each, so that the shared machine's changing load falls on both
  alike (sequential jobs a minute apart differed by more than overlap does). The
  reducer reads the overlap setting from the runtime's config when the model's first
  step is traced; the worker sets it for that step, a benchmark-only shortcut for two
  settings in one process.
* ``comm-free`` (diagnostic): no gradient is reduced at all: the compute alone, the step a
  faster network could approach. The backend's allreduce is replaced by a no-op, which
  only the Python path calls, so this job runs with ``TNT_NATIVE_OPS=false``.

The ``paired`` job also times the gradients' allreduce alone (one buffer of all
parameters, median of 3, the slowest rank's). The model, ``convfc``, puts its compute in
front (three 3×3 convolutions on 32×32 inputs, 0.06 M parameters) and its parameters at
the end (a dense layer on the flattened 64 feature maps, 4.2 M parameters, 17 MB of
gradients): its largest bucket is ready early in the backward pass, and its allreduce at
400 Mbit/s (0.34 s at the link's bound on 2 hosts) is of the order of the backward pass
with the default micro-batch of 96 (about two thirds of a 0.63 s comm-free step on the
2-core development machine, 4 ranks; at 16 the allreduce is twice the whole step, and
overlap can hide little of it).

A step's time is the time between two step ends on rank 0 (Keras' ``on_train_batch_end``;
every step ends with the gradients' collective, so the ranks' step ends align); a fit's
first step, which includes fit's own start, is not counted; the cells are medians. No
XLA: with ``jit_compile=True`` tnt reduces the gradients only after the whole compiled
backward pass (``docs/architecture.md``), so overlap needs the graph path without it.
Needs root (see ``cluster_unavailable``); writes the rows as JSON to
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from launch import write_results

RESULT_TAG = "CLUSTER_TRAINING_RESULT "
VARIANTS = ("overlap on", "overlap off", "comm-free")


def build_model(keras):
    """``convfc``: compute in front (convolutions), parameters at the end (a wide dense)."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input(shape=(32, 32, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.Flatten(),
        layers.Dense(64, activation="relu"),
        layers.Dense(10),
    ], name="convfc")


# -- one rank --------------------------------------------------------------------------

def _data(np, global_batch: int, steps: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((global_batch * steps, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=global_batch * steps).astype(np.int32)
    return x, y


def worker(variant: str, micro_batch: int, warmup: int, steps: int, per_fit: int) -> int:
    import dataclasses

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks per 2-core "host"
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    import tarantella as tnt
    import tnt_core

    keras.utils.set_random_seed(0)
    runtime = tnt_core.init()
    global_batch = micro_batch * tnt.get_size()
    x, y = _data(np, global_batch, per_fit)

    def make(overlap: bool):
        # Each model's gradient reducer reads TNT_OVERLAP's value from the runtime's
        # config when its first step is traced: set it for that first step only.
        config = runtime.config
        runtime.config = dataclasses.replace(config, overlap=overlap)
        model = tnt.Model(build_model(keras))
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x[:global_batch], y[:global_batch], batch_size=global_batch, verbose=0)
        runtime.config = config
        return model

    if variant == "comm-free":
        runtime.backend.allreduce_async = lambda buf, op="sum": tnt_core.CompletedHandle(buf)
        models = {"comm-free": make(True)}
    else:
        models = {"overlap on": make(True), "overlap off": make(False)}
    times: dict[str, list[float]] = {name: [] for name in models}

    class StepEnds(keras.callbacks.Callback):
        def __init__(self, ends: list[float]) -> None:
            super().__init__()
            self.ends = ends

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    # The models take turns, per_fit steps at a time, so that the machine's load falls on
    # both alike; a fit's first step (which includes fit's own start) is not counted.
    turns = -(-(warmup + steps) // (per_fit - 1))
    for _ in range(turns):
        for name, model in models.items():
            ends: list[float] = []
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=[StepEnds(ends)])
            times[name] += [b - a for a, b in itertools.pairwise(ends)]
    for name in times:
        times[name] = times[name][warmup:warmup + steps]
    allreduce_s = []
    if variant != "comm-free":  # the gradients' allreduce alone, as one buffer
        grads = np.ones(int(models["overlap on"].count_params()), np.float32)
        for _ in range(3):
            runtime.backend.barrier()
            t0 = time.perf_counter()
            runtime.backend.allreduce(grads)
            elapsed = np.array([time.perf_counter() - t0])
            allreduce_s.append(float(runtime.backend.allgather(elapsed).max()))
    if tnt.is_master_rank():
        for name, model in models.items():
            info = {"variant": name, "ranks": tnt.get_size(), "micro_batch": micro_batch,
                    "global_batch": global_batch, "params": int(model.count_params()),
                    "times_s": times[name], "median_s": sorted(times[name])[len(times[name]) // 2]}
            if allreduce_s:
                info["allreduce_s"] = sorted(allreduce_s)[1]
            print(RESULT_TAG + json.dumps(info), flush=True)
    return 0


# -- the driver --------------------------------------------------------------------------

def run_job(cluster, job: str, args: argparse.Namespace) -> dict[str, dict]:
    """Run the worker in ``job`` mode ("paired" or "comm-free"); its variants' results."""
    from tnt_core.testing.cluster import RANK_ENV

    hostfile = cluster.write_hostfile(cluster.workdir / f"hostfile{args.hosts}", range(args.hosts))
    # comm-free replaces the backend's allreduce, which only the Python path calls
    env = dict(RANK_ENV, TNT_NATIVE_OPS="false" if job == "comm-free" else "true",
               TF_CPP_MIN_LOG_LEVEL="2")
    argv = cluster.tnt_run_argv(
        "--n-per-node", str(args.per_host), "--backend", "gloo", "--timeout", str(int(args.timeout)),
        "--", str(Path(__file__).resolve()), "--worker", job,
        "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
        "--steps", str(args.steps), "--per-fit", str(args.per_fit),
        hostfile=hostfile, env=env, cwd=cluster.workdir)
    wanted = ("comm-free",) if job == "comm-free" else ("overlap on", "overlap off")
    started = time.monotonic()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout + 300,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {v: {"error": f"no result within {args.timeout + 300:.0f} s"} for v in wanted}
    found = [json.loads(line[len(RESULT_TAG):]) for line in res.stdout.splitlines()
             if line.startswith(RESULT_TAG)]
    if res.returncode != 0 or len(found) != len(wanted):
        tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-3:]
        return {v: {"error": f"exit {res.returncode}: " + " | ".join(tail)} for v in wanted}
    wall = time.monotonic() - started
    return {info["variant"]: dict(info, job_wall_s=wall) for info in found}


def format_table(rounds: list[dict[str, dict]], args: argparse.Namespace, params: int) -> str:
    grad_mb = params * 4 / 1e6
    link_s = grad_mb * 1e6 / (args.rate_mbit * 1e6 / 8) * 2 * (args.hosts - 1) / args.hosts
    lines = [
        f"convfc ({params / 1e6:.2f} M parameters, {grad_mb:.1f} MB of float32 gradients), "
        f"{args.hosts} hosts x {args.per_host} ranks, micro-batch {args.micro_batch}, "
        f"links {args.rate_mbit:g} Mbit/s each way",
        f"the gradients' allreduce at the link's bound: 2(H-1)/H*n/R = {link_s:.2f} s; "
        f"cells: median step time in s over {args.steps} steps",
        "",
        "| round | " + " | ".join(VARIANTS) + " | off - comm-free | allreduce alone | off / on |",
        "|" + "---|" * (len(VARIANTS) + 4),
    ]
    for k, row in enumerate(rounds, 1):
        cells = [f"{row[v]['median_s']:.3f}" if "median_s" in row[v] else "failed" for v in VARIANTS]
        if all("median_s" in row[v] for v in VARIANTS):
            on, off, free = (row[v]["median_s"] for v in VARIANTS)
            alone = row["overlap on"].get("allreduce_s")
            extra = [f"{off - free:.3f}", f"{alone:.3f}" if alone else "", f"{off / on:.2f}x"]
        else:
            extra = ["", "", ""]
        lines.append(f"| {k} | " + " | ".join(cells + extra) + " |")
    done = [r for r in rounds if all("median_s" in r[v] for v in VARIANTS)]
    if done:  # every timed step of every round; off / on paired: step i of both ran in one turn
        med = {v: float(np.median([t for r in done for t in r[v]["times_s"]])) for v in VARIANTS}
        paired = float(np.median([off / on for r in done for on, off in
                                  zip(r["overlap on"]["times_s"], r["overlap off"]["times_s"])]))
        lines.append("| all rounds | " + " | ".join(f"{med[v]:.3f}" for v in VARIANTS)
                     + f" | {med['overlap off'] - med['comm-free']:.3f} | | {paired:.2f}x |")
        lines.append("")
        lines.append("all rounds: the median of every timed step; its off / on is the median of "
                     "the ratios of steps run in the same turn")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("paired", "comm-free"), help=argparse.SUPPRESS)
    parser.add_argument("--rate-mbit", type=float, default=400.0,
                        help="every link's rate in Mbit/s, each way (default 400)")
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--per-host", type=int, default=2, help="ranks per host (default 2)")
    parser.add_argument("--micro-batch", type=int, default=96,
                        help="samples per rank and step (default 96)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per variant, after the first (default 3)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant (default 12)")
    parser.add_argument("--per-fit", type=int, default=4,
                        help="steps per fit() before the other model takes its turn (default 4)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the two jobs (paired, comm-free) (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a rank waits for a peer (tnt run --timeout; default 300)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default in benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.micro_batch < 1 or args.per_fit < 2:
        parser.error("--steps and --micro-batch must be at least 1, --per-fit at least 2")
    if args.worker:
        return worker(args.worker, args.micro_batch, args.warmup, args.steps, args.per_fit)
    if args.hosts < 2 or args.per_host < 1 or args.rounds < 1:
        parser.error("--hosts must be at least 2, --per-host and --rounds at least 1")

    from tnt_core.testing.cluster import ClusterUnavailable, EmulatedCluster

    started = time.time()
    load_start = os.getloadavg()[0]
    rounds: list[dict[str, dict]] = []
    params = 0
    try:
        with EmulatedCluster(args.hosts, rate_mbit=args.rate_mbit) as cluster:
            for k in range(args.rounds):
                row: dict[str, dict] = {}
                for job in ("paired", "comm-free"):
                    row.update(run_job(cluster, job, args))
                for variant in VARIANTS:
                    cell = row[variant]
                    params = cell.get("params", params)
                    what = (f"median step {cell['median_s']:.3f} s, job {cell['job_wall_s']:.0f} s"
                            if "median_s" in cell else cell["error"])
                    print(f"round {k + 1} {variant}: {what}", file=sys.stderr, flush=True)
                rounds.append(row)
    except ClusterUnavailable as exc:
        raise SystemExit(f"cannot build the emulated cluster: {exc}") from None
    print(format_table(rounds, args, params))
    print(f"load average (1 min): {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    write_results("cluster_training", started, {
        "rate_mbit": args.rate_mbit, "hosts": args.hosts, "per_host": args.per_host,
        "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps,
        "load_start": load_start, "load_end": os.getloadavg()[0], "rounds": rounds}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
