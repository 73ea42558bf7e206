"""Training loops of one's own, once in plain Keras and once distributed (``tnt.*`` and
``tarantella.horovod``), the same code with the distributed lines switched on.

``--mode serial``: plain Keras, no tarantella (the reference); ``--mode tnt``: every rank,
only on 3 ranks (the checks need uneven shares and a batch smaller than the job; other
launches return at once). Each case writes ``<case>.<who>.npz`` (``w<i>`` weights, case
arrays); ``facts.<who>.json`` holds what is not compared with serial (the horovod-module
names, the gradient path taken). float64, so round-off cannot hide a wrong weighting.

The loops:

* ``guide_function``: Keras' guide "Writing a training loop from scratch", its
  ``tf.function`` step with ``optimizer.apply``; ``tnt.distribute_dataset``,
  ``tnt.DistributedOptimizer`` and ``tnt.broadcast_variables`` (every rank builds the model
  with another seed). 26 samples in batches of 8: 8, 8, 8 and 2, so on 3 ranks the shares
  are 3/3/2 and the last batch leaves rank 2 a stand-in sample.
* ``guide_eager_tape``: the same loop run eagerly, with ``tnt.DistributedGradientTape`` and
  an Embedding (its gradient is sparse, gathered row by row), SGD; then the gradients a
  ``tf.function`` returns, kept over later steps, must not change.
* ``tnt_model_with_distributed_optimizer``: a ``tnt.Model`` compiled with a
  ``tnt.DistributedOptimizer`` reduces once (fit against plain fit).
* ``horovod_loop``: Horovod's TF2 example loop (``hvd.DistributedGradientTape``, broadcast
  inside the ``tf.function`` after the first step, of ``opt.variables()`` as Keras 2 spelled
  it); each rank takes every third sample
  (``dataset.shard``) in batches of 3, serial takes batches of 9: equal shares, so Horovod's
  average is the serial gradient.
* ``horovod_fit``: Horovod's Keras example: ``hvd.DistributedOptimizer`` in a plain Keras
  model compiled with Keras 2's ``experimental_run_tf_function=False``,
  ``BroadcastGlobalVariablesCallback`` (ranks built with other seeds) and
  ``MetricAverageCallback``; sharded as ``horovod_loop``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

CASES = ("guide_function", "guide_eager_tape", "tnt_model_with_distributed_optimizer",
         "horovod_loop", "horovod_fit")
RANKS = 3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    tnt_mode = args.mode == "tnt"
    if tnt_mode:
        import tarantella as tnt
        import tarantella.horovod.keras as hvd

        if tnt.get_size() != RANKS:
            return
    import keras
    import tensorflow as tf

    before = keras.config.floatx(), keras.mixed_precision.global_policy().name
    keras.config.set_floatx("float64")  # before any layer or loss is made
    keras.mixed_precision.set_dtype_policy("float64")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    who = f"rank{tnt.get_rank()}" if tnt_mode else "serial"
    rank = tnt.get_rank() if tnt_mode else 0
    L = keras.layers  # noqa: N806 (Keras' own abbreviation)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(26, 6))
    y = rng.integers(0, 3, size=26)
    tokens = rng.integers(0, 10, size=(26, 4))
    x9 = rng.normal(size=(27, 6))
    y9 = rng.integers(0, 3, size=27)

    def mlp(seed: int) -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((6,)), L.Dense(8, activation="relu"), L.Dense(3)])

    def save(case: str, model: keras.Model, **extra) -> None:
        arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        arrays.update({k: np.asarray(v) for k, v in extra.items()})
        np.savez(os.path.join(out, f"{case}.{who}.npz"), **arrays)

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def guide_function() -> None:
        model = mlp(1 + rank)  # the master's seed is serial's; broadcast makes it everyone's
        optimizer = keras.optimizers.Adam(learning_rate=0.01)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        if tnt_mode:
            tnt.broadcast_variables(model.weights, root_rank=0)
            optimizer = tnt.DistributedOptimizer(optimizer)
            dataset = tnt.distribute_dataset(dataset)

        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss_value = loss_fn(yb, logits)
            grads = tape.gradient(loss_value, model.trainable_weights)
            optimizer.apply(grads, model.trainable_weights)
            return loss_value

        for _ in range(3):
            for xb, yb in dataset:
                train_step(xb, yb)
        save("guide_function", model, iterations=int(optimizer.iterations.numpy()))

    def guide_eager_tape() -> None:
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((4,), dtype="int64"), L.Embedding(10, 5),
                                  L.GlobalAveragePooling1D(), L.Dense(3)])
        optimizer = keras.optimizers.SGD(learning_rate=0.2)
        dataset = tf.data.Dataset.from_tensor_slices((tokens, y)).batch(8)
        if tnt_mode:
            dataset = tnt.distribute_dataset(dataset)

        def gradients(xb, yb):
            with tf.GradientTape() as tape:
                loss_value = loss_fn(yb, model(xb, training=True))
            if tnt_mode:
                tape = tnt.DistributedGradientTape(tape)
            return tape.gradient(loss_value, model.trainable_weights)

        for _ in range(2):
            for xb, yb in dataset:  # eagerly
                grads = gradients(xb, yb)
                optimizer.apply_gradients(zip(grads, model.trainable_weights))
        sparse = type(grads[0]).__name__
        copied, held = [], []
        traced = tf.function(gradients)
        for xb, yb in dataset:  # the gradients a tf.function returns, kept across steps
            grads = traced(xb, yb)
            copied.append(np.array(grads[-1]))  # the Dense bias, as it was returned
            held.append(grads[-1])  # the tensor itself: later reductions must not change it
        save("guide_eager_tape", model, copied=np.array(copied),
             held=np.array([h.numpy() for h in held]), sparse=sparse)

    def tnt_model_with_distributed_optimizer() -> None:
        model = mlp(3)
        optimizer = keras.optimizers.Adam(learning_rate=0.01)
        if tnt_mode:
            model = tnt.Model(model)
            optimizer = tnt.DistributedOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss=loss_fn)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        save("tnt_model_with_distributed_optimizer", model)

    def per_rank_batches():
        """Horovod's way: every rank reads its own third of the data; serial the whole."""
        dataset = tf.data.Dataset.from_tensor_slices((x9, y9))
        if tnt_mode:
            return dataset.shard(hvd.size(), hvd.rank()).batch(3)
        return dataset.batch(9)

    def horovod_loop() -> None:
        model = mlp(4)
        optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)

        @tf.function
        def training_step(images, labels, first_batch):
            with tf.GradientTape() as tape:
                loss_value = loss_fn(labels, model(images, training=True))
            if tnt_mode:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss_value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            if tnt_mode and first_batch:
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(optimizer.variables(), root_rank=0)  # Keras 2's spelling
            return loss_value

        for epoch in range(2):
            for batch, (images, labels) in enumerate(per_rank_batches()):
                training_step(images, labels, epoch == 0 and batch == 0)
        save("horovod_loop", model)

    def horovod_fit() -> None:
        model = mlp(5 + rank)
        optimizer = keras.optimizers.SGD(learning_rate=0.1)
        callbacks = []
        if tnt_mode:
            optimizer = hvd.DistributedOptimizer(optimizer)
            callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()]
        # Horovod's example passes Keras 2's experimental_run_tf_function (plain Keras 3 refuses it)
        keras2 = {"experimental_run_tf_function": False} if tnt_mode else {}
        model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"], **keras2)
        history = model.fit(per_rank_batches(), epochs=3, verbose=0, callbacks=callbacks)
        save("horovod_fit", model, history=json.dumps(history.history))

    try:
        cases = {"guide_function": guide_function, "guide_eager_tape": guide_eager_tape,
                 "tnt_model_with_distributed_optimizer": tnt_model_with_distributed_optimizer,
                 "horovod_loop": horovod_loop, "horovod_fit": horovod_fit}
        for case in CASES:
            cases[case]()
            print(f"{who} done {case}", flush=True)
        facts = _facts(tnt, hvd, keras, tf, mlp) if tnt_mode else {}
    finally:
        keras.config.set_floatx(before[0])  # the suite's next worker runs as it did before
        keras.mixed_precision.set_dtype_policy(before[1])
    with open(os.path.join(out, f"facts.{who}.json"), "w") as f:
        json.dump(facts, f)


