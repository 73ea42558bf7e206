"""Single-process checks of tnt-keras' pieces (no launched ranks; fast).

The sharding arithmetic against ``tnt_core``'s for every rank, the plugin registration and
hook behaviour on foreign objects, callback placement, ``tnt.Model`` as the user's own model
and its errors, and the process set-up rules.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import types
import warnings
from typing import ClassVar

import keras
import numpy as np
import pytest
import tensorflow as tf

import tarantella as tnt
import tnt_core
from tarantella import callbacks as tcb
from tarantella import datasets, environment
from tarantella.data_parallel import batch_scaling, steps, xla
from tnt_keras_helpers import EchoPeerBackend


def _ids(ds) -> list[list[int]]:
    return [np.asarray(e[steps.BATCH_KEY]).tolist()[: int(e[steps.INFO_KEY][0])] for e in ds]


@pytest.mark.parametrize("size,global_batch,samples", [
    (size, batch, samples) for size in (1, 2, 3, 4, 5)
    for batch, samples in ((7, 23), (4, 9), (10, 31), (6, 6)) if batch >= size])
def test_shards_follow_tnt_core_and_rejoin_to_the_global_batch(size, global_batch, samples):
    base = tf.data.Dataset.range(samples).batch(global_batch)
    per_rank = []
    for rank in range(size):
        ctx = tnt_core.ShardContext(rank=rank, size=size, global_batch_size=global_batch)
        per_rank.append(_ids(datasets.shard_dataset(base, ctx)))
    serial = [np.asarray(b).tolist() for b in base]
    for step, batch in enumerate(serial):
        parts = [r[step] for r in per_rank]
        assert [len(p) for p in parts] == tnt_core.micro_batch_sizes(len(batch), size, allow_empty=True)
        for rank, part in enumerate(parts):
            assert part == batch[tnt_core.micro_batch_slice(len(batch), rank, size, allow_empty=True)]
        assert [i for p in parts for i in p] == batch


def test_rank_without_samples_gets_a_stand_in_with_zero_weight():
    base = tf.data.Dataset.range(5).batch(4)  # last batch: 1 sample for 3 ranks
    ctx = tnt_core.ShardContext(rank=2, size=3, global_batch_size=4)
    last = list(datasets.shard_dataset(base, ctx))[-1]
    assert last[steps.INFO_KEY].numpy().tolist() == [0, 1]
    assert last[steps.BATCH_KEY].numpy().tolist() == [4], "one stand-in sample: no empty batch"


def test_any_batch_size_is_split_at_run_time():
    """No global batch size is read from the pipeline: every batch is split by its size."""
    ctx = tnt_core.ShardContext(rank=1, size=2)
    ds = tf.data.Dataset.range(20).batch(3).rebatch(5)
    assert _ids(datasets.shard_dataset(ds, ctx)) == [[3, 4], [8, 9], [13, 14], [18, 19]]


def test_scalar_datasets_are_refused_with_advice():
    with pytest.raises(tnt.DatasetError, match="batch it"):
        datasets.prepare_data(tf.data.Dataset.range(10))


def test_batch_size_with_a_dataset_is_refused_with_advice():
    with pytest.raises(tnt.DatasetError, match="tnt_micro_batch_size"):
        datasets.prepare_data(tf.data.Dataset.range(10).batch(5), batch_size=4)
    data = datasets.prepare_data(tf.data.Dataset.range(10), micro_batch_size=3)  # x 1 rank
    assert _ids(data.dataset) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_a_rank_on_one_cpu_reads_its_data_without_tf_datas_autotuning(monkeypatch):
    """On one CPU, tf.data's autotuning thread makes every epoch's new iterator wait up to
    its period (datasets.without_autotune_on_one_cpu): off there, unless the dataset's
    options decide."""
    x = np.zeros((8, 2), np.float32)
    chosen = tf.data.Options()
    chosen.autotune.enabled = True
    theirs = tf.data.Dataset.from_tensor_slices((x, x)).batch(4).with_options(chosen)
    monkeypatch.setattr(datasets, "cpus_of_this_process", lambda: 1)
    assert datasets.prepare_data(x, x, batch_size=4).dataset.options().autotune.enabled is False
    assert datasets.whole_batches(x, x, batch_size=4)[0].options().autotune.enabled is False  # pipeline
    assert datasets.prepare_data(theirs).dataset.options().autotune.enabled is True
    budget = tf.data.Options()
    budget.autotune.ram_budget = 2**30  # tuning asked for, though not enabled by name
    budgeted = tf.data.Dataset.from_tensor_slices((x, x)).batch(4).with_options(budget)
    assert datasets.prepare_data(budgeted).dataset.options().autotune.enabled is None
    monkeypatch.setattr(datasets, "cpus_of_this_process", lambda: 2)
    assert datasets.prepare_data(x, x, batch_size=4).dataset.options().autotune.enabled is None


def test_generators_are_accepted_as_keras_accepts_them():
    def gen():
        for i in range(3):
            yield np.full((2, 3), i, dtype=np.float32), np.zeros((2,), dtype=np.float32)

    data = datasets.prepare_data(gen())
    assert [e[steps.INFO_KEY].numpy().tolist() for e in data.dataset] == [[2, 2]] * 3


def test_plugin_is_registered_and_ignores_foreign_objects():
    eps = [ep for ep in importlib.metadata.entry_points(group="tnt") if ep.name == "keras"]
    assert eps and eps[0].value == "tarantella_plugin"
    pm = tnt_core.get_plugin_manager()
    ctx = tnt_core.ShardContext(rank=0, size=1, global_batch_size=2)
    assert pm.hook.tnt_shard_data(data=[1, 2, 3], context=ctx) is None
    assert pm.hook.tnt_wrap_callback(callback=object(), context={"rank": 0, "size": 1}) is None
    assert isinstance(pm.hook.tnt_shard_data(data=tf.data.Dataset.range(4).batch(2), context=ctx),
                      tf.data.Dataset)


def test_plugin_module_is_light():
    import subprocess
    import sys

    code = ("import sys, tarantella_plugin; "
            "print('tensorflow' in sys.modules, 'keras' in sys.modules, 'tarantella' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]


@pytest.mark.parametrize("rank", [0, 1])
def test_callback_placement(rank, tmp_path, monkeypatch):
    ctx = {"rank": rank, "size": 2}
    master = rank == 0

    def placed(cb):
        wrapped = tcb.wrap_callback(cb, ctx)
        if wrapped is cb:
            return "as-is"
        return "all" if wrapped.run_on_all_ranks else ("master" if wrapped._is_master else "silent")

    where = "master" if master else "silent"
    assert placed(keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))) == where
    assert placed(keras.callbacks.CSVLogger(str(tmp_path / "l.csv"))) == ("master" if master else "silent")
    assert placed(keras.callbacks.EarlyStopping()) == "all"
    assert placed(keras.callbacks.ReduceLROnPlateau()) == "all"
    assert placed(keras.callbacks.History()) == "as-is"
    assert placed(keras.callbacks.ProgbarLogger()) == ("as-is" if master else "silent")
    backup = tcb.wrap_callback(keras.callbacks.BackupAndRestore(str(tmp_path / "b")), ctx)
    assert backup._runs("on_train_begin") and backup._runs("on_epoch_end") == master
    monkeypatch.setenv("TNT_TENSORBOARD_ON_ALL_DEVICES", "true")
    tb = tcb.wrap_callback(keras.callbacks.TensorBoard(str(tmp_path / "tb")), ctx)
    assert tb.run_on_all_ranks and tb.keras_callback.log_dir.endswith(f"rank_{rank}")
    monkeypatch.setenv("TNT_TENSORBOARD_ON_ALL_DEVICES", "maybe")
    with pytest.raises(tnt_core.ConfigError, match="TNT_TENSORBOARD_ON_ALL_DEVICES"):
        tcb.wrap_callback(keras.callbacks.TensorBoard(str(tmp_path / "tb")), ctx)


def test_user_callback_wrapper():
    inner = keras.callbacks.LambdaCallback()
    wrapped = tnt.keras.callbacks.Callback(inner, aggregate_logs=False, run_on_all_ranks=False)
    assert wrapped.keras_callback is inner and not wrapped.run_on_all_ranks
    assert tcb.wrap_callback(wrapped, {"rank": 0, "size": 2}) is wrapped
    with pytest.raises(TypeError, match=r"keras\.callbacks\.Callback"):
        tnt.keras.callbacks.Callback(object())


def _mlp():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_tnt_model_is_the_users_keras_model():
    inner = _mlp()
    model = tnt.Model(inner)
    assert model is inner and model.keras_model is model
    assert isinstance(model, keras.Sequential) and isinstance(model, tnt.Model)
    assert model.__class__ is keras.Sequential, "Keras serializes it as a plain Sequential"
    assert tnt.Model(model) is model
    model.compile(optimizer="adam", loss="mse")
    assert model.compiled and isinstance(model.optimizer, keras.optimizers.Adam)
    config = model.get_config()
    assert keras.Sequential.from_config(config).count_params() == model.count_params()


class _NoXla(keras.layers.Layer):
    """A layer that tells Keras XLA cannot compile it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-only", "fake-gpu"])
