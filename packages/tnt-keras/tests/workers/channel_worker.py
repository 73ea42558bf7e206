"""Every collective a step traces goes through the channel (``tarantella.comm``).

``python channel_worker.py --out DIR`` (a rank of a tnt launch; run by ``suite_worker --also
channel``) traces the steps users trace — ``fit``/``evaluate``/``predict`` of a model with an
``Embedding`` (sparse gradients), a synchronized ``BatchNormalization`` and a metric; a custom
loop with ``tnt.DistributedGradientTape`` and ``tnt.broadcast_variables``; Horovod's
collectives in a ``tf.function``; a pipelined model's stage step (as many stages as ranks) —
and writes, per traced graph, the collectives the channel counted and the ops in the graph
that reach a communicator (``numpy_function`` ops and the op library's ``Tnt*`` ops, the
timeline's marks aside), its inner functions and branches included. The test compares them.
Then it binds a new communicator (a split of the job over every rank) to the trained model's
channel and trains on: the later steps must reach the new communicator only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: op types through which a graph reaches a communicator (``tf.numpy_function`` is a PyFunc)
_PY_FUNCS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}


def _communicating(graph: Any) -> list[str]:
    """Names of the ops of ``graph`` and of every function it calls that can reach a
    communicator."""
    names = [op.name for op in graph.get_operations()
             if op.type in _PY_FUNCS or op.type.startswith("Tnt")]
    for function in graph.as_graph_def().library.function:
        names += [node.name for node in function.node_def
                  if node.op in _PY_FUNCS or node.op.startswith("Tnt")]
    return sorted(n for n in names if "timeline" not in n)


def _graphs(fn: Any) -> list[Any]:
    """The graphs of every top-level trace of ``fn``: a ``tf.function``, or Keras' step
    function, a closure over its ``tf.function`` s (a trace nested in another's is part of
    the outer one's graph)."""
    while not hasattr(fn, "get_concrete_function") and hasattr(fn, "function"):
        fn = fn.function  # tarantella's wrapper around Keras' (step_backup.SkippedWhileReplaying)
    functions = [fn] if hasattr(fn, "get_concrete_function") else \
        [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
         if hasattr(c.cell_contents, "get_concrete_function")]
    if not functions:
        raise RuntimeError(f"no tf.function in {fn!r}: update channel_worker")
    graphs = []
    for function in functions:
        # TensorFlow's own list of a function's traces (what SavedModel saves)
        graphs += [c.graph for c in function._list_all_concrete_functions()]
    # a nested trace's outer graph is a function's graph too (the top's is the global graph)
    return [g for g in graphs if getattr(g.outer_graph, "outer_graph", None) is None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import keras
    import numpy as np
    import tensorflow as tf

    import tarantella as tnt
    import tarantella.horovod as hvd
    from tarantella import comm

    rank, size = tnt.get_rank(), tnt.get_size()
    # this worker's models are float32; the workers after it find what the one before left
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(7)
    x = rng.integers(0, 20, size=(24, 4)).astype("int32")
    y = rng.integers(0, 2, size=(24,)).astype("int32")
    traced: dict[str, list[tuple[list[str], list[str]]]] = {}

    def note(label: str, fn: Any) -> None:
        traced[label] = [(sorted(comm.traced_collectives(g)), _communicating(g))
                         for g in _graphs(fn)]

    # -- fit, evaluate, predict ------------------------------------------------------------------
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(20, 3),
                              keras.layers.Flatten(), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(synchronized=True),
                              keras.layers.Dense(2)])
    model = tnt.Model(model)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    model.evaluate(x, y, batch_size=6, verbose=0)
    model.predict(x, batch_size=6, verbose=0)
    note("fit", model.train_function)
    note("evaluate", model.test_function)
    note("predict", model.predict_function)

    # -- a custom loop, and Horovod's collectives --------------------------------------------------
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def loop_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(dense(xb) - yb))
        tape = tnt.DistributedGradientTape(tape)
        grads = tape.gradient(loss, dense.trainable_variables)
        optimizer.apply(grads, dense.trainable_variables)
        tnt.broadcast_variables(dense.weights, root_rank=0)
        return loss

    xf = x.astype("float32") / 20.0
    yf = y.astype("float32")[:, None]
    loop_step(tf.constant(xf[:6]), tf.constant(yf[:6]))
    note("custom loop", loop_step)

    @tf.function
    def horovod_calls(t: tf.Tensor) -> list[tf.Tensor]:
        return [hvd.allreduce(t), hvd.allgather(t), hvd.broadcast(t, root_rank=0)]

    horovod_calls(tf.constant(xf[:2]))
    note("horovod", horovod_calls)

    # -- a pipelined stage step ---------------------------------------------------------------------
    if size > 1:
        keras.utils.set_random_seed(2)
        inputs = keras.Input((4,))
        h = inputs
        for _ in range(size):
            h = keras.layers.Dense(4, activation="relu")(h)
        pipelined = tnt.Model(keras.Model(inputs, keras.layers.Dense(1)(h)),
                              parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                              num_micro_batches=2)
        pipelined.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        pipelined.fit(xf, yf, batch_size=6, epochs=1, shuffle=False, verbose=0)
        step = pipelined._tnt.step
        note("pipelined stage step", step._train_fn)

    # -- a new communicator bound to a trained model ----------------------------------------------
    # The same model trained three epochs twice: once on the job's communicator throughout,
    # once with a new communicator bound after each epoch, the one before it closed (a
    # collective that still reached it would fail). The results must be the same bits.
    def trained(rebind: bool) -> tuple[list[np.ndarray], list[float]]:
        keras.utils.set_random_seed(3)
        m = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                                        keras.layers.Dense(1)]))
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        channel = m._tnt.channel
        world, bound = channel.backend, None
        losses = []
        for _ in range(3):
            history = m.fit(xf, yf, batch_size=6, epochs=1, shuffle=False, verbose=0)
            losses += history.history["loss"]
            if rebind and size > 1:
                fresh = world.split(list(range(size)))
                channel.bind(fresh)
                if bound is not None:
                    bound.close()
                bound = fresh
        if bound is not None:
            channel.bind(world)
            bound.close()
        return [np.asarray(w) for w in m.weights], losses

    steady, steady_losses = trained(rebind=False)
    rebound, rebound_losses = trained(rebind=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "size": size, "traced": traced,
        "rebind": {"generation": model._tnt.channel.generation,
                   "same_weights": all(np.array_equal(a, b) for a, b in zip(steady, rebound)),
                   "losses": [steady_losses, rebound_losses]},
    }))
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)
    print(f"channel worker rank {rank}: {len(traced)} kinds of traces compared", flush=True)


if __name__ == "__main__":
    main()
