"""``tnt.Model(..., PIPELINING)`` next to plain Keras: the same script, fit with
validation, evaluate, predict and get_weights.

``--mode serial``: plain Keras. ``--mode pipeline``: a rank of a launched job. Each writes
``<mode>.rank<r>.npz`` (weights, predictions) and ``.json`` (History, evaluate, counts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import keras
import numpy as np
import pipeline_bucket_worker
import pipeline_graph_worker
import pipeline_sparse_worker
from pipeline_worker import build, data

EPOCHS, BATCH, MICRO = 3, 16, 3


class Interrupt(keras.callbacks.Callback):
    """Ends fit after epoch 2 (on every rank), as a preempted job would end."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("preempted")


def built(args: argparse.Namespace, scope: str) -> keras.Model:
    """Serial: the model built as usual. Pipelined: built without values, inside
    ``tnt.deferred_build()`` (``scope="tnt"``) or Keras' own
    ``StatelessScope(initialize_variables=False)`` (``"keras"``), then ``tnt.Model`` with
    the run's strategy."""
    if args.mode != "pipeline":
        return build(args.partitions)
    import tarantella as tnt

    with tnt.deferred_build() if scope == "tnt" else keras.StatelessScope(initialize_variables=False):
        model = build(args.partitions)
    strategy = (tnt.ParallelStrategy.PIPELINING if args.strategy == "pipelining"
                else tnt.ParallelStrategy.ALL)
    return tnt.Model(model, parallel_strategy=strategy, num_micro_batches=MICRO)


def resume(args: argparse.Namespace, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Serial: 3 epochs straight. Pipelined (built without values): interrupted after
    epoch 2 with a BackupAndRestore, then a new model resumes from the backup to epoch 3."""
    def fresh():
        model = built(args, "tnt")  # pipelined: tarantella's alias of Keras' scope
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    model = fresh()
    if args.mode == "serial":
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        return model.get_weights()
    backup = keras.callbacks.BackupAndRestore(str(args.out / "backup"))
    try:
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[backup, Interrupt()])
        raise AssertionError("not interrupted")
    except RuntimeError as exc:
        assert "preempted" in str(exc), exc
    model = fresh()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(str(args.out / "backup"))])
    # resumed at the backup's step (the start of epoch 2: the interruption came before the
    # end-of-epoch backup was written), the History that of the whole fit, as serial's
    assert len(history.history["loss"]) == EPOCHS, f"not the whole fit's History: {history.history}"
    return model.get_weights()


def stage_memory(args: argparse.Namespace, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """A model built without values (Keras' own StatelessScope; serial: built as usual, same
    seed), Adam, checkpoints in the middle of epochs and at their ends, then save and
    save_weights: the initial and trained weights (get_weights) and the History. Every
    rank then loads the saved weights from a copy in which every value it does not hold is
    NaN: it must read only its own layers and optimizer slots."""
    out = args.out / f"memory-{args.mode}"
    out.mkdir(exist_ok=True)
    model = built(args, "keras")
    initial = model.get_weights()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(out / "batch.keras"), save_freq=2),
        keras.callbacks.ModelCheckpoint(str(out / "best.weights.h5"), monitor="loss",
                                        save_best_only=True, save_weights_only=True)])
    weights = model.get_weights()
    model.save(str(out / "final.keras"))
    model.save_weights(str(out / "final.weights.h5"))
    if args.mode == "pipeline":  # every rank writes in turn, served by its pipeline's stages
        import tarantella as tnt

        model.save_weights(str(out / f"all.rank{tnt.get_rank()}.weights.h5"), tnt_save_all_devices=True)
    result = {f"memory_initial{i}": w for i, w in enumerate(initial)}
    result.update({f"memory_w{i}": w for i, w in enumerate(weights)})
    result.update({f"memory_history_{k}": np.array(v) for k, v in history.history.items()})
    if args.mode == "pipeline":
        import h5py

        import tarantella as tnt

        held = []
        for v in model.weights + model.optimizer.variables:
            try:
                held.append(np.asarray(v))
            except tnt.NotSupportedError:  # another partition's: this rank holds no value
                pass
        slots = [np.asarray(v) for v in model.optimizer.variables]
        poisoned = out / f"poisoned.rank{tnt.get_rank()}.weights.h5"
        poisoned.write_bytes((out / "final.weights.h5").read_bytes())
        with h5py.File(poisoned, "r+") as f:
            def poison(name, item):
                if isinstance(item, h5py.Dataset) and item.dtype.kind == "f" and \
                        not any(h.shape == item.shape and np.array_equal(h, item[()]) for h in held):
                    item[...] = np.nan
            f.visititems(poison)
        model.load_weights(poisoned)
        result["memory_poisoned_loaded"] = np.array([
            all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights)) and
            all(np.array_equal(np.asarray(v), s) for v, s in zip(model.optimizer.variables, slots))])
        result["memory_held"] = np.array([len(held)])
    else:  # serial Keras holds every value and reads the whole file
        result["memory_poisoned_loaded"] = np.array([True])
        result["memory_held"] = np.array([len(model.weights) + len(model.optimizer.variables)])
    return result


def dict_inputs(args: argparse.Namespace, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """A model of two named inputs, fed a dict: 2 epochs, its weights. The optimizer keeps
    a moving average of the weights (``use_ema``), which fit's end writes into them: on a
    pipeline, each stage's own."""
    keras.utils.set_random_seed(3)
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(6, activation="tanh")(a), b])
    for _ in range(args.partitions - 1):
        import tarantella as tnt

        h = keras.layers.Dense(5, activation="tanh")(tnt.keras.layers.SplitLayer()(h))
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h))
    if args.mode == "pipeline":
        import tarantella as tnt

        strategy = (tnt.ParallelStrategy.PIPELINING if args.strategy == "pipelining"
                    else tnt.ParallelStrategy.ALL)
        model = tnt.Model(model, parallel_strategy=strategy, num_micro_batches=MICRO)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, use_ema=True,
                                                 ema_overwrite_frequency=3), loss="mse")
    model.fit({"a": x[:, :4], "b": x[:, 4:]}, y, batch_size=BATCH, epochs=2, shuffle=False,
              verbose=0)
    return model.get_weights()


