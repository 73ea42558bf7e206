"""What ``TNT_GRADIENT_COMPRESSION=fp16`` does: to a link-bound gradient allreduce, and to
a training's result.

    .venv/bin/python benchmarks/gradient_compression.py wire --rate-mbit 400   # as root
    .venv/bin/python benchmarks/gradient_compression.py fidelity
    .venv/bin/python benchmarks/gradient_compression.py passes

``wire``: on tnt-core's emulated cluster (``tnt_core.testing.cluster``; hosts as network
namespaces, every link limited to ``--rate-mbit`` each way), for every layout (hosts ×
ranks per host) and every value of the setting, one job of this file's worker through
``tnt run --hostfile ... --launcher ssh``. The worker reduces ``--size`` bytes of float32
gradients (16 tensors) through tnt-keras' gradient reduction, as ``fit``'s step does
(``reduce_weighted`` in a ``tf.function``, weight 1/ranks, the native path on gloo): a
warm-up, then ``--reps`` timed calls, each after a barrier; a call's time is the slowest
rank's, the median is reported. The first rank of each host reads its link's transmitted
bytes (``/proc/net/dev``, the host's namespace) around the timed calls: every byte the host
sent, headers included, per call. Every result is checked (each element is 1 within
float16's round-off).

``passes``: in one process, what compression adds on the CPU per call, timed interleaved
(medians): the weighting before the cast as a ``where`` (the zeros, the product and the
select: three passes, the reduction's earlier form) and as a ``cond`` on the scalar (one
pass, ``tarantella.comm.gradients``'s), the cast to float16 and back, against the
uncompressed path's one scaling pass and a plain copy of the float32 bytes (numpy).

``fidelity``: 2 ranks on this machine (``tnt run -n 2``) each train a small float32 Keras
model a few epochs with the setting ``none`` and ``fp16``; rank 0 trains the same model
with plain Keras on the same batches. Reported: the largest relative difference of a
weight tensor from plain Keras' (max |w - w_serial| / max |w_serial|) and of the last
epoch's loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT_TAG = "GRADIENT_COMPRESSION_RESULT "
SETTING = "TNT_GRADIENT_COMPRESSION"
TENSORS = 16


def _tx_bytes(iface: str = "tnteth0") -> int:
    """Bytes this network namespace's ``iface`` has sent (``/proc/net/dev``: the reading
    process's namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == iface:
            return int(counters.split()[8])
    return -1


# -- a rank of the wire benchmark ----------------------------------------------------------

