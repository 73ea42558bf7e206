"""Callbacks, saving/loading and the errors of tnt.Model, in one process per rank.

``--mode serial``: plain Keras runs of the decision-making callbacks (the reference).
``--mode tnt``: everything, each rank working in ``<out>/rank<r>`` (so a file shows which
rank wrote it) and sharing ``<out>/shared``; results go to ``<out>/<who>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    tnt_mode = args.mode == "tnt"
    if tnt_mode:
        import tarantella as tnt
    import keras
    import tensorflow as tf

    keras.config.set_floatx("float64")
    out = os.path.abspath(args.out)
    who = f"rank{tnt.get_rank()}" if tnt_mode else "serial"
    workdir = os.path.join(out, who)
    shared = os.path.join(out, "shared")
    os.makedirs(workdir, exist_ok=True)
    os.makedirs(shared, exist_ok=True)
    os.chdir(workdir)
    result: dict = {}

    rng = np.random.default_rng(3)
    x, vx = rng.normal(size=(40, 5)), rng.normal(size=(15, 5))
    y, vy = (x[:, 0] + x[:, 1] > 0).astype(np.int64), (vx[:, 0] + vx[:, 1] > 0).astype(np.int64)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(9)
    val = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(6)

    def make(lr: float = 0.1, wrap: bool = tnt_mode):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dense(2, activation="softmax")])
        if wrap:
            model = tnt.Model(model)
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    class RecordLogs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs, self.batches = [], []

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(dict(logs))

        def on_train_batch_end(self, batch, logs=None):
            self.batches.append(dict(logs))

    # -- decisions: EarlyStopping, ReduceLROnPlateau, logs seen by a user callback ----------
    model = make(lr=0.2)
    record = RecordLogs()
    # serial: stops after 11 of 30 epochs, the learning rate halved 3 times
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.005, patience=1)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.02)
    history = model.fit(train, epochs=30, validation_data=val, verbose=0,
                        callbacks=[stop, plateau, record])
    result["early_stopping"] = {"epochs_run": len(history.epoch), "stopped_epoch": stop.stopped_epoch,
                                "lr": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
                                "epoch_logs": record.epochs, "batch_logs": record.batches}

    if tnt_mode:
        rank = tnt.get_rank()
        result["threads"] = {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                             "cores": len(os.sched_getaffinity(0)),
                             "user_set": bool(os.environ.get("TF_NUM_INTRAOP_THREADS")
                                              or os.environ.get("TNT_NUM_THREADS"))}
        # -- aggregate_logs=False: this rank's own metrics --------------------------------------
        model = make(lr=0.2)
        local, shared_logs = RecordLogs(), RecordLogs()
        model.fit(train, epochs=2, validation_data=val, verbose=0,
                  callbacks=[tnt.keras.callbacks.Callback(local, aggregate_logs=False), shared_logs])
        result["local_logs"] = {"local": local.epochs, "global": shared_logs.epochs,
                                "local_batches": local.batches, "global_batches": shared_logs.batches}

        # -- writers: files only in the master's directory ----------------------------------
        model = make()
        callbacks = [
            keras.callbacks.ModelCheckpoint(os.path.join("ckpt", "epoch{epoch}.keras")),
            keras.callbacks.ModelCheckpoint(os.path.join("ckpt", "w{epoch}.weights.h5"),
                                            save_weights_only=True),
            keras.callbacks.CSVLogger("log.csv"),
            keras.callbacks.BackupAndRestore("backup", delete_checkpoint=False),
        ]
        tensorboard = importlib.util.find_spec("tensorboard") is not None
        result["tensorboard_installed"] = tensorboard
        if tensorboard:  # tf.summary needs the tensorboard package
            callbacks.append(keras.callbacks.TensorBoard("tb_master"))

        class Marker(keras.callbacks.Callback):
            def __init__(self, name):
                super().__init__()
                self.name = name

            def on_epoch_end(self, epoch, logs=None):
                with open(self.name, "a") as f:
                    f.write(f"{epoch}\n")

        callbacks.append(tnt.keras.callbacks.Callback(Marker("marker_master"), aggregate_logs=False,
                                                      run_on_all_ranks=False))
        callbacks.append(tnt.keras.callbacks.Callback(Marker("marker_all")))
        model.fit(train, epochs=2, verbose=1, callbacks=callbacks, validation_data=val)
        if tensorboard:
            os.environ["TNT_TENSORBOARD_ON_ALL_DEVICES"] = "true"
            model.fit(train, epochs=1, verbose=0, callbacks=[keras.callbacks.TensorBoard("tb_all")])
            del os.environ["TNT_TENSORBOARD_ON_ALL_DEVICES"]
        files = []
        for root, _, names in os.walk("."):
            files += [os.path.normpath(os.path.join(root, n)) for n in names]
        result["files"] = sorted(files)

        # -- a master-only callback that stops training stops every rank ----------------------
        class StopOnMaster(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    self.model.stop_training = True

        model = make()
        h = model.fit(train, epochs=5, verbose=0,
                      callbacks=[tnt.keras.callbacks.Callback(StopOnMaster(), run_on_all_ranks=False)])
        result["master_stop_epochs"] = len(h.epoch)

        # -- save / load ----------------------------------------------------------------------
        model = make()
        model.fit(train, epochs=1, verbose=0)
        weights = model.get_weights()
        model.save(os.path.join(workdir, "own.keras"))  # only the master writes
        path = os.path.join(shared, "model.keras")
        model.save(path)
        loaded = tnt.models.load_model(path)
        result["load_model"] = {
            "type": type(loaded).__name__ + ("/tnt" if isinstance(loaded, tnt.Model) else ""),
            "compiled": bool(loaded.compiled),
            "optimizer": type(loaded.optimizer).__name__,
            "weights_equal": all(np.array_equal(a, b) for a, b in zip(weights, loaded.get_weights())),
            "evaluate": loaded.evaluate(val, verbose=0, return_dict=True),
            "own_file": os.path.exists(os.path.join(workdir, "own.keras")),
        }
        uncompiled = tnt.models.load_model(path, compile=False)
        result["load_model"]["uncompiled"] = not uncompiled.compiled
        tnt.models.save_model(model, os.path.join(shared, "via_function.keras"))
        result["save_model_function"] = os.path.exists(os.path.join(shared, "via_function.keras"))
        wpath = os.path.join(shared, "model.weights.h5")
        model.save_weights(wpath)
        fresh = make()
        fresh.load_weights(wpath)
        result["load_weights_equal"] = all(np.array_equal(a, b) for a, b in zip(weights, fresh.get_weights()))
        model.save_weights(os.path.join(workdir, "all.weights.h5"), tnt_save_all_devices=True)
        result["save_all_devices"] = os.path.exists(os.path.join(workdir, "all.weights.h5"))
        clones = {
            "model_from_config": tnt.models.model_from_config(model.get_config()),
            "model_from_json": tnt.models.model_from_json(model.to_json()),
            "clone_model": tnt.models.clone_model(model),
            "from_config": tnt.Model.from_config(model.get_config()),
        }
        result["architecture"] = {
            name: isinstance(m, tnt.Model)
            and [w.shape for w in m.get_weights()] == [w.shape for w in weights]
            for name, m in clones.items()}

        # -- weights set on the master only reach every rank before the next step --------------
        model = make()
        if rank == 0:
            model.set_weights([np.full_like(w, 0.01 * (i + 1)) for i, w in enumerate(model.get_weights())])
        model.evaluate(val, verbose=0)
        result["broadcast_after_set_weights"] = [float(np.sum(w)) for w in model.get_weights()]

        # -- BatchNormalization with small micro-batches: a warning (on the master) ----------
        import warnings

        keras.utils.set_random_seed(5)
        bn = tnt.Model(keras.Sequential([keras.Input((5,)), keras.layers.BatchNormalization(),
                                         keras.layers.Dense(2, activation="softmax")]))
        bn.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit_line = sys._getframe().f_lineno + 1
            bn.fit(train, epochs=1, verbose=0)  # global batch 9: micro-batches of <= 9
        result["batch_norm_warning"] = any("BatchNormalization" in str(w.message) for w in caught)
        result["batch_norm_warning_at"] = [
            [os.path.basename(w.filename), w.lineno == fit_line] for w in caught
            if "BatchNormalization" in str(w.message)]

        # -- what is not supported: a clear error -----------------------------------------------
        errors = {}
        # a global batch smaller than the ranks trains (ranks without a sample stand by)
        model.fit(x[:4], y[:4], batch_size=1, epochs=1, verbose=0)
        result["batch_smaller_than_ranks_trains"] = True
        try:
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)), epochs=1, verbose=0)
        except tnt.DatasetError as exc:
            errors["unbatched"] = str(exc)
        result["errors"] = errors

    with open(os.path.join(out, f"{who}.json"), "w") as f:
        json.dump(result, f, default=str)
    print(f"{who} finished", flush=True)


if __name__ == "__main__":
    sys.exit(main())
