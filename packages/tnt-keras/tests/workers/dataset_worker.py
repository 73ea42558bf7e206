"""Iterate ~20 input pipelines as fit would, and record which samples each step holds.

``--mode serial``: plain TensorFlow, the global batches. ``--mode tnt``: this rank's part of
each step, through ``tarantella.datasets.prepare_data`` (what ``tnt.Model.fit`` uses).
Every sample carries its id; the file ``<who>.json`` maps pipeline name to a list of epochs,
each a list of steps ``{"ids": [...], "n": n, "b": b}`` (only this rank's real samples).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

N = 29  # samples


def pipelines(tf):
    ids = np.arange(N, dtype=np.int64)
    feats = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    labels = (ids % 4).astype(np.int64)
    xy = lambda: tf.data.Dataset.from_tensor_slices((ids, labels))  # noqa: E731
    seqs = tf.data.Dataset.from_tensor_slices(ids).map(
        lambda i: tf.fill([tf.cast(i % 5 + 1, tf.int32)], i))

    def gen():
        yield from ids.tolist()

    out = {
        # name: (dataset or (arrays...), kwargs for prepare_data, ids_of(batch))
        "plain": (tf.data.Dataset.from_tensor_slices(ids).batch(10), {}, lambda b: b),
        "tuple": (xy().batch(7), {}, lambda b: b[0]),
        "dict_features": (tf.data.Dataset.from_tensor_slices(({"id": ids, "f": feats}, labels)).batch(6),
                          {}, lambda b: b[0]["id"]),
        "sample_weights": (tf.data.Dataset.from_tensor_slices((ids, labels, feats[:, 0])).batch(8),
                           {}, lambda b: b[0]),
        "map": (xy().map(lambda i, y: (i * 1, y + 1)).batch(9), {}, lambda b: b[0]),
        "filter": (xy().filter(lambda i, y: i % 3 != 1).batch(6), {}, lambda b: b[0]),
        "seeded_shuffle": (xy().shuffle(N, seed=3).batch(8), {}, lambda b: b[0]),
        "unseeded_shuffle": (xy().shuffle(N).batch(8), {}, lambda b: b[0]),
        "shuffle_batches": (xy().batch(5).shuffle(10, seed=5), {}, lambda b: b[0]),
        "cache_shuffle_prefetch": (xy().cache().shuffle(N, seed=11).batch(7).prefetch(2), {},
                                   lambda b: b[0]),
        "repeat_then_batch": (xy().repeat(2).batch(9), {}, lambda b: b[0]),
        "padded_batch": (seqs.padded_batch(6), {}, lambda b: b[:, 0]),
        "ragged_batch": (seqs.ragged_batch(6), {}, lambda b: b.to_tensor()[:, 0]),
        "drop_remainder": (xy().batch(8, drop_remainder=True), {}, lambda b: b[0]),
        "batched_map": (xy().batch(7).map(lambda i, y: (i, y, tf.ones_like(y, tf.float32))), {},
                        lambda b: b[0]),
        "interleave_source": (tf.data.Dataset.range(2).interleave(
            lambda k: tf.data.Dataset.from_tensor_slices(ids).shard(2, k), cycle_length=2).batch(5), {},
            lambda b: b),
        "generator": (tf.data.Dataset.from_generator(
            gen, output_signature=tf.TensorSpec([], tf.int64)).batch(7), {}, lambda b: b),
        "tiny_last_batch": (xy().batch(14), {}, lambda b: b[0]),  # 29 = 14 + 14 + 1
        "unbatched_micro": (xy(), {"micro_batch_size": 3}, lambda b: b[0]),
        "numpy_shuffle": ((ids, labels), {"batch_size": 7, "shuffle": True}, lambda b: b[0]),
        "numpy_dict": (({"id": ids, "f": feats}, labels), {"batch_size": 11}, lambda b: b[0]["id"]),
    }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.mode == "tnt":
        import tarantella as tnt
        from tarantella.data_parallel.steps import BATCH_KEY, INFO_KEY
        from tarantella.datasets import prepare_data
    import tensorflow as tf

    result = {}
    for name, (data, kwargs, ids_of) in pipelines(tf).items():
        epochs = []
        if args.mode == "serial":
            if isinstance(data, tuple):  # arrays: batch in order (no shuffle to compare)
                x, y = data
                dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(kwargs["batch_size"])
            elif "micro_batch_size" in kwargs:
                dataset = data.batch(kwargs["micro_batch_size"])  # x ranks: filled in by the test
            else:
                dataset = data
            for _ in range(2):
                epochs.append([{"ids": np.asarray(ids_of(b)).tolist(), "n": None, "b": None}
                               for b in dataset])
        else:
            kwargs = dict(kwargs)
            if isinstance(data, tuple):
                prepared = prepare_data(data[0], data[1], **kwargs)
            else:
                prepared = prepare_data(data, **kwargs)
            for _ in range(2):
                steps = []
                for element in prepared.dataset:
                    batch, info = element[BATCH_KEY], element[INFO_KEY]
                    n, b = int(info[0]), int(info[1])
                    steps.append({"ids": np.asarray(ids_of(batch))[:n].tolist(), "n": n, "b": b})
                epochs.append(steps)
        result[name] = epochs
    who = "serial" if args.mode == "serial" else f"rank{tnt.get_rank()}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{who}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
