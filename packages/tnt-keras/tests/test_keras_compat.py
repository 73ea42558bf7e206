"""Keras' private seams (``tarantella._keras_compat``) and what replaced the avoidable ones.

Each entry of ``_keras_compat`` is called here against the installed Keras, so a Keras
release that renames one fails this file by name (tox env ``tnt-keras-prevkeras`` runs it
on the previous Keras minor). The replacements of private names (``validation_split``, the
class-weight map, BatchNormalization's reduction axes, the global-seed check, the
compile check) are compared with plain Keras running the same calls, in one process.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tarantella as tnt
from tarantella import _keras_compat, environment
from tarantella.seams.overrides import instance_attributes

SRC = Path(__file__).resolve().parents[2]  # packages/


def test_private_keras_and_tensorflow_names_live_in_keras_compat_only():
    found = sorted(str(path.relative_to(SRC)) for path in SRC.glob("*/src/**/*.py")
                   if any(word in path.read_text() for word in ("keras.src", "tensorflow.python")))
    assert found == ["tnt-keras/src/tarantella/_keras_compat.py"], found


# -- the entries, against the installed Keras ---------------------------------------------------

def test_all_layers_walks_nested_models_and_attribute_layers():
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(2, name="held_as_attribute")

        def call(self, x):
            return self.inner(x)

    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, name="nested")])
    model = keras.Sequential([keras.Input((3,)), inner, Block()])
    names = [layer.name for layer in _keras_compat.all_layers(model)]
    assert {"nested", "held_as_attribute"} <= set(names) and model.name not in names


def test_is_op_determinism_enabled_reads_tensorflows_setting(monkeypatch):
    assert _keras_compat.is_op_determinism_enabled() is False
    from tarantella.data_parallel import compiled_update

    monkeypatch.setattr(_keras_compat, "is_op_determinism_enabled", lambda: True)
    assert not compiled_update.wants_compiled_update("auto")  # Keras' rule: no XLA with determinism


@pytest.mark.parametrize("kwargs,asked", [({}, True), ({"jit_compile": False}, False),
                                          ({"jit_compile": "auto", "run_eagerly": True}, False)])
def test_asks_auto_jit_compile_sees_what_keras_keeps_only_resolved(kwargs, asked):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with _keras_compat.asks_auto_jit_compile(model) as auto:
        model.compile(optimizer="sgd", loss="mse", **kwargs)
    assert bool(auto) is asked
    assert "_resolve_auto_jit_compile" not in vars(model)  # nothing stays on the model


def test_symbolic_build_builds_model_metrics_and_optimizer():
    model = keras.Sequential([keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    spec = (tf.TensorSpec((None, 3), tf.float32), tf.TensorSpec((None, 2), tf.float32))
    _keras_compat.symbolic_build(model, spec)
    assert model.built and model.optimizer.built and model.metrics_variables


def test_is_fit_validation_sees_fits_own_evaluate_call():
    calls = []

    class Recording(keras.Sequential):
        def evaluate(self, *args, **kwargs):
            calls.append(_keras_compat.is_fit_validation(kwargs))
            return super().evaluate(*args, **kwargs)

    model = Recording([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    model.fit(x, y, validation_data=(x, y), epochs=1, verbose=0)
    model.evaluate(x, y, verbose=0)
    assert calls == [True, False]


def test_batch_norm_moments_replaces_how_the_layer_computes_its_moments():
    layer = keras.layers.BatchNormalization(epsilon=0.0, center=False, scale=False)
    x = tf.constant(np.arange(12, dtype="float32").reshape(4, 3))
    layer.build(x.shape)
    seen = []

    def moments(inputs, mask=None):
        seen.append(inputs.shape)
        return tf.fill([3], 2.0), tf.fill([3], 4.0)

    with instance_attributes([_keras_compat.batch_norm_moments(layer, moments)]):
        out = layer(x, training=True)
    assert seen == [x.shape]
    np.testing.assert_allclose(out, (x - 2.0) / 2.0)
    assert "_moments" not in vars(layer), "the override is gone afterwards"


def test_producer_names_the_layer_that_made_a_tensor():
    inp = keras.Input((3,))
    dense = keras.layers.Dense(2)
    out = dense(inp)
    operation, node = _keras_compat.producer(out)
    assert operation is dense and node.operation is dense
    assert _keras_compat.producer(np.ones(3)) is None


def test_compile_owner_is_where_loading_looks_for_keras_compile(tmp_path):
    """A compile replaced on compile_owner() still counts as Keras' own: load_model compiles."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.save(tmp_path / "m.keras")
    owner = _keras_compat.compile_owner()
    original = vars(owner)["compile"]

    def compile(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    owner.compile = compile
    try:
        loaded = keras.models.load_model(tmp_path / "m.keras")
    finally:
        owner.compile = original
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)


