"""Global batches smaller than the number of ranks: tnt.Model against plain Keras.

Run on every rank of a launched job with several ranks (``workers/suite_worker.py`` calls
``main(["--out", OUT_DIR])``; ``python small_batch_worker.py --out OUT_DIR``). Each case
trains (or evaluates, predicts) a plain Keras model and the same model under ``tnt.Model``
in this process, from the same initial weights, and records the largest relative
difference of the weights and of what the call returned (``OUT_DIR/rank<r>.json``).
float64, so that a difference would be the algorithm's, not float32 round-off.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12)) if b.size else 0.0


def _flat(value) -> list[float]:
    if isinstance(value, dict):
        return [v for k in sorted(value) for v in _flat(value[k])]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _flat(item)]
    return list(np.ravel(np.asarray(value, np.float64)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    keras.config.set_floatx("float64")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 4)), rng.normal(size=(7, 2))

    def fresh() -> keras.Model:
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
        return model

    def fit(**kwargs):
        return lambda m: m.fit(epochs=2, verbose=0, **kwargs).history

    def shuffled(m):
        keras.utils.set_random_seed(11)
        return m.fit(x, y, batch_size=1, epochs=2, verbose=0, shuffle=True).history

    def on_batch(m):
        return [m.train_on_batch(x[i:i + 1], y[i:i + 1], return_dict=True) for i in range(3)]

    cases = {
        "fit batch_size=1": fit(x=x, y=y, batch_size=1, shuffle=False),
        "fit batch_size=1, shuffled": shuffled,
        "fit dataset batched by 1": fit(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(1)),
        "fit 3 samples, batch_size=2": fit(x=x[:3], y=y[:3], batch_size=2, shuffle=False),
        "fit batch_size=1 with validation": fit(x=x, y=y, batch_size=1, shuffle=False,
                                                validation_data=(x[:3], y[:3]),
                                                validation_batch_size=1),
        "evaluate batch_size=1": lambda m: m.evaluate(x, y, batch_size=1, verbose=0,
                                                      return_dict=True),
        "predict batch_size=1": lambda m: m.predict(x, batch_size=1, verbose=0),
        "train_on_batch of 1 row": on_batch,
    }
    results = {}
    for name, call in cases.items():
        serial_model = fresh()
        serial = call(serial_model)
        model = tnt.Model(fresh())
        got = call(model)
        weights = max(_rel(a, b) for a, b in zip(model.get_weights(), serial_model.get_weights()))
        results[name] = {"weights": weights, "returned": _rel(_flat(got), _flat(serial))}
    rank = tnt.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"size": tnt.get_size(), "cases": results}))


if __name__ == "__main__":
    main()
