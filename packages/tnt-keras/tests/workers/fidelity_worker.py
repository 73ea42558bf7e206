"""Keras workflows as users write them, once in plain Keras and once with ``tnt.Model``.

``--mode serial``: plain Keras (the reference); ``--mode tnt``: the same code with the
model wrapped, on every rank. Each case writes ``<case>.<who>.npz`` (``w<i>`` weights,
``history``/``logs`` JSON, case-specific arrays); ``facts.<who>.json`` holds what is not
compared with serial (identity checks, errors, seed states). Cases run in float64 unless
the case is about precision (mixed precision), so round-off cannot hide a real difference.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import warnings
import zipfile

import numpy as np

CASES = ("dense3d_dataset", "dense3d_numpy", "unknown_cardinality", "generator", "pydataset",
         "rebatch_zip", "shuffle_seeded", "masked_loss", "reduction_sum", "weighted_mean",
         "custom_training", "two_optimizers", "two_outputs", "on_batch", "mixed_precision",
         "predict_loaded", "regularized", "synchronized_bn", "added_losses", "position_embedding")


def _jsonable(value):
    """History entries that are not floats (a custom step may log anything): arrays as lists,
    the rest (text) as its repr."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        return value.tolist()
    return repr(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    tnt_mode = args.mode == "tnt"
    if tnt_mode:
        import tarantella as tnt
    import keras
    import tensorflow as tf

    L = keras.layers  # noqa: N806 (Keras' own abbreviation)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    who = f"rank{tnt.get_rank()}" if tnt_mode else "serial"
    facts: dict = {}

    def wrap(model):
        return tnt.Model(model) if tnt_mode else model

    def save(case: str, model, history=None, **extra):
        result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        if history is not None:
            result["history"] = np.array(json.dumps(history.history, default=_jsonable))
        for k, v in extra.items():
            result[k] = np.array(json.dumps(v)) if isinstance(v, dict) else np.asarray(v)
        np.savez(os.path.join(out, f"{case}.{who}.npz"), **result)

    rng = np.random.default_rng(11)

    def seq_model(seed=1):
        keras.utils.set_random_seed(seed)
        inp = keras.Input((None, 4))  # every sequence model: Dense on a 3-D input
        h = L.Dense(6, activation="tanh")(inp)
        h = L.GlobalAveragePooling1D()(h)
        return keras.Model(inp, L.Dense(3, activation="softmax")(h))

    xs = rng.normal(size=(29, 5, 4))
    ys = rng.integers(0, 3, size=29)

    def mlp(seed=2, inputs=6, outputs=3, activation="softmax"):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((inputs,)), L.Dense(8, activation="relu"),
                                 L.Dense(outputs, activation=activation)])

    xm = rng.normal(size=(37, 6))
    ym = rng.integers(0, 3, size=37)

    def compiled(model, opt=None, loss="sparse_categorical_crossentropy", metrics=("accuracy",), **kw):
        model = wrap(model)
        model.compile(optimizer=opt or keras.optimizers.Adam(0.01), loss=loss, metrics=list(metrics), **kw)
        return model

    def run(case: str) -> None:
        # each case's own draws: a case's data must not depend on the cases run before it
        # (a launch may run a few of them; the serial run runs all)
        rng = np.random.default_rng([11, CASES.index(case)])
        if case == "dense3d_dataset":  # batched without drop_remainder: dynamic batch dim
            m = compiled(seq_model())
            h = m.fit(tf.data.Dataset.from_tensor_slices((xs, ys)).batch(6), epochs=2, verbose=0)
            save(case, m, h)
        elif case == "dense3d_numpy":
            m = compiled(seq_model())
            h = m.fit(xs, ys, batch_size=7, epochs=2, verbose=0, shuffle=False)
            save(case, m, h, predict=m.predict(xs, batch_size=5, verbose=0))
        elif case == "unknown_cardinality":  # .filter: Keras learns the length at the end
            ds = (tf.data.Dataset.from_tensor_slices((xm, ym)).filter(lambda x, y: y < 2)
                  .batch(5))
            m = compiled(mlp())
            h = m.fit(ds, epochs=4, verbose=0, validation_data=ds,
                      callbacks=[keras.callbacks.EarlyStopping(monitor="loss", patience=0)])
            ev = m.evaluate(ds, verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev)
        elif case == "generator":  # the docs' recipe and a plain Python generator
            def gen():
                for i in range(0, 37, 8):
                    yield xm[i:i + 8], ym[i:i + 8]

            sig = (tf.TensorSpec((None, 6), tf.float64), tf.TensorSpec((None,), tf.int64))
            m = compiled(mlp())
            h = m.fit(tf.data.Dataset.from_generator(gen, output_signature=sig), epochs=2, verbose=0)
            h2 = m.fit(gen(), epochs=1, verbose=0)
            save(case, m, h, history2=h2.history)
        elif case == "pydataset":
            class Batches(keras.utils.PyDataset):
                def __init__(self, **kw):
                    super().__init__(**kw)

                def __len__(self):
                    return 5

                def __getitem__(self, i):
                    return xm[i * 8:(i + 1) * 8], ym[i * 8:(i + 1) * 8]

            m = compiled(mlp())
            h = m.fit(Batches(workers=2), epochs=2, verbose=0, validation_data=Batches())
            ev = m.evaluate(Batches(), verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev, predict=m.predict(Batches(), verbose=0))
        elif case == "rebatch_zip":
            xs_ds = tf.data.Dataset.from_tensor_slices(xm).batch(4)
            ys_ds = tf.data.Dataset.from_tensor_slices(ym).batch(4)
            ds = tf.data.Dataset.zip((xs_ds, ys_ds)).rebatch(9)
            m = compiled(mlp())
            h = m.fit(ds, epochs=2, verbose=0)
            save(case, m, h)
        elif case == "shuffle_seeded":  # fit's default shuffle=True after set_random_seed
            m = compiled(mlp())
            keras.utils.set_random_seed(9)
            h = m.fit(xm, ym, batch_size=6, epochs=3, verbose=0, validation_split=0.2)
            save(case, m, h)
        elif case == "masked_loss":  # per-token loss; padding differs across ranks
            keras.utils.set_random_seed(4)
            tokens = rng.integers(1, 12, size=(21, 7))
            lengths = rng.integers(1, 8, size=21)
            for i, n in enumerate(lengths):
                tokens[i, n:] = 0
            labels = (tokens % 3).astype(np.int64)
            inp = keras.Input((7,), dtype="int64")
            h = L.Embedding(12, 5, mask_zero=True)(inp)
            h = L.Dense(6, activation="tanh")(h)
            model = keras.Model(inp, L.Dense(3, activation="softmax")(h))
            m = compiled(model, metrics=["accuracy"])
            h = m.fit(tokens, labels, batch_size=6, epochs=2, verbose=0, shuffle=False)
            ev = m.evaluate(tokens, labels, batch_size=5, verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev)
        elif case == "position_embedding":  # the Transformer guides' token and position lookups
            keras.utils.set_random_seed(5)

            class TokenAndPosition(L.Layer):
                def __init__(self, **kw):
                    super().__init__(**kw)
                    self.tokens, self.positions = L.Embedding(12, 6), L.Embedding(7, 6)

                def call(self, x):  # positions looked up with arange: the same rows for every sample
                    return self.tokens(x) + self.positions(keras.ops.arange(0, keras.ops.shape(x)[-1]))

            tokens = rng.integers(0, 12, size=(21, 7))
            inp = keras.Input((7,), dtype="int64")
            h = L.GlobalAveragePooling1D()(TokenAndPosition()(inp))
            m = compiled(keras.Model(inp, L.Dense(3, activation="softmax")(h)))
            h = m.fit(tokens, tokens[:, 0] % 3, batch_size=6, epochs=2, verbose=0, shuffle=False)
            save(case, m, h)
        elif case == "reduction_sum":
            m = compiled(mlp(), opt=keras.optimizers.SGD(0.001),
                         loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum"))
            h = m.fit(xm, ym, batch_size=7, epochs=2, verbose=0, shuffle=False)
            save(case, m, h)
        elif case == "weighted_mean":
            sw = rng.uniform(0.0, 2.0, size=37)
            m = compiled(mlp(), loss=keras.losses.SparseCategoricalCrossentropy(
                reduction="mean_with_sample_weight"))
            h = m.fit(xm, ym, sample_weight=sw, batch_size=7, epochs=2, verbose=0, shuffle=False)
            save(case, m, h)
        elif case == "custom_training":  # Keras' guide's custom steps, with logs of every kind
            class Custom(keras.Model):
                def train_step(self, data):
                    x, y = data
                    with tf.GradientTape() as tape:
                        y_pred = self(x, training=True)
                        loss = self.compute_loss(y=y, y_pred=y_pred)
                    self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                         self.trainable_variables)
                    for metric in self.metrics:
                        if metric.name == "loss":
                            metric.update_state(loss)
                        else:
                            metric.update_state(y, y_pred)
                    # compile_metrics' result is a dict: the logs nest
                    logs = {m.name: m.result() for m in self.metrics}
                    return {**logs, "batch": {"value": loss, "parts": [2.0 * loss, loss]}, "n": 3,
                            "note": "text", "none": None, "flag": tf.constant("on")}

                def test_step(self, data):
                    x, y = data
                    y_pred = self(x, training=False)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                    for metric in self.metrics:
                        if metric.name == "loss":
                            metric.update_state(loss)
                        else:
                            metric.update_state(y, y_pred)
                    return {m.name: m.result() for m in self.metrics}

            keras.utils.set_random_seed(6)
            inp = keras.Input((6,))
            h = L.Dense(8, activation="relu")(inp)
            m = wrap(Custom(inp, L.Dense(3, activation="softmax")(h)))
            m.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
            h = m.fit(xm, ym, batch_size=7, epochs=2, verbose=0, shuffle=False,
                      validation_data=(xm[:11], ym[:11]), validation_batch_size=4)
            ev = m.evaluate(xm, ym, batch_size=8, verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev)
        elif case == "two_optimizers":  # Keras' guide's GAN: no call(), two optimizers, trackers
            class Two(keras.Model):
                def __init__(self, **kw):
                    super().__init__(**kw)
                    self.a = keras.Sequential([keras.Input((6,)), L.Dense(4, activation="tanh")])
                    self.b = keras.Sequential([keras.Input((4,)), L.Dense(1)])
                    self.tracker_a = keras.metrics.Mean(name="loss_a")  # one value per step
                    self.tracker_b = keras.metrics.Mean(name="loss_b")  # weighted by samples

                @property
                def metrics(self):
                    return [self.tracker_a, self.tracker_b]

                def compile(self, opt_a, opt_b):
                    super().compile()
                    self.opt_a, self.opt_b = opt_a, opt_b

                def train_step(self, data):
                    x, y = data
                    y = tf.cast(tf.reshape(y, (-1, 1)), x.dtype)
                    with tf.GradientTape() as tape:
                        la = tf.reduce_mean((self.b(self.a(x)) - y) ** 2)
                    ga = tape.gradient(la, self.a.trainable_variables)
                    self.opt_a.apply(ga, self.a.trainable_variables)
                    with tf.GradientTape() as tape:
                        lb = tf.reduce_mean(tf.abs(self.b(self.a(x)) - y))
                    gb = tape.gradient(lb, self.b.trainable_variables)
                    self.opt_b.apply(gb, self.b.trainable_variables)
                    self.tracker_a.update_state(la)
                    self.tracker_b.update_state(lb, sample_weight=tf.shape(x)[0])
                    return {"loss_a": self.tracker_a.result(), "loss_b": self.tracker_b.result()}

            keras.utils.set_random_seed(8)
            m = wrap(Two())
            m.compile(keras.optimizers.SGD(0.05), keras.optimizers.Adam(0.01))
            h = m.fit(xm, ym.astype("float64"), batch_size=9, epochs=2, verbose=0, shuffle=False)
            save(case, m, h)
        elif case == "two_outputs":  # per-output losses and metrics, uneven batches everywhere
            keras.utils.set_random_seed(14)
            inp = keras.Input((6,))
            h = L.Dense(8, activation="relu")(inp)
            model = keras.Model(inp, {"cls": L.Dense(3, activation="softmax", name="cls")(h),
                                      "reg": L.Dense(1, name="reg")(h)})
            m = wrap(model)
            m.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                      loss_weights={"cls": 1.0, "reg": 0.5},
                      metrics={"cls": ["accuracy"], "reg": ["mae"]})
            yr = xm[:, :1] * 2.0
            xv = rng.normal(size=(60, 6))
            yv = {"cls": rng.integers(0, 3, size=60), "reg": xv[:, :1] * 2.0}
            h = m.fit(xm, {"cls": ym, "reg": yr}, batch_size=7, epochs=2, verbose=0,
                      shuffle=False, validation_data=(xv, yv), validation_batch_size=25)
            ev = m.evaluate(xv, yv, batch_size=25, verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev)
        elif case == "on_batch":
            m = compiled(mlp())
            logs = [m.train_on_batch(xm[i:i + 7], ym[i:i + 7], return_dict=True)
                    for i in range(0, 37, 7)]
            test = m.test_on_batch(xm[:10], ym[:10], return_dict=True)
            pred = m.predict_on_batch(xm[:10])
            save(case, m, None, logs={"train": [{k: float(v) for k, v in d.items()} for d in logs],
                                      "test": [{k: float(v) for k, v in test.items()}]},
                 predict=pred)
        elif case == "mixed_precision":  # float16 output: the loss scale overflows at times
            keras.config.set_floatx("float32")
            keras.mixed_precision.set_dtype_policy("mixed_float16")
            try:
                keras.utils.set_random_seed(10)
                model = keras.Sequential([keras.Input((6,)), L.Dense(16, activation="relu"),
                                          L.Dense(3, dtype="float16")])
                m = compiled(model, opt=keras.optimizers.SGD(0.1),
                             loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                m.optimizer.dynamic_growth_steps = 2  # many scale changes in a short run
                h = m.fit(xm.astype("float32"), ym, batch_size=7, epochs=3, verbose=0,
                          shuffle=False)
                save(case, m, h, iterations=int(m.optimizer.iterations.numpy()),
                     loss_scale=float(m.optimizer.dynamic_scale.numpy()))
            finally:
                keras.mixed_precision.set_dtype_policy("float64")
                keras.config.set_floatx("float64")
        elif case == "predict_loaded":  # predict first thing after loading, and uncompiled
            path = os.path.join(out, f"loaded.{who}.keras")
            plain = mlp()
            plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            plain.save(path)
            loaded = keras.models.load_model(path)
            if tnt_mode:
                loaded = tnt.models.load_model(path)
            pred = loaded.predict(xm, batch_size=8, verbose=0)
            raw = wrap(mlp())
            pred_uncompiled = raw.predict(xm, batch_size=8, verbose=0)
            ev = loaded.evaluate(xm, ym, batch_size=8, verbose=0, return_dict=True)
            save(case, loaded, None, predict=pred, predict_uncompiled=pred_uncompiled, evaluate=ev)
        elif case == "regularized":  # weight and activity regularizers, class weights
            keras.utils.set_random_seed(12)
            model = keras.Sequential([
                keras.Input((6,)),
                L.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01),
                        activity_regularizer=keras.regularizers.L1(0.001)),
                L.Dense(3, activation="softmax")])
            m = compiled(model)
            h = m.fit(xm, ym, batch_size=7, epochs=2, verbose=0, shuffle=False,
                      class_weight={0: 1.0, 1: 2.0, 2: 0.5})
            save(case, m, h)
        elif case == "synchronized_bn":  # the global batch's moments, forward and backward
            keras.utils.set_random_seed(13)
            inp = keras.Input((6,))
            # no bias before a normalisation (its gradient is zero: only round-off moves it)
            a = L.BatchNormalization(synchronized=True)(L.Dense(8, use_bias=False)(inp))
            b = L.BatchNormalization(synchronized=True)(L.Dense(8, use_bias=False)(inp))  # parallel
            h = L.Activation("relu")(L.Add()([a, b]))
            model = keras.Model(inp, L.Dense(3, activation="softmax")(h))
            m = compiled(model)
            h = m.fit(xm, ym, batch_size=8, epochs=2, verbose=0, shuffle=False)
            save(case, m, h, evaluate=m.evaluate(xm, ym, batch_size=8, verbose=0, return_dict=True))
        elif case == "added_losses":  # add_loss as Keras' guides write it; a metric of sums
            ops = keras.ops

            class ActivityRegularization(L.Layer):  # Keras' guide: a sum over the batch
                def call(self, inputs):
                    self.add_loss(1e-2 * ops.sum(inputs))
                    return inputs

            class Spread(L.Layer):  # a mean over the samples of per-sample sums
                def call(self, inputs):
                    self.add_loss(0.1 * ops.mean(ops.sum(ops.square(inputs), axis=-1)))
                    return inputs

            class LossObjects(L.Layer):  # Keras' Loss objects (the guide's LogisticEndpoint)
                def call(self, inputs):
                    self.add_loss(0.05 * keras.losses.MeanSquaredError()(ops.zeros_like(inputs), inputs))
                    self.add_loss(keras.losses.BinaryCrossentropy(from_logits=True)(
                        ops.ones_like(inputs[:, :1]), inputs[:, 1:2], sample_weight=ops.abs(inputs[:, 0])))
                    return inputs

            class MeanAbsOutput(keras.metrics.Metric):  # sums and counts; the ratio in result()
                def __init__(self, name="mean_abs_output", **kw):
                    super().__init__(name=name, **kw)
                    self.total = self.add_variable(shape=(), initializer="zeros", name="total")
                    self.count = self.add_variable(shape=(), initializer="zeros", name="count")

                def update_state(self, y_true, y_pred, sample_weight=None):
                    self.total.assign(self.total + ops.sum(ops.abs(y_pred)))
                    self.count.assign_add(ops.cast(ops.shape(y_pred)[0], self.count.dtype))

                def result(self):
                    return self.total / ops.maximum(self.count, 1.0)

            keras.utils.set_random_seed(15)
            model = keras.Sequential([
                keras.Input((6,)),
                L.Dense(8, activation="relu", activity_regularizer=keras.regularizers.L2(0.01)),
                ActivityRegularization(), Spread(), LossObjects(), L.Dense(3, activation="softmax")])
            m = compiled(model, metrics=("accuracy", MeanAbsOutput()))
            h = m.fit(xm, ym, batch_size=7, epochs=2, verbose=0, shuffle=False,
                      validation_data=(xm[:11], ym[:11]), validation_batch_size=4)
            ev = m.evaluate(xm, ym, batch_size=8, verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev)
        else:
            raise ValueError(case)

    keras.config.set_floatx("float64")
    keras.mixed_precision.set_dtype_policy("float64")
    selected = [c for c in CASES if not args.only or c in args.only.split(",")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in selected:
            run(case)
            print(f"{who} done {case}", flush=True)
    if tnt_mode:
        facts.update(_tnt_facts(tnt, keras, tf, out, who))
    with open(os.path.join(out, f"facts.{who}.json"), "w") as f:
        json.dump(facts, f)


def _tnt_facts(tnt, keras, tf, out: str, who: str) -> dict:
    """What only a tnt run can show: identity, nesting, saving, seeds, errors."""
    L = keras.layers  # noqa: N806 (Keras' own abbreviation)
    facts: dict = {}
    keras.utils.set_random_seed(3)
    base = keras.Sequential([keras.Input((4,)), L.Dense(5), L.Dropout(0.5), L.Dense(2)])
    m = tnt.Model(base)
    facts["same_object"] = m is base
    facts["isinstance"] = [isinstance(m, keras.Model), isinstance(m, keras.Sequential),
                           isinstance(m, tnt.Model)]
    outer = keras.Sequential([keras.Input((4,)), m, L.Dense(1)])  # nestable as a layer
    facts["nested_output_shape"] = list(outer(np.zeros((3, 4))).shape)
    m.compile(optimizer="sgd", loss="mse")
    seen = {}

    class See(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["model_is_m"] = self.model is m

    x = np.random.default_rng(0).normal(size=(16, 4))
    m.fit(x, np.zeros((16, 2)), batch_size=8, epochs=1, verbose=0, callbacks=[See()])
    facts.update(seen)
    seeds = [np.asarray(v).tolist() for v in m.variables if v.name == "seed_generator_state"]
    facts["seed_states"] = seeds
    shared = os.path.join(out, "shared")
    os.makedirs(shared, exist_ok=True)
    path = os.path.join(shared, "saved_by_keras_api.keras")
    if tnt.is_master_rank():  # Keras' own API writes where it is called: on the master only
        keras.saving.save_model(m, path)
        facts["saved_class"] = json.loads(zipfile.ZipFile(path).read("config.json"))["class_name"]
    path = os.path.join(shared, "saved_by_tnt.keras")
    m.save(path)  # a collective: the master writes, every rank returns once the file exists
    facts["tnt_saved_class"] = json.loads(zipfile.ZipFile(path).read("config.json"))["class_name"]
    export_dir = os.path.join(shared, "exported")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        m.export(export_dir)
    facts["export_printed"] = printed.getvalue()
    facts["export_dir"] = export_dir
    facts["export_exists"] = os.path.isdir(export_dir)
    facts["tmp_left"] = sorted(f for f in os.listdir(shared) if "tnt-tmp" in f)
    try:
        m.save(os.path.join(out, "no_such_dir", "model.keras"))
        facts["save_error"] = "no error"
    except Exception as exc:  # noqa: BLE001 (whatever it is, its message must name the user's path)
        facts["save_error"] = str(exc)
    # a model that depends on the rank: refused before any weight moves, on every rank
    odd = tnt.Model(keras.Sequential([keras.Input((3,)), L.Dense(4 + tnt.get_rank()), L.Dense(1)]))
    odd.compile(optimizer="sgd", loss="mse")
    try:
        odd.fit(np.zeros((8, 3)), np.zeros((8, 1)), batch_size=4, epochs=1, verbose=0)
        facts["differing_model"] = "trained"
    except ValueError as exc:
        facts["differing_model"] = str(exc)
    facts.update(_refusals(tnt, keras))
    return facts


def _refusals(tnt, keras) -> dict:
    """What cannot equal serial Keras is refused when the step is traced, with one line."""
    L = keras.layers  # noqa: N806 (Keras' own abbreviation)
    ops = keras.ops

    class RunningMax(keras.metrics.Metric):  # keeps a maximum
        def __init__(self, name="running_max", **kw):
            super().__init__(name=name, **kw)
            self.peak = self.add_variable(shape=(), initializer="zeros", name="peak")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.peak.assign(ops.maximum(self.peak, ops.max(y_pred)))

        def result(self):
            return self.peak

    class Ratio(keras.metrics.Metric):  # recomputes a ratio of its sums into a state
        def __init__(self, name="ratio", **kw):
            super().__init__(name=name, **kw)
            self.hits = self.add_variable(shape=(), initializer="zeros", name="hits")
            self.seen = self.add_variable(shape=(), initializer="zeros", name="seen")
            self.rate = self.add_variable(shape=(), initializer="zeros", name="rate")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.hits.assign_add(ops.sum(ops.cast(y_pred[:, 0] > 0.5, self.hits.dtype)))
            self.seen.assign_add(ops.cast(ops.shape(y_pred)[0], self.seen.dtype))
            self.rate.assign(self.hits / self.seen)

        def result(self):
            return self.rate

    class CategoricalTruePositives(keras.metrics.Metric):  # Keras' guide, as written there
        def __init__(self, name="categorical_true_positives", **kw):
            super().__init__(name=name, **kw)
            self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

        def update_state(self, y_true, y_pred, sample_weight=None):
            y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
            values = ops.cast(y_true, "int32") == ops.cast(y_pred, "int32")  # (n,) vs (n, 1)
            values = ops.cast(values, "float32")
            if sample_weight is not None:
                values = ops.multiply(values, ops.cast(sample_weight, "float32"))
            self.true_positives.assign_add(ops.sum(values))

        def result(self):
            return self.true_positives

    class SquaredMean(L.Layer):  # neither a mean nor a sum over the samples
        def call(self, inputs):
            self.add_loss(ops.square(ops.mean(inputs)))
            return inputs

    x, y = np.zeros((8, 4)), np.zeros((8,))
    out = {}
    for key, layers, metrics in (("metric_max", [], [RunningMax()]),
                                 ("metric_ratio", [], [Ratio()]),
                                 ("metric_pairs", [], [CategoricalTruePositives()]),
                                 ("added_loss_square", [SquaredMean()], [])):
        m = tnt.Model(keras.Sequential([keras.Input((4,)), *layers, L.Dense(1)]))
        m.compile(optimizer="sgd", loss="mse", metrics=metrics)
        try:
            m.fit(x, y, batch_size=4, epochs=1, verbose=0)
            out[key] = "trained"
        except tnt.NotSupportedError as exc:
            out[key] = str(exc)
    return out


if __name__ == "__main__":
    sys.exit(main())
