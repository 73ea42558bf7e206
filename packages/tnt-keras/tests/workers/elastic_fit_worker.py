"""An elastic job's Keras training, as a user writes it, against plain Keras running the same
script: ``elastic_fit_worker.py serial|tnt OUT [KILLS [GROW]]``.

KILLS lists ``member:phase:epoch:batch``: the process that started as rank ``member`` (a
replacement started by ``tnt run --max-restarts`` is a new member) SIGKILLs itself, as an
OOM kill or a lost host would end it, where ``phase`` says:

* ``train``, ``test``, ``predict``: as that batch begins (a predict's epoch does not count);
* ``input``: in the input pipeline, in the training data's ``__getitem__`` making the
  ``batch``-th batch of that epoch (Keras shuffles their order), once the master is inside
  its checkpoint write at the end of the epoch before (the master waits there until it
  learns of the death: the rank dies while the master writes);
* ``write``: in the middle of the master's ``ModelCheckpoint`` write at the end of that
  epoch (some layers of the file written, not all);
* ``hang``: as that train batch begins, the process stops itself (SIGSTOP): alive, stuck.

GROW, ``size:epoch:batch``: a kill first writes OUT/grow (the test's host discovery script
then offers one slot more); as each train batch begins from that one on, while the job has
fewer than ``size`` ranks, the master waits until it sees a new generation coming (its ranks
join at the next step's boundary; one may die there, and the master waits again).

The float64 model has BatchNormalization(synchronized=True) (collectives in the forward
pass, statistics moved there), Adam, metrics; the training data is a ``PyDataset`` shuffled
anew each epoch with a short last batch, the validation data arrays. ``ModelCheckpoint``
writes OUT/ckpt/w-EE.weights.h5 at each epoch's end and ``BackupAndRestore`` OUT/backup
(plain Keras removes it when fit ends). Rank 0 of the end writes the final weights and
History to OUT/result-<mode>.npz, and its recoveries to OUT/recoveries.json (seconds each
took, the wall-clock times the loop met each failure and the times this rank first knew of
each new generation); a killed rank writes the time of its kill to OUT/killed-<member>.
With GROW every rank writes its own result too, OUT/result-member<M>.npz.

``ELASTIC_DIE_TAKING_STATE=M`` (``ELASTIC_DIE_GIVING_STATE=M``): member ``M`` SIGKILLs
itself as it would take (give) the state of a joining rank, the other ranks in the broadcast.
``ELASTIC_JOIN_AFTER=M:H``: member ``M`` starts its runtime once member ``H`` holds the job's
state (it wrote OUT/holds-H after its first train step), so that ``M`` joins a job ``H`` is
part of, never together with it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np

mode, out = sys.argv[1], Path(sys.argv[2])
kills = [tuple(k.split(":")) for k in (sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else [])]
grow = [int(v) for v in sys.argv[4].split(":")] if len(sys.argv) > 4 else None
keras.config.set_floatx("float64")
keras.utils.set_random_seed(7)
# the rank this process started as, or the member id tnt run gave a process started later
me = int(os.environ.get("TNT_MEMBER_ID", os.environ.get("TNT_RANK", "0")))


def wait_for(condition, what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"member {me}: {what} did not happen within {seconds:g}s")
        time.sleep(0.01)


if mode == "tnt" and os.environ.get("ELASTIC_JOIN_AFTER", "").startswith(f"{me}:"):
    holder = out / f"holds-{os.environ['ELASTIC_JOIN_AFTER'].split(':')[1]}"
    wait_for(holder.exists, f"{holder.name}")
if mode == "tnt":
    import tarantella as tnt
    import tnt_core

if mode == "tnt" and os.environ.get("ELASTIC_DIE_TAKING_STATE") == str(me):
    # a joiner that dies as the master gives it the state (the others are in the broadcast)
    from tarantella.data_parallel.elastic import ElasticLoop

    ElasticLoop._take_state = lambda self, kind: die()
if mode == "tnt" and os.environ.get("ELASTIC_DIE_GIVING_STATE") == str(me):
    # a survivor that dies as the master gives a joiner the state
    from tarantella.data_parallel.elastic import ElasticLoop

    ElasticLoop._give_state = lambda self: die()

#: the epoch this rank is in (Killer keeps it; None before the first), its checkpoint writes
#: and the batches its input pipeline made in that epoch
where: dict = {"epoch": None, "writes": 0, "made": 0}


def _kills(phase: str) -> list[tuple[int, int, int]]:
    return [(int(m), int(e), int(b)) for m, p, e, b in kills if p == phase]


def die() -> None:
    if grow is not None:
        (out / "grow").touch()
    (out / f"killed-{me}").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


class Killer(keras.callbacks.Callback):
    def _maybe(self, phase: str, batch: int) -> None:
        for member, epoch, at in _kills(phase):
            in_epoch = phase == "predict" or epoch == where["epoch"]
            if member == me and in_epoch and at == batch:
                die()

    def on_epoch_begin(self, epoch, logs=None):
        where.update(epoch=epoch, writes=0, made=0)

    def on_train_batch_begin(self, batch, logs=None):
        self._maybe("train", batch)
        if (me, where["epoch"], batch) in _kills("hang"):
            (out / f"killed-{me}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if (grow is not None and where["epoch"] is not None and tnt.get_rank() == 0
                and (where["epoch"], batch) >= tuple(grow[1:])):
            runtime, deadline = tnt_core.init(), time.monotonic() + 120
            while runtime.size < grow[0] and runtime.newest_seen() == runtime.generation:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no rank joined within 120s ({runtime.size} ranks)")
                time.sleep(0.05)

    def on_train_batch_end(self, batch, logs=None):
        if not (out / f"holds-{me}").exists():  # a joiner's first step with the job's state
            (out / f"holds-{me}").touch()

    def on_test_batch_begin(self, batch, logs=None):
        self._maybe("test", batch)

    def on_predict_batch_begin(self, batch, logs=None):
        self._maybe("predict", batch)


rng = np.random.default_rng(3)
x = rng.normal(size=(230, 6))
y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(230, 1)) > 0).astype("float64")
vx, vy = x[:64] * 0.5, y[:64]


class Batches(keras.utils.PyDataset):
    """The training data as a user's PyDataset: shuffled anew each epoch, batches of 32 and a
    short last one."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0

    def __len__(self) -> int:
        return math.ceil(len(x) / 32)

    def __getitem__(self, index: int):
        if where["epoch"] is not None:  # not Keras' look at the first batches
            for member, epoch, at in _kills("input"):
                if member == me and (epoch, at) == (where["epoch"], where["made"]):
                    wait_for((out / f"writing-{epoch}").exists, "the master's checkpoint write")
                    die()
            where["made"] += 1
        rows = np.random.default_rng(self.epoch).permutation(len(x))[index * 32:(index + 1) * 32]
        return x[rows], y[rows]

    def on_epoch_end(self) -> None:
        self.epoch += 1


