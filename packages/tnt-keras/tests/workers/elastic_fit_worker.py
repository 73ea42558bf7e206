"""An elastic job's Keras training, as a user writes it, against plain Keras running the same
script: ``elastic_fit_worker.py serial|tnt OUT [KILLS [GROW]]``.

KILLS lists ``member:phase:epoch:batch`` (``phase`` train, test or predict, whose epoch
does not count): the process that started as rank ``member`` (a replacement started by
``tnt run --max-restarts`` is a new member) SIGKILLs itself when that batch begins, as an
OOM kill or a lost host would end it. GROW, ``size:epoch:batch``: a kill first writes
OUT/grow (the test's host discovery script then offers one slot more), and the master waits
as that train batch begins until the job has ``size`` ranks or it has seen them coming
(they join at the next step's boundary). The float64 model has
BatchNormalization(synchronized=True) (collectives in the forward pass, statistics moved
there), Adam, metrics, shuffled array data with a short last batch and validation data.
Rank 0 of the end writes the final weights and History to OUT/result-<mode>.npz, and the
times of its recoveries to OUT/recoveries.json; with GROW every rank writes its own too,
OUT/result-member<M>.npz.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import keras
import numpy as np

mode, out = sys.argv[1], Path(sys.argv[2])
kills = [tuple(k.split(":")) for k in (sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else [])]
grow = [int(v) for v in sys.argv[4].split(":")] if len(sys.argv) > 4 else None
keras.config.set_floatx("float64")
keras.utils.set_random_seed(7)
if mode == "tnt":
    import tarantella as tnt

# the rank this process started as, or the member id tnt run gave a process started later
me = int(os.environ.get("TNT_MEMBER_ID", os.environ.get("TNT_RANK", "0")))
if mode == "tnt" and os.environ.get("ELASTIC_DIE_TAKING_STATE") == str(me):
    # a joiner that dies as the master gives it the state (the others are in the broadcast)
    from tarantella.data_parallel.elastic import ElasticLoop

    ElasticLoop._take_state = lambda self, kind: os.kill(os.getpid(), signal.SIGKILL)
if mode == "tnt" and os.environ.get("ELASTIC_DIE_GIVING_STATE") == str(me):
    # a survivor that dies as the master gives a joiner the state
    from tarantella.data_parallel.elastic import ElasticLoop

    ElasticLoop._give_state = lambda self: os.kill(os.getpid(), signal.SIGKILL)


class Killer(keras.callbacks.Callback):
    def _maybe(self, phase: str, batch: int) -> None:
        for member, when, epoch, at in kills:
            in_epoch = phase == "predict" or int(epoch) == self.epoch
            if int(member) == me and when == phase and in_epoch and int(at) == batch:
                if grow is not None:
                    (out / "grow").touch()
                os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._maybe("train", batch)
        if grow is not None and (self.epoch, batch) == tuple(grow[1:]) and tnt.get_rank() == 0:
            import tnt_core

            runtime, deadline = tnt_core.init(), time.monotonic() + 120
            while runtime.size < grow[0] and runtime.newest_seen() == runtime.generation:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no rank joined within 120s ({runtime.size} ranks)")
                time.sleep(0.05)

    def on_test_batch_begin(self, batch, logs=None):
        self._maybe("test", batch)

    def on_predict_batch_begin(self, batch, logs=None):
        self._maybe("predict", batch)


rng = np.random.default_rng(3)
x = rng.normal(size=(230, 6))
y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(230, 1)) > 0).astype("float64")
vx, vy = x[:64] * 0.5, y[:64]

model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.BatchNormalization(synchronized=True),
                          keras.layers.Dense(1, activation="sigmoid")])
if mode == "tnt":
    model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
              metrics=["accuracy", keras.metrics.AUC(name="auc")])
callbacks = [Killer()] if mode == "tnt" else []
history = model.fit(x, y, batch_size=32, epochs=3, shuffle=True, validation_data=(vx, vy),
                    callbacks=callbacks, verbose=0)
evaluated = model.evaluate(vx, vy, batch_size=24, verbose=0, return_dict=True)
predicted = model.predict(vx, batch_size=20, verbose=0, callbacks=callbacks)
on_batch = model.predict_on_batch(vx[:9])

if mode == "serial" or tnt.get_rank() == 0 or grow is not None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"h_{k}": np.array(v) for k, v in history.history.items()})
    arrays.update({f"e_{k}": np.array(v) for k, v in evaluated.items()})
    arrays.update(predicted=predicted, on_batch=on_batch)
    if mode == "serial" or tnt.get_rank() == 0:
        np.savez(out / f"result-{mode}.npz", **arrays)
    if grow is not None:
        np.savez(out / f"result-member{me}.npz", **arrays)
    if mode == "tnt" and tnt.get_rank() == 0:
        (out / "recoveries.json").write_text(json.dumps(
            {"recoveries": model._tnt.elastic.recoveries, "size": tnt.get_size()}))
