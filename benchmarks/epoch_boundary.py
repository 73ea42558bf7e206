"""What an epoch's start and a fit's end cost on ranks held to one CPU, with tf.data's
autotuning on (TensorFlow's default) and off (tarantella's choice there), side by side.

Keras makes a new tf.data iterator for every epoch and deletes the last one when ``fit``
returns. Deleting an iterator whose autotuning thread is asleep waits for that thread, and on
a process held to one CPU the thread, woken before TensorFlow marks the iterator cancelled,
sleeps out the rest of its period (10 ms doubling to a minute):
``tarantella.data_autotune``. Each job trains a small MLP (32 -> 64 -> 10, global batch 64)
on one ``tf.data`` pipeline of in-memory arrays for ``--epochs`` epochs and records, per
epoch, the time from its last batch's end to the next epoch's first batch (the gap), and
from ``on_train_end`` to ``fit``'s return (the end). Jobs, in interleaved rounds:

* ``keras``: plain Keras in one process held to one CPU (one rank of ``tnt run`` that
  imports no tarantella), the pipeline's autotuning as TensorFlow leaves it (on), and
  turned off in the dataset's options;
* ``tnt data``: 2 data-parallel ranks (``tnt run``, each bound to a CPU of its own on a
  2-core machine), the pipeline's autotuning left to tarantella (off on one CPU), and
  turned on in the dataset's options (TensorFlow's default: every rank before tarantella
  chose);
* ``tnt pipe``: the same model cut in 2 stages (2 micro-batches), the same two ways.

It prints every job, then per kind the medians and the fit's time with autotuning on over
its time with it off (same rounds).

    python benchmarks/epoch_boundary.py [--rounds 2] [--epochs 4] [--samples 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import rank_reports

KINDS = ("keras", "tnt data", "tnt pipe")
#: the dataset's ``autotune.enabled``: "unset" leaves it to TensorFlow (plain Keras) or
#: tarantella; "on" and "off" set it
AUTOTUNE = {"keras": ("unset", "off"), "tnt data": ("unset", "on"), "tnt pipe": ("unset", "on")}


def worker(args: argparse.Namespace) -> None:
    """One process of a job: fit ``--epochs`` epochs, write the gaps and ends (rank 0)."""
    if args.kind == "keras":  # before TensorFlow sizes its thread pools
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 32), dtype=np.float32)
    y = rng.random((args.samples, 10), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).prefetch(tf.data.AUTOTUNE)
    if args.autotune != "unset":
        options = tf.data.Options()
        options.autotune.enabled = args.autotune == "on"
        data = data.with_options(options)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    rank = 0
    if args.kind == "keras":
        model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    else:
        import tarantella as tnt

        rank = tnt.get_rank()
        if args.kind == "tnt pipe":
            hidden = tnt.keras.layers.SplitLayer()(hidden)
            model = tnt.Model(keras.Model(inputs, keras.layers.Dense(10)(hidden)),
                              parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                              num_micro_batches=2)
        else:
            model = tnt.Model(keras.Model(inputs, keras.layers.Dense(10)(hidden)))
    model.compile(optimizer="sgd", loss="mse")
    marks: dict[str, list[float]] = {"begin": [], "end": []}

    class Marks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            if batch == 0:
                marks["begin"].append(time.perf_counter())

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            self.last = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            marks["end"].append(self.last)

        def on_train_end(self, logs: object = None) -> None:
            marks["train_end"] = [time.perf_counter()]

    start = time.perf_counter()
    model.fit(data, epochs=args.epochs, verbose=0, callbacks=[Marks()])
    returned = time.perf_counter()
    gaps = [b - e for e, b in zip(marks["end"], marks["begin"][1:])]
    epochs = [e - b for b, e in zip(marks["begin"], marks["end"])]
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({
        "gaps": gaps, "epochs": epochs, "fit": returned - start,
        "end": returned - marks["train_end"][0], "cpus": len(os.sched_getaffinity(0))}))


def job(args: argparse.Namespace, kind: str, autotune: str) -> dict:
    """One job of ``kind``; rank 0's report. Plain Keras runs as one rank of ``tnt run``
    (it imports no tarantella and holds itself to one CPU)."""
    reports = rank_reports(__file__, 1 if kind == "keras" else 2,
                           ["--kind", kind, "--autotune", autotune, "--epochs", str(args.epochs),
                            "--samples", str(args.samples)],
                           options=[] if kind == "keras" else ["--backend", args.backend],
                           timeout=args.timeout)
    return dict(reports[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=200_000, help="samples per epoch")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--kind", choices=KINDS, help="(worker) the job")
    p.add_argument("--autotune", choices=("unset", "on", "off"), default="unset")
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        worker(args)
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    print(f"epoch boundary benchmark, {os.cpu_count()} CPUs, {args.epochs} epochs of "
          f"{args.samples // 64} steps, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {(k, a): [] for k in kinds for a in AUTOTUNE[k]}
    for r in range(args.rounds):
        for kind in kinds:
            ways = AUTOTUNE[kind] if r % 2 == 0 else tuple(reversed(AUTOTUNE[kind]))
            for autotune in ways:
                result = job(args, kind, autotune)
                runs[(kind, autotune)].append(result)
                print(f"round {r + 1}  {kind:9s} autotune {autotune:5s} fit {result['fit']:6.2f} s"
                      f"  epochs {' '.join(f'{e:.2f}' for e in result['epochs'])} s"
                      f"  gaps {' '.join(f'{g:.3f}' for g in result['gaps'])} s"
                      f"  end {result['end']:.3f} s  (rank 0 on {result['cpus']} CPU)", flush=True)
    print(f"\n{'job':9s} {'autotune':9s} {'gap s':>8s} {'end s':>8s} {'epoch s':>8s} {'fit s':>8s}"
          "   (medians: gap between epochs, fit's end after on_train_end, an epoch's batches)")
    for kind in kinds:
        fits = {}
        for autotune in AUTOTUNE[kind]:
            rs = runs[(kind, autotune)]
            fits[autotune] = statistics.median(r["fit"] for r in rs)
            gap = statistics.median(g for r in rs for g in r["gaps"])
            end = statistics.median(r["end"] for r in rs)
            epoch = statistics.median(e for r in rs for e in r["epochs"])
            print(f"{kind:9s} {autotune:9s} {gap:8.3f} {end:8.3f} {epoch:8.2f} {fits[autotune]:8.2f}")
        on, off = (fits["unset"], fits["off"]) if "off" in fits else (fits["on"], fits["unset"])
        print(f"{kind:9s} fit with autotuning on / off: {on / off:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
