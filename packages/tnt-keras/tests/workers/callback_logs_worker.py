"""The logs a wrapped callback receives, for every ``aggregate_logs`` / ``run_on_all_ranks``
combination, in a model's first ``fit``/``evaluate``/``predict`` and in later ones, next to
what plain Keras passes, computed in this rank's process; ``<out>/rank<R>.json``.

* ``serial``: plain Keras running the same calls on the same data and seed (what callbacks
  with ``aggregate_logs=True`` must receive);
* ``own``: plain Keras on this rank's own micro-batches: for each step, the model of that
  step (the serial run's weights before it) evaluated on this rank's micro-batch, the
  metrics accumulated as Keras' loop accumulates them; validation, ``evaluate`` and
  ``predict`` on this rank's shard of each global batch (what ``aggregate_logs=False``
  must receive).

Two scenarios, each on a fresh ``tnt.Model``: ``first`` (the wrapped callbacks come with
its first ``fit``, ``evaluate`` and ``predict``) and ``later`` (the model ran each loop once
without them, at learning rate 0 so that its weights stay the serial run's: Keras then holds
steps traced before any callback wanted rank-local logs).
``test_callback_logs.py`` reads the files.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

#: (aggregate_logs, run_on_all_ranks) of the wrapped callbacks
COMBINATIONS = [(True, True), (True, False), (False, True), (False, False)]
GLOBAL_BATCH, VAL_BATCH, EPOCHS, LEARNING_RATE = 8, 4, 2, 0.3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import keras

    import tarantella as tnt
    import tnt_core

    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")  # differences are then round-off, not float32 noise
    rank, size = tnt.get_rank(), tnt.get_size()
    rng = np.random.default_rng(11)
    x, vx = rng.normal(size=(22, 4)), rng.normal(size=(10, 4))  # last batches: 6 and 2 rows
    y, vy = (x[:, 0] - x[:, 2] > 0).astype(np.int64), (vx[:, 0] - vx[:, 2] > 0).astype(np.int64)

    def batches(a: np.ndarray, batch: int) -> list[np.ndarray]:
        return [a[i:i + batch] for i in range(0, len(a), batch)]

    def own(a: np.ndarray) -> np.ndarray:
        """This rank's micro-batch of the global batch ``a``."""
        start = tnt_core.micro_batch_offset(len(a), rank, size)
        return a[start:start + tnt_core.micro_batch_size(len(a), rank, size)]

    train_own = list(zip(*(map(own, batches(a, GLOBAL_BATCH)) for a in (x, y))))
    val_own = list(zip(*(map(own, batches(a, VAL_BATCH)) for a in (vx, vy))))
    pred_own = [own(b) for b in batches(vx, VAL_BATCH)]

    def make(distributed: bool):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                                  keras.layers.Dense(2, activation="softmax")])
        if distributed:
            model = tnt.Model(model)
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    def plain(logs: dict | None) -> dict:
        out = {}
        for k, v in (logs or {}).items():
            v = keras.ops.convert_to_numpy(v)
            out[k] = v.tolist() if np.ndim(v) else float(v)
        return out

    class Record(keras.callbacks.Callback):
        """Every hook's logs that Keras passes with metrics or outputs, in order."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[list] = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(["train_batch", batch, plain(logs)])

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(["epoch", epoch, plain(logs)])

        def on_test_batch_end(self, batch, logs=None):
            self.seen.append(["test_batch", batch, plain(logs)])

        def on_test_end(self, logs=None):
            self.seen.append(["test_end", None, plain(logs)])

        def on_predict_batch_end(self, batch, logs=None):
            self.seen.append(["predict_batch", batch, plain(logs)])

    class OwnShard(Record):
        """On the serial run: what plain Keras computes on this rank's micro-batches with the
        serial model's weights of each step (a second plain model evaluates them; the epoch's
        loss and accuracy are means over its samples, as Keras' loop accumulates them)."""

        def __init__(self, shadow: keras.Model) -> None:
            super().__init__()
            self.shadow = shadow

        def on_epoch_begin(self, epoch, logs=None):
            # Keras' loop: the loss a mean over the samples (its loss tracker), the metrics
            # accumulated by their own objects
            self.loss = keras.metrics.Mean()
            self.accuracy = keras.metrics.SparseCategoricalAccuracy()

        def on_train_batch_begin(self, batch, logs=None):
            bx, by = train_own[batch]
            self.shadow.set_weights(self.model.get_weights())  # the weights this step uses
            y_pred = self.shadow(bx, training=True)
            loss = self.shadow.compute_loss(x=bx, y=by, y_pred=y_pred, training=True)
            self.loss.update_state(loss, sample_weight=len(bx))
            self.accuracy.update_state(by, y_pred)

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(["train_batch", batch, self._train_logs()])

        def _train_logs(self) -> dict:
            return {"accuracy": float(self.accuracy.result()), "loss": float(self.loss.result())}

        def on_epoch_end(self, epoch, logs=None):
            val = evaluate_own(self.model, self.shadow, self.seen)  # fit validates at the end
            self.seen.append(["epoch", epoch, {**self._train_logs(),
                                               **{"val_" + k: v for k, v in val.items()}}])

        def on_test_batch_end(self, batch, logs=None):
            pass  # fit's validation: recorded at the epoch's end

        def on_test_end(self, logs=None):
            pass

    def evaluate_own(model: keras.Model, shadow: keras.Model, seen: list) -> dict:
        """``model`` evaluated by plain Keras on this rank's shard of the validation data (its
        micro-batch of each global batch); its callback's logs go to ``seen``."""
        shadow.set_weights(model.get_weights())
        record = Record()
        logs = shadow.evaluate((b for b in val_own), steps=len(val_own), verbose=0, return_dict=True,
                               callbacks=[record])
        seen += record.seen
        return plain(logs)

    def predict_own(model: keras.Model, shadow: keras.Model) -> list:
        """The logs plain Keras' predict passes on this rank's shard of each global batch."""
        shadow.set_weights(model.get_weights())
        record = Record()
        shadow.predict(((b,) for b in pred_own), steps=len(pred_own), verbose=0, callbacks=[record])
        return record.seen

    def fit(model: keras.Model, callbacks: list) -> None:
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, validation_data=(vx, vy),
                  validation_batch_size=VAL_BATCH, shuffle=False, verbose=0, callbacks=callbacks)

    def evaluate(model: keras.Model, callbacks: list) -> None:
        model.evaluate(vx, vy, batch_size=VAL_BATCH, verbose=0, callbacks=callbacks)

    def predict(model: keras.Model, callbacks: list) -> None:
        model.predict(vx, batch_size=VAL_BATCH, verbose=0, callbacks=callbacks)

    loops = {"fit": fit, "evaluate": evaluate, "predict": predict}

    # plain Keras: the serial logs, and this rank's own along the same run
    serial_model, shadow = make(False), make(False)
    serial = {call: Record() for call in loops}
    own_fit = OwnShard(shadow)
    fit(serial_model, [serial["fit"], own_fit])
    own: dict[str, list] = {"fit": own_fit.seen, "evaluate": []}
    evaluate_own(serial_model, shadow, own["evaluate"])
    evaluate(serial_model, [serial["evaluate"]])
    own["predict"] = predict_own(serial_model, shadow)
    predict(serial_model, [serial["predict"]])
    result: dict = {"rank": rank, "size": size, "serial": {c: r.seen for c, r in serial.items()},
                    "own": own}

    for scenario in ("first", "later"):
        tnt_model = make(True)
        if scenario == "later":  # each loop once, without wrapped callbacks, leaving the weights
            tnt_model.optimizer.learning_rate.assign(0.0)  # as they were (as the serial run's)
            for loop in loops.values():
                loop(tnt_model, [])
            tnt_model.optimizer.learning_rate.assign(LEARNING_RATE)
        # the same calls as the serial run, with a recorder for every combination
        recorders = [Record() for _ in COMBINATIONS]
        wrapped = [tnt.keras.callbacks.Callback(r, aggregate_logs=agg, run_on_all_ranks=everywhere)
                   for r, (agg, everywhere) in zip(recorders, COMBINATIONS)]
        got: dict[str, list] = {}
        for call, loop in loops.items():
            for r in recorders:
                r.seen = []
            loop(tnt_model, wrapped)
            got[call] = [r.seen for r in recorders]
        result[scenario] = got
    keras.config.set_floatx(floatx)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
