"""Pipelined training steps (``tarantella.pipeline.stage.StageStep``) next to plain Keras.

``--mode serial``: one plain process, ``model.fit`` of the whole model for every case.
``--mode pipeline``: rank ``p`` of a launched job runs stage ``p`` of the same cases.
Each case writes ``<case>.npz`` (serial: every weight; pipeline: this stage's weights)
and ``<case>.json`` (the per-batch losses); the test compares them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import keras
import numpy as np

SAMPLES, BATCH, EPOCHS = 40, 16, 2  # batches of 16, 16 and a last one of 8
#: (name, partitions, optimizer, micro-batches, schedule)
CASES = [(f"p{p}-{opt}-m{m}-{schedule}", p, opt, m, schedule) for p in (3,)
         for opt in ("sgd", "adam") for m in ((1, 4, 3) if opt == "sgd" else (3,))
         for schedule in (("1f1b", "gpipe") if m == 3 else ("1f1b",))]
#: global_clipnorm: the stages agree on the whole model's gradient norm
CASES.append(("p3-adamclip-m3-1f1b", 3, "adamclip", 3, "1f1b"))
#: mixed_float16: loss scaling, the stages skipping a non-finite step together
CASES.append(("p3-mixed-m1-1f1b", 3, "mixed", 1, "1f1b"))  # float16 sums: one micro-batch
#: ZB-H1 with a last partition of wide Dense layers: its stage joins its W after its last B
#: (their inputs hold less than the weight-sized sums they save: StageStep._defers_weights)
CASES.append(("p3-adam-m4-zb-h1-wide", 3, "adam", 4, "zb-h1"))


def wide(name: str) -> bool:
    return name.endswith("-wide")


def build(partitions: int, wide: bool = False) -> keras.Model:
    """A model with ``partitions - 1`` cuts: a branch and a merge inside a partition,
    two tensors across the first cut, weight regularisation after it; ``wide``: two
    Dense layers of 128 units before the output."""
    keras.utils.set_random_seed(11)
    import tarantella as tnt

    split = tnt.keras.layers.SplitLayer
    inp = keras.Input((6,), name="x")
    a = keras.layers.Dense(12, activation="tanh", name="a")(inp)
    b = keras.layers.Dense(4, activation="relu", name="b")(inp)
    a, b = split(name="cut1")([a, b])
    h = keras.layers.Concatenate(name="join")([a, b])
    h = keras.layers.Dense(10, activation="tanh", name="c",
                           kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    if partitions == 3:
        h = split(name="cut2")(h)
    h = keras.layers.Dense(128 if wide else 8, activation="relu", name="d")(h)
    if wide:
        h = keras.layers.Dense(128, activation="relu", name="e")(h)
    out = keras.layers.Dense(3, name="out")(h)
    return keras.Model(inp, out, name="net")


def optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    if name == "mixed":  # a scale so large that the first steps overflow and are skipped
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(learning_rate=0.01),
                                                   initial_scale=2.0 ** 18)
    if name == "adamclip":  # a norm the gradients exceed: the clip acts in every step
        return keras.optimizers.Adam(learning_rate=0.01, global_clipnorm=0.05)
    return keras.optimizers.Adam(learning_rate=0.01)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((SAMPLES, 6)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2], x[:, 3:].sum(1)], axis=1).astype(np.float32)
    return x, y


def batches():
    x, y = data()
    for _ in range(EPOCHS):
        for start in range(0, SAMPLES, BATCH):
            yield x[start:start + BATCH], y[start:start + BATCH]


def serial(out: Path) -> None:
    for name, partitions, opt, _, _ in CASES:
        keras.config.set_dtype_policy("mixed_float16" if opt == "mixed" else "float32")
        model = build(partitions, wide(name))
        model.compile(optimizer=optimizer(opt), loss="mse")
        losses = [float(model.train_on_batch(bx, by)) for bx, by in batches()]
        np.savez(out / f"{name}.npz", **{w.path: np.asarray(w) for w in model.weights})
        (out / f"{name}.json").write_text(json.dumps({"losses": losses}))


def pipeline(out: Path) -> None:
    import tarantella as tnt  # noqa: F401 - starts the runtime
    import tnt_core
    from tarantella.pipeline.partition import partition
    from tarantella.pipeline.stage import StageStep

    runtime = tnt_core.init()
    backend, rank = runtime.backend, runtime.rank
    for name, partitions, opt, micro, schedule in CASES:
        if partitions != runtime.size:
            continue
        keras.config.set_dtype_policy("mixed_float16" if opt == "mixed" else "float32")
        model = build(partitions, wide(name))
        step = StageStep(partition(model), rank, backend, loss=keras.losses.MeanSquaredError(),
                         optimizer=optimizer(opt), num_micro_batches=micro, schedule=schedule)
        losses = []
        for bx, by in batches():
            part = np.array([step.train(bx, by)], dtype=np.float64)
            losses.append(float(backend.allreduce(part)[0]))  # the stages' parts of the loss
        local = {w.path: np.asarray(w) for w in step.model.weights}
        np.savez(out / f"{name}.rank{rank}.npz", **local)
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(
            {"losses": losses, "params": step.parts.param_count(rank),
             "joined_weights": step.joined_weights}))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "pipeline"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    serial(args.out) if args.mode == "serial" else pipeline(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
