"""Graphs a pipeline must route, next to plain Keras (run by ``pipeline_model_worker``).

For ``P`` partitions, each case builds a seeded model, trains it (fit with validation data),
evaluates and predicts; serially in plain Keras, or as ``tnt.Model(..., PIPELINING or ALL)``:

* ``skip``: a residual connection from partition 0 straight to the last partition (across
  every cut), routed through the stages between;
* ``late``: a model of two inputs (a dict), one of which enters the last partition;
* ``outputs``: three outputs, computed in partitions 0, 1 and the last, with a loss dict,
  ``loss_weights`` and per-output metrics;
* ``sequential``: a ``keras.Sequential`` without SplitLayer, cut automatically into ``P``
  partitions (PIPELINING: one per rank, the default; ALL: ``num_pipeline_stages=P``).

Writes ``graph.<mode>.rank<r>.json`` (Histories, evaluate results, each stage's parameter
count) and ``.npz`` (weights and predictions), which ``test_pipeline_model`` compares.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import keras
import numpy as np

#: 24 samples: batches of 16 and 8 (an uneven last batch), 2 epochs
SAMPLES, EPOCHS, BATCH, MICRO = 24, 2, 16, 3


def _split(x: Any) -> Any:
    import tarantella as tnt

    return tnt.keras.layers.SplitLayer()(x)


def skip(partitions: int) -> keras.Model:
    inp = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="h")(inp)
    x = h
    for p in range(partitions - 1):
        x = keras.layers.Dense(8, activation="tanh", name=f"g{p}")(_split(x))
    x = keras.layers.Add(name="residual")([x, h])  # h crosses every cut
    return keras.Model(inp, keras.layers.Dense(3, name="out")(x), name="skip")


def late(partitions: int) -> keras.Model:
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    x = keras.layers.Dense(8, activation="tanh", name="first")(a)
    for p in range(partitions - 1):
        x = keras.layers.Dense(6, activation="tanh", name=f"g{p}")(_split(x))
    x = keras.layers.Concatenate(name="join")([x, b])  # b enters the last partition
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="out")(x), name="late")


def outputs(partitions: int) -> keras.Model:
    inp = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="h")(inp)
    early = keras.layers.Dense(2, name="early")(h)  # partition 0
    x = keras.layers.Dense(8, activation="tanh", name="g0")(_split(h))
    middle = keras.layers.Dense(1, name="middle")(x)  # partition 1
    for p in range(1, partitions - 1):
        x = keras.layers.Dense(8, activation="tanh", name=f"g{p}")(_split(x))
    main = keras.layers.Dense(3, name="main")(x)  # the last partition
    return keras.Model(inp, [main, early, middle], name="outputs")


def sequential(partitions: int) -> keras.Model:
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(12, activation="tanh"),
                             keras.layers.Dense(10, activation="tanh"),
                             keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)],
                            name="sequential")


def _data(name: str, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
    if name == "late":
        return {"a": x[:, :4], "b": x[:, 4:]}, y
    if name == "outputs":
        return x, {"main": y, "early": y[:, :2] * 2, "middle": y[:, 2:] - y[:, :1]}
    return x, y


def _compile(name: str, model: keras.Model) -> None:
    if name == "outputs":
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss={"main": "mse", "early": "mae", "middle": keras.losses.Huber()},
                      loss_weights={"main": 1.0, "early": 0.5, "middle": 2.0},
                      metrics={"main": ["mae"], "middle": ["mse"]})
    else:
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                      metrics=["mae"])


CASES = {"skip": skip, "late": late, "outputs": outputs, "sequential": sequential}


def run(args: argparse.Namespace, x: np.ndarray, y: np.ndarray) -> None:
    """Every case, serially or pipelined (``args``: pipeline_model_worker's)."""
    rank, results, arrays = 0, {}, {}
    x, y = x[:SAMPLES], y[:SAMPLES]
    for name, build in CASES.items():
        keras.utils.set_random_seed(21)
        model = build(args.partitions)
        extra = {}
        if args.mode == "pipeline":
            import tarantella as tnt

            strategy = (tnt.ParallelStrategy.PIPELINING if args.strategy == "pipelining"
                        else tnt.ParallelStrategy.ALL)
            # PIPELINING cuts into one partition per rank by default; ALL is told how many
            stages = ({"num_pipeline_stages": args.partitions}
                      if name == "sequential" and args.strategy == "all" else {})
            model = tnt.Model(model, parallel_strategy=strategy, num_micro_batches=MICRO, **stages)
            rank = tnt.get_rank()
            extra = {"local_params": model.local_param_count}
        _compile(name, model)
        data_x, data_y = _data(name, x, y)
        val_x, val_y = _data(name, x[:12] * 0.5, y[:12])
        history = model.fit(data_x, data_y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                            validation_data=(val_x, val_y), verbose=0).history
        evaluation = model.evaluate(val_x, val_y, batch_size=5, verbose=0, return_dict=True)
        predictions = keras.tree.flatten(model.predict(data_x, batch_size=13, verbose=0))
        results[name] = {"history": history, "evaluate": evaluation, **extra}
        arrays.update({f"{name}_w{i}": w for i, w in enumerate(model.get_weights())})
        arrays.update({f"{name}_predict{i}": p for i, p in enumerate(predictions)})
    tag = f"graph.{args.mode}.rank{rank}"
    np.savez(args.out / f"{tag}.npz", **arrays)
    (args.out / f"{tag}.json").write_text(json.dumps(results, default=float))
