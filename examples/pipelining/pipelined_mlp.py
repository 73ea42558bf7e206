"""Pipelining: an MLP cut into stages, one per rank, trained with micro-batches.

    tnt run -n 2 -- examples/pipelining/pipelined_mlp.py                      # 2 stages
    tnt run -n 3 -- examples/pipelining/pipelined_mlp.py --stages 3
    tnt run -n 4 -- examples/pipelining/pipelined_mlp.py --pipelines 2        # ALL: 2 x 2
    tnt run -n 2 -- examples/pipelining/pipelined_mlp.py --compare-serial

The model is an ordinary functional Keras model with ``tnt.keras.layers.SplitLayer``
where it is cut (an identity anywhere else: the same model trains unchanged with plain
Keras). ``tnt.Model(..., parallel_strategy=tnt.ParallelStrategy.PIPELINING,
num_micro_batches=M)`` gives rank ``p`` the layers between cut ``p`` and cut ``p + 1``;
each global batch is split into ``M`` micro-batches that flow through the stages.
``--pipelines R`` runs ``R`` such pipelines side by side (``DATA | PIPELINING``), each on
its share of every batch: ``stages x pipelines`` ranks. It trains on the handwritten
digits that ship with scikit-learn (no download). ``--compare-serial`` trains the same
model with plain Keras on the master after the pipelined run and prints the largest
relative weight difference. It computes in float64 unless ``--dtype float32`` is given:
the micro-batch gradients are summed in another order than the batch's, a round-off
difference (~1e-7 in float32) that SGD with momentum amplifies over the steps; float64
keeps it at round-off and shows that the training itself is the serial one.

The Tarantella lines are marked ``# tnt``.
"""

from __future__ import annotations

import argparse
import time

import tarantella as tnt  # tnt: first, before TensorFlow runs anything

# isort: split
import keras
import numpy as np


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2, choices=(2, 3, 4))
    parser.add_argument("--pipelines", type=int, default=1, help="pipelines side by side (ALL)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--save-weights", default=None, metavar="PATH.weights.h5")
    parser.add_argument("--compare-serial", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="float type (default: float32; float64 with --compare-serial)")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float64" if args.compare_serial else "float32")
    return args


def load_data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)     # 64 pixels in [0, 1]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def mlp(stages: int) -> keras.Model:
    """Four hidden layers, cut evenly into ``stages`` partitions."""
    inp = keras.Input((64,), name="pixels")
    x = inp
    widths = [256, 256, 256, 128]
    stage = [i * stages // len(widths) for i in range(len(widths))]  # [0, 0, 1, 1] for 2
    for i, width in enumerate(widths):
        x = keras.layers.Dense(width, activation="relu", name=f"hidden{i}")(x)
        if i + 1 < len(widths) and stage[i + 1] != stage[i]:
            x = tnt.keras.layers.SplitLayer(name=f"cut{stage[i + 1]}")(x)  # tnt: a cut
    out = keras.layers.Dense(10, activation="softmax", name="digit")(x)
    return keras.Model(inp, out, name="mlp")


def train(model, args, train_data, test_data):
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    start = time.perf_counter()
    model.fit(*train_data, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              verbose=2 if not args.compare_serial and tnt.is_master_rank() else 0)
    seconds = time.perf_counter() - start
    return model.evaluate(*test_data, verbose=0, return_dict=True)["accuracy"], seconds


def main() -> None:
    args = parse_args()
    keras.config.set_floatx(args.dtype)
    train_data, test_data = load_data()
    keras.utils.set_random_seed(args.seed)
    strategy = tnt.ParallelStrategy.PIPELINING                       # tnt
    if args.pipelines > 1:
        strategy = tnt.ParallelStrategy.DATA | tnt.ParallelStrategy.PIPELINING  # tnt: ALL
    if tnt.get_size() == 1:  # `python pipelined_mlp.py`: the cut model trains whole
        print("one process: training the whole model (run with tnt run -n "
              f"{args.stages * args.pipelines} to pipeline it)")
        model = tnt.Model(mlp(args.stages))
    else:
        model = tnt.Model(mlp(args.stages), parallel_strategy=strategy,   # tnt
                          num_micro_batches=args.micro_batches)
    accuracy, seconds = train(model, args, train_data, test_data)
    if tnt.get_size() > 1:
        print(f"rank {tnt.get_rank()}: stage {tnt.get_rank() % args.stages} holds "
              f"{model.local_param_count} of {model.count_params()} parameters", flush=True)
    if args.save_weights:
        model.save_weights(args.save_weights)  # the whole model's weights, written once
    if tnt.is_master_rank():
        how = (f"pipelined ({args.stages} stages x {args.pipelines} pipeline(s), "
               f"{args.micro_batches} micro-batches)" if tnt.get_size() > 1 else "whole")
        print(f"{how}: test accuracy {accuracy:.4f} (training {seconds:.1f} s)")
    # every rank: each holds its own partition, get_weights() gathers the whole model
    weights = model.get_weights() if args.compare_serial else []
    if args.compare_serial and tnt.is_master_rank():
        keras.utils.set_random_seed(args.seed)  # the same initial weights and shuffle
        serial = mlp(args.stages)               # plain Keras
        serial_accuracy, serial_seconds = train(serial, args, train_data, test_data)
        diff = max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
                   for a, b in zip(weights, serial.get_weights()))
        print(f"serial (1 process): test accuracy {serial_accuracy:.4f} "
              f"(training {serial_seconds:.1f} s)")
        print(f"largest relative weight difference, pipelined vs serial: {diff:.2e}")


if __name__ == "__main__":
    main()
