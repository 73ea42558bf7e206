"""Where one process's training step goes: CPU time and thread hand-offs per step, per thread.

Trains the benchmark ``mlp`` (784-512-512-10, micro-batch 64, 1 intra-op thread, 2 inter-op
threads, SGD with momentum; as ``throughput_worker.py``) held to one CPU, as plain Keras
(``keras``), plain Keras with tarantella imported (``import``) or tnt on one rank (``tnt``),
and prints one JSON line: samples/s, the median and smallest step, and per timed step the
process's CPU time, minor page faults and, for each thread name, its CPU time, its time spent
runnable but waiting for the CPU (``delay``) and its voluntary context switches (hand-offs).

Why these figures: on a shared machine the wall time of a step measures the other work as
much as the step, while the CPU time and the hand-offs per step are properties of the step.
``--fifo`` (root only) runs the timed steps under SCHED_FIFO, so that the other processes on
that CPU wait while the step runs: the wall time then approaches the CPU time, for a few
seconds per run. Set ``ONEDNN_VERBOSE=1`` to have oneDNN print the implementation and time of
every primitive it runs.

    python benchmarks/step_anatomy.py --mode keras --pin 1 [--fifo]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

MB, WARMUP = 64, 30


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("keras", "import", "tnt"), default="keras")
    p.add_argument("--pin", type=int, default=0, help="the CPU to hold the process to")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fifo", action="store_true", help="SCHED_FIFO for the timed steps (root)")
    return p.parse_args()


def thread_counters() -> dict[str, tuple[str, int, int, int]]:
    """Per thread id: (name, ns on the CPU, ns runnable but waiting, voluntary switches)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/schedstat") as f:
                run_ns, wait_ns, _ = map(int, f.read().split())
            with open(f"{base}/status") as f:
                status = f.read()
        except OSError:  # the thread ended
            continue
        switches = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        out[tid] = (name, run_ns, wait_ns, switches)
    return out


def set_policy(fifo: bool) -> None:
    policy, priority = (os.SCHED_FIFO, 1) if fifo else (os.SCHED_OTHER, 0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(priority))
        except OSError:
            pass


def main() -> int:
    args = parse()
    os.sched_setaffinity(0, [args.pin])  # before TensorFlow starts a thread
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    if args.mode != "keras":
        import tarantella as tnt
    import keras
    import numpy as np

    layers = keras.layers
    model = keras.Sequential([keras.Input(shape=(784,)), layers.Dense(512, activation="relu"),
                              layers.Dense(512, activation="relu"), layers.Dense(10)])
    if args.mode == "tnt":
        model = tnt.Model(model)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    n = MB * (WARMUP + args.steps)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    times: list[float] = []
    marks: dict[str, tuple] = {}

    class Marks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter())
            if len(times) in (WARMUP, WARMUP + args.steps):
                key = "start" if len(times) == WARMUP else "end"
                marks[key] = (thread_counters(), resource.getrusage(resource.RUSAGE_SELF))

    if args.fifo:
        set_policy(True)
    try:
        model.fit(x, y, batch_size=MB, epochs=1, shuffle=False, verbose=0, callbacks=[Marks()])
    finally:
        if args.fifo:
            set_policy(False)
    steps = args.steps
    timed = np.diff(times[WARMUP - 1:])
    (t0, r0), (t1, r1) = marks["start"], marks["end"]
    threads: dict[str, list[float]] = {}
    for tid, (name, run_ns, wait_ns, switches) in t1.items():
        _, run0, wait0, switches0 = t0.get(tid, (name, 0, 0, 0))
        row = threads.setdefault(name, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += (run_ns - run0) / steps / 1e6
        row[2] += (wait_ns - wait0) / steps / 1e6
        row[3] += (switches - switches0) / steps
    cpu_ms = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / steps * 1e3
    print(json.dumps({
        "mode": args.mode, "pin": args.pin, "fifo": args.fifo,
        "samples_per_s": MB * len(timed) / float(timed.sum()),
        "median_step_ms": 1e3 * statistics.median(timed), "min_step_ms": 1e3 * float(timed.min()),
        "cpu_ms_per_step": cpu_ms, "minor_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / steps,
        "handoffs_per_step": sum(row[3] for row in threads.values()),
        "threads": {name: {"count": row[0], "cpu_ms": round(row[1], 3), "delay_ms": round(row[2], 3),
                           "handoffs": round(row[3], 2)}
                    for name, row in threads.items() if row[1] > 0.001},
        "load": os.getloadavg()[0],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
