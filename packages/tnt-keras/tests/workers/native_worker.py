"""The native gradient path against the Python path, and a peer's death under it.

Run on every rank of a launched job: ``python native_worker.py OUT_DIR CASE``.

* ``train``: trains small models with micro-batches of unequal size (global batch 7 on 2
  ranks: factors 4/7 and 3/7, so the scaled copy into the buckets is exercised), in
  float32 and float16, and saves the weights and which path each step took
  (``OUT_DIR/<path>-rank<r>.npz``, path from ``TNT_NATIVE_OPS``). Then the replicas of a
  pipeline stage: one stage (the whole model, uncut) on both ranks, each training on its
  share of every global batch (4 and 3 of 7, in 2 micro-batches), its gradients summed over
  a group split from the job by the stage's ``GradientReducer``; saved with the weights of
  plain Keras ``fit`` on the same batches.
* ``kill``: rank 1 SIGKILLs itself at the start of a step of the second epoch; rank 0 must
  end with the peer's failure (a CommError, exit code 75), not hang.
* ``hang``: rank 1 stops (sleeps) at the start of step 3 of the first epoch, so it never
  reaches that step's gradient allreduce; run under ``tnt run``, whose last line must name
  it (the stall inspector sees the native allreduces).
* ``mismatch``: the ranks are given different fusion thresholds (an operator's mistake), so
  their bucket plans differ: every rank must raise CollectiveMismatchError before any
  gradient moves, and write what it raised to ``OUT_DIR/mismatch-rank<r>.txt``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

if sys.argv[2:3] == ["mismatch"] and os.environ.get("TNT_RANK") == "1":
    os.environ["TNT_FUSION_THRESHOLD_KB"] = "0"  # rank 0 keeps the default: other buckets

import keras
import numpy as np

import tarantella as tnt
import tnt_core
from tarantella.gradients import GradientReducer
from tarantella.native_ops import NativeReducer
from tarantella.partition import partition
from tarantella.pipeline import StageStep


def _model(dtype: str) -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="tanh", dtype=dtype),
                             keras.layers.Dense(10, dtype=dtype), keras.layers.Dense(3, dtype=dtype)])


def _data(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(61, 12)).astype(dtype), rng.normal(size=(61, 3)).astype(dtype)


def train(out: Path) -> None:
    path = "python" if os.environ.get("TNT_NATIVE_OPS", "true") == "false" else "native"
    saved = {}
    for dtype in ("float32", "float16"):
        model = tnt.Model(_model(dtype))
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, name="sgd"), loss="mse")
        x, y = _data(dtype)
        model.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
        for i, w in enumerate(model.get_weights()):
            saved[f"{dtype}_{i}"] = w
        plans = list(model._tnt._reducers["train_sgd_0"]._plans.values())
        saved[f"{dtype}_native"] = np.array([isinstance(p, NativeReducer) for p in plans])
    saved.update(_stage_replicas())
    np.savez(out / f"{path}-rank{tnt.get_rank()}.npz", **saved)


def _functional() -> keras.Model:
    keras.utils.set_random_seed(7)
    inp = keras.Input((12,))
    h = keras.layers.Dense(24, activation="tanh")(inp)
    return keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(10)(h)))


def _stage_replicas() -> dict[str, np.ndarray]:
    runtime = tnt_core.init()
    rank, size = runtime.rank, runtime.size
    x, y = _data("float32")
    plain = _functional()
    plain.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    plain.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    group = runtime.backend.split(list(range(size)))
    reducer = GradientReducer(runtime, "stage0_replicas", group)
    step = StageStep(partition(_functional()), 0, group, loss=keras.losses.MeanSquaredError(),
                     optimizer=keras.optimizers.SGD(0.05, momentum=0.9), num_micro_batches=2,
                     replicas=reducer)
    for _ in range(2):
        for start in range(0, len(x), 7):
            bx, by = x[start:start + 7], y[start:start + 7]
            share = tnt_core.micro_batch_slice(len(bx), rank, size, allow_empty=True)
            step.train(bx[share], by[share], global_batch=len(bx))
    saved = {f"stage_{i}": w for i, w in enumerate(step.model.get_weights())}
    saved.update({f"serial_{i}": w for i, w in enumerate(plain.get_weights())})
    saved.update({f"initial_{i}": w for i, w in enumerate(_functional().get_weights())})
    saved["stage_native"] = np.array([isinstance(p, NativeReducer) for p in reducer._plans.values()])
    saved["stage_traces"] = np.array([step._replicas_sum.experimental_get_tracing_count()])
    return saved


def kill(out: Path) -> None:
    class Die(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if tnt.get_rank() == 1 and self.epoch == 1 and batch == 3:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    model = tnt.Model(_model("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05, name="sgd"), loss="mse")
    x, y = _data("float32")
    model.fit(x, y, batch_size=7, epochs=3, shuffle=False, verbose=0, callbacks=[Die()])
    (out / f"finished-rank{tnt.get_rank()}").write_text("the job went on without rank 1\n")


def hang(out: Path) -> None:
    class Hang(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if tnt.get_rank() == 1 and batch == 2:
                time.sleep(600)  # tnt run ends it once rank 0 has failed waiting

    model = tnt.Model(_model("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05, name="sgd"), loss="mse")
    x, y = _data("float32")
    model.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0, callbacks=[Hang()])
    (out / f"finished-rank{tnt.get_rank()}").write_text("the job went on without rank 1\n")


def mismatch(out: Path) -> None:
    import tnt_core

    model = tnt.Model(_model("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05, name="sgd"), loss="mse")
    x, y = _data("float32")
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except tnt_core.CollectiveMismatchError as exc:
        (out / f"mismatch-rank{tnt.get_rank()}.txt").write_text(f"{type(exc).__name__}: {exc}")
        return
    raise SystemExit("fit ran with different bucket plans on the ranks")


if __name__ == "__main__":
    {"train": train, "kill": kill, "hang": hang, "mismatch": mismatch}[sys.argv[2]](Path(sys.argv[1]))
