"""Quick start: LeNet-5, trained data-parallel with Tarantella-NT.

    tnt run -n 2 -- examples/quickstart/lenet5.py                 # scikit-learn's digits
    tnt run -n 2 -- examples/quickstart/lenet5.py --mnist mnist.npz
    tnt run -n 2 -- examples/quickstart/lenet5.py --compare-serial

Without ``--mnist`` it trains on the handwritten digits that ship with scikit-learn (1,797
real 8x8 images, scaled up to 28x28), so it runs anywhere without a download. ``--mnist``
takes the ``mnist.npz`` of ``keras.datasets.mnist`` (keys x_train, y_train, x_test, y_test).
``--batch_size`` is the *global* batch size, whatever the number of ranks.
``--compare-serial`` also trains the same model serially (plain Keras, on the master rank,
after the distributed run) and prints both accuracies and the largest relative difference
of the weights. It computes in float64 unless ``--dtype float32`` is given: the distributed
run sums the micro-batch gradients in another order than serial training, a float round-off
difference (~1e-7 in float32) that SGD with momentum, ReLU and max-pooling amplify over the
steps (a pooling window flips on a near-tie); float64 keeps it at ~1e-14 and shows that the
training itself is the serial one.

The two Tarantella lines are marked ``# tnt``.
"""

from __future__ import annotations

import argparse
import sys
import time

import tarantella as tnt  # tnt: first, before TensorFlow runs anything

# isort: split
import keras
import numpy as np
import tensorflow as tf


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mnist", metavar="PATH", help="mnist.npz (default: scikit-learn digits)")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning_rate", "--learning-rate", type=float, default=0.1)
    parser.add_argument("--train_size", "--train-size", type=int, default=None,
                        help="use only the first N training samples")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2))
    parser.add_argument("--compare-serial", "--serial-baseline", dest="compare_serial",
                        action="store_true", help="also train serially and compare (master rank)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="float type (default: float32; float64 with --compare-serial)")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float64" if args.compare_serial else "float32")
    return args


def load_data(args: argparse.Namespace):
    """``(x_train, y_train), (x_test, y_test)``: float32 images 28x28x1 in [0, 1], int labels."""
    if args.mnist:
        with np.load(args.mnist) as data:
            x_train, y_train = data["x_train"], data["y_train"]
            x_test, y_test = data["x_test"], data["y_test"]
        x_train = (x_train.astype(np.float32) / 255.0)[..., None]
        x_test = (x_test.astype(np.float32) / 255.0)[..., None]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            sys.exit("lenet5.py: its default data set, the digits, comes with scikit-learn: "
                     "pip install scikit-learn, or pass --mnist PATH (a Keras mnist.npz)")

        digits = load_digits()
        images = digits.images.astype(np.float32) / 16.0             # 8x8, values 0..16
        images = images.repeat(3, axis=1).repeat(3, axis=2)          # 24x24
        images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None]  # 28x28x1, like MNIST
        labels = digits.target.astype(np.int64)
        order = np.random.default_rng(0).permutation(len(labels))   # fixed train/test split
        images, labels = images[order], labels[order]
        split = int(0.8 * len(labels))
        x_train, y_train, x_test, y_test = images[:split], labels[:split], images[split:], labels[split:]
    if args.train_size:
        x_train, y_train = x_train[:args.train_size], y_train[:args.train_size]
    return (x_train, y_train), (x_test, y_test)


def lenet5() -> keras.Model:
    layers = keras.layers
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(6, 5, padding="same", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Conv2D(16, 5, activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(120, activation="relu"),
        layers.Dense(84, activation="relu"),
        layers.Dense(10, activation="softmax"),
    ], name="lenet5")


def train(model, args, train_ds, test_ds, verbose):
    model.compile(optimizer=keras.optimizers.SGD(args.learning_rate, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    start = time.perf_counter()
    model.fit(train_ds, epochs=args.epochs, verbose=verbose, shuffle=False)  # shuffled by the pipeline
    seconds = time.perf_counter() - start
    results = model.evaluate(test_ds, verbose=0, return_dict=True)
    return results["accuracy"], seconds


def datasets(args, x_train, y_train, x_test, y_test):
    """Fresh pipelines (a seeded shuffle continues its sequence when iterated again)."""
    train_ds = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(len(x_train), seed=args.seed)
                .batch(args.batch_size)              # the global batch size
                .prefetch(tf.data.AUTOTUNE))
    test_ds = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size)
    return train_ds, test_ds


def main() -> None:
    args = parse_args()
    keras.config.set_floatx(args.dtype)
    (x_train, y_train), (x_test, y_test) = load_data(args)
    keras.utils.set_random_seed(args.seed)  # seeds the initial weights and the shuffle
    train_ds, test_ds = datasets(args, x_train, y_train, x_test, y_test)
    model = tnt.Model(lenet5())  # tnt
    accuracy, seconds = train(model, args, train_ds, test_ds, args.verbose if tnt.is_master_rank() else 0)
    if tnt.is_master_rank():
        data = "MNIST" if args.mnist else "scikit-learn digits"
        print(f"LeNet-5 on {data}: {len(x_train)} training samples, global batch {args.batch_size}, "
              f"{args.epochs} epochs, {args.dtype}")
        ranks = f"{tnt.get_size()} rank" + ("s" if tnt.get_size() != 1 else "")
        print(f"distributed ({ranks}): test accuracy {accuracy:.4f}  "
              f"(training {seconds:.1f} s)")

    if args.compare_serial and tnt.is_master_rank():
        keras.utils.set_random_seed(args.seed)  # as above: same data order, same initial weights
        train_ds, test_ds = datasets(args, x_train, y_train, x_test, y_test)
        serial = lenet5()  # plain Keras
        serial_accuracy, serial_seconds = train(serial, args, train_ds, test_ds, 0)
        diff = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))
                   for a, b in zip(model.get_weights(), serial.get_weights()))
        print(f"serial (1 process):  test accuracy {serial_accuracy:.4f}  (training {serial_seconds:.1f} s)")
        print(f"largest relative weight difference, distributed vs serial: {diff:.2e}")


if __name__ == "__main__":
    main()
