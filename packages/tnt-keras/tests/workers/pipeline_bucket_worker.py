"""Batches of different sequence lengths through a pipeline, next to plain Keras (run by
``pipeline_model_worker``).

A text model on ``keras.Input((None,))``: an ``Embedding`` with ``mask_zero=True``, a cut,
``GlobalAveragePooling1D`` (which reads the mask, so the mask crosses the cut with the
embeddings) and two ``Dense`` layers (a second cut before the last with ``P = 3``). A
``keras.utils.PyDataset`` yields padded batches, each of its own length (sequence
bucketing); Adam, float64, 3 micro-batches: fit, evaluate and predict. Every stage traces
a step per length and receives the activations at the batch's length (two lengths: each
trace costs seconds).

Writes ``bucket.<mode>.rank<r>.npz`` (weights, losses, evaluate, predictions), which
``test_pipeline_model`` compares.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np

EPOCHS, MICRO = 2, 3
#: (batch size, sequence length) of each batch
BATCHES = ((8, 6), (8, 9), (8, 6))


def data() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    batches = []
    for size, length in BATCHES:
        x = rng.integers(1, 40, (size, length)).astype(np.int32)
        x[np.arange(length)[None, :] >= rng.integers(2, length + 1, (size, 1))] = 0  # padding
        batches.append((x, (x % 3 == 0).mean(axis=1, keepdims=True)))
    return batches


class Buckets(keras.utils.PyDataset):
    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        super().__init__()
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.batches[i]


def build(partitions: int) -> keras.Model:
    from tarantella.keras.layers import SplitLayer

    tokens = keras.Input((None,), dtype="int32")
    h = SplitLayer()(keras.layers.Embedding(40, 6, mask_zero=True)(tokens))
    h = keras.layers.Dense(5, activation="tanh")(keras.layers.GlobalAveragePooling1D()(h))
    if partitions > 2:
        h = SplitLayer()(h)
    return keras.Model(tokens, keras.layers.Dense(1)(h))


def run(args: argparse.Namespace) -> None:
    """Serially or pipelined (``args``: pipeline_model_worker's)."""
    batches, rank = data(), 0
    try:
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
        keras.utils.set_random_seed(17)
        model = build(args.partitions)
        if args.mode == "pipeline":
            import tarantella as tnt

            strategy = (tnt.ParallelStrategy.PIPELINING if args.strategy == "pipelining"
                        else tnt.ParallelStrategy.ALL)
            model = tnt.Model(model, parallel_strategy=strategy, num_micro_batches=MICRO)
            rank = tnt.get_rank()
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", jit_compile=False)
        history = model.fit(Buckets(batches), epochs=EPOCHS, shuffle=False, verbose=0).history
        arrays = {"loss": np.array(history["loss"]),
                  "evaluate": np.array([model.evaluate(Buckets(batches[:2]), verbose=0)]),
                  "predict": model.predict(batches[1][0], batch_size=8, verbose=0)}
        arrays.update({f"w{i}": w for i, w in enumerate(model.get_weights())})
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
    np.savez(args.out / f"bucket.{args.mode}.rank{rank}.npz", **arrays)
