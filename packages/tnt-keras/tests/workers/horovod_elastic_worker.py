"""A Horovod elastic custom loop, as Horovod's TensorFlow 2 example writes it, with one rank
SIGKILLed: ``horovod_elastic_worker.py OUT MEMBER:BATCH[,MEMBER:BATCH...]``.

The process that started as rank ``MEMBER`` kills itself as batch ``BATCH`` begins. Every
step trains one global batch of ``GLOBAL`` rows, split evenly over the ranks there are at
that moment (``GLOBAL`` divides by 3, 2 and 1); ``hvd.DistributedGradientTape`` averages
the ranks' gradients of their mean losses, which is the gradient of the global batch's mean
loss: every step is serial training's step on that global batch, on any number of ranks.
The state is committed after every second batch, so the survivors roll back over a batch
that was done but not committed, and redo it: the result equals serial training only if
the rollback restored the weights, Adam's slots and step counter, and ``state.batch``.

The traced step has a shape-free signature: it is traced once, at 3 ranks, and runs at 2
after the failure (what tarantella must reach then is the new communicator and size).

Rank 0 of the end trains the same sequence in plain TensorFlow (a tape, Adam, the global
batches; from the same initial weights) and writes both to ``OUT/result.npz``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tarantella.horovod.tensorflow as hvd  # the one line changed: `import horovod.tensorflow as hvd`

out = Path(sys.argv[1])
kills = {tuple(int(v) for v in kill.split(":")) for kill in sys.argv[2].split(",")}
me = int(os.environ["TNT_RANK"])  # the rank this process started as: its member id
keras.config.set_floatx("float64")
keras.utils.set_random_seed(7)

STEPS, GLOBAL, FEATURES = 8, 12, 5
rng = np.random.default_rng(3)
x_all = rng.normal(size=(STEPS * GLOBAL, FEATURES))
y_all = x_all @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(STEPS * GLOBAL, 1))


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def global_batch(b: int) -> tuple[np.ndarray, np.ndarray]:
    return x_all[b * GLOBAL:(b + 1) * GLOBAL], y_all[b * GLOBAL:(b + 1) * GLOBAL]


hvd.init()
model = make_model()
initial = [w.copy() for w in model.get_weights()]
opt = keras.optimizers.Adam(0.05)
opt.build(model.trainable_variables)
loss_fn = keras.losses.MeanSquaredError()
spec = [tf.TensorSpec([None, FEATURES], tf.float64), tf.TensorSpec([None, 1], tf.float64)]


@tf.function(input_signature=spec)
def training_step(x, y):
    with tf.GradientTape() as tape:
        loss_value = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return hvd.allreduce(loss_value)  # the average of the ranks' means: the global batch's


calls: list[int] = []
losses: dict[int, float] = {}
reset_sizes: list[int] = []


@hvd.elastic.run
def train(state):
    while state.batch < STEPS:
        b = state.batch
        if (me, b) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = global_batch(b)
        share = GLOBAL // hvd.size()
        calls.append(b)
        rows = slice(hvd.rank() * share, (hvd.rank() + 1) * share)
        losses[b] = float(training_step(x[rows], y[rows]))
        state.batch = b + 1
        if state.batch % 2 == 0:
            state.commit()


state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
state.register_reset_callbacks([lambda: reset_sizes.append(hvd.size())])
train(state)

if hvd.rank() == 0:
    serial = make_model()
    serial.set_weights(initial)
    serial_opt = keras.optimizers.Adam(0.05)
    serial_losses = []
    for b in range(STEPS):
        x, y = global_batch(b)
        with tf.GradientTape() as tape:
            loss_value = keras.losses.MeanSquaredError()(y, serial(x, training=True))
        grads = tape.gradient(loss_value, serial.trainable_variables)
        serial_opt.apply_gradients(zip(grads, serial.trainable_variables))
        serial_losses.append(float(loss_value))
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "result.npz", calls=np.array(calls), reset_sizes=np.array(reset_sizes),
             size=hvd.size(), traces=training_step.experimental_get_tracing_count(),
             losses=np.array([losses[b] for b in range(STEPS)]), serial_losses=np.array(serial_losses),
             iterations=int(opt.iterations), serial_iterations=int(serial_opt.iterations),
             **{f"w{i}": w for i, w in enumerate(model.get_weights())},
             **{f"serial_w{i}": w for i, w in enumerate(serial.get_weights())})