def keras_workflow(args: argparse.Namespace, x: np.ndarray) -> dict[str, np.ndarray]:
    """What users do besides fit: predict before compile, a tf.data dataset with sample
    weights and of unknown length (filtered: each epoch ends when it runs out, which plain
    Keras' graph step counts as an optimizer iteration, read by Adam), validation_split
    with class weights, a PyDataset with workers (its epoch hooks counted), extra and
    weighted metrics, the
    single-batch calls, then get_weights; every result, flattened into arrays."""
    import tensorflow as tf

    keras.utils.set_random_seed(5)
    classes = (np.abs(x[:, 0] * 3).astype(np.int64) % 3)
    weights = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    model = build(args.partitions)
    if args.mode == "pipeline":
        import tarantella as tnt

        strategy = (tnt.ParallelStrategy.PIPELINING if args.strategy == "pipelining"
                    else tnt.ParallelStrategy.ALL)
        model = tnt.Model(model, parallel_strategy=strategy, num_micro_batches=MICRO)
    out = {"predict_uncompiled": model.predict(x[:9], verbose=0)}
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
                  weighted_metrics=["accuracy"])
    dataset = tf.data.Dataset.from_tensor_slices((x, classes, weights)).filter(
        lambda *_: True).batch(12)
    history = model.fit(dataset, epochs=2, verbose=0).history
    history.update({f"split_{k}": v for k, v in model.fit(
        x, classes, batch_size=10, epochs=2, validation_split=0.25, shuffle=False, verbose=0,
        class_weight={0: 1.0, 1: 2.0, 2: 0.5}).history.items()})
    hooks = [0, 0]

    class Batches(keras.utils.PyDataset):
        """Batches of 12 by index, counting its epoch hooks (where a PyDataset's workers
        start and stop): Keras' loop gets them through tarantella's coordinator."""

        def __init__(self, n: int, **kwargs: object) -> None:
            super().__init__(**kwargs)
            self.n = n

        def __len__(self) -> int:
            return -(-self.n // 12)

        def __getitem__(self, i: int) -> tuple:
            rows = slice(12 * i, min(12 * i + 12, self.n))
            return x[rows], classes[rows], weights[rows]

        def on_epoch_begin(self) -> None:
            hooks[0] += 1

        def on_epoch_end(self) -> None:
            hooks[1] += 1

    history.update({f"pydataset_{k}": v for k, v in model.fit(
        Batches(len(x), workers=2), epochs=2, validation_data=Batches(24), verbose=0).history.items()})
    out["pydataset_hooks"] = np.array(hooks)
    out.update({f"history_{k}": np.array(v) for k, v in history.items()})
    out["train_on_batch"] = np.array(model.train_on_batch(x[:13], classes[:13],
                                                          sample_weight=weights[:13]))
    out["test_on_batch"] = np.array(model.test_on_batch(x[:13], classes[:13]))
    out["predict_on_batch"] = np.asarray(model.predict_on_batch(x[:5]))
    out["evaluate"] = np.array(list(model.evaluate(dataset, verbose=0, return_dict=True).values()))
    out.update({f"weight{i}": w for i, w in enumerate(model.get_weights())})
    return out


def batch_norm_first(partitions: int) -> keras.Model:
    import tarantella as tnt

    inp = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4)(inp))
    for _ in range(partitions - 1):
        h = keras.layers.Dense(4)(tnt.keras.layers.SplitLayer()(h))
    return keras.Model(inp, h)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "pipeline"], required=True)
    parser.add_argument("--partitions", type=int, required=True)
    parser.add_argument("--strategy", choices=["pipelining", "all"], default="pipelining")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sparse", action="store_true",
                        help="serial: also the sparse and bucketed cases (one layout's serial "
                             "run makes them)")
    parser.add_argument("--routing", action="store_true",
                        help="also the cases of what a pipeline routes between its stages (dict "
                             "inputs, the graph cases, batches of different lengths) and the "
                             "resume from BackupAndRestore: the same code in every pipeline, "
                             "so one layout runs them")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    x, y = data()
    vx, vy = x[:12] * 0.5, y[:12]
    model = build(args.partitions)
    rank, extra = 0, {}
    if args.mode == "pipeline":
        import tarantella as tnt

        strategy = (tnt.ParallelStrategy.PIPELINING if args.strategy == "pipelining"
                    else tnt.ParallelStrategy.DATA | tnt.ParallelStrategy.PIPELINING)
        model = tnt.Model(model, parallel_strategy=strategy, num_micro_batches=MICRO)
        rank = tnt.get_rank()
        extra = {"local_params": model.local_param_count, "repr": repr(model)}
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), loss="mse",
                  metrics=["mae"])
    callbacks = [] if args.mode == "serial" else [  # run on the master only: written once
        keras.callbacks.CSVLogger(str(args.out / "log.csv")),
        keras.callbacks.ModelCheckpoint(str(args.out / "epoch.weights.h5"), save_weights_only=True),
        keras.callbacks.ModelCheckpoint(str(args.out / "epoch{epoch}.keras"))]
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, validation_data=(vx, vy),
                        shuffle=True, verbose=0, callbacks=callbacks)
    evaluation = model.evaluate(vx, vy, batch_size=5, verbose=0)
    predictions = model.predict(x, batch_size=7, verbose=0)
    weights = model.get_weights()
    model.save(str(args.out / f"{args.mode}.keras"))  # every rank calls it; the master writes
    if args.mode == "pipeline":  # what is refused, on every rank alike
        import tensorflow as tf

        refused = {}
        for name, call in {
            "export": lambda: model.export(str(args.out / "exported")),
            "legacy_h5": lambda: model.save(str(args.out / "legacy.h5")),
            "micro_batch_size": lambda: model.fit(x, y, tnt_micro_batch_size=4, verbose=0),
            "summed_loss": lambda: model.compile(
                optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum")),
            # the argument checks of DATA (tarantella.arguments), before any collective
            "batch_size": lambda: model.fit(x, y, batch_size=0, verbose=0),
            "cardinality": lambda: model.fit(x, y[:5], verbose=0),
            "callbacks": lambda: model.evaluate(x, y, callbacks=[42], verbose=0),
            "strings": lambda: model.predict(np.array([["a"] * x.shape[1]] * 4), verbose=0),
            "unbatched": lambda: model.fit(tf.data.Dataset.from_tensor_slices((x, y)), verbose=0),
            # each rank reading its own order of the same data (batch_fingerprint)
            "different_batches": lambda: model.fit(np.roll(x, rank, axis=0), np.roll(y, rank, axis=0),
                                                   batch_size=BATCH, shuffle=False, verbose=0),
            # ... or batches of another size: refused before any message (no rank waits)
            "different_batch_sizes": lambda: model.fit(x, y, batch_size=BATCH + (rank > 0),
                                                       shuffle=False, verbose=0),
            # ... and in evaluate (its forward-only step checks the same way)
            "different_batches_evaluate": lambda: model.evaluate(
                np.roll(x, rank, axis=0), np.roll(y, rank, axis=0), batch_size=BATCH, verbose=0),
            # in the first partition only: every rank refuses it, not only the first stage's
            "batch_norm": lambda: tnt.Model(batch_norm_first(args.partitions),
                                            parallel_strategy=strategy, num_micro_batches=MICRO),
        }.items():
            try:
                call()
                refused[name] = None
            except Exception as exc:  # noqa: BLE001 - the message is the result
                refused[name] = f"{type(exc).__name__}: {exc}"
        extra["refused"] = refused
        # a refused step applied no update on any rank (the batch check gates the update)
        extra["weights_kept_by_refusals"] = all(
            np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
        model.save_weights(str(args.out / "w.weights.h5"))
    # BackupAndRestore's resume at the step: one layout (under ALL, the elastic test's
    # restart of a pipelined job resumes from it too: test_elastic_fit)
    resumed = resume(args, x, y) if args.routing else []
    memory = stage_memory(args, x, y)
    named = dict_inputs(args, x, y) if args.routing else []
    workflow = keras_workflow(args, x)
    if args.routing:  # skips, late inputs, several outputs, automatic cuts
        pipeline_graph_worker.run(args, x, y)
    if args.mode == "pipeline" or args.sparse:  # sparse gradients, float64 and float32
        pipeline_sparse_worker.run(args)
    if args.routing and (args.mode == "pipeline" or args.sparse):
        pipeline_bucket_worker.run(args)  # batches of different sequence lengths
    tag = f"{args.mode}.rank{rank}"
    np.savez(args.out / f"{tag}.npz", predictions=predictions,
             **{f"w{i}": w for i, w in enumerate(weights)},
             **{f"resumed{i}": w for i, w in enumerate(resumed)},
             **{f"named{i}": w for i, w in enumerate(named)},
             **{f"workflow_{k}": v for k, v in workflow.items()})
    np.savez(args.out / f"{tag}.memory.npz", **memory)
    (args.out / f"{tag}.json").write_text(json.dumps({
        "history": history.history, "evaluate": evaluation, "count": model.count_params(),
        **extra}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
