"""Keras-guide workflows pipelined on 2 and 3 stages, against plain Keras, in float64.

    python benchmarks/pipeline_corpus.py [--only mlp,lstm] [--write-docs]

Each workflow is a small script of the kind the keras.io guides teach (a Sequential MLP, the
functional API with several inputs and outputs, convolutional and residual networks, text
models with Embedding, LSTM, GRU, Conv1D and a Transformer block, sample and class weights,
validation_split, a custom layer with a regulariser, callbacks, mixed precision, sequence
bucketing). It runs once in plain Keras (one process, the reference) and once as
``tnt.Model(..., PIPELINING)`` on 2 and on 3 ranks (``tnt run``), with the same seed and
data, cut where a user would cut it: at SplitLayers, or automatically
(``num_pipeline_stages``). Everything runs in float64 (mixed precision excepted), so a
difference beyond round-off (1e-10 relative) is a defect, not float32 noise.

The table has per workflow and stage count the largest relative difference of the
weights (``get_weights`` after ``fit``, norm-relative per weight), of the History
(every key and epoch), and of ``evaluate`` and ``predict``; or the message with which the
pipelined model refused the workflow. ``--write-docs`` writes it into docs/pipelining.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

EXACT = 1e-10
STAGES = (2, 3)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "pipelining.md"
BEGIN, END = "<!-- pipeline-corpus: begin -->", "<!-- pipeline-corpus: end -->"


# -- the workflows (run in the reference process and on every rank) ----------------------------

class Run:
    """What a workflow gets: the stage count (0: plain Keras) and how to cut and wrap."""

    def __init__(self, stages: int) -> None:
        self.stages = stages

    @property
    def pipelined(self) -> bool:
        return self.stages > 0

    def cut(self, x: Any, plan: dict[int, set[int]], place: int) -> Any:
        """A SplitLayer at ``place`` if this stage count's ``plan`` has one there (plain
        Keras: the identity, which a SplitLayer is there)."""
        if not self.pipelined or place not in plan.get(self.stages, set()):
            return x
        import tarantella as tnt

        return tnt.keras.layers.SplitLayer()(x)

    def wrap(self, model: Any, micro_batches: int = 4, automatic: bool = False) -> Any:
        if not self.pipelined:
            return model
        import tarantella as tnt

        stages = {"num_pipeline_stages": self.stages} if automatic else {}
        return tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                         num_micro_batches=micro_batches, **stages)


def _tabular(n: int = 90, features: int = 12, seed: int = 0) -> tuple[Any, Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features))
    y = np.tanh(x[:, :3] @ rng.standard_normal((3, 1)))
    classes = (np.abs(x[:, 0] * 2).astype(np.int64) % 3)
    return x, y, classes


def _tokens(n: int = 90, length: int = 16, vocab: int = 50, seed: int = 1) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(1, vocab, (n, length)).astype(np.int32)
    return x, (x[:, :4].sum(axis=1) % 2).astype(np.float64)


def _images(n: int = 48, seed: int = 2) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 10, 10, 1))
    return x, (x.mean(axis=(1, 2, 3)) > 0).astype(np.int64)


def mlp(run: Run) -> Any:
    """Sequential MLP, Adam, validation_split; cut automatically."""
    import keras

    x, _, classes = _tabular()
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model = run.wrap(model, automatic=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, classes, batch_size=16, epochs=2, validation_split=0.2, verbose=0)
    return model, history, model.evaluate(x, classes, verbose=0), model.predict(x, verbose=0)


def multi_io(run: Run) -> Any:
    """Functional API: two inputs (features, tokens), two outputs with a loss dict,
    loss_weights and per-output metrics; SplitLayers."""
    import keras

    x, y, classes = _tabular()
    tokens, _ = _tokens()
    plan = {2: {1}, 3: {0, 1}}
    f_in, t_in = keras.Input((12,), name="features"), keras.Input((16,), name="tokens", dtype="int32")
    t = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(t_in))
    h = keras.layers.Concatenate()([keras.layers.Dense(16, activation="relu")(f_in), t])
    h = keras.layers.Dense(16, activation="relu")(run.cut(h, plan, 0))
    h = run.cut(h, plan, 1)
    score = keras.layers.Dense(1, name="score")(h)
    kind = keras.layers.Dense(3, name="kind")(keras.layers.Dense(8, activation="relu")(h))
    model = run.wrap(keras.Model({"features": f_in, "tokens": t_in}, {"score": score, "kind": kind}))
    model.compile(optimizer=keras.optimizers.RMSprop(0.005),
                  loss={"score": "mse",
                        "kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
                  loss_weights={"score": 1.0, "kind": 0.5},
                  metrics={"score": ["mae"], "kind": ["accuracy"]})
    data = {"features": x, "tokens": tokens}
    history = model.fit(data, {"score": y, "kind": classes}, batch_size=32, epochs=2, verbose=0)
    return (model, history, model.evaluate(data, {"score": y, "kind": classes}, verbose=0),
            model.predict(data, verbose=0))


def cnn_batchnorm(run: Run) -> Any:
    """The MNIST convnet of the guides: Conv2D, BatchNormalization, MaxPooling, Dropout."""
    return _convnet(run, batchnorm=True)


def cnn_dropout(run: Run) -> Any:
    """The same convnet without BatchNormalization: Conv2D, MaxPooling, Dropout."""
    return _convnet(run, batchnorm=False)


def _convnet(run: Run, batchnorm: bool) -> Any:
    import keras

    x, labels = _images()
    plan = {2: {0}, 3: {0, 1}}
    inp = keras.Input((10, 10, 1))
    h = keras.layers.Conv2D(8, 3, activation="relu")(inp)
    if batchnorm:
        h = keras.layers.BatchNormalization()(h)
    h = keras.layers.MaxPooling2D()(run.cut(h, plan, 0))
    h = keras.layers.Conv2D(8, 3, activation="relu")(h)
    h = keras.layers.Dropout(0.3)(keras.layers.Flatten()(run.cut(h, plan, 1)))
    model = run.wrap(keras.Model(inp, keras.layers.Dense(2)(h)))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, labels, batch_size=16, epochs=2, verbose=0)
    return model, history, model.evaluate(x, labels, verbose=0), model.predict(x, verbose=0)


def resnet(run: Run) -> Any:
    """A residual CNN (Conv2D blocks with Add, LayerNormalization); cut automatically
    between the blocks."""
    import keras

    x, labels = _images()
    inp = keras.Input((10, 10, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="stem")(inp)
    for i in range(3):
        r = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
        r = keras.layers.Conv2D(8, 3, padding="same")(r)
        h = keras.layers.LayerNormalization()(keras.layers.Add(name=f"block{i}")([h, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = run.wrap(keras.Model(inp, keras.layers.Dense(2)(h)), automatic=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, labels, batch_size=16, epochs=2, verbose=0)
    return model, history, model.evaluate(x, labels, verbose=0), model.predict(x, verbose=0)


def lstm(run: Run) -> Any:
    """Text classification: Embedding, LSTM, Dense; RMSprop; cut automatically."""
    import keras

    x, y = _tokens()
    model = keras.Sequential([keras.Input((16,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.LSTM(8), keras.layers.Dense(1, activation="sigmoid")])
    model = run.wrap(model, automatic=True)
    model.compile(optimizer=keras.optimizers.RMSprop(0.01), loss="binary_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


def gru_masked(run: Run) -> Any:
    """Embedding(mask_zero=True) on padded sequences, a bidirectional GRU, Dense; Adam;
    SplitLayers (the mask crosses the first cut)."""
    import keras

    x, y = _tokens()
    x[:, 12:] = 0  # padding
    plan = {2: {0}, 3: {0, 1}}
    inp = keras.Input((16,), dtype="int32")
    h = run.cut(keras.layers.Embedding(50, 8, mask_zero=True)(inp), plan, 0)
    h = run.cut(keras.layers.Bidirectional(keras.layers.GRU(6))(h), plan, 1)
    model = run.wrap(keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(h)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


def conv1d_adam(run: Run) -> Any:
    """Text classification with Embedding, Conv1D, GlobalMaxPooling1D; Adam (a sparse
    gradient with optimizer state); cut automatically."""
    import keras

    x, y = _tokens()
    model = keras.Sequential([keras.Input((16,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.Conv1D(8, 3, activation="relu"),
                              keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model = run.wrap(model, automatic=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


def transformer(run: Run) -> Any:
    """A Transformer block (the text-classification guide's): token and position
    embeddings (two Embedding layers in a layer of the user's, the positions looked up with
    ``arange``), MultiHeadAttention, LayerNormalization, a feed-forward part,
    GlobalAveragePooling1D; AdamW; SplitLayers."""
    return _transformer(run, gathered_positions=True)


def transformer_dense_positions(run: Run) -> Any:
    """The same block with the position table as a weight added whole (its gradient is
    dense) instead of looked up with an Embedding."""
    return _transformer(run, gathered_positions=False)


def _transformer(run: Run, gathered_positions: bool) -> Any:
    import keras

    x, y = _tokens()
    plan = {2: {1}, 3: {0, 1}}
    class TokenAndPosition(keras.layers.Layer):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(50, 8)
            if gathered_positions:
                self.positions = keras.layers.Embedding(16, 8)

        def build(self, shape: Any) -> None:
            if not gathered_positions:
                self.table = self.add_weight(shape=(16, 8), initializer="uniform")

        def call(self, x: Any) -> Any:
            if gathered_positions:
                return self.tokens(x) + self.positions(keras.ops.arange(keras.ops.shape(x)[-1]))
            return self.tokens(x) + self.table

    inp = keras.Input((16,), dtype="int32")
    h = run.cut(TokenAndPosition()(inp), plan, 0)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.LayerNormalization(epsilon=1e-6)(h + a)
    f = keras.layers.Dense(8)(keras.layers.Dense(16, activation="relu")(h))
    h = keras.layers.LayerNormalization(epsilon=1e-6)(h + f)
    h = run.cut(keras.layers.GlobalAveragePooling1D()(h), plan, 1)
    model = run.wrap(keras.Model(inp, keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(h))))
    model.compile(optimizer=keras.optimizers.AdamW(0.005),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, y.astype("int64"), batch_size=32, epochs=2, verbose=0)
    return model, history, model.evaluate(x, y.astype("int64"), verbose=0), model.predict(x, verbose=0)


def sample_weights(run: Run) -> Any:
    """fit with sample_weight and validation_data; weighted metrics; SGD with momentum;
    cut automatically."""
    import keras
    import numpy as np

    x, y, _ = _tabular()
    weights = np.linspace(0.2, 2.0, len(x))
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model = run.wrap(model, automatic=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                  weighted_metrics=["mae"])
    history = model.fit(x, y, sample_weight=weights, batch_size=16, epochs=2,
                        validation_data=(x[:20], y[:20], weights[:20]), verbose=0)
    return model, history, model.evaluate(x, y, sample_weight=weights, verbose=0), \
        model.predict(x, verbose=0)


def class_weights(run: Run) -> Any:
    """Imbalanced classification with class_weight (the guide's fraud example), Adam,
    metrics; cut automatically."""
    import keras

    x, _, classes = _tabular()
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model = run.wrap(model, automatic=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, classes, batch_size=16, epochs=2, class_weight={0: 1.0, 1: 3.0, 2: 0.5},
                        verbose=0)
    return model, history, model.evaluate(x, classes, verbose=0), model.predict(x, verbose=0)


def custom_layer(run: Run) -> Any:
    """A custom Layer (the "making new layers" guide's Linear, with add_weight) and Dense
    layers with an L2 kernel_regularizer and a bias_regularizer; Nadam; SplitLayers."""
    import keras

    @keras.saving.register_keras_serializable(package="corpus")
    class Linear(keras.layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = units

        def build(self, shape: Any) -> None:
            self.w = self.add_weight(shape=(shape[-1], self.units), initializer="random_normal",
                                     regularizer=keras.regularizers.L2(1e-3))
            self.b = self.add_weight(shape=(self.units,), initializer="zeros")

        def call(self, inputs: Any) -> Any:
            return keras.ops.tanh(keras.ops.matmul(inputs, self.w) + self.b)

    x, y, _ = _tabular()
    plan = {2: {0}, 3: {0, 1}}
    inp = keras.Input((12,))
    h = run.cut(Linear(16)(inp), plan, 0)
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2),
                           bias_regularizer=keras.regularizers.L1(1e-3))(h)
    h = run.cut(h, plan, 1)
    model = run.wrap(keras.Model(inp, Linear(1)(h)))
    model.compile(optimizer=keras.optimizers.Nadam(0.01), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return model, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


def callbacks(run: Run) -> Any:
    """ReduceLROnPlateau, EarlyStopping(restore_best_weights=True) and a
    LearningRateScheduler on validation_data, 6 epochs; cut automatically."""
    import keras

    x, y, _ = _tabular()
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model = run.wrap(model, automatic=True)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=6, validation_data=(x[:30] * 1.5, y[:30]),
                        verbose=0, callbacks=[
                            keras.callbacks.ReduceLROnPlateau(factor=0.5, patience=1, min_delta=1e-3),
                            keras.callbacks.EarlyStopping(patience=2, restore_best_weights=True),
                            keras.callbacks.LearningRateScheduler(
                                lambda epoch, lr: lr * (0.9 if epoch > 2 else 1.0))])
    return model, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


def bucketed(run: Run) -> Any:
    """Sequence bucketing with tf.data: bucket_by_sequence_length pads each batch to its
    own length (Input((None,)), Embedding(mask_zero=True), an LSTM); Adam. The dataset's
    size is asserted (assert_cardinality): see the unknown-size row."""
    return _bucketed(run, known_size=True)


def bucketed_unknown_size(run: Run) -> Any:
    """The same bucketed dataset without its size asserted."""
    return _bucketed(run, known_size=False)


def _bucketed(run: Run, known_size: bool) -> Any:
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(4)
    lengths = rng.integers(3, 15, 60)
    sequences = [rng.integers(1, 40, n).astype(np.int32) for n in lengths]
    labels = np.array([float(s[0] % 2) for s in sequences])

    def dataset() -> Any:
        data = tf.data.Dataset.from_generator(
            lambda: iter(zip(sequences, labels)),
            output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.float64)))
        data = data.bucket_by_sequence_length(lambda s, _: tf.shape(s)[0], [6, 10],
                                              [12, 12, 12], drop_remainder=False)
        if known_size:
            data = data.apply(tf.data.experimental.assert_cardinality(
                sum(1 for _ in data)))
        return data

    plan = {2: {0}, 3: {0, 1}}
    inp = keras.Input((None,), dtype="int32")
    h = run.cut(keras.layers.Embedding(40, 8, mask_zero=True)(inp), plan, 0)
    h = run.cut(keras.layers.LSTM(8)(h), plan, 1)
    model = run.wrap(keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(h)), micro_batches=3)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    history = model.fit(dataset(), epochs=2, verbose=0)
    return model, history, model.evaluate(dataset(), verbose=0), \
        model.predict(np.stack([s[:3] for s in sequences]), verbose=0)


def mixed_precision(run: Run) -> Any:
    """mixed_float16 (float16 compute, float32 weights, loss scaling) on the MLP, 4
    micro-batches; cut automatically. Float16 round-off: compared, not expected to be exact."""
    return _mixed_precision(run, 4)


def mixed_precision_one_micro_batch(run: Run) -> Any:
    """The same with one micro-batch: the serial sums, so exact (cut automatically)."""
    return _mixed_precision(run, 1)


def _mixed_precision(run: Run, micro_batches: int) -> Any:
    import keras

    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("mixed_float16")
    x, _, classes = _tabular()
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3, dtype="float32")])
    model = run.wrap(model, micro_batches=micro_batches, automatic=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, classes, batch_size=16, epochs=2, verbose=0)
    return model, history, model.evaluate(x, classes, verbose=0), model.predict(x, verbose=0)


def custom_train_step(run: Run) -> Any:
    """A Model subclass overriding train_step (the "customizing fit" guide)."""
    import keras
    import tensorflow as tf

    class Custom(keras.Model):
        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return self.compute_metrics(x, y, self(x), None)

    x, y, _ = _tabular()
    plan = {2: {0}, 3: {0, 1}}
    inp = keras.Input((12,))
    h = run.cut(keras.layers.Dense(8, activation="tanh")(inp), plan, 0)
    h = run.cut(keras.layers.Dense(8, activation="tanh")(h), plan, 1)
    model = run.wrap(Custom(inp, keras.layers.Dense(1)(h)))
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return model, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


WORKFLOWS: dict[str, Callable[[Run], Any]] = {
    "mlp": mlp, "multi_io": multi_io, "cnn_batchnorm": cnn_batchnorm, "cnn_dropout": cnn_dropout,
    "resnet": resnet, "lstm": lstm, "gru_masked": gru_masked, "conv1d_adam": conv1d_adam,
    "transformer": transformer, "transformer_dense_positions": transformer_dense_positions,
    "sample_weights": sample_weights, "class_weights": class_weights,
    "custom_layer": custom_layer, "callbacks": callbacks, "bucketed": bucketed,
    "bucketed_unknown_size": bucketed_unknown_size, "mixed_precision": mixed_precision,
    "mixed_precision_one_micro_batch": mixed_precision_one_micro_batch,
    "custom_train_step": custom_train_step,
}
#: why a workflow differs, where that is known and documented (docs/pipelining.md); any
#: other difference beyond round-off is a defect
KNOWN = {
    "cnn_dropout": "Dropout draws its masks per micro-batch: serial in distribution, not bitwise",
    "bucketed_unknown_size": "serial Keras' compiled step counts one optimizer step more each "
                             "time a dataset of unknown size runs out (eager Keras and the "
                             "pipeline count the steps taken); Adam reads the count",
    "transformer_dense_positions": "only MultiHeadAttention's key bias, whose gradient is zero "
                                   "up to round-off (the softmax ignores it) and which Adam "
                                   "scales to full steps; outputs and History exact",
    "mixed_precision": "float16 round-off: the micro-batches' sums in another order (one "
                       "micro-batch: the next row)",
}
#: how each workflow is cut (for the table)
CUTS = {name: ("automatic" if "automatic" in (fn.__doc__ or "") else "SplitLayer")
        for name, fn in WORKFLOWS.items()}


def run_workflows(stages: int, names: list[str], out: Path, rank: int) -> None:
    """Every workflow of ``names``, each result (or the refusal) written as soon as it is
    known, so that a launch that dies leaves the finished ones."""
    import keras
    import numpy as np

    for name in names:
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
        keras.utils.set_random_seed(7)
        tag = out / f"{name}.{stages}.rank{rank}"
        start = time.perf_counter()
        try:
            model, history, evaluation, predictions = WORKFLOWS[name](Run(stages))
            arrays = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
            arrays["evaluate"] = np.ravel(np.asarray(evaluation, np.float64))
            arrays.update({f"predict{i}": np.asarray(p) for i, p in
                           enumerate(keras.tree.flatten(predictions))})
            np.savez(f"{tag}.npz", **arrays)
            result = {"history": history.history}
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            result = {"error": f"{type(exc).__name__}: {first}",
                      "traceback": traceback.format_exc(limit=-3)}
        finally:
            keras.config.set_floatx("float32")
            keras.config.set_dtype_policy("float32")
        result["seconds"] = time.perf_counter() - start
        Path(f"{tag}.json").write_text(json.dumps(result, default=float))


# -- the parent: launches, comparison, table -------------------------------------------------

def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore", TNT_TIMEOUT_S="300")
    return env


def _launch(stages: int, names: list[str], out: Path) -> None:
    """Serial (``stages == 0``: one plain process) or ``tnt run -n stages``; a launch that
    dies (a rank crashed, a hang past the timeout) is restarted with the workflows it had
    not finished, the one it died in marked with the launch's last error line."""
    remaining = list(names)
    while remaining:
        script = [__file__, "--rank-main", "--stages", str(stages), "--out", str(out),
                  "--only", ",".join(remaining)]
        command = [sys.executable, *script] if stages == 0 else \
            [str(Path(sys.executable).with_name("tnt")), "run", "-n", str(stages), "--", *script]
        try:
            done = subprocess.run(command, env=_environment(), capture_output=True, text=True,
                                  timeout=1800)
            failure = "" if done.returncode == 0 else \
                (done.stderr.strip().splitlines() or [f"exited with code {done.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            failure = "the launch hung (killed after 1800 s)"
        finished = [n for n in remaining if (out / f"{n}.{stages}.rank0.json").exists()]
        remaining = [n for n in remaining if n not in finished]
        if remaining and failure:
            crashed = remaining.pop(0)
            (out / f"{crashed}.{stages}.rank0.json").write_text(json.dumps(
                {"error": f"the launch died: {failure}", "seconds": 0.0}))
        elif remaining:
            raise RuntimeError(f"launch of {stages} stages ended without {remaining}")


def _relative(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    scale = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / scale) if scale else float(np.linalg.norm(a - b))


def compare(name: str, stages: int, out: Path) -> dict[str, Any]:
    """One row: the pipelined ranks against the serial run."""
    import numpy as np

    ref = json.loads((out / f"{name}.0.rank0.json").read_text())
    row: dict[str, Any] = {"workflow": name, "stages": stages, "cut": CUTS[name]}
    if "error" in ref:
        return {**row, "verdict": f"serial Keras failed: {ref['error']}"}
    ref_arrays = dict(np.load(out / f"{name}.0.rank0.npz"))
    weights = history = outputs = 0.0
    for rank in range(stages):
        path = out / f"{name}.{stages}.rank{rank}.json"
        got = json.loads(path.read_text()) if path.exists() else {"error": "no result"}
        if "error" in got:
            return {**row, "verdict": f"refused: {got['error']}" if rank == 0 else
                    f"rank {rank}: {got['error']}"}
        arrays = dict(np.load(out / f"{name}.{stages}.rank{rank}.npz"))
        if set(arrays) != set(ref_arrays) or set(got["history"]) != set(ref["history"]):
            return {**row, "verdict": "DIFFERS: other weights or History keys"}
        weights = max([weights] + [_relative(arrays[k], v) for k, v in ref_arrays.items()
                                   if k.startswith("w")])
        outputs = max([outputs] + [_relative(arrays[k], v) for k, v in ref_arrays.items()
                                   if not k.startswith("w")])
        history = max([history] + [_relative(got["history"][k], v)
                                   for k, v in ref["history"].items()])
        row["seconds"] = got["seconds"]
    worst = max(weights, history, outputs)
    verdict = "exact" if worst <= EXACT else \
        f"differs: {KNOWN[name]}" if name in KNOWN else "DIFFERS (a defect)"
    return {**row, "weights": weights, "history": history, "outputs": outputs, "verdict": verdict}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workflow | stages | cut | weights | History | evaluate, predict | result |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        numbers = [f"{r[k]:.1e}" if k in r else "" for k in ("weights", "history", "outputs")]
        verdict = r["verdict"].replace("|", "\\|")
        lines.append(f"| {r['workflow']} | {r['stages']} | {r['cut']} | {' | '.join(numbers)} | "
                     f"{verdict} |")
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        raise SystemExit(f"{DOCS} has no {BEGIN} ... {END} block to write the table into")
    DOCS.write_text(doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated workflows (default: all)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"write the table into {DOCS.relative_to(DOCS.parent.parent)}")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(WORKFLOWS)
    unknown = [n for n in names if n not in WORKFLOWS]
    if unknown:
        parser.error(f"unknown workflows {unknown}; known: {', '.join(WORKFLOWS)}")
    if args.rank_main:
        rank = 0
        if args.stages:
            import tarantella as tnt  # before TensorFlow starts

            rank = tnt.get_rank()
        run_workflows(args.stages, names, Path(args.out), rank)
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        with ThreadPoolExecutor(len(STAGES) + 1) as pool:  # the stages wait on each other
            for future in [pool.submit(_launch, s, names, out) for s in (0, *STAGES)]:
                future.result()
        rows = [compare(n, s, out) for n in names for s in STAGES]
    text = table(rows)
    command = "python benchmarks/pipeline_corpus.py" + (f" --only {args.only}" if args.only else "")
    load = os.getloadavg()[0]
    footer = (f"`{command}`: float64 (mixed_precision: float32 weights, float16 compute), "
              f"gloo, {time.perf_counter() - start:.0f} s wall at load {load:.1f}; exact: "
              f"every difference <= {EXACT:.0e} relative.")
    print(text)
    print()
    print(footer)
    if args.write_docs:
        write_docs(f"{text}\n\n{footer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
