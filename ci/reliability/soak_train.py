"""One attempt of the resume soak (see soak_resume.py): trains a classifier with Keras'
BackupAndRestore under ``tnt run``; the rank ``--kill-rank`` kills itself with SIGKILL in
the middle of each epoch of ``--kill-epochs``, once per epoch (a marker file remembers it),
as a node failure would. Rank 0 writes the final weights to ``--out``."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import keras
import numpy as np

import tarantella as tnt

parser = argparse.ArgumentParser()
parser.add_argument("--backup", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--samples", type=int, default=32768)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--kill-epochs", default="")
parser.add_argument("--kill-rank", type=int, default=2)
args = parser.parse_args()

keras.utils.set_random_seed(1234)
rng = np.random.default_rng(0)
x = rng.normal(size=(args.samples, 64)).astype("float32")
labels = (x[:, :10] @ rng.normal(size=(10, 10))).argmax(axis=1).astype("int64")

model = tnt.Model(keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(args.width, activation="relu"),
    keras.layers.Dense(args.width, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
]))
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
kill_epochs = {int(e) for e in args.kill_epochs.split(",") if e}
steps = -(-args.samples // 256)


class KillOnce(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if tnt.get_rank() == 0:
            print(f"epoch {epoch + 1} begins at {time.time():.3f}", flush=True)

    def on_train_batch_begin(self, batch, logs=None):
        marker = Path(args.backup) / f"killed-at-epoch-{self.epoch}"
        if (self.epoch in kill_epochs and batch == steps // 2 and tnt.get_rank() == args.kill_rank
                and not marker.exists()):
            marker.write_text(f"{time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)


history = model.fit(x, labels, batch_size=256, epochs=args.epochs, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(os.path.join(args.backup, "bak")),
                               KillOnce()])
if tnt.get_rank() == 0:
    np.savez(args.out, *model.get_weights())
    print(f"done: {len(history.epoch)} epochs in this attempt, final loss "
          f"{history.history['loss'][-1]:.6f}", flush=True)