model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.BatchNormalization(synchronized=True),
                          keras.layers.Dense(1, activation="sigmoid")])
if mode == "tnt":
    last = model.layers[-1]  # written after the others: a kill here leaves a partial file
    save_layer = last.save_own_variables

    def save_own_variables(store):
        where["writes"] += 1
        if where["writes"] == 1:  # ModelCheckpoint's write (BackupAndRestore's comes next)
            epoch = where["epoch"]
            if any(m == me and e == epoch for m, e, _ in _kills("write")):
                die()
            if any(e == epoch + 1 for _, e, _ in _kills("input")):
                runtime = tnt_core.init()
                (out / f"writing-{epoch + 1}").touch()  # a rank dies now, in its input pipeline
                wait_for(lambda: runtime.newest_seen() > runtime.generation, "a rank's death")
        save_layer(store)

    last.save_own_variables = save_own_variables
    model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
              metrics=["accuracy", keras.metrics.AUC(name="auc")])

#: when this rank first knew of each generation after its first (wall clock, generation)
notices: list[tuple[float, int]] = []
done = threading.Event()
if mode == "tnt":
    def watch_generations() -> None:
        runtime = tnt_core.init()
        seen = runtime.newest_seen()
        while not done.wait(0.005):
            newest = runtime.newest_seen()
            if newest > seen:
                notices.append((time.time(), newest))
                seen = newest

    watcher = threading.Thread(target=watch_generations, daemon=True)
    watcher.start()

checkpoints = [keras.callbacks.ModelCheckpoint(str(out / "ckpt" / "w-{epoch:02d}.weights.h5"),
                                               save_weights_only=True),
               keras.callbacks.BackupAndRestore(str(out / "backup"))]
killer = [Killer()] if mode == "tnt" else []
history = model.fit(Batches(), epochs=3, validation_data=(vx, vy), callbacks=killer + checkpoints,
                    verbose=0)
evaluated = model.evaluate(vx, vy, batch_size=24, verbose=0, return_dict=True)
predicted = model.predict(vx, batch_size=20, verbose=0, callbacks=killer)
on_batch = model.predict_on_batch(vx[:9])
if mode == "tnt":  # ended before the runtime is: it holds it
    done.set()
    watcher.join()

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
        loop = model._tnt.elastic
        (out / "recoveries.json").write_text(json.dumps(
            {"recoveries": loop.recoveries, "failures": [seen for seen, _ in loop.events],
             "notices": notices, "size": tnt.get_size()}))
