"""The optimizer's update compiled with XLA (``tarantella.data_parallel.compiled_update``),
single process: the same weights as Keras' update as TensorFlow ops, an update XLA cannot
compile falls back to those ops (with a warning when ``jit_compile=True`` asked), and a
data-parallel ``tnt.Model`` compiles it under ``jit_compile="auto"`` only."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tarantella as tnt
from tarantella.data_parallel import compiled_update
from tarantella.data_parallel.compiled_update import CompiledUpdate, wants_compiled_update


class HostSGD(keras.optimizers.SGD):
    """SGD whose step passes through a NumPy function: an op XLA cannot compile."""

    def update_step(self, gradient, variable, learning_rate):
        through = tf.numpy_function(lambda g: g, [gradient], gradient.dtype)
        variable.assign(variable - tf.cast(learning_rate, variable.dtype)
                        * tf.ensure_shape(through, gradient.shape))


def _train(optimizer, compiled: bool | None, explicit: bool = False):
    keras.utils.set_random_seed(2)
    weights = [keras.Variable(np.random.default_rng(i).standard_normal(shape), dtype="float64")
               for i, shape in enumerate([(6, 5), (5,)])]
    optimizer.build(weights)
    update = CompiledUpdate(optimizer, weights, explicit=explicit) if compiled else None

    @tf.function(autograph=False)
    def step(k):
        grads = [tf.sin(w * tf.cast(k, tf.float64)) for w in weights]
        if update is None:
            optimizer.apply(grads, weights)
        else:
            update(grads)
        return tf.constant(0)

    for k in range(1, 6):
        step(tf.constant(k))
    return [w.numpy() for w in weights], update


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.1),
                                  lambda: keras.optimizers.RMSprop(0.1, momentum=0.5)],
                         ids=["adam", "rmsprop"])
def test_the_compiled_update_gives_keras_update(make):
    plain, _ = _train(make(), compiled=False)
    got, update = _train(make(), compiled=True)
    assert update.compiled is True
    for a, b in zip(got, plain):
        np.testing.assert_allclose(a, b, rtol=1e-14)


def test_an_update_xla_cannot_compile_runs_as_tensorflow_ops_and_warns_when_asked_for():
    plain, _ = _train(HostSGD(0.1), compiled=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet, update = _train(HostSGD(0.1), compiled=True)
    assert update.compiled is False and not caught  # jit_compile="auto": no warning
    with pytest.warns(UserWarning, match=r"jit_compile=True: XLA cannot compile this "
                                         r"optimizer's update \(HostSGD"):
        asked, _ = _train(HostSGD(0.1), compiled=True, explicit=True)
    for a, b, c in zip(quiet, asked, plain):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)


def test_checking_that_xla_compiles_the_update_leaves_no_op_in_the_step():
    """Asked for a compiler IR without a device, TensorFlow makes a random number to find
    its preferred device: traced into the step, that op would run every step."""
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    weights = [keras.Variable(np.ones((4, 3)), dtype="float32")]
    optimizer.build(weights)
    update = CompiledUpdate(optimizer, weights)

    @tf.function(autograph=False)
    def step():
        update([tf.ones((4, 3))])
        return tf.constant(0)

    graph = step.get_concrete_function().graph
    assert update.compiled is True
    kinds = {op.type for op in graph.get_operations()}
    assert kinds <= {"Placeholder", "Const", "StatefulPartitionedCall", "Identity", "NoOp"}, kinds


def test_jit_compile_false_keeps_the_update_as_tensorflow_ops():
    assert not wants_compiled_update(False)
    assert wants_compiled_update("auto") and wants_compiled_update(True)


def test_a_data_parallel_step_compiles_its_update_under_auto_only(monkeypatch):
    """One rank, float64: with compile's default (``"auto"``, which Keras resolves to no XLA
    on this machine) the step's update is the compiled function, within round-off of plain
    Keras; ``jit_compile=False`` keeps Keras' ops, bit for bit."""
    calls: list[bool] = []
    original = CompiledUpdate.__call__

    def spy(self, grads):
        out = original(self, grads)
        calls.append(bool(self.compiled))
        return out

    monkeypatch.setattr(compiled_update.CompiledUpdate, "__call__", spy)
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        def build():
            keras.utils.set_random_seed(5)
            return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                     keras.layers.Dense(3)])

        rng = np.random.default_rng(1)
        x, y = rng.normal(size=(48, 6)), rng.normal(size=(48, 3))
        plain = build()
        plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        plain.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
        trained = {}
        for jit_compile in ("auto", False):
            calls.clear()
            model = tnt.Model(build())
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit_compile)
            model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
            trained[jit_compile] = (model.get_weights(), list(calls))
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    weights, traced = trained["auto"]
    assert traced and all(traced), "the auto step did not run the compiled update"
    for a, b in zip(weights, plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    weights, traced = trained[False]
    assert not traced
    for a, b in zip(weights, plain.get_weights()):
        np.testing.assert_array_equal(a, b)
