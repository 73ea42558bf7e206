"""Callbacks in a distributed run: Keras' own, custom ones, master-only and rank-local ones.

    tnt run -n 2 -- examples/callbacks/callbacks.py --out-dir /tmp/tnt-callbacks
    tnt run -n 2 --output-on-all-devices -- examples/callbacks/callbacks.py   # see every rank

What each callback shows:

* ``keras.callbacks.ModelCheckpoint`` and ``CSVLogger``: passed unchanged on every rank;
  Tarantella-NT runs them on the master rank only, so each file is written once.
* ``keras.callbacks.EarlyStopping``: runs on every rank; the logs are the same everywhere
  (metrics are reduced over all ranks), so every rank decides to stop at the same epoch.
* ``EpochSummary`` (custom, master only): printing once is the job of the master rank,
  ``tnt.keras.callbacks.Callback(..., run_on_all_ranks=False)``.
* ``RankLog`` (custom, rank-local): runs on every rank with ``aggregate_logs=False``, so
  its logs hold this rank's own metrics (from the samples this rank trained on); it
  writes them, with the rank's own step times, to its own file ``rank<R>.csv``.
* ``StopAtAccuracy`` (custom, master only): it asks to stop training, and Tarantella-NT
  stops every rank with it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import tarantella as tnt  # first: places this rank on its GPU / CPU threads

# isort: split
import keras
import numpy as np
import tensorflow as tf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("callbacks-output"),
                        help="where checkpoints, the CSV log and the rank files go")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--train-size", type=int, default=None,
                        help="use only the first N training samples")
    parser.add_argument("--stop-at-accuracy", type=float, default=0.95,
                        help="StopAtAccuracy ends training once val_accuracy reaches this")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


class EpochSummary(keras.callbacks.Callback):
    """One line per epoch. Wrapped with run_on_all_ranks=False: printed by the master only."""

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.4f}, "
              f"val_accuracy {logs['val_accuracy']:.4f}", flush=True)


class RankLog(keras.callbacks.Callback):
    """Rank-local: each rank writes its own metrics and step times to its own file.

    Wrapped with ``aggregate_logs=False``, the logs it gets hold this rank's metrics,
    computed from this rank's micro-batches only, instead of the job's.
    """

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.path = out_dir / f"rank{tnt.get_rank()}.csv"
        self.rows: list[str] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.step_times: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.step_times.append(time.perf_counter() - self.start)

    def on_epoch_end(self, epoch, logs=None):
        self.rows.append(f"{epoch},{len(self.step_times)},{np.mean(self.step_times) * 1000:.2f},"
                         f"{logs['loss']:.4f},{logs['accuracy']:.4f}\n")

    def on_train_end(self, logs=None):
        with open(self.path, "w") as f:
            f.write("epoch,steps,ms_per_step,loss,accuracy\n")
            f.writelines(self.rows)
        print(f"rank {tnt.get_rank()}: its own last-epoch metrics {self.rows[-1].strip()} "
              f"-> {self.path}", flush=True)


class StopAtAccuracy(keras.callbacks.Callback):
    """Ends training once the validation accuracy is high enough."""

    def __init__(self, target: float) -> None:
        super().__init__()
        self.target = target

    def on_epoch_end(self, epoch, logs=None):
        if (logs or {}).get("val_accuracy", 0.0) >= self.target:
            print(f"val_accuracy reached {self.target}: stopping after epoch {epoch + 1}", flush=True)
            self.model.stop_training = True


def load_digits(train_size: int | None):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # 64 pixels per image
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    x_train, y_train = x[:split][:train_size], y[:split][:train_size]
    return (x_train, y_train), (x[split:], y[split:])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_val, y_val) = load_digits(args.train_size)
    train_ds = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(len(x_train), seed=args.seed).batch(args.batch_size))
    val_ds = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(args.batch_size)

    model = tnt.Model(keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ]))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    callbacks = [
        # Keras callbacks, unchanged: the writing ones run on the master only
        keras.callbacks.ModelCheckpoint(os.fspath(args.out_dir / "checkpoint.keras")),
        keras.callbacks.CSVLogger(os.fspath(args.out_dir / "training.csv")),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2),
        # custom callbacks
        tnt.keras.callbacks.Callback(EpochSummary(), run_on_all_ranks=False),
        tnt.keras.callbacks.Callback(RankLog(args.out_dir), aggregate_logs=False,
                                     run_on_all_ranks=True),
        tnt.keras.callbacks.Callback(StopAtAccuracy(args.stop_at_accuracy), run_on_all_ranks=False),
    ]
    history = model.fit(train_ds, validation_data=val_ds, epochs=args.epochs, verbose=0,
                        callbacks=callbacks)
    epochs_run = len(history.history["loss"])
    # every rank ran the same epochs, whichever callback stopped training
    print(f"rank {tnt.get_rank()}: trained {epochs_run} epoch(s)", flush=True)


if __name__ == "__main__":
    main()
