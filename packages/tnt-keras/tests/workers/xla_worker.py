"""Keras workflows compiled with ``jit_compile=True``, in plain Keras and with ``tnt.Model``.

``--mode serial``: plain Keras with XLA (the reference); ``--mode tnt``: the same code with
the model wrapped, on every rank of a 2-rank job (other sizes write nothing: the test runs
on 2 ranks). Each case writes ``<case>.<who>.npz`` (``w<i>`` weights, ``history`` JSON,
case-specific results); ``facts.<who>.json`` holds the warnings of the steps that run
without XLA and the structure of the traced steps (:func:`structure`). Cases are float32
(what XLA is used for) unless named float64.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

CASES = ("metrics_weights", "custom_accumulation", "masked_loss_scaling", "mixed_precision",
         "float64", "two_optimizers", "synchronized_bn")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    tnt_mode = args.mode == "tnt"
    out = os.path.abspath(args.out)
    if tnt_mode:
        import tarantella as tnt

        if tnt.get_size() != 2:
            return
        who = f"rank{tnt.get_rank()}"
    else:
        who = "serial"
    import keras
    import tensorflow as tf

    L = keras.layers  # noqa: N806 (Keras' own abbreviation)
    os.makedirs(out, exist_ok=True)
    facts: dict = {}

    def wrap(model):
        return tnt.Model(model) if tnt_mode else model

    def save(case: str, model, history=None, **extra):
        result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        if history is not None:
            result["history"] = np.array(json.dumps(history.history))
        for k, v in extra.items():
            result[k] = np.array(json.dumps(v)) if isinstance(v, (dict, list)) else np.asarray(v)
        np.savez(os.path.join(out, f"{case}.{who}.npz"), **result)

    rng = np.random.default_rng(21)
    x = rng.normal(size=(37, 6)).astype("float32")
    y = rng.integers(0, 3, size=37)
    sw = rng.uniform(0.2, 2.0, size=37).astype("float32")

    def mlp(seed: int, **dense):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((6,)), L.Dense(16, activation="tanh", **dense),
                                 L.Dense(3, activation="softmax")])

    def compiled(model, opt, **kw):
        model = wrap(model)
        kw.setdefault("loss", "sparse_categorical_crossentropy")
        kw.setdefault("metrics", ["accuracy"])
        model.compile(optimizer=opt, jit_compile=True, **kw)
        return model

    def run(case: str) -> None:
        if case == "metrics_weights":  # metrics, weighted metrics, sample weights, several
            # steps per execution, validation, evaluate and predict (the last batches uneven;
            # in fit, one sample: rank 1 has none)
            m = compiled(mlp(1), keras.optimizers.SGD(0.05, momentum=0.9), steps_per_execution=3,
                         weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w_acc")])
            h = m.fit(x[:33], y[:33], sample_weight=sw[:33], batch_size=8, epochs=3, verbose=0,
                      shuffle=False, validation_data=(x[:16], y[:16], sw[:16]))
            ev = m.evaluate(x, y, sample_weight=sw, batch_size=8, verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev, predict=m.predict(x, batch_size=8, verbose=0))
            if tnt_mode:
                facts["structure"] = {kind: structure(m, kind, (x[:8], y[:8], sw[:8]))
                                      for kind in ("train", "test", "predict")}
        elif case == "custom_accumulation":  # the user's step (its own loss and tracker); the
            # optimizer accumulates 3 steps' gradients (in XLA)
            class Custom(keras.Model):
                def __init__(self, **kw):
                    super().__init__(**kw)
                    self.d1, self.d2 = L.Dense(8, activation="relu"), L.Dense(3)
                    self.tracker = keras.metrics.Mean(name="my_loss")
                    self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

                def call(self, inputs):
                    return self.d2(self.d1(inputs))

                def train_step(self, data):
                    xb, yb = data
                    with tf.GradientTape() as tape:
                        loss = self.loss_fn(yb, self(xb, training=True))
                    grads = tape.gradient(loss, self.trainable_variables)
                    self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
                    self.tracker.update_state(loss, sample_weight=tf.shape(xb)[0])
                    return {"my_loss": self.tracker.result()}

            keras.utils.set_random_seed(6)
            model = Custom()
            model.build((None, 6))
            m = wrap(model)
            m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5,
                                                     gradient_accumulation_steps=3),
                      jit_compile=True)
            h = m.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
            save(case, m, h, iterations=int(m.optimizer.iterations.numpy()))
        elif case == "masked_loss_scaling":  # masked loss (its normaliser summed after the
            # body), sparse gradients, dynamic loss scaling (float32: exact to round-off)
            keras.utils.set_random_seed(5)
            tokens = rng.integers(1, 12, size=(21, 7))
            for i, n in enumerate(rng.integers(1, 8, size=21)):
                tokens[i, n:] = 0
            labels = (tokens % 3).astype(np.int64)
            inp = keras.Input((7,), dtype="int64")
            h = L.Dense(6, activation="tanh")(L.Embedding(12, 5, mask_zero=True)(inp))
            opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                      initial_scale=2.0**120, dynamic_growth_steps=2)
            m = compiled(keras.Model(inp, L.Dense(3, activation="softmax")(h)), opt)
            h = m.fit(tokens, labels, batch_size=6, epochs=2, verbose=0, shuffle=False)
            ev = m.evaluate(tokens, labels, batch_size=5, verbose=0, return_dict=True)
            save(case, m, h, evaluate=ev, iterations=int(m.optimizer.iterations.numpy()),
                 loss_scale=float(m.optimizer.dynamic_scale.numpy()))
        elif case == "mixed_precision":  # float16 compute, dynamic loss scaling
            keras.mixed_precision.set_dtype_policy("mixed_float16")
            try:
                keras.utils.set_random_seed(3)
                model = keras.Sequential([keras.Input((6,)), L.Dense(16, activation="tanh"),
                                          L.Dense(3, dtype="float32")])
                m = compiled(model, keras.optimizers.SGD(0.02),
                             loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                m.optimizer.dynamic_growth_steps = 2  # many scale changes in a short run
                h = m.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
                save(case, m, h, iterations=int(m.optimizer.iterations.numpy()),
                     loss_scale=float(m.optimizer.dynamic_scale.numpy()))
            finally:
                keras.mixed_precision.set_dtype_policy("float32")
        elif case == "float64":  # XLA on CPU computes float64 too: a convolution, Adam; on
            # tnt, data each rank brings itself (the global normaliser summed after the body)
            keras.config.set_floatx("float64")
            keras.mixed_precision.set_dtype_policy("float64")
            try:
                keras.utils.set_random_seed(7)
                model = keras.Sequential([
                    keras.Input((8, 8, 2)), L.Conv2D(4, 3, activation="relu"), L.MaxPooling2D(2),
                    L.Flatten(), L.Dense(3, activation="softmax")])
                m = compiled(model, keras.optimizers.Adam(0.01))
                images, labels = rng.normal(size=(23, 8, 8, 2)), y[:23]
                if tnt_mode:  # this rank's part of every global batch of 6, as tnt splits it
                    rank = tnt.get_rank()
                    parts = [np.array_split(np.arange(i, min(i + 6, 23)), 2)[rank]
                             for i in range(0, 23, 6)]
                    data = tf.data.Dataset.from_generator(
                        lambda: ((images[p], labels[p]) for p in parts),
                        output_signature=(tf.TensorSpec((None, 8, 8, 2), tf.float64),
                                          tf.TensorSpec((None,), tf.int64)))
                    h = m.fit(data, epochs=2, verbose=0, validation_data=(images[:9], labels[:9]),
                              tnt_distribute_dataset=False)
                else:
                    h = m.fit(images, labels, batch_size=6, epochs=2, verbose=0, shuffle=False,
                              validation_data=(images[:9], labels[:9]))
                save(case, m, h, predict=m.predict(images, batch_size=5, verbose=0))
            finally:
                keras.config.set_floatx("float32")
                keras.mixed_precision.set_dtype_policy("float32")
        elif case == "two_optimizers":  # two applies: clustered between the collectives (tnt)
            class Two(keras.Model):
                def __init__(self, **kw):
                    super().__init__(**kw)
                    self.a, self.b = L.Dense(4, activation="tanh"), L.Dense(1)
                    self.tracker = keras.metrics.Mean(name="loss")

                def call(self, inputs):
                    return self.b(self.a(inputs))

                def compile(self, opt_a, opt_b):
                    super().compile(jit_compile=True)
                    self.opt_a, self.opt_b = opt_a, opt_b

                def train_step(self, data):
                    xb, yb = data
                    yb = tf.cast(tf.reshape(yb, (-1, 1)), xb.dtype)
                    with tf.GradientTape() as tape:
                        la = tf.reduce_mean((self(xb) - yb) ** 2)
                    ga = tape.gradient(la, self.a.trainable_variables)
                    self.opt_a.apply_gradients(zip(ga, self.a.trainable_variables))
                    with tf.GradientTape() as tape:
                        lb = tf.reduce_mean(tf.abs(self(xb) - yb))
                    gb = tape.gradient(lb, self.b.trainable_variables)
                    self.opt_b.apply_gradients(zip(gb, self.b.trainable_variables))
                    self.tracker.update_state(la + lb, sample_weight=tf.shape(xb)[0])
                    return {"loss": self.tracker.result()}

            keras.utils.set_random_seed(8)
            model = Two()
            model.build((None, 6))
            m = wrap(model)
            m.compile(keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.02))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                h = m.fit(x, y.astype("float32"), batch_size=9, epochs=2, verbose=0,
                          shuffle=False)
            facts[case] = [str(w.message) for w in caught if "jit_compile" in str(w.message)]
            if tnt_mode:
                facts["structure_two_optimizers"] = structure(m, "train", (x[:8], y[:8]))
            save(case, m, h)
        elif case == "synchronized_bn":  # collectives in the forward pass: clustered between them
            keras.utils.set_random_seed(9)
            inp = keras.Input((6,))
            hidden = L.BatchNormalization(synchronized=True)(L.Dense(8, use_bias=False)(inp))
            model = keras.Model(inp, L.Dense(3, activation="softmax")(L.Activation("relu")(hidden)))
            m = compiled(model, keras.optimizers.SGD(0.05))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                h = m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
            facts[case] = [str(w.message) for w in caught if "jit_compile" in str(w.message)]
            save(case, m, h)
        else:
            raise ValueError(case)

    keras.config.set_floatx("float32")
    keras.mixed_precision.set_dtype_policy("float32")
    for case in [c for c in CASES if not args.only or c in args.only.split(",")]:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(case)
        print(f"{who} done {case} in {time.perf_counter() - start:.1f} s", flush=True)
    keras.config.set_floatx("float64")  # the suite's other workers compute in float64
    keras.mixed_precision.set_dtype_policy("float64")
    with open(os.path.join(out, f"facts.{who}.json"), "w") as f:
        json.dump(facts, f)


def structure(model, kind: str, batch: tuple) -> dict:
    """What a traced distributed step is made of: the functions XLA must compile (by name),
    the op types inside them (nested calls included) and those outside them. Traced, not run,
    as Keras traces its own step (the same calls of ``train_step``/``test_step``/
    ``predict_step`` on a batch packed as tarantella's datasets pack it)."""
    import tensorflow as tf

    import tnt_core
    from tarantella.data_parallel import steps

    size = tnt_core.init().size
    n = len(batch[0]) // size
    packed = steps.pack(tuple(b[:n] for b in batch), tf.constant([n, n * size], tf.int64))
    step = {"train": model.train_step, "test": model.test_step, "predict": model.predict_step}[kind]
    graph = tf.function(step, autograph=False).get_concrete_function(packed).graph
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}

    def calls(node) -> list[str]:
        return [v.func.name for v in node.attr.values() if v.func.name] + \
            [f.name for v in node.attr.values() for f in v.list.func]

    compiled = sorted(name for name, f in library.items() if f.attr["_XlaMustCompile"].b)
    inside: set[str] = set()
    seen: set[str] = set()
    todo = list(compiled)
    while todo:  # every function an XLA function calls is compiled with it
        name = todo.pop()
        if name in seen or name not in library:
            continue
        seen.add(name)
        for node in library[name].node_def:
            inside.add(node.op)
            todo += calls(node)
    outside = {op.type for op in graph.get_operations()}
    for name, f in library.items():
        if name not in seen:
            outside |= {node.op for node in f.node_def}
    # ops XLA may cluster (made in a jit_scope), and the collectives that cut the clusters:
    # those a clustered op waits for by a control edge
    marked = [op for op in graph.get_operations()
              if "_XlaCompile" in op.node_def.attr and op.node_def.attr["_XlaCompile"].b]
    cuts = {c.type for op in marked for c in op.control_inputs
            if c.type in ("TntPushBucket", "TntFinishReduce", "PyFunc", "EagerPyFunc")}
    return {"compiled": compiled, "inside": sorted(inside), "outside": sorted(outside),
            "clustered": sorted({op.type for op in marked}), "cut_by": sorted(cuts)}


if __name__ == "__main__":
    sys.exit(main())