def wire_worker(size: int, reps: int) -> int:
    import numpy as np
    import tensorflow as tf

    import tnt_core
    from tarantella.comm import world
    from tarantella.comm.compression import for_fit
    from tarantella.comm.gradients import GradientReducer, reduce_weighted

    runtime = tnt_core.init()
    backend = runtime.backend
    channel = world(runtime)
    reducer = GradientReducer(channel, "bench")
    compression = for_fit(runtime)
    grads = [tf.ones([size // 4 // TENSORS], tf.float32) for _ in range(TENSORS)]
    weight = tf.constant(1.0 / backend.size, tf.float64)

    @tf.function
    def reduce(gs):
        out = reduce_weighted(gs, None, weight, lambda: reducer, channel, keep=tf.constant(True),
                              compression=compression)
        return tf.stack([tf.reduce_min(o) for o in out] + [tf.reduce_max(o) for o in out])

    times, sent = [], 0
    for rep in range(reps + 1):  # the first is a warm-up: tracing, connections, page faults
        backend.barrier()
        before = _tx_bytes()
        t0 = time.perf_counter()
        extremes = reduce(grads).numpy()
        elapsed = time.perf_counter() - t0
        after = _tx_bytes()
        if not np.all(np.abs(extremes - 1.0) <= 1e-3):
            raise SystemExit(f"rank {backend.rank}: wrong sum, extremes {extremes.min()}..{extremes.max()}")
        slowest = backend.allgather(np.array([elapsed])).max()
        if rep:
            times.append(float(slowest))
            sent += after - before
    per_host = backend.allgather(np.array([sent if runtime.local_rank == 0 else -1], np.int64))
    if backend.rank == 0:
        info = {"backend": backend.name, "size": backend.size, "times_s": times,
                "compression": os.environ.get(SETTING, "none"),
                "tx_bytes_per_call": [int(b) // reps for b in per_host.ravel() if b >= 0]}
        print(RESULT_TAG + json.dumps(info), flush=True)
    tnt_core.shutdown()
    return 0


def run_wire(args: argparse.Namespace) -> int:
    from tnt_core.testing.cluster import RANK_ENV, ClusterUnavailable, EmulatedCluster

    rate_bytes = args.rate_mbit * 1e6 / 8
    rows = []
    try:
        with EmulatedCluster(max(h for h, _ in args.layouts), rate_mbit=args.rate_mbit) as cluster:
            for hosts, per_host in args.layouts:
                hostfile = cluster.write_hostfile(cluster.workdir / f"hostfile{hosts}", range(hosts))
                bound = 2 * (hosts - 1) / hosts * args.size / rate_bytes
                row = {"hosts": hosts, "per_host": per_host, "bound_s": bound, "cells": {}}
                for value in args.values:
                    argv = cluster.tnt_run_argv(
                        "--n-per-node", str(per_host), "--backend", args.backend,
                        "--timeout", str(int(args.timeout)), "-x", f"{SETTING}={value}",
                        "--", str(Path(__file__).resolve()), "wire-worker", "--size", str(args.size),
                        "--reps", str(args.reps), hostfile=hostfile,
                        env={**RANK_ENV, "TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=cluster.workdir)
                    started = time.monotonic()
                    res = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                         timeout=args.timeout + 120)
                    found = [ln[len(RESULT_TAG):] for ln in res.stdout.splitlines()
                             if ln.startswith(RESULT_TAG)]
                    if res.returncode != 0 or not found:
                        tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-3:]
                        cell = {"error": f"exit {res.returncode}: " + " | ".join(tail)}
                    else:
                        cell = json.loads(found[0])
                        cell["median_s"] = sorted(cell["times_s"])[len(cell["times_s"]) // 2]
                        cell["job_wall_s"] = time.monotonic() - started
                    row["cells"][value] = cell
                    print(f"{hosts}x{per_host} {value}: {cell.get('median_s', cell.get('error'))}",
                          file=sys.stderr, flush=True)
                rows.append(row)
    except ClusterUnavailable as exc:
        raise SystemExit(f"cannot build the emulated cluster: {exc}") from None
    mib = args.size / 2**20
    print(f"{mib:g} MiB of float32 gradients through tnt-keras' reduction ({TENSORS} tensors), "
          f"{args.backend}, every link {args.rate_mbit:g} Mbit/s each way; t_bound = "
          "2(H-1)/H·n/R for the float32 bytes n")
    print("cells: median time per call in s (t_bound/t); MiB sent per host per call")
    print()
    print("| hosts | ranks/host | t_bound s | " + " | ".join(f"{v} s | {v} MiB sent" for v in args.values)
          + (" | speed-up | bytes ratio |" if len(args.values) == 2 else " |"))
    print("|" + "---|" * (3 + 2 * len(args.values) + (2 if len(args.values) == 2 else 0)))
    for row in rows:
        cells, medians, sent = [], [], []
        for value in args.values:
            cell = row["cells"][value]
            if "median_s" not in cell:
                cells += ["failed", "-"]
                continue
            host_sent = max(cell["tx_bytes_per_call"]) / 2**20
            medians.append(cell["median_s"])
            sent.append(host_sent)
            cells += [f"{cell['median_s']:.2f} ({row['bound_s'] / cell['median_s']:.2f})", f"{host_sent:.1f}"]
        extra = ""
        if len(args.values) == 2 and len(medians) == 2:
            extra = f" | {medians[0] / medians[1]:.2f} | {sent[1] / sent[0]:.3f}"
        print(f"| {row['hosts']} | {row['per_host']} | {row['bound_s']:.2f} | " + " | ".join(cells)
              + extra + " |")
    out = args.out or HERE / "results" / f"gradient_compression_wire_{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rate_mbit": args.rate_mbit, "size_bytes": args.size, "reps": args.reps,
                               "backend": args.backend, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


# -- the passes over the buffer -----------------------------------------------------------------

def run_passes(args: argparse.Namespace) -> int:
    """What compression adds on the CPU, per call, in one process (see the module's
    docstring)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    n = args.size // 4 // TENSORS
    grads = [tf.random.normal([n]) for _ in range(TENSORS)]
    weight = tf.constant(0.5, tf.float64)

    @tf.function
    def where_cast(gs, w64):
        w = tf.cast(w64, tf.float32)
        return [tf.cast(tf.where(tf.equal(w64, 0.0), tf.zeros_like(g), g * w), tf.float16) for g in gs]

    @tf.function
    def cond_cast(gs, w64):
        w = tf.cast(w64, tf.float32)
        return [tf.cast(tf.cond(tf.equal(w64, 0.0), lambda g=g: tf.zeros_like(g), lambda g=g: g * w),
                        tf.float16) for g in gs]

    @tf.function
    def cast(gs):
        return [tf.cast(g, tf.float16) for g in gs]

    @tf.function
    def cast_back(hs):
        return [tf.cast(h, tf.float32) for h in hs]

    @tf.function
    def scale(gs, w64):
        w = tf.cast(w64, tf.float32)
        return [g * w for g in gs]

    halves = cast(grads)
    src, dst = np.ones(n * TENSORS, np.float32), np.empty(n * TENSORS, np.float32)
    cases = {
        "weight (where) + cast to float16": lambda: where_cast(grads, weight),
        "weight (cond) + cast to float16": lambda: cond_cast(grads, weight),
        "cast to float16": lambda: cast(grads),
        "cast back to float32": lambda: cast_back(halves),
        "uncompressed: weight only": lambda: scale(grads, weight),
        "memcpy of the float32 bytes (numpy)": lambda: np.copyto(dst, src),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.reps + 1):  # the first traces
        for name, fn in cases.items():
            t0 = time.perf_counter()
            out = fn()
            if isinstance(out, list):
                out[-1].numpy()
            times[name].append(time.perf_counter() - t0)
    load = os.getloadavg()
    print(f"{args.size / 2**20:g} MiB of float32 gradients ({TENSORS} tensors), one process, "
          f"median of {args.reps}; load average {load[0]:.2f}")
    print("| step | ms | × memcpy |")
    print("|---|---|---|")
    copy = sorted(times["memcpy of the float32 bytes (numpy)"][1:])[args.reps // 2]
    for name, samples in times.items():
        median = sorted(samples[1:])[args.reps // 2]
        print(f"| {name} | {median * 1e3:.1f} | {median / copy:.2f} |")
    return 0


# -- the fidelity benchmark --------------------------------------------------------------------

def _mlp():
    import keras

    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def fidelity_worker(out: str, epochs: int) -> int:
    import keras
    import numpy as np

    import tarantella as tnt

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 32)).astype("float32")
    y = (x[:, :10] * 3.0 + rng.normal(size=(2048, 10))).argmax(axis=1)

    def train(model):
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        history = model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0)
        return model.get_weights(), float(history.history["loss"][-1])

    report = {}
    for value in ("none", "fp16"):
        os.environ[SETTING] = value  # read when the step is traced
        report[value] = train(tnt.Model(_mlp()))
    os.environ.pop(SETTING)
    if tnt.get_rank() == 0:
        serial_w, serial_loss = train(_mlp())
        result = {"epochs": epochs, "ranks": tnt.get_size(), "serial_loss": serial_loss}
        for value, (weights, loss) in report.items():
            result[value] = {
                "max_rel_weight_diff": max(float(np.abs(w - s).max() / np.abs(s).max())
                                           for w, s in zip(weights, serial_w)),
                "loss": loss, "rel_loss_diff": abs(loss - serial_loss) / abs(serial_loss)}
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def run_fidelity(args: argparse.Namespace) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    tnt = Path(sys.executable).with_name("tnt")
    out = HERE / "results" / f"gradient_compression_fidelity_{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(tnt), "run", "-n", str(args.ranks), "--backend", args.backend, "--",
                    str(Path(__file__).resolve()), "fidelity-worker", "--out", str(out),
                    "--epochs", str(args.epochs)], env=env, check=True, timeout=1800)
    result = json.loads(out.read_text())
    print(f"small float32 MLP (32-64-64-10, Adam 1e-3, global batch 64, 2048 samples), "
          f"{result['epochs']} epochs on {result['ranks']} ranks against plain Keras")
    print("| TNT_GRADIENT_COMPRESSION | max relative weight difference | last loss | "
          "relative loss difference |")
    print("|---|---|---|---|")
    for value in ("none", "fp16"):
        r = result[value]
        print(f"| {value} | {r['max_rel_weight_diff']:.1e} | {r['loss']:.6f} | {r['rel_loss_diff']:.1e} |")
    print(f"plain Keras' last loss: {result['serial_loss']:.6f}; wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from cluster_allreduce import parse_layouts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = parser.add_subparsers(dest="part", required=True)
    wire = parts.add_parser("wire", help="the allreduce's time and bytes on a rate-limited emulated cluster")
    wire.add_argument("--rate-mbit", type=float, default=400.0)
    wire.add_argument("--size", type=int, default=64 << 20,
                      help="bytes of float32 gradients (default 64 MiB)")
    wire.add_argument("--reps", type=int, default=3)
    wire.add_argument("--layouts", type=parse_layouts, default=parse_layouts("2x1,2x2"))
    wire.add_argument("--values", nargs="+", default=["none", "fp16"])
    wire.add_argument("--backend", default="gloo")
    wire.add_argument("--timeout", type=float, default=120.0)
    wire.add_argument("--out", type=Path, default=None)
    worker = parts.add_parser("wire-worker")
    worker.add_argument("--size", type=int, required=True)
    worker.add_argument("--reps", type=int, required=True)
    fidelity = parts.add_parser("fidelity", help="a training's difference from plain Keras")
    fidelity.add_argument("--epochs", type=int, default=5)
    fidelity.add_argument("--ranks", type=int, default=2)
    fidelity.add_argument("--backend", default="gloo")
    passes = parts.add_parser("passes", help="the CPU passes compression adds, in one process")
    passes.add_argument("--size", type=int, default=64 << 20,
                        help="bytes of float32 gradients (default 64 MiB)")
    passes.add_argument("--reps", type=int, default=9)
    fworker = parts.add_parser("fidelity-worker")
    fworker.add_argument("--out", required=True)
    fworker.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args(argv)
    if args.part == "wire-worker":
        return wire_worker(args.size, args.reps)
    if args.part == "fidelity-worker":
        return fidelity_worker(args.out, args.epochs)
    if args.part == "wire":
        return run_wire(args)
    if args.part == "passes":
        return run_passes(args)
    return run_fidelity(args)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