@pytest.mark.parametrize("case", ["True", "False", "auto", "default", "uncompiled", "no-xla-layer",
                                  "determinism"])
def test_jit_compile_resolves_as_keras_resolves_it(case, gpu, monkeypatch):
    """The step compiles with XLA exactly when plain Keras' step would (``tarantella.data_parallel.xla``).
    On several ranks (or with a timeline) tarantella compiles the step's parts and Keras'
    own flag reads False (its outer function hosts the collectives); on one rank Keras
    compiles the whole step. A GPU is faked in the device list Keras reads, op determinism
    in the switch Keras reads."""
    devices = tf.config.list_physical_devices()
    if gpu:
        devices = [*devices, tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda device_type=None: [
        d for d in devices if device_type in (None, d.device_type)])
    if case == "determinism":
        switch = importlib.import_module("tensorflow.python.framework.config")  # Keras reads it
        monkeypatch.setattr(switch, "is_op_determinism_enabled", lambda: True)

    def make():
        layers = [keras.layers.Dense(2)] + ([_NoXla()] if case == "no-xla-layer" else [])
        model = keras.Sequential([keras.Input((3,)), *layers])
        if case != "uncompiled":
            kwargs = {} if case == "default" else {
                "jit_compile": {"True": True, "False": False}.get(case, "auto")}
            model.compile(optimizer="sgd", loss="mse", **kwargs)
        return model

    with warnings.catch_warnings(record=True) as keras_warned:
        warnings.simplefilter("always")
        plain = make()
        expected = bool(plain.jit_compile)
    with warnings.catch_warnings(record=True) as tnt_warned:
        warnings.simplefilter("always")
        model = tnt.Model(make())
    assert model.jit_compile is expected and model._tnt.xla is None, "one rank: Keras compiles"
    assert [str(w.message) for w in tnt_warned] == [str(w.message) for w in keras_warned], \
        "Keras' own warning (a layer or determinism refusing XLA), nothing else"
    if case == "auto" or (case == "default" and gpu):
        assert expected is gpu, "Keras: XLA by default on a machine with a GPU, not CPU-only"
    for size, timeline in ((2, ""), (1, "trace.json")):  # the step split around collectives
        other = make()
        config = types.SimpleNamespace(timeline=timeline, overlap=True)
        split = xla.take_jit_compile(other, types.SimpleNamespace(
            size=size, is_master=True, config=config))
        assert (split is not None) is expected and other.jit_compile is False