def _facts(tnt, hvd, keras, tf, mlp) -> dict:
    """The horovod module's names and collectives, and which gradient path ran."""
    import tnt_core
    from tarantella.comm import native as native_ops

    runtime = tnt_core.init()
    rank = hvd.rank()
    facts: dict = {
        "backend": runtime.backend.inner.name if hasattr(runtime.backend, "inner") else runtime.backend.name,
        "native": native_ops.unavailable_reason(runtime) is None,
        "ranks": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.is_initialized()],
        "tnt_ranks": [tnt.get_rank(), tnt.get_size(), runtime.local_rank, runtime.local_size],
    }
    hvd.init()  # again: a no-op, as in Horovod
    value = tf.constant([float(rank), 2.0 * rank + 1.0], tf.float64)
    facts["allreduce_average"] = hvd.allreduce(value).numpy().tolist()
    facts["allreduce_sum"] = hvd.allreduce(value, op=hvd.Sum).numpy().tolist()
    facts["allreduce_average_false"] = hvd.allreduce(value, average=False).numpy().tolist()
    facts["allreduce_max_int"] = hvd.allreduce(tf.constant([rank, -rank]), op=hvd.Max).numpy().tolist()
    facts["allreduce_fp16"] = [hvd.allreduce(tf.constant([1.5 * rank], tf.float32),
                                             compression=hvd.Compression.fp16).dtype.name]
    # the ranks' sum is past float16's 65504, their average is not
    facts["allreduce_fp16_average"] = hvd.allreduce(tf.constant([1e4 * (rank + 3)], tf.float32),
                                                    compression=hvd.Compression.fp16).numpy().tolist()
    facts["allgather_rows"] = hvd.allgather(tf.fill([rank + 1, 2], rank)).numpy().tolist()
    facts["broadcast"] = hvd.broadcast(tf.constant([rank + 10]), root_rank=2).numpy().tolist()

    @tf.function
    def in_graph(v):
        summed = hvd.allreduce(v, op=hvd.Sum)
        gathered = hvd.allgather(tf.reshape(v, [1, -1]))
        return summed, gathered

    summed, gathered = in_graph(value)
    facts["graph_allreduce_sum"] = summed.numpy().tolist()
    facts["graph_allgather"] = gathered.numpy().tolist()
    var = tf.Variable([float(rank), 5.0 * rank], dtype=tf.float64)

    @tf.function
    def broadcast_in_graph():
        hvd.broadcast_variables([var], root_rank=1)

    broadcast_in_graph()
    facts["graph_broadcast_variables"] = var.numpy().tolist()

    model = mlp(7)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    facts["optimizer_is_sgd"] = [isinstance(optimizer, keras.optimizers.SGD),
                                 optimizer.__class__.__name__,
                                 keras.optimizers.serialize(optimizer)["class_name"]]
    adam = keras.optimizers.Adam(0.1)  # Keras 2's opt.variables() next to Keras 3's property
    adam.build(model.trainable_variables)
    facts["variables_spellings"] = [isinstance(adam.variables, list), len(adam.variables),
                                    type(adam.variables()).__name__,
                                    [v.path for v in adam.variables()] == [v.path for v in adam.variables]]
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.3, warmup_epochs=2, verbose=1)
    lrs = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(self.model.optimizer.learning_rate.numpy()))

    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.zeros((8, 6)), np.zeros((8, 3)), batch_size=2, epochs=3, verbose=0,
              callbacks=[warmup, Record()])
    facts["warmup_lrs"] = lrs
    errors = {}
    for name, call in (
            ("tape_of_a_list", lambda: tnt.DistributedGradientTape([])),
            ("optimizer_of_a_name", lambda: tnt.DistributedOptimizer("adam")),
            ("unbatched_dataset", lambda: tnt.distribute_dataset(tf.data.Dataset.range(4))),
            ("allreduce_adasum", lambda: hvd.allreduce(value, op="adasum")),
            ("backward_passes", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(),
                                                                backward_passes_per_step=2))):
        try:
            call()
            errors[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            errors[name] = f"{type(exc).__name__}: {exc}"
    facts["errors"] = errors
    return facts


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