def test_compiled_losses_weigh_and_sum_the_outputs_losses_and_track_each():
    inp = keras.Input((3,))
    model = keras.Model(inp, [keras.layers.Dense(2, name="a")(inp), keras.layers.Dense(1, name="b")(inp)])
    loss, weights = {"a": "mse", "b": "mae"}, {"a": 0.5, "b": 2.0}
    model.compile(optimizer="sgd", loss=loss, loss_weights=weights)
    x = np.random.default_rng(1).standard_normal((4, 3)).astype("float32")
    y = {"a": np.ones((4, 2), "float32"), "b": np.zeros((4, 1), "float32")}
    y_pred = model(x)
    expected = 0.5 * float(keras.losses.mean_squared_error(y["a"], y_pred[0]).numpy().mean()) \
        + 2.0 * float(keras.losses.mean_absolute_error(y["b"], y_pred[1]).numpy().mean())
    made = _keras_compat.new_compiled_loss(model, loss, weights)
    np.testing.assert_allclose(float(made(y, y_pred)), expected, rtol=1e-6)
    own = _keras_compat.compiled_loss(model)
    np.testing.assert_allclose(float(own(y, y_pred)), expected, rtol=1e-6)
    assert [m.name for m in own.metrics] == ["a_loss", "b_loss"] and own is not made


def test_variables_without_values_are_made_initialised_forgotten_and_released():
    keras.utils.set_random_seed(2)
    expected = keras.layers.Dense(3, name="normal")
    expected.build((None, 4))
    keras.utils.set_random_seed(2)
    with keras.StatelessScope(initialize_variables=False):
        assert _keras_compat.in_stateless_scope()
        layer = keras.layers.Dense(3, name="deferred")
        layer.build((None, 4))
    assert not _keras_compat.in_stateless_scope()
    kernel, bias = _keras_compat.own_variables(layer)
    assert [v.path for v in (kernel, bias)] == ["deferred/kernel", "deferred/bias"]
    assert not _keras_compat.has_value(kernel)
    _keras_compat.initialize_deferred(kernel)  # its own initializer and seed
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(expected.kernel))
    _keras_compat.forget_uninitialized([kernel, bias])
    with keras.StatelessScope():  # the exit initialises what waits: no longer these two
        pass
    assert not _keras_compat.has_value(bias)
    _keras_compat.release_value(kernel, lambda shape, dtype=None: np.full(shape, 7.0, dtype))
    assert not _keras_compat.has_value(kernel) and float(np.asarray(kernel)[0, 0]) == 7.0


def test_forgetting_custom_gradients_lets_a_traced_graph_and_its_variables_go():
    def trace(forget: bool) -> weakref.ref:
        v = tf.Variable(tf.ones((3,)))

        @tf.custom_gradient
        def double(x):
            return 2 * x, lambda dy: 2 * dy

        def step():
            with _keras_compat.forgetting_custom_gradients() if forget else contextlib.nullcontext():
                return double(v * 1.0)

        tf.function(step)()
        return weakref.ref(v.handle)

    # the objects of the tests before stay out of the collection (a full one of them took
    # 31 s in the suite); a cycle of the two traces' own objects is collected as before
    gc.freeze()
    try:
        kept, freed = trace(forget=False), trace(forget=True)
        gc.collect()
    finally:
        gc.unfreeze()
    assert kept() is not None, "TensorFlow no longer keeps a traced custom gradient: drop the entry"
    assert freed() is None