def test_one_rank_with_xla_trains_as_keras_with_xla():
    """One rank: Keras compiles the whole step with XLA, tarantella's part of it included
    (sparse gradients, synchronized BatchNormalization, predictions, a callback's own logs).
    The multi-rank proof is test_xla."""
    def make():
        keras.utils.set_random_seed(3)
        return keras.Sequential([
            keras.Input((4,), dtype="int32"), keras.layers.Embedding(10, 5),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Dense(3, activation="softmax")])

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.logs = []

        def on_epoch_end(self, epoch, logs=None):
            self.logs.append(dict(logs))

    rng = np.random.default_rng(2)
    x, y = rng.integers(0, 10, size=(23, 4)), rng.integers(0, 3, size=23)
    results = []
    for model in (make(), tnt.Model(make())):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=True)
        record = Record()
        callback = record if not isinstance(model, tnt.Model) else \
            tnt.keras.callbacks.Callback(record, aggregate_logs=False)
        history = model.fit(x, y, batch_size=6, epochs=2, verbose=0, shuffle=False,
                            callbacks=[callback])
        assert model.jit_compile is True
        results.append((history.history, record.logs, model.get_weights(),
                        model.predict(x, batch_size=5, verbose=0)))
    (h_keras, r_keras, w_keras, p_keras), (h_tnt, r_tnt, w_tnt, p_tnt) = results
    assert h_tnt.keys() == h_keras.keys() and len(r_tnt) == len(r_keras)
    for key in h_keras:
        np.testing.assert_allclose(h_tnt[key], h_keras[key], rtol=1e-6)
        np.testing.assert_allclose([r[key] for r in r_tnt], [r[key] for r in r_keras], rtol=1e-6)
    for a, b in zip(w_tnt, w_keras):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(p_tnt, p_keras, rtol=1e-6)


