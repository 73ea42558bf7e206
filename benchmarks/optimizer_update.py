"""An optimizer's update alone: Keras' TensorFlow ops against the same update compiled with XLA.

A data-parallel step that Keras does not compile runs the optimizer's update as one XLA
function (``tarantella.data_parallel.compiled_update``): XLA fuses the update's element-wise
ops into one pass over each weight. Whether that pays depends on how many passes the ops
make (SGD with momentum: a few; Adam: many) and on the machine, so this times both on the
weights of a benchmark model, in interleaved rounds on one CPU, with:

* the same call without the update (the function call and the gradients' copies): the
  fixed part of both;
* the update's least memory traffic, the bytes every weight's update must read and write
  once (SGD with momentum: gradient, momentum and weight read, momentum and weight
  written; Adam: two more slots), timed as that many copies of the weights at the memcpy
  speed of this run.

    python benchmarks/optimizer_update.py [--models mlp,gelu] [--optimizers sgd,adam]
        [--repeats 7] [--pin 1]

Prints, per model and optimizer, the median time per update (call minus the empty call)
of the ops and of the compiled function, their ratio and the memory bound; absolute times
as context.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import one_cpu

#: per optimizer: Keras' constructor arguments and the weight-sized tensors its update
#: reads and writes at least (gradient + slots + weight read, slots + weight written)
OPTIMIZERS = {"sgd": ("SGD", {"learning_rate": 0.01, "momentum": 0.9}, 5),
              "adam": ("Adam", {"learning_rate": 1e-3}, 7)}


def make_step(kind: str, shapes: list, grads: list, optimizer):
    """A ``tf.function`` updating fresh weights of ``shapes`` with ``grads``: as Keras' ops
    (``ops``), compiled (``xla``) or not at all (``empty``); and the compiled update."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tarantella.data_parallel.compiled_update import CompiledUpdate

    rng = np.random.default_rng(1)
    weights = [keras.Variable(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    optimizer.build(weights)
    compiled = CompiledUpdate(optimizer, weights) if kind == "xla" else None

    @tf.function(autograph=False)
    def step():
        fresh = [tf.identity(g) for g in grads]  # as a step's own gradients
        if kind == "ops":
            optimizer.apply(fresh, weights)
        elif compiled is not None:
            compiled(fresh)
        return tf.constant(0)

    step()
    return step, compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gelu")
    parser.add_argument("--optimizers", default="sgd,adam")
    one_cpu.add_arguments(parser, repeats=7, calls=300)
    args = parser.parse_args()
    one_cpu.start_tensorflow(args, inter_op_threads=2)  # as the benchmark models' processes
    import keras
    import numpy as np
    import tensorflow as tf

    import models
    print(f"CPU: {os.sched_getaffinity(0)}; {args.repeats} interleaved rounds of {args.calls} "
          "calls; medians per call")
    for name in args.models.split(","):
        shapes = [tuple(w.shape) for w in models.build(name, keras).weights]
        nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
        rng = np.random.default_rng(0)
        grads = [tf.constant(rng.standard_normal(s, dtype=np.float32) * 1e-3) for s in shapes]
        for key in args.optimizers.split(","):
            cls, kwargs, passes = OPTIMIZERS[key]

            fns = {kind: make_step(kind, shapes, grads, getattr(keras.optimizers, cls)(**kwargs))
                   for kind in ("empty", "ops", "xla")}
            assert fns["xla"][1].compiled, "XLA did not compile the update"
            src = np.ones(nbytes // 4, np.float32)
            dst = np.empty_like(src)
            times: dict[str, list[float]] = {k: [] for k in (*fns, "memcpy")}
            for _ in range(args.repeats):
                for kind, (fn, _c) in fns.items():
                    fn()
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    times[kind].append((time.perf_counter() - t) / args.calls * 1e6)
                t = time.perf_counter()
                for _ in range(20):
                    np.copyto(dst, src)
                times["memcpy"].append((time.perf_counter() - t) / 20 * 1e6)
            med = {k: statistics.median(v) for k, v in times.items()}
            ops, xla = med["ops"] - med["empty"], med["xla"] - med["empty"]
            bound = passes * med["memcpy"] / 2  # a copy reads and writes: two passes
            print(f"{name} ({nbytes / 1e6:.2f} MB of weights), {cls}: ops {ops:.0f} us, "
                  f"compiled {xla:.0f} us per update (empty call {med['empty']:.0f} us); "
                  f"ops / compiled {ops / xla:.2f}; least traffic ({passes} passes at memcpy "
                  f"speed) {bound:.0f} us: ops {ops / bound:.1f}x, compiled {xla / bound:.1f}x it")
            for kind in ("empty", "ops", "xla"):
                print(f"    {kind:5s} " + " ".join(f"{v:.0f}" for v in times[kind]))


if __name__ == "__main__":
    main()
