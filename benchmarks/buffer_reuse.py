"""What an optimizer's element-wise update costs when TensorFlow may not reuse the gradient's
buffer.

Keras' SGD multiplies each gradient by the learning rate. When the gradient is a kernel's
fresh output that TensorFlow owns and nothing else holds, the multiply writes its result
into the gradient's own buffer (TensorFlow "forwards" it: `Tensor::RefCountIsOne`, which
also requires the buffer to own its memory). The reduced gradients of tnt's native path
are views of the reducer's bucket, memory TensorFlow does not own (`TF_NewTensor` with a
deallocator), so the multiply writes a new buffer: one more stream of the gradients'
bytes through memory per step (the destination's cache lines are read before they are
written). This measures both, side by side, on one CPU, with a buffer as large as the
`gelu` benchmark model's gradients (31.7 MB): a kernel's output (reused) and a variable's
value (held by the variable: a new buffer, as for a bucket view).

    python benchmarks/buffer_reuse.py [--mbytes 32] [--repeats 9] [--pin 1]

Prints each case's median time per call and the multiply's share (call minus the same
call without the multiply); ratios side by side in one run, absolute times as context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import one_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=float, default=32.0, help="float32 megabytes (1e6)")
    one_cpu.add_arguments(parser, repeats=9, calls=20)
    args = parser.parse_args()
    tf = one_cpu.start_tensorflow(args, inter_op_threads=1)
    n = int(args.mbytes * 1e6 / 4)
    lr, eps, source = tf.Variable(0.01), tf.Variable(0.0), tf.Variable(tf.ones(n))

    def reusable() -> tf.Tensor:  # a kernel's fresh output: TensorFlow owns it, alone
        return source + eps

    def held() -> tf.Tensor:  # a buffer something else holds (here: the variable)
        return tf.identity(source)

    cases = {}
    for name, make in (("reusable", reusable), ("held", held)):
        # [:1] keeps the result from being copied out; the sum, from being pruned
        cases[name] = tf.function(lambda make=make: tf.reduce_sum(make()[:1]))
        cases[f"{name} * lr"] = tf.function(lambda make=make: tf.reduce_sum((lr * make())[:1]))
    for function in cases.values():
        function()
        function()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, function in cases.items():
            started = time.perf_counter()
            for _ in range(args.calls):
                function()
            samples[name].append((time.perf_counter() - started) / args.calls * 1e3)
    median = {name: statistics.median(values) for name, values in samples.items()}
    print(f"{n * 4 / 1e6:.1f} MB of float32, {args.repeats} interleaved rounds of "
          f"{args.calls} calls, medians (ms):")
    for name, values in samples.items():
        print(f"  {name:14s} {median[name]:7.2f}   samples {' '.join(f'{v:.2f}' for v in values)}")
    in_place = median["reusable * lr"] - median["reusable"]
    new_buffer = median["held * lr"] - median["held"]
    print(f"lr * gradient in the gradient's buffer: {in_place:.2f} ms; into a new buffer: "
          f"{new_buffer:.2f} ms ({new_buffer / in_place:.2f}x, +{new_buffer - in_place:.2f} ms)")


if __name__ == "__main__":
    main()