def test_unsupported_uses_raise_with_advice():
    with pytest.raises(TypeError, match=r"keras\.Model"):
        tnt.Model(object())
    with pytest.raises(TypeError, match="unexpected arguments"):
        tnt.Model(_mlp(), num_stages=2)
    with pytest.raises(tnt.NotSupportedError, match=r"not a parallel strategy; use .*ParallelStrategy\.DATA"):
        tnt.Model(_mlp(), parallel_strategy="tensor")


#: Keras' built-in losses that reduce per-sample terms (Dice and Tversky: one ratio per batch)
PER_SAMPLE_LOSSES = ("BinaryCrossentropy", "BinaryFocalCrossentropy", "CategoricalCrossentropy",
                     "CategoricalFocalCrossentropy", "CategoricalHinge", "CosineSimilarity", "Hinge",
                     "Huber", "KLDivergence", "LogCosh", "MeanAbsoluteError",
                     "MeanAbsolutePercentageError", "MeanSquaredError", "MeanSquaredLogarithmicError",
                     "Poisson", "SparseCategoricalCrossentropy", "SquaredHinge")


@pytest.mark.parametrize("weighted", (False, True))
def test_keras_loss_objects_added_with_add_loss_are_means(weighted):
    """A Loss object's default reduction divides by the size it reads from the shape: a
    mean over the samples (the guide's LogisticEndpoint); a loss over the whole batch (Dice,
    unweighted: weighted, its rows mix samples, which is not read, see points_to_consider)
    is not."""
    kinds = {}
    for name in PER_SAMPLE_LOSSES + (() if weighted else ("Dice",)):
        loss = getattr(keras.losses, name)()

        @tf.function
        def step(y, p, w, loss=loss, name=name):
            target = tf.cast(tf.argmax(p, -1), p.dtype) if name.startswith("Sparse") else y
            kinds[name] = batch_scaling.scaling(loss(target, p, w if weighted else None), [y, p, w])
            return p

        step.get_concrete_function(tf.TensorSpec((None, 4, 3)), tf.TensorSpec((None, 4, 3)),
                                   tf.TensorSpec((None,)))
    if not weighted:
        assert kinds.pop("Dice") is batch_scaling.Scaling.OTHER
    assert set(kinds.values()) == {batch_scaling.Scaling.MEAN}, kinds


def test_custom_steps_and_single_batches_run():
    class Custom(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self(x) - y) ** 2)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    model = tnt.Model(Custom())
    model.compile(optimizer="sgd")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 2), "float32")
    history = model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert set(history.history) == {"loss"}
    logs = model.train_on_batch(x, y, return_dict=True)
    assert set(logs) == {"loss"}


def test_ftrl_trains_like_serial_in_one_process():
    """Ftrl applied to the reduced gradient is the serial update; the multi-rank proof is
    the mlp-ftrl case of test_equivalence."""
    model = tnt.Model(_mlp())
    model.compile(optimizer=keras.optimizers.Ftrl(0.1), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, epochs=1, verbose=0)


def test_default_seed_is_tensorflows_own():
    from tensorflow.python.framework import random_seed

    assert environment.DEFAULT_SHUFFLE_SEED == random_seed.DEFAULT_GRAPH_SEED


@pytest.mark.parametrize("num_threads,cores,local_size,expected", [
    (None, 16, 4, 4), (None, 2, 4, 1), (3, 16, 4, 3), (None, 8, 1, 8)])
def test_intra_op_threads(num_threads, cores, local_size, expected):
    assert environment.intra_op_threads_for(num_threads, local_size, cores) == expected


