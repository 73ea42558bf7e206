"""A ResNet-style CNN trained data-parallel, with linear learning-rate scaling and warm-up.

    tnt run -n 2 -- examples/resnet/resnet.py                       # global batch 64
    tnt run -n 4 -- examples/resnet/resnet.py --micro-batch-size 32 # global batch 128
    python examples/resnet/resnet.py                                # one rank, same model

The data are the handwritten digits that ship with scikit-learn (8x8 images, scaled up to
16x16), so the example runs anywhere without a download; ``--synthetic N`` trains on N
random 32x32x3 images instead (for timing, not for accuracy).

The learning rate follows the *linear scaling rule*: ``--base-lr`` is tuned for a global
batch of ``--base-batch-size`` samples, and a global batch k times larger gets a learning
rate k times larger. A large learning rate at the start of training can diverge, so it is
reached gradually: a linear *warm-up* from ``--base-lr`` to the scaled rate over
``--warmup-epochs``, then a cosine decay. The global batch size, not the number of ranks,
decides the learning rate: with ``--batch-size`` fixed, any number of ranks trains the same
model; with ``--micro-batch-size`` the global batch (and so the learning rate) grows with
the number of ranks.
"""

from __future__ import annotations

import argparse
import math

import tarantella as tnt  # first: places this rank on its GPU / CPU threads

# isort: split
import keras
import numpy as np
import tensorflow as tf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=int, default=None,
                       help="global batch size (default 64)")
    batch.add_argument("--micro-batch-size", type=int, default=None,
                       help="batch size per rank; the global batch is this x the number of ranks")
    parser.add_argument("--base-lr", type=float, default=0.05,
                        help="learning rate tuned for --base-batch-size (default 0.05)")
    parser.add_argument("--base-batch-size", type=int, default=32,
                        help="global batch size --base-lr was tuned for (default 32)")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="epochs of linear warm-up to the scaled learning rate (default 1)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-size", type=int, default=None,
                        help="use only the first N training samples (short runs)")
    parser.add_argument("--synthetic", type=int, default=0, metavar="N",
                        help="train on N random 32x32x3 images instead of the digits")
    parser.add_argument("--width", type=int, default=16, help="filters of the first stage")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2))
    return parser.parse_args(argv)


def load_data(args: argparse.Namespace):
    """``(x_train, y_train), (x_test, y_test)``, float32 images and int labels."""
    if args.synthetic:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((args.synthetic, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, args.synthetic)
        split = int(0.8 * len(y))
        return (x[:split], y[:split]), (x[split:], y[split:])
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0).repeat(2, axis=1).repeat(2, axis=2)[..., None]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))  # a fixed train/test split
    images, labels = images[order], labels[order]
    split = int(0.8 * len(labels))
    x_train, y_train = images[:split], labels[:split]
    if args.train_size:
        x_train, y_train = x_train[:args.train_size], y_train[:args.train_size]
    return (x_train, y_train), (images[split:], labels[split:])


# BatchNormalization with momentum 0.9 (Keras: 0.99): the moving statistics used for
# evaluation settle within the few hundred steps of this short training.


def residual_block(x, filters: int, stride: int):
    layers = keras.layers
    shortcut = x
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    y = layers.BatchNormalization(momentum=0.9)(y)
    y = layers.Activation("relu")(y)
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = layers.BatchNormalization(momentum=0.9)(y)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
        shortcut = layers.BatchNormalization(momentum=0.9)(shortcut)
    return layers.Activation("relu")(layers.Add()([y, shortcut]))


def resnet(input_shape: tuple[int, ...], width: int, classes: int = 10) -> keras.Model:
    """A small ResNet: a stem and three stages of one residual block each."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.Activation("relu")(x)
    for stage, stride in enumerate((1, 2, 2)):
        x = residual_block(x, width * 2**stage, stride)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="resnet")


def learning_rate(args: argparse.Namespace, global_batch: int, steps_per_epoch: int):
    """Linear scaling rule, linear warm-up, cosine decay."""
    scaled = args.base_lr * global_batch / args.base_batch_size
    total = args.epochs * steps_per_epoch
    warmup = min(int(args.warmup_epochs * steps_per_epoch), total - 1)
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=args.base_lr,   # where the warm-up starts
        warmup_target=scaled,                 # the scaled rate, reached after warm-up
        warmup_steps=warmup,
        decay_steps=max(total - warmup, 1),   # then a cosine decay to 0
    )
    return schedule, scaled, warmup


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)  # same initial weights and data order everywhere
    (x_train, y_train), (x_test, y_test) = load_data(args)

    if args.micro_batch_size:
        global_batch = args.micro_batch_size * tnt.get_size()
    else:
        global_batch = args.batch_size or 64
    steps_per_epoch = math.ceil(len(x_train) / global_batch)
    schedule, scaled_lr, warmup_steps = learning_rate(args, global_batch, steps_per_epoch)

    train_ds = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(len(x_train), seed=args.seed)
                .batch(global_batch)                    # the global batch: tnt splits it
                .prefetch(tf.data.AUTOTUNE))
    test_ds = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)

    model = tnt.Model(resnet(x_train.shape[1:], args.width))
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if tnt.is_master_rank():
        print(f"{tnt.get_size()} rank(s), global batch {global_batch} "
              f"({global_batch // tnt.get_size()}+ samples per rank); learning rate "
              f"{args.base_lr:g} -> {scaled_lr:g} over {warmup_steps} warm-up steps, "
              f"then cosine decay over {args.epochs * steps_per_epoch - warmup_steps} steps")

    model.fit(train_ds, epochs=args.epochs, verbose=args.verbose if tnt.is_master_rank() else 0)
    results = model.evaluate(test_ds, verbose=0, return_dict=True)
    if tnt.is_master_rank():
        print(f"test accuracy {results['accuracy']:.4f}, test loss {results['loss']:.4f}")


if __name__ == "__main__":
    main()
