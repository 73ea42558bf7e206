"""What a call into TensorFlow costs right after work that streams memory.

A pipelined stage's step is one compiled graph whose passes and optimizer update stream
tens of MB through the caches; whatever the loop then calls into TensorFlow (the next
batch, a traced function, an eager op) finds its code and data evicted. This times one
trivial traced call (``x + 1`` on a scalar) after each of:

* ``graph``: a graph of six 256 x 1024 x 1024 products and an update-like pass over the six
  1024 x 1024 weights (about the benchmark stage's work on one micro-batch size);
* ``copy``: NumPy copying 64 MB one way and back (no TensorFlow at all);
* ``nothing``: the call alone, back to back;

and a second call at once after the first (``again``), in interleaved rounds on one CPU.
``tarantella.pipeline.step_ends`` cites it: why a pipelined loop makes one call a step.

    python benchmarks/cold_calls.py [--repeats 40] [--pin 0]

Prints, per case, the median first and second call in microseconds and the first's ratio
to ``nothing``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import one_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_cpu.add_arguments(parser, repeats=40, calls=1)
    args = parser.parse_args()
    tf = one_cpu.start_tensorflow(args, inter_op_threads=2)
    import numpy as np

    x = tf.random.normal([256, 1024])
    weights = [tf.Variable(tf.random.normal([1024, 1024]) * 0.03) for _ in range(6)]

    @tf.function
    def graph(x):
        h = x
        for w in weights:
            h = tf.nn.relu(h @ w)
        for w in weights:
            w.assign_add(tf.ones_like(w) * 1e-9)
        return tf.reduce_sum(h)

    @tf.function
    def trivial(v):
        return v + 1

    scalar = tf.constant(1.0)
    a = np.ones(8 << 20, np.float64)
    b = np.empty_like(a)
    cases = {
        "graph": lambda: graph(x).numpy(),
        "copy": lambda: (np.copyto(b, a), np.copyto(a, b)),
        "nothing": lambda: None,
    }
    for before in cases.values():  # traced and warm
        before()
        trivial(scalar)
    first: dict[str, list[float]] = {k: [] for k in cases}
    again: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, before in cases.items():
            before()
            t0 = time.perf_counter()
            trivial(scalar)
            t1 = time.perf_counter()
            trivial(scalar)
            t2 = time.perf_counter()
            first[name].append((t1 - t0) * 1e6)
            again[name].append((t2 - t1) * 1e6)
    alone = statistics.median(first["nothing"])
    print(f"a trivial traced call, medians of {args.repeats} interleaved rounds (us)")
    print(f"{'after':10s} {'first':>8s} {'again':>8s} {'first / nothing':>16s}")
    for name in cases:
        f, g = statistics.median(first[name]), statistics.median(again[name])
        print(f"{name:10s} {f:8.0f} {g:8.0f} {f / alone:16.2f}")


if __name__ == "__main__":
    main()