def test_rank_api():
    assert tnt.get_size() == 1 and tnt.get_rank() == 0
    assert tnt.get_master_rank() == 0 and tnt.is_master_rank()


@pytest.fixture(scope="module", autouse=True)
def _stop_runtime_afterwards():
    """Importing tarantella started a (local) runtime in pytest's process; stop it so that
    tests of other packages that run later in this process start from a clean state."""
    yield
    tnt_core.shutdown()


def test_multi_output_model_matches_keras_in_one_process():
    """Two named outputs, one loss each (per-output loss metrics), dict targets."""
    def make():
        keras.utils.set_random_seed(3)
        inp = keras.Input((4,))
        h = keras.layers.Dense(5, activation="relu")(inp)
        out = {"cls": keras.layers.Dense(3, activation="softmax", name="cls")(h),
               "reg": keras.layers.Dense(1, name="reg")(h)}
        model = keras.Model(inp, out)
        model.compile(optimizer="adam", loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                      metrics={"cls": ["accuracy"], "reg": ["mae"]})
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(13, 4)).astype("float32")
    y = {"cls": rng.integers(0, 3, size=13), "reg": rng.normal(size=(13, 1)).astype("float32")}
    serial, dist = make(), tnt.Model(make())
    h_serial = serial.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
    h_dist = dist.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
    assert h_dist.history.keys() == h_serial.history.keys()
    for key, values in h_serial.history.items():
        np.testing.assert_allclose(h_dist.history[key], values, rtol=1e-5)
    for a, b in zip(dist.get_weights(), serial.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    p_serial, p_dist = serial.predict(x, batch_size=5, verbose=0), dist.predict(x, batch_size=5, verbose=0)
    assert p_dist.keys() == p_serial.keys()
    for key in p_serial:
        np.testing.assert_allclose(p_dist[key], p_serial[key], rtol=1e-5, atol=1e-7)
    e_serial = serial.evaluate(x, y, batch_size=5, verbose=0, return_dict=True)
    e_dist = dist.evaluate(x, y, batch_size=5, verbose=0, return_dict=True)
    assert e_dist == pytest.approx(e_serial, rel=1e-5)


class _GraphOfStep(keras.metrics.MeanSquaredError):
    """A metric that keeps the graph its ``update_state`` is traced into (the step's)."""

    graphs: ClassVar[list] = []

    def update_state(self, y_true, y_pred, sample_weight=None):
        if not tf.executing_eagerly():
            _GraphOfStep.graphs.append(tf.compat.v1.get_default_graph())
        return super().update_state(y_true, y_pred, sample_weight=sample_weight)


def _variable_writes(graph) -> int:
    return sum(op.type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
               for op in graph.get_operations())


def test_one_rank_runs_keras_step_as_it_is():
    """One rank has nothing to combine: its step is Keras' own (``steps.alone``), so it
    trains and logs bitwise as plain Keras, asks for no gradient reduction, and writes each
    variable as often as Keras' step does (summing the metric states over one rank wrote
    each of them twice more, with about 100 small ops per step). ``jit_compile=False``:
    under ``"auto"`` the update is XLA-compiled, which is round-off (test_compiled_update)."""
    def build():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(4)])

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")
    runs = []
    for wrap in (lambda m: m, tnt.Model):
        _GraphOfStep.graphs = []
        model = wrap(build())
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5, name="sgd"), loss="mse",
                      metrics=["mae", _GraphOfStep(name="mse_again")], jit_compile=False)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs.append((model, history.history, _GraphOfStep.graphs[-1]))
    (plain, plain_logs, plain_graph), (model, logs, graph) = runs
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert logs == plain_logs
    assert not model._tnt._reducers, "one rank asked for a gradient reduction"
    assert _variable_writes(graph) == _variable_writes(plain_graph) > 0


