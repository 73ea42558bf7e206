"""Sparse gradients through a pipeline, next to plain Keras (run by ``pipeline_model_worker``).

A model whose gradients Keras delivers as ``tf.IndexedSlices``, cut automatically (no
SplitLayer) into ``P`` partitions: an ``Embedding`` on partition 0, a custom layer that
``tf.gather``s rows of its own weight, and an ``Embedding`` with an ``embeddings_regularizer``
on an input that enters a later partition (its gradient is dense in the serial step: the
regulariser's is added to it). Trained with Adam, RMSprop and SGD with momentum and a
``global_clipnorm`` that clips every step (the norm counts each sparse row, as Keras
squares them), in float64 (and Adam in float32), 4 micro-batches, on 33 samples: batches
of 16, 16 and 1 (with 2 pipelines, the second has no sample of the last batch). The
schedule is 1F1B; for Adam in float64 also ZB-H1 (weight gradients apart from the input
gradients) with activation recomputation on the first and every second stage
(``tnt.Model(recompute=[...])``), and ZB-fused (several micro-batches' weight gradients in
one op) without and with it: the same serial weights, and recomputation changes no bit.

Writes ``sparse.<mode>.rank<r>.npz``: every case's weights (get_weights) and losses, which
``test_pipeline_model`` compares.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf

SAMPLES, EPOCHS, BATCH, MICRO = 33, 2, 16, 4
#: (optimizer, floatx, schedule, recompute): float64 tells a defect from round-off; float32 is
#: what users run; the schedule and recomputation change the order of the passes and what is
#: kept between them, never the result
CASES = (("adam", "float64", "1f1b", False), ("rmsprop", "float64", "1f1b", False),
         ("sgd", "float64", "1f1b", False), ("adam", "float32", "1f1b", False),
         ("adam", "float64", "zb-h1", True), ("adam", "float64", "zb-fused", False),
         ("adam", "float64", "zb-fused", True))


def cases(strategy: str) -> tuple[tuple[str, str, str, bool], ...]:
    """The cases a layout runs: every one pipelined alone; under ALL the first only (Adam in
    float64, the one that broke). What ALL adds is the allreduce of each stage's sparse
    gradient across the pipelines, which every optimizer then sees the same; a schedule orders
    a stage's own passes, the same code in every pipeline; so the 3-stage layout shows the
    other optimizers, precisions and schedules."""
    if strategy == "pipelining":
        return CASES
    return CASES[:1]


class Lookup(keras.layers.Layer):
    """Rows of its own table, by ``tf.gather``: a sparse gradient from a layer of the
    user's, not Keras' Embedding."""

    def build(self, shape):
        self.table = self.add_weight(shape=(15, 3), initializer="random_normal", name="table")

    def call(self, ids):
        return tf.gather(self.table, ids % 15)


def build() -> keras.Model:
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    late = keras.Input((3,), dtype="int32", name="late")
    h = keras.layers.Flatten()(keras.layers.Embedding(20, 4, name="embedding")(tokens))
    h = keras.layers.Dense(8, activation="tanh", name="d1")(h)
    g = keras.layers.Flatten()(Lookup(name="lookup")(tokens))
    h = keras.layers.Dense(8, activation="tanh", name="d2")(keras.layers.Concatenate()([h, g]))
    f = keras.layers.Flatten()(keras.layers.Embedding(
        10, 3, embeddings_regularizer=keras.regularizers.L2(1e-3), name="regularised")(late))
    h = keras.layers.Dense(6, activation="tanh", name="d3")(keras.layers.Concatenate()([h, f]))
    return keras.Model({"tokens": tokens, "late": late}, keras.layers.Dense(3, name="out")(h))


def optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "adam":
        return keras.optimizers.Adam(0.02)
    if name == "rmsprop":
        return keras.optimizers.RMSprop(0.01)
    return keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05)


def data() -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Few distinct ids, so every batch repeats rows (where row by row and dense differ)."""
    rng = np.random.default_rng(7)
    x = {"tokens": rng.integers(0, 20, (SAMPLES, 6)).astype(np.int32),
         "late": rng.integers(0, 10, (SAMPLES, 3)).astype(np.int32)}
    y = np.stack([np.sin(x["tokens"][:, 0]), np.cos(x["late"][:, 1]),
                  (x["tokens"][:, 2] % 3) - 1.0], axis=1)
    return x, y


def run(args: argparse.Namespace) -> None:
    """Every case, serially or pipelined (``args``: pipeline_model_worker's)."""
    x, y = data()
    rank, arrays = 0, {}
    try:
        for name, dtype, schedule, recompute in (CASES if args.mode == "serial"
                                                  else cases(args.strategy)):
            case = f"{name}_{dtype}_{schedule}" + ("_recompute" if recompute else "")
            same = f"{name}_{dtype}_{CASES[0][2]}"
            if args.mode == "serial" and f"{same}_loss" in arrays:  # Keras has no schedule
                arrays.update({key.replace(same, case): v for key, v in arrays.items()
                               if key.startswith(same + "_")})
                continue
            keras.config.set_floatx(dtype)  # both: a policy left from a float64 model
            keras.config.set_dtype_policy(dtype)  # would make float64 losses in float32
            keras.utils.set_random_seed(13)
            model = build()
            if args.mode == "pipeline":
                import tarantella as tnt

                strategy = (tnt.ParallelStrategy.PIPELINING if args.strategy == "pipelining"
                            else tnt.ParallelStrategy.ALL)
                stages = {} if args.strategy == "pipelining" else \
                    {"num_pipeline_stages": args.partitions}
                model = tnt.Model(model, parallel_strategy=strategy, num_micro_batches=MICRO,
                                  pipeline_schedule=schedule, **stages,
                                  recompute=[p % 2 == 0 for p in range(args.partitions)]
                                  if recompute else None)
                rank = tnt.get_rank()
            # without XLA: a quarter faster to compile, the same weights in float64
            model.compile(optimizer=optimizer(name), loss="mse", jit_compile=False)
            history = model.fit(x, y.astype(dtype), batch_size=BATCH, epochs=EPOCHS,
                                shuffle=False, verbose=0).history
            arrays[f"{case}_loss"] = np.array(history["loss"])
            arrays.update({f"{case}_w{i}": w for i, w in enumerate(model.get_weights())})
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
    np.savez(args.out / f"sparse.{args.mode}.rank{rank}.npz", **arrays)
