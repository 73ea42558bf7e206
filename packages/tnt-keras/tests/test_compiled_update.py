"""A pipeline stage's optimizer update compiled with XLA (``tarantella.pipeline.compiled_update``),
single process: the same weights as Keras' update as TensorFlow ops, and an update XLA
cannot compile falls back to those ops (with a warning when ``jit_compile=True`` asked)."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tarantella.pipeline.compiled_update import CompiledUpdate, wants_xla


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
    with pytest.warns(UserWarning, match=r"jit_compile=True: XLA cannot compile this stage's "
                                         r"optimizer update \(HostSGD"):
        asked, _ = _train(HostSGD(0.1), compiled=True, explicit=True)
    for a, b, c in zip(quiet, asked, plain):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)


def test_jit_compile_false_keeps_the_update_as_tensorflow_ops():
    assert not wants_xla(False)
    assert wants_xla("auto") and wants_xla(True)