def test_run_after_makes_a_traced_op_wait_for_one_made_later():
    def run(edge: bool) -> float:
        v = tf.Variable(0.0)

        def step(x):
            # reads v in Python as soon as x is there, unless the edge makes it wait for the
            # assignment of a value that takes 0.2 s to come
            seen = tf.numpy_function(lambda x: np.float32(v.numpy() + x), [x], tf.float32,
                                     stateful=False)
            slow = tf.numpy_function(lambda: (time.sleep(0.2), np.float32(5.0))[1], [], tf.float32)
            written = v.assign(slow)
            if edge:
                _keras_compat.run_after([seen.op], [written.op])
            return seen

        return float(tf.function(step, autograph=False)(tf.constant(1.0)))

    assert (run(edge=False), run(edge=True)) == (1.0, 6.0)


def test_get_keras_mask_reads_a_layers_output_mask():
    x = np.array([[[1.0], [0.0]], [[0.0], [0.0]]], "float32")
    out = keras.layers.Masking(mask_value=0.0)(x)
    np.testing.assert_array_equal(_keras_compat.get_keras_mask(out), [[True, False], [False, False]])
    assert _keras_compat.get_keras_mask(tf.constant(x)) is None


def test_get_data_adapter_gives_keras_batches():
    x = np.arange(10, dtype="float32").reshape(10, 1)
    adapter = _keras_compat.get_data_adapter(x, x, None, batch_size=4, steps_per_epoch=None,
                                             shuffle=False, class_weight=None)
    sizes = [int(batch[0].shape[0]) for batch in adapter.get_tf_dataset()]
    assert sizes == [4, 4, 2] and adapter.num_batches == 3


# -- the replacements, against plain Keras -------------------------------------------------------

def _pair(build):
    """The same model twice, from the same seed: plain Keras, and distributed."""
    models = []
    for distributed in (False, True):
        keras.utils.set_random_seed(7)
        model = build()
        models.append(tnt.Model(model) if distributed else model)
    return models


def _same(a: keras.Model, b: keras.Model) -> None:
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


def test_validation_split_and_class_weights_as_keras():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(22, 4)).astype("float32")
    labels = rng.integers(0, 3, size=22)
    histories = []
    models = _pair(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]))
    for model in models:
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        histories.append(model.fit(x, labels, batch_size=5, epochs=2, validation_split=0.3,
                                   class_weight={0: 0.5, 2: 3.0}, shuffle=False, verbose=0).history)
    assert set(histories[0]) == set(histories[1]) == {"loss", "val_loss"}
    for key, values in histories[0].items():
        np.testing.assert_allclose(histories[1][key], values, rtol=1e-6, err_msg=key)
    _same(*models)
    onehot = np.eye(3, dtype="float32")[labels]
    for model in models:  # one-hot labels: a sample's class is its largest entry
        model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
        model.train_on_batch(x, onehot, class_weight={1: 2.0})
    _same(*models)
    with pytest.raises(ValueError, match=r"validation_split=0\.99: the 22 samples cannot be split"):
        models[1].fit(x, onehot, validation_split=0.99, verbose=0)


def test_synchronized_batch_norm_on_another_axis_as_keras():
    """The reduction axes come from ``layer.axis`` (here the middle one of three)."""
    def build():
        return keras.Sequential([keras.Input((3, 5)),
                                 keras.layers.BatchNormalization(axis=1, synchronized=True),
                                 keras.layers.Flatten(), keras.layers.Dense(2)])

    x = np.random.default_rng(1).normal(size=(12, 3, 5)).astype("float32")
    y = np.ones((12, 2), "float32")
    models = _pair(build)
    for model in models:
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    _same(*models)


def test_the_default_seed_is_set_only_when_the_user_set_none():
    try:
        tf.random.set_seed(None)
        environment._set_default_seed()
        assert tf.compat.v1.random.get_seed(0)[0] == environment.DEFAULT_SHUFFLE_SEED
        tf.random.set_seed(5)
        environment._set_default_seed()
        assert tf.compat.v1.random.get_seed(0)[0] == 5
    finally:
        tf.random.set_seed(environment.DEFAULT_SHUFFLE_SEED)  # as importing tarantella left it


@pytest.mark.parametrize("method", ["fit", "evaluate", "train_on_batch", "test_on_batch"])
def test_loops_before_compile_are_refused_as_keras_refuses_them(method):
    model = tnt.Model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    x, y = np.ones((4, 3), "float32"), np.ones((4, 2), "float32")
    with pytest.raises(ValueError, match=rf"^You must call `compile\(\)` before calling `{method}\(\)`\.$"):
        getattr(model, method)(x, y)