def test_one_rank_with_a_timeline_records_its_steps(tmp_path, monkeypatch):
    """``TNT_TIMELINE`` on one rank: the step keeps the reduction's marks (it is not Keras'
    step as it is there), so a trace is written with an optimizer span per step (one rank
    hands no bucket over, so it has no backprop span: that ends at the last bucket)."""
    from tarantella import timeline

    model = tnt.Model(keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)]))
    runtime = model._tnt.runtime
    path = tmp_path / "trace.json"
    monkeypatch.setattr(runtime, "config", dataclasses.replace(runtime.config, timeline=str(path)))
    monkeypatch.setattr(timeline, "_timeline", None)
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(48, 8)), rng.normal(size=(48, 4)), batch_size=16, verbose=0)
    timeline.close()
    spans = [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert spans.count("optimizer apply") == 3, spans


@pytest.mark.parametrize("steps_per_execution,policy", [(3, "float32"), (1, "mixed_float16")])
def test_steps_per_execution_and_mixed_precision(steps_per_execution, policy):
    """Several steps per tf.function call (a tf.while_loop around the step) and the loss
    scaling of mixed precision go through the distributed step unchanged."""
    def make():
        keras.utils.set_random_seed(1)
        keras.config.set_dtype_policy(policy)
        try:
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(3, activation="softmax", dtype="float32")])
        finally:
            keras.config.set_dtype_policy("float32")
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
        return model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(23, 6)).astype("float32"), rng.integers(0, 3, 23)
    serial, dist = make(), tnt.Model(make())
    h_serial = serial.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
    h_dist = dist.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
    for key, values in h_serial.history.items():
        np.testing.assert_allclose(h_dist.history[key], values, rtol=1e-5)
    for a, b in zip(dist.get_weights(), serial.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_list_inputs_and_outputs_match_keras_in_one_process():
    def make():
        keras.utils.set_random_seed(4)
        a, b = keras.Input((3,)), keras.Input((2,))
        h = keras.layers.Concatenate()([keras.layers.Dense(4)(a), b])
        model = keras.Model([a, b], [keras.layers.Dense(1, name="o1")(h),
                                     keras.layers.Dense(2, name="o2")(h)])
        model.compile(optimizer="sgd", loss=["mse", "mse"])
        return model

    rng = np.random.default_rng(1)
    x = [rng.normal(size=(11, 3)), rng.normal(size=(11, 2))]
    y = [rng.normal(size=(11, 1)), rng.normal(size=(11, 2))]
    serial, dist = make(), tnt.Model(make())
    h_serial = serial.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    h_dist = dist.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    for key, values in h_serial.history.items():
        np.testing.assert_allclose(h_dist.history[key], values, rtol=1e-5)
    p_serial, p_dist = serial.predict(x, batch_size=4, verbose=0), dist.predict(x, batch_size=4, verbose=0)
    assert len(p_dist) == len(p_serial) == 2
    for a, b in zip(p_dist, p_serial):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_failed_write_leaves_no_half_written_file_and_names_the_users_path(tmp_path):
    from tarantella import files

    target = tmp_path / "model.keras"
    target.write_bytes(b"the previous, complete checkpoint")

    def write_half_then_fail(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(f"disk full while writing {path}")

    with pytest.raises(OSError) as info:
        files.write_collectively(write_half_then_fail, target)
    assert str(target) in str(info.value) and "tnt-tmp" not in str(info.value)
    assert target.read_bytes() == b"the previous, complete checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["model.keras"], "the temporary file is gone"


def test_checkpoints_of_master_only_callbacks_are_written_atomically(tmp_path):
    """ModelCheckpoint runs on the master only; its save goes through tnt.Model.save, which
    writes locally there (no other rank waits) and atomically."""
    model = tnt.Model(_mlp())
    model.compile(optimizer="sgd", loss="mse")
    seen = []
    original = tnt.Model.save

    def spy(self, filepath, *args, **kwargs):
        from tarantella import files

        seen.append(files.writes_locally())
        return original(self, filepath, *args, **kwargs)

    tnt.Model.save = spy
    try:
        checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch-{epoch}.keras"))
        model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, epochs=2, verbose=0,
                  callbacks=[checkpoint])
    finally:
        tnt.Model.save = original
    assert seen == [True, True], "each checkpoint written by the master alone"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-1.keras", "epoch-2.keras"]
    assert keras.models.load_model(tmp_path / "epoch-2.keras").count_params() == model.count_params()


def test_keras_backup_metadata_interrupted_in_its_write_leaves_the_previous_file(tmp_path,
                                                                                   monkeypatch):
    """Where Keras' own BackupAndRestore runs (steps_per_execution above 1, an elastic
    data-parallel job), its training_metadata.json is written whole: a write that dies in the
    middle (here its json.dumps fails after Keras opened the file) leaves the previous
    epoch's file, where plain Keras leaves an empty one that a resumed fit cannot read."""
    from keras.src.callbacks import backup_and_restore

    class FailingSecondDump:
        calls = 0

        @staticmethod
        def dumps(value):
            FailingSecondDump.calls += 1
            if FailingSecondDump.calls == 2:
                raise OSError("killed in the middle of the write")
            return json.dumps(value)

        loads = staticmethod(json.loads)

    def fit(model, backup_dir):
        FailingSecondDump.calls = 0
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
        with monkeypatch.context() as m:
            m.setattr(backup_and_restore, "json", FailingSecondDump)
            with pytest.raises(OSError, match="killed in the middle"):
                model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, epochs=3, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(str(backup_dir))])
        return (backup_dir / "training_metadata.json").read_text()

    assert fit(_mlp(), tmp_path / "plain") == ""  # plain Keras: the file truncated
    written = fit(tnt.Model(_mlp()), tmp_path / "tnt")
    assert json.loads(written)["epoch"] == 1, written  # the first epoch's (Keras counts from 1)
    assert sorted(p.name for p in (tmp_path / "tnt").iterdir()) == [
        "latest.weights.h5", "training_metadata.json"]


