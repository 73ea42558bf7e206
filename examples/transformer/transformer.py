"""A small Transformer fed by a per-rank input pipeline (``tnt_distribute_dataset=False``).

    tnt run -n 2 -- examples/transformer/transformer.py
    python examples/transformer/transformer.py          # one rank: the same code path

Usually Tarantella-NT splits every global batch over the ranks itself. Sometimes the input
pipeline should be per rank instead: each rank reads its own files, or groups its own
sequences by length. Then every rank builds its own dataset from its *shard* of the data
(``tnt.get_rank()`` of ``tnt.get_size()``), batches it with the micro-batch size, and
``fit`` is told not to split it again with ``tnt_distribute_dataset=False``; the same for
validation data with ``tnt_distribute_validation_dataset=False``. The global batch of a step
is then the sum of the ranks' micro-batches.

Every rank must run the same number of steps (each step is a collective): here every
rank's shard is cut to the same number of full micro-batches.

The task is synthetic, so the example needs no download: sequences of random tokens, in
which a marker token appears 0 to 3 times; the model learns to count the markers.
"""

from __future__ import annotations

import argparse

import tarantella as tnt  # first: places this rank on its GPU / CPU threads

# isort: split
import keras
import numpy as np
import tensorflow as tf

MARKER = 1
CLASSES = 4  # 0..3 markers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=32, help="batch size of each rank")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=4096, help="training sequences in all")
    parser.add_argument("--test-size", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2))
    return parser.parse_args(argv)


def make_sequences(n: int, seq_len: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` sequences of tokens 2..vocab-1 with 0-3 marker tokens each; label = markers."""
    rng = np.random.default_rng(seed)
    x = rng.integers(2, vocab, size=(n, seq_len))
    y = rng.integers(0, CLASSES, size=n)
    for i, count in enumerate(y):
        x[i, rng.choice(seq_len, size=count, replace=False)] = MARKER
    return x.astype(np.int32), y.astype(np.int32)


def rank_dataset(x: np.ndarray, y: np.ndarray, micro_batch: int, seed: int | None) -> tf.data.Dataset:
    """This rank's pipeline: its shard of the data, in micro-batches.

    Every rank shuffles the *whole* data set with the same seed and keeps every size-th
    sample from its rank on, so the shards are disjoint in every epoch. All shards are
    cut to the same number of full micro-batches, so every rank runs the same steps.
    """
    rank, size = tnt.get_rank(), tnt.get_size()
    batches_per_rank = len(x) // (size * micro_batch)
    if batches_per_rank == 0:
        raise SystemExit(f"{len(x)} samples are fewer than one micro-batch of {micro_batch} "
                         f"for each of {size} ranks")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if seed is not None:
        ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    return (ds.shard(num_shards=size, index=rank)
              .take(batches_per_rank * micro_batch)
              .batch(micro_batch, drop_remainder=True)
              .prefetch(tf.data.AUTOTUNE))


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, seq_len: int, vocab: int, d_model: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocab, d_model)
        self.positions = keras.layers.Embedding(seq_len, d_model)

    def call(self, x):
        positions = keras.ops.arange(keras.ops.shape(x)[-1])
        return self.tokens(x) + self.positions(positions)


def transformer(args: argparse.Namespace) -> keras.Model:
    """One Transformer encoder block and a classifier over the pooled sequence."""
    layers = keras.layers
    inputs = keras.Input((args.seq_len,), dtype="int32")
    x = TokenAndPositionEmbedding(args.seq_len, args.vocab, args.d_model)(inputs)
    attention = layers.MultiHeadAttention(args.heads, args.d_model // args.heads)(x, x)
    x = layers.LayerNormalization(epsilon=1e-6)(x + attention)
    ffn = layers.Dense(2 * args.d_model, activation="relu")(x)
    x = layers.LayerNormalization(epsilon=1e-6)(x + layers.Dense(args.d_model)(ffn))
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="transformer")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)  # the same initial weights on every rank
    x_train, y_train = make_sequences(args.train_size, args.seq_len, args.vocab, seed=1)
    x_test, y_test = make_sequences(args.test_size, args.seq_len, args.vocab, seed=2)

    train_ds = rank_dataset(x_train, y_train, args.micro_batch_size, seed=args.seed)
    val_ds = rank_dataset(x_test, y_test, args.micro_batch_size, seed=None)

    model = tnt.Model(transformer(args))
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if tnt.is_master_rank():
        print(f"{tnt.get_size()} rank(s), micro-batch {args.micro_batch_size}, global batch "
              f"{args.micro_batch_size * tnt.get_size()}; each rank reads its own shard")
    model.fit(train_ds, validation_data=val_ds, epochs=args.epochs,
              verbose=args.verbose if tnt.is_master_rank() else 0,
              tnt_distribute_dataset=False,               # the ranks' datasets are their own
              tnt_distribute_validation_dataset=False)

    # evaluate() may still get one global dataset, split by Tarantella-NT as usual
    test_ds = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(256)
    results = model.evaluate(test_ds, verbose=0, return_dict=True)
    if tnt.is_master_rank():
        print(f"test accuracy {results['accuracy']:.4f}, test loss {results['loss']:.4f}")


if __name__ == "__main__":
    main()
