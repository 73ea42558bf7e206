"""A pipelined fit restarted twice, resumed at the step each time, against plain Keras
running the same script: ``pipeline_resume_worker.py serial|tnt OUT`` (the serial run is part
of the suite's plain process, ``suite_worker``).

Float64, two stages (cut automatically) under ``ParallelStrategy.ALL`` (two pipelines on
4 ranks), Adam, a metric, shuffled data and validation data; the user's own
``keras.callbacks.BackupAndRestore(save_freq=2)``. Under ``tnt run -n 4 --max-restarts 2``:

* in the first run, rank 3 (stage 1 of pipeline 1) SIGKILLs itself as train batch 5 of the
  second epoch begins; the survivors write the step in flight, and the restarted fit
  resumes at batch 5 (its backup is at batch 4);
* in the second run, ranks 1 and 3 (both replicas of stage 1) SIGKILL themselves as batch 4
  of the third epoch begins: no survivor holds stage 1, and the fit resumes from the backup
  written as batch 3 began.

Each run leaves OUT/killed-<run>. Rank 0 writes the final weights and History to
OUT/result-<mode>.npz, and the first batch its callbacks saw in each run to
OUT/first-batch-<run>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str]) -> None:
    mode, out = argv[0], Path(argv[1])
    if mode == "tnt":
        import tarantella as tnt
    import keras

    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")
    keras.utils.set_random_seed(11)
    out.mkdir(parents=True, exist_ok=True)
    run = len(list(out.glob("killed-*")))
    kills = {0: ((1, 5), {3}), 1: ((2, 4), {1, 3})}
    seen: list[list[int]] = []  # not the callback's state: the backup restores that

    class Killer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if not seen:
                seen.append([self.epoch, batch])
                if mode == "serial" or tnt.get_rank() == 0:
                    (out / f"first-batch-{run}.json").write_text(json.dumps(seen[0]))
            at, ranks = kills.get(run, (None, set()))
            if mode == "tnt" and tnt.get_rank() in ranks and (self.epoch, batch) == at:
                (out / f"killed-{run}").touch()
                os.kill(os.getpid(), signal.SIGKILL)

    rng = np.random.default_rng(5)
    x = rng.normal(size=(96, 6))
    y = x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(96, 1))
    vx, vy = x[:32] * 0.5, y[:32]

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    if mode == "tnt":
        model = tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.ALL,
                          num_pipeline_stages=2, num_micro_batches=2)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    callbacks = [keras.callbacks.BackupAndRestore(str(out / "backup"), save_freq=2), Killer()]
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=True, validation_data=(vx, vy),
                        callbacks=callbacks, verbose=0)
    weights = model.get_weights()
    if mode == "serial" or tnt.get_rank() == 0:
        arrays = {f"w{i}": w for i, w in enumerate(weights)}
        arrays.update({f"h_{k}": np.array(v) for k, v in history.history.items()})
        np.savez(out / f"result-{mode}.npz", **arrays)
    keras.config.set_floatx(floatx)


if __name__ == "__main__":
    main(sys.argv[1:])
