"""Train each model of the equivalence set with its optimizer; write the results.

Run as ``python train_worker.py --mode serial --out DIR`` (plain Keras, no tarantella: the
reference) or under ``launch_ranks`` with ``--mode tnt`` (every rank writes its own files).
One process trains all combinations, so TensorFlow is imported once per rank.

A diagonal, not the cross product: every model once, every optimizer once. The optimizer
only ever sees the reduced gradient, so what a model brings (its layers, inputs and batch
split) and what an optimizer brings (its state built from the serial gradient) do not
depend on each other; each pair shows both.

Everything runs in float64: the test compares against serial training with a relative
tolerance of 1e-5 after 2 epochs of Adam/RMSprop, which divide by the root of the squared
gradients; in float32 the round-off of summing micro-batch gradients in another order
(~1e-7 relative per step) is amplified there for tiny gradient components, so float32 could
not show 1e-5 honestly. float64 shows the algorithm is exact; float32 only adds round-off.
Measured with ``TNT_TEST_FLOATX=float32`` on 3 ranks over the full model x optimizer
product: History within 2.4e-7, weights within 2.7e-6 except LeNet-5 with Adam (1.1e-4)
and RMSprop (3.3e-5); in float64 everything is within 1e-13.

Under tarantella the ``two_input`` model's fit is interrupted (an exception on every rank) as
batch 2 of its second epoch begins, and a new model resumes it from its
``keras.callbacks.BackupAndRestore(save_freq=2)`` backup: at the step, not at Keras' epoch,
so its History and weights are still the straight serial run's.

Files per combination ``<tag>.<who>.npz`` (``who`` = ``serial`` or ``rank<r>``): ``w<i>``
weights, ``history`` (JSON), ``evaluate`` (JSON) and ``predict``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

#: model -> optimizer: each model once, each optimizer once (see the module docstring)
PAIRS = {"mlp": "ftrl", "lenet5": "sgd", "cnn": "rmsprop", "subclassed": "momentum", "two_input": "adam"}
#: (samples, global batch): none of 2, 3 ranks divides every batch; last batches are partial,
#: the MLP's last batch has a single sample (ranks 1 and 2 get none).
DATA = {"mlp": (31, 10), "lenet5": (22, 8), "cnn": (25, 7), "subclassed": (20, 5), "two_input": (17, 6)}


class Interrupted(Exception):
    """What the interrupting callback raises: a job ended in the middle of an epoch."""


def tags() -> list[str]:
    return [f"{m}-{o}" for m, o in PAIRS.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated tags")
    args = parser.parse_args(argv)

    if args.mode == "tnt":
        import tarantella as tnt
    import keras
    import tensorflow as tf

    # float64 (see the module docstring); TNT_TEST_FLOATX=float32 measures float32 round-off
    keras.config.set_floatx(os.environ.get("TNT_TEST_FLOATX", "float64"))
    L = keras.layers  # noqa: N806 (Keras' own abbreviation)

    def make_model(name: str) -> keras.Model:
        keras.utils.set_random_seed(7)
        if name == "mlp":
            return keras.Sequential([keras.Input((12,)), L.Dense(16, activation="relu"),
                                     L.Dense(3, activation="softmax")])
        if name == "lenet5":
            return keras.Sequential([
                keras.Input((28, 28, 1)),
                L.Conv2D(6, 5, padding="same", activation="tanh"), L.AveragePooling2D(2),
                L.Conv2D(16, 5, activation="tanh"), L.AveragePooling2D(2), L.Flatten(),
                L.Dense(120, activation="tanh"), L.Dense(84, activation="tanh"),
                L.Dense(10, activation="softmax")])
        if name == "cnn":
            return keras.Sequential([keras.Input((10, 10, 2)), L.Conv2D(4, 3, activation="relu"),
                                     L.MaxPooling2D(2), L.Flatten(), L.Dense(5, activation="softmax")])
        if name == "subclassed":
            class Sub(keras.Model):
                def __init__(self):
                    super().__init__()
                    self.d1 = L.Dense(8, activation="tanh")
                    self.d2 = L.Dense(4, activation="softmax")

                def call(self, x):
                    return self.d2(self.d1(x))

            return Sub()  # unbuilt: tarantella must build it before the first step
        if name == "two_input":
            a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
            h = L.Concatenate()([L.Dense(5, activation="relu")(a), b])
            return keras.Model({"a": a, "b": b}, L.Dense(2)(h))
        raise ValueError(name)

    def make_optimizer(name: str) -> keras.optimizers.Optimizer:
        return {"sgd": lambda: keras.optimizers.SGD(0.05),
                "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                "adam": lambda: keras.optimizers.Adam(0.01),
                "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
                "ftrl": lambda: keras.optimizers.Ftrl(0.05)}[name]()

    def make_data(name: str, n: int, seed: int):
        rng = np.random.default_rng(seed)
        if name == "two_input":
            x = {"a": rng.normal(size=(n, 6)), "b": rng.normal(size=(n, 4))}
            return x, rng.normal(size=(n, 2))
        shape, classes = {"mlp": ((12,), 3), "lenet5": ((28, 28, 1), 10), "cnn": ((10, 10, 2), 5),
                          "subclassed": ((7,), 4)}[name]
        return rng.normal(size=(n,) + shape), rng.integers(0, classes, size=n)

    selected = [t for t in tags() if not args.only or t in args.only.split(",")]
    who = "serial" if args.mode == "serial" else f"rank{tnt.get_rank()}"
    os.makedirs(args.out, exist_ok=True)
    for tag in selected:
        model_name, opt_name = tag.split("-")
        samples, batch = DATA[model_name]
        x, y = make_data(model_name, samples, 1)
        vx, vy = make_data(model_name, 11, 2)
        model = make_model(model_name)
        if args.mode == "tnt":
            model = tnt.Model(model)
        loss = "mse" if model_name == "two_input" else "sparse_categorical_crossentropy"
        metrics = ["mae"] if model_name == "two_input" else ["accuracy"]
        model.compile(optimizer=make_optimizer(opt_name), loss=loss, metrics=metrics)
        if model_name == "two_input":  # NumPy dicts with batch_size=
            fit_args = dict(x=x, y=y, batch_size=batch, shuffle=False)
            val = (vx, vy)
        else:
            fit_args = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))
            val = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(4)
        if args.mode == "tnt" and model_name == "two_input" and tnt.get_size() == 3:
            # interrupted as batch 2 of epoch 2 begins, resumed by a new model from the
            # BackupAndRestore(save_freq=2) backup written as batch 1 began: at the step,
            # with the whole History (the serial run trains straight through); in the
            # 3-rank launch only (the native path, batches split unevenly), for time
            backup = os.path.join(args.out, f"{tag}.backup")  # shared: every rank reads it

            class Interrupt(keras.callbacks.Callback):
                def on_epoch_begin(self, epoch, logs=None):
                    self.epoch = epoch

                def on_train_batch_begin(self, batch, logs=None):
                    if (self.epoch, batch) == (1, 2):
                        raise Interrupted(f"interrupted at batch {batch} of epoch {self.epoch}")

            try:
                model.fit(**fit_args, epochs=2, verbose=0, validation_data=val, callbacks=[
                    keras.callbacks.BackupAndRestore(backup, save_freq=2), Interrupt()])
                raise AssertionError("the fit was not interrupted")
            except Interrupted:
                pass
            model = tnt.Model(make_model(model_name))
            model.compile(optimizer=make_optimizer(opt_name), loss=loss, metrics=metrics)
            history = model.fit(**fit_args, epochs=2, verbose=0, validation_data=val,
                                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2)])
            # the master (rank 0) deletes it (on_train_end, before its fit returns)
            if tnt.get_rank() == 0 and os.path.exists(backup):
                raise AssertionError(f"the backup {backup} outlived the fit")
        else:
            history = model.fit(**fit_args, epochs=2, verbose=0, validation_data=val)
        result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        result["history"] = np.array(json.dumps(history.history))
        if model_name == "two_input":
            ev = model.evaluate(vx, vy, batch_size=4, verbose=0, return_dict=True)
            pred = model.predict(vx, batch_size=4, verbose=0)
        else:
            ev = model.evaluate(val, verbose=0, return_dict=True)
            pred = model.predict(val, verbose=0)
        result["evaluate"] = np.array(json.dumps(ev))
        result["predict"] = pred
        np.savez(os.path.join(args.out, f"{tag}.{who}.npz"), **result)
        print(f"{who} done {tag}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