def test_a_pydatasets_epoch_hooks_run_as_in_plain_keras():
    """Keras' fit and evaluate reset their epoch iterator first: a PyDataset's on_epoch_end
    runs before the first epoch and before each evaluation (one that reshuffles there would
    otherwise train on other batches)."""

    class Counting(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __len__(self):
            return 2

        def __getitem__(self, index):
            return np.full((2, 3), float(index)), np.ones((2, 2))

        def on_epoch_begin(self):
            self.calls.append("begin")

        def on_epoch_end(self):
            self.calls.append("end")

    def hooks(model):
        train, val = Counting(), Counting()
        model.compile(optimizer="sgd", loss="mse")
        model.fit(train, validation_data=val, epochs=2, verbose=0)
        model.evaluate(val, verbose=0)
        return train.calls, val.calls

    assert hooks(tnt.Model(_mlp())) == hooks(_mlp())


def test_a_pipelined_batch_checksum_sees_one_bit_and_ignores_the_reduction_order():
    """What the ranks of a pipelined model compare to know they read the same batch."""
    from tarantella.pipeline.batch_fingerprint import checksum as _checksum

    rng = np.random.default_rng(3)
    for array in (rng.random((64, 33), np.float32), rng.random(17), np.arange(9, dtype=np.int64),
                  rng.random(8).astype(np.float16), np.array([True, False]),
                  np.array([b"a", b"bc"])):
        assert _checksum(array) == _checksum(array.copy())
        if array.dtype.kind == "f":
            changed = array.copy()
            changed.flat[5] = np.nextafter(changed.flat[5], np.inf)
            assert _checksum(changed) != _checksum(array), array.dtype
            assert _checksum(array[::-1].copy()) == _checksum(array)  # order-free: a sum


def test_a_pipelined_steps_reductions_agree_once_then_exchange_once_per_step():
    """The loss's sum and the batch check of every pipelined step: a header exchange the
    first time, then only the data (one round trip instead of two), each result its own."""
    from tarantella.comm.step_reductions import StepReductions

    calls = []

    class Recorder(EchoPeerBackend):  # rank 0 of 2 whose peer agrees and adds nothing
        def allreduce_async(self, buf, op="sum"):
            calls.append("header" if buf.dtype == np.int64 else f"{op} {buf.size}")
            return tnt_core.CompletedHandle(buf)

    reductions = StepReductions(tnt_core.WatchedBackend(Recorder()))
    results = [(reductions.allreduce(np.ones(4) * step, "max"), reductions.allreduce([step + 0.5]))
               for step in range(3)]
    assert calls == ["header", "max 4", "header", "sum 1"] + ["max 4", "sum 1"] * 2
    assert [(list(m), list(s)) for m, s in results] == [([k] * 4, [k + 0.5]) for k in range(3)]


def test_warnings_for_a_users_call_name_the_users_line():
    """Keras' notice that ``shuffle`` is ignored for a dataset, raised while tarantella prepares
    the data, named ``tarantella/datasets.py``; it names the user's ``fit`` as in plain Keras.
    (The BatchNormalization warning, which needs 2 ranks: ``test_features``.)"""
    import sys

    model = tnt.Model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices((np.zeros((4, 3)), np.zeros((4,)))).batch(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        model.fit(data, shuffle=True, epochs=1, verbose=0)
    shuffle = [w for w in caught if "`shuffle=True` was passed" in str(w.message)]
    assert [(w.filename, w.lineno) for w in shuffle] == [(__file__, line)]


def test_a_joiner_keeps_the_results_of_the_calls_it_skips(monkeypatch):
    """A joiner skips the script's calls the job had finished, returning the master's
    results, and keeps them: should it become the master, a later joiner learns them from
    it (here a joiner that skips call 1, an evaluate, and replays call 2)."""
    from tarantella.data_parallel import joining

    book = joining.CallLedger()
    monkeypatch.setattr(joining, "_LEDGER", book)
    position = {"call": 2, "first_operation": 7, "done": 9, "kind": "train",
                "results": {1: {"loss": 0.5}}, "predictions": {}}
    replayed: list[dict] = []
    loop = types.SimpleNamespace(state=types.SimpleNamespace(
        runtime=types.SimpleNamespace(joined_late=True, rank=1)),
        greet=lambda: position, start_replay=replayed.append, done=7)
    assert joining.run_call(None, loop, "evaluate", lambda: pytest.fail("skipped")) == {"loss": 0.5}
    assert joining.run_call(None, loop, "fit", lambda: "history") == "history"
    assert replayed == [position]
    assert book.results == {1: {"loss": 0.5}, 2: "history"}
    assert book.describe(9, "train")["results"] == {1: {"loss": 0.5}, 2: "history"}


def test_survivors_copies_resume_at_the_newest_step_every_stage_has(tmp_path):
    """``tarantella.pipeline.rescue``: rank 3 (stage 1 of pipeline 1) died; ranks 0 and 2
    (stage 0) had begun step 5, rank 1 (stage 1) was still in step 4, so only step 4 has
    every stage. Each survivor wrote its last two copies; a restarted rank 3 takes rank 1's
    stage 1 at step 4 with its own seed stream, and every rank the lowest rank's metric and
    callbacks' state."""
    from tarantella.pipeline import rescue as step_rescue
    from tarantella.randomness import refold_seed_state

    def rank_state(stage: int, replica: int, rank: int):
        weight = keras.Variable(np.zeros((2, 3)), name=f"w{stage}")
        seeds = keras.random.SeedGenerator(7)
        metric = keras.Variable(np.zeros(()), name="total")
        history = keras.callbacks.History()
        return (weight, seeds, metric, history,
                step_rescue.StepCopies([weight, seeds.state], stage, replica, rank))

    ranks = {0: (0, 0), 2: (0, 1), 1: (1, 0)}  # survivor -> (stage, replica)
    steps = {0: (3, 4, 5), 2: (3, 4, 5), 1: (2, 3, 4)}
    for rank, (stage, replica) in ranks.items():
        weight, seeds, metric, history, copies = rank_state(stage, replica, rank)
        for step in steps[rank]:
            seeds.state.assign(refold_seed_state(np.array([7, step]), 0, replica))
            weight.assign(np.full((2, 3), 10.0 * stage + step))
            metric.assign(100.0 * rank + step)
            history.history = {"loss": [float(rank)]}
            copies.take((1, step), step // 2, [metric], [history])
            copies.take((1, step), 0, [], [])  # once per position: the epoch's first hook too
        assert copies.write(str(tmp_path)) == [(1, steps[rank][2]), (1, steps[rank][1])]
    (tmp_path / "tnt-rescue-000001-00000003" / "stage-1-rank-1.pkl").unlink()  # not written
    found = step_rescue.complete_positions(str(tmp_path), 2)
    assert [position for position, _ in found] == [(1, 4)]

    weight, seeds, metric, history, copies = rank_state(1, 1, 3)
    saves = step_rescue.load(found[0][1], copies, [metric], [history])
    assert saves == 2
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(weight), np.full((2, 3), 14.0))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(seeds.state),
                                  refold_seed_state(np.array([7, 4]), 0, 1))
    assert float(keras.ops.convert_to_numpy(metric)) == 4.0 and history.history == {"loss": [0.0]}
    step_rescue.remove_all(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
