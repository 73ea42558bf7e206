"""Keras callbacks in a data-parallel run (``tnt_wrap_callback`` for Keras).

Logs are the same on every rank and equal the serial ones (metric states are reduced every
step, ``tarantella.data_parallel.metrics``), so callbacks that *decide* (EarlyStopping, ReduceLROnPlateau,
LearningRateScheduler, TerminateOnNaN, user callbacks) run on every rank and decide
identically. Callbacks that *write* (ModelCheckpoint, BackupAndRestore, CSVLogger,
RemoteMonitor, TensorBoard) run on the master only; BackupAndRestore still restores on every
rank, so all ranks resume at the same epoch. TensorBoard runs on every rank, each writing to
``<log_dir>/rank_<r>``, when ``TNT_TENSORBOARD_ON_ALL_DEVICES=true``. The progress bar prints
on the master only.

Every callback gets the model itself (``self.model``). Saving from it is a collective
(``tarantella.files``); inside a master-only callback it writes on the master alone, still
atomically, since the other ranks are not there to wait. Each hook of a master-only
callback that may save runs through the model's ``DistributedState.master_writes`` on every
rank: for DATA that is the master running it alone; a pipelined model's other stages take
part in the master's saves there (they hold the other partitions).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

import tnt_core

from . import comm
from .data_parallel.weights import broadcast_model_state
from .files import local_writes, written_whole

__all__ = ["INTERNAL", "Callback", "distribute_callbacks", "wrap_callback"]

_HOOKS = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_test_begin", "on_test_end", "on_predict_begin", "on_predict_end",
    "on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end",
    "on_predict_batch_begin", "on_predict_batch_end", "on_batch_begin", "on_batch_end",
)

#: callbacks that write files or send data: master only
_WRITERS = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.CSVLogger,
    keras.callbacks.RemoteMonitor,
)
#: master-only callbacks that never save the model: the other ranks need not wait in their
#: hooks (any other master-only callback may save, e.g. a user's; see ``master_writes``)
_NOT_SAVING = (
    keras.callbacks.ProgbarLogger,
    keras.callbacks.CSVLogger,
    keras.callbacks.RemoteMonitor,
    keras.callbacks.TensorBoard,
    keras.callbacks.History,
)


class Callback(keras.callbacks.Callback):
    """Run a Keras callback in a distributed ``fit``/``evaluate``/``predict``.

    :param keras_callback: the callback to run.
    :param aggregate_logs: True (default): the callback sees the logs of the whole job
        (equal to the serial logs). False: the metrics in the logs are this rank's own,
        computed from the samples this rank processed, and ``predict``'s outputs this rank's
        rows (e.g. to look at one rank's data).
    :param run_on_all_ranks: True (default): run on every rank; False: on the master only
        (e.g. printing or timing). A master-only callback that stops training stops it on
        every rank.
    """

    keras_callback: keras.callbacks.Callback

    def __init__(self, keras_callback: keras.callbacks.Callback, aggregate_logs: bool = True,
                 run_on_all_ranks: bool = True, *, _master: bool | None = None,
                 _everywhere: Sequence[str] = ()) -> None:
        super().__init__()
        if isinstance(keras_callback, Callback):
            keras_callback = keras_callback.keras_callback
        if not isinstance(keras_callback, keras.callbacks.Callback):
            raise TypeError(f"tnt.keras.callbacks.Callback wraps a keras.callbacks.Callback, got "
                            f"{type(keras_callback).__name__}")
        for name, value in (("aggregate_logs", aggregate_logs), ("run_on_all_ranks", run_on_all_ranks)):
            if not isinstance(value, (bool, np.bool_)):  # 'no' would count as True
                raise TypeError(f"tnt.keras.callbacks.Callback({name}={value!r}): {name} must be "
                                f"True or False, not {type(value).__name__}")
        self.keras_callback = keras_callback
        self.aggregate_logs = bool(aggregate_logs)
        self.run_on_all_ranks = bool(run_on_all_ranks)
        self._is_master = tnt_core.is_master_rank() if _master is None else _master
        #: hooks that run on every rank even when the callback is master-only
        self._everywhere: frozenset[str] = frozenset(_everywhere)

    @property
    def runs_here(self) -> bool:
        """True when this callback runs (some of) its hooks on this rank."""
        return self.run_on_all_ranks or self._is_master or bool(self._everywhere)

    def _runs(self, hook: str) -> bool:
        return self.run_on_all_ranks or self._is_master or hook in self._everywhere

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if self.runs_here:
            self.keras_callback.set_params(params)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        if self.runs_here:
            self.keras_callback.set_model(model)

    def __repr__(self) -> str:
        where = "all ranks" if self.run_on_all_ranks else "master rank"
        return f"<tnt Callback {type(self.keras_callback).__name__} on {where}>"


#: hooks whose logs hold metrics of training ("train") or evaluation ("test")
_LOG_KIND = {"on_train_batch_end": "train", "on_batch_end": "train", "on_epoch_end": "epoch",
             "on_test_batch_end": "test", "on_test_end": "test", "on_predict_batch_end": "predict"}


def local_metric_logs(model: Any, increments: np.ndarray | None, prefix: str = "") -> dict[str, Any]:
    """The metric results of ``model`` for states equal to ``increments`` (this rank's own
    increments since the metrics were reset); the model's states are left unchanged."""
    variables = list(model.metrics_variables)
    saved = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
    offset = 0
    try:
        for v, old in zip(variables, saved):
            part = (increments[offset:offset + old.size] if increments is not None
                    else np.zeros(old.size))
            v.assign(part.reshape(old.shape).astype(old.dtype))
            offset += old.size
        results = model.get_metrics_result()
    finally:
        for v, old in zip(variables, saved):
            v.assign(old)
    return {prefix + k: (float(r) if np.ndim(r) == 0 else np.asarray(r))
            for k, r in ((k, keras.ops.convert_to_numpy(r)) for k, r in results.items())}


def _local_logs(callback: Callback, hook: str, logs: dict | None) -> dict | None:
    state = getattr(callback.model, "_tnt", None)
    kind = _LOG_KIND.get(hook)
    if logs is None or state is None or kind is None or state.runtime.size == 1:
        return logs  # one rank's own logs are the job's
    local = dict(logs)
    if kind == "predict":  # the global batch's predictions: this rank's rows of them
        outputs = logs.get("outputs")
        leaves = keras.tree.flatten(outputs)
        rows = state.own_rows(len(leaves[0])) if leaves else None
        if rows is not None:
            local["outputs"] = keras.tree.map_structure(lambda a: a[rows], outputs)
        return local
    train, test = state.local_increments("train").total, state.local_increments("test").total
    if kind in ("train", "epoch"):
        local.update(local_metric_logs(callback.model, train))
    if kind == "test":
        local.update(local_metric_logs(callback.model, test))
    if kind == "epoch" and any(k.startswith("val_") for k in logs):
        local.update(local_metric_logs(callback.model, test, "val_"))
    return {k: v for k, v in local.items() if k in logs}


def _make_hook(name: str):
    def hook(self: Callback, *args: Any, **kwargs: Any) -> None:
        state = getattr(self.model, "_tnt", None)
        if state is not None and state.replaying:  # a resumed fit replays: the backup has it
            return
        served = (not self.run_on_all_ranks and name not in self._everywhere and state is not None
                  and not isinstance(self.keras_callback, _NOT_SAVING))
        if not self._runs(name):
            if served and state is not None:  # the master's saves may need this rank (pipelining)
                state.master_writes(self.model, None)
            return
        if not self.aggregate_logs and name in _LOG_KIND:
            if "logs" in kwargs:
                kwargs["logs"] = _local_logs(self, name, kwargs["logs"])
            elif len(args) == (1 if name == "on_test_end" else 2):
                args = (*args[:-1], _local_logs(self, name, args[-1]))
        if self.run_on_all_ranks:
            getattr(self.keras_callback, name)(*args, **kwargs)
        elif served and state is not None:
            state.master_writes(self.model, lambda: getattr(self.keras_callback, name)(*args, **kwargs))
        else:  # the other ranks do not run this hook: nothing it writes may wait for them
            with local_writes():
                getattr(self.keras_callback, name)(*args, **kwargs)

    hook.__name__ = name
    hook.__doc__ = f"Run the wrapped callback's {name} where it runs."
    return hook


for _name in _HOOKS:
    setattr(Callback, _name, _make_hook(_name))


def _master_only(cb: keras.callbacks.Callback, master: bool, everywhere: Sequence[str] = ()) -> Callback:
    return Callback(cb, run_on_all_ranks=False, _master=master, _everywhere=everywhere)


class _KerasBackupAndRestore(Callback):
    """Keras' own ``BackupAndRestore`` run as Keras runs it (every rank restores at the epoch,
    the master writes), where tarantella's step backup does not apply (an elastic
    data-parallel job, ``steps_per_execution`` above 1). Its weights go through the model's
    atomic ``save_weights``; its small ``training_metadata.json``, which Keras writes in
    place, is written whole too (:func:`tarantella.files.written_whole`): a master killed in
    that write leaves the previous file, not an empty one that the resumed ``fit`` could not
    read."""

    def _metadata_whole(self) -> Any:
        """Where this rank writes (the master), Keras' metadata write made whole."""
        callback = self.keras_callback
        if not self._is_master:
            return contextlib.nullcontext()
        # double_checkpoint copies the file aside before it writes it
        return written_whole(callback, "_training_metadata_path",
                             keep_content=bool(getattr(callback, "double_checkpoint", False)))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        with self._metadata_whole():
            super().on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if getattr(self.keras_callback, "save_freq", "epoch") == "epoch":  # never saves here
            super().on_train_batch_end(batch, logs)
            return
        with self._metadata_whole():
            super().on_train_batch_end(batch, logs)


def wrap_callback(callback: keras.callbacks.Callback, context: dict[str, Any]) -> Any:
    """``tnt_wrap_callback`` for Keras: how ``callback`` runs on this rank."""
    if isinstance(callback, Callback):
        return callback
    rank = context.get("rank", tnt_core.get_rank())
    master = rank == tnt_core.get_master_rank()
    if isinstance(callback, keras.callbacks.ProgbarLogger):
        # as-is on the master, so Keras does not add a second one; silent elsewhere
        return callback if master else _master_only(callback, master)
    if isinstance(callback, keras.callbacks.History):
        return callback
    if isinstance(callback, keras.callbacks.TensorBoard):
        if tnt_core.read_setting("TNT_TENSORBOARD_ON_ALL_DEVICES"):
            callback.log_dir = os.path.join(str(callback.log_dir), f"rank_{rank}")
            return Callback(callback)
        return _master_only(callback, master)
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        model = context.get("model")
        state = getattr(model, "_tnt", None)
        if state is not None and state.resumes_at_step and getattr(model, "steps_per_execution", 1) == 1:
            return state.step_backup_callback(callback)
        # every rank restores (all resume at the same epoch); only the master writes
        return _KerasBackupAndRestore(callback, run_on_all_ranks=False, _master=master,
                                      _everywhere=("on_train_begin",))
    if isinstance(callback, _WRITERS):
        return _master_only(callback, master)
    return Callback(callback)


#: the attribute holding Keras' traced step of each kind of rank-local increments
_STEP_FUNCTION = {"train": "train_function", "test": "test_function"}


class _Coordinator(keras.callbacks.Callback):
    """tarantella's own callback, run last on every rank.

    * on_train_begin: broadcast the master's weights, after every other callback (e.g.
      BackupAndRestore) had its chance to load some;
    * when master-only callbacks exist, make a stop requested on the master stop every rank;
    * drive the epoch hooks of Keras' data adapters (a ``PyDataset``'s workers start and
      stop there), which Keras' loop now calls on the distributed dataset instead;
    * reset the rank-local metric increments when Keras resets the metrics, and have a step
      traced anew when it was traced without them and a callback now wants them (or the
      other way round: the native path back).
    """

    def __init__(self, runtime: tnt_core.Runtime, sync_stop: bool, local_logs: bool = False,
                 adapters: Sequence[Any] = (), broadcast_weights: bool = True) -> None:
        super().__init__()
        self.runtime = runtime
        self.broadcast_weights = broadcast_weights
        # in a job that ranks may join, whether to agree must not depend on the size now
        self.sync_stop = sync_stop and (runtime.size > 1 or _joins(runtime))
        self.local_logs = local_logs
        self.adapters = list(adapters)

    def _local(self, kind: str) -> Any:
        state = getattr(self.model, "_tnt", None)
        return None if state is None else state.local_increments(kind)

    def _adapter(self, index: int, hook: str) -> None:
        if 0 <= index < len(self.adapters) and self.adapters[index] is not None:
            getattr(self.adapters[index], hook)()

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        for kind in ("train", "test"):  # rank-local metrics only when a callback wants them
            local = self._local(kind)
            if local is None:
                continue
            # one rank's own logs are the job's (and its step calls no Python: see xla)
            local.enabled = self.local_logs and self.runtime.size > 1
            local.reset()
            if local.traced is not None and local.traced != local.enabled:
                # the step Keras holds records them only if it was traced wanting them: have
                # Keras trace it anew (as after compile) rather than pass the loop zeros
                setattr(model, _STEP_FUNCTION[kind], None)
                local.traced = None

    def _elastic(self) -> Any:
        """The model's elastic loop (``tarantella.data_parallel.elastic``), or None."""
        state = getattr(self.model, "_tnt", None)
        return getattr(state, "elastic", None)

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Keras' fit resets its epoch iterator before training (EpochIterator.reset): the
        # adapter's epoch ends once, so a PyDataset's on_epoch_end runs before the first epoch
        self._adapter(0, "on_epoch_end")
        if self.broadcast_weights:
            elastic = self._elastic()
            if elastic is None:
                broadcast_model_state(self.model, self.runtime)
            else:  # redone over the new membership when a rank leaves meanwhile
                elastic.host("weights", lambda: broadcast_model_state(self.model, self.runtime))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        local = self._local("train")  # Keras reset the metrics before this hook
        if local is not None:
            local.reset()
        self._adapter(0, "on_epoch_begin")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._adapter(0, "on_epoch_end")
        if self.sync_stop:
            self._sync_stop()

    def on_test_begin(self, logs: dict | None = None) -> None:
        local = self._local("test")
        if local is not None:
            local.reset()
        last = len(self.adapters) - 1
        self._adapter(last, "on_epoch_end")  # Keras' evaluate resets its iterator too
        self._adapter(last, "on_epoch_begin")

    def on_test_end(self, logs: dict | None = None) -> None:
        self._adapter(len(self.adapters) - 1, "on_epoch_end")

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._adapter(0, "on_epoch_begin")

    def on_predict_end(self, logs: dict | None = None) -> None:
        self._adapter(0, "on_epoch_end")

    def _sync_stop(self) -> None:
        mine = 1 if getattr(self.model, "stop_training", False) else 0

        def agree() -> int:
            flag = np.array([mine], dtype=np.int32)
            comm.world(self.runtime).backend.allreduce(flag, "max")
            return int(flag[0])

        elastic = self._elastic()
        if (agree() if elastic is None else int(elastic.host("sync", agree))):
            self.model.stop_training = True

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.sync_stop:
            self._sync_stop()


class _Position(keras.callbacks.Callback):
    """Tells tnt-core's stall inspector where this rank is (epoch, step, phase), so that a
    peer waiting for it can say so. Run first: a callback that hangs comes after it."""

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        tnt_core.report_position(epoch=epoch, step=None, phase="fit")

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        tnt_core.report_position(step=batch + 1, phase="fit")  # 1-based, as the progress bar

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        tnt_core.report_position(step=batch + 1, phase="evaluate")

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        tnt_core.report_position(step=batch + 1, phase="predict")


def distribute_callbacks(callbacks: Sequence[Any], model: Any, runtime: tnt_core.Runtime,
                         adapters: Sequence[Any] = (), *,
                         broadcast_weights: bool = True) -> list[keras.callbacks.Callback]:
    """The user's callbacks as they run on this rank, plus tarantella's coordinator.

    ``adapters``: Keras' data adapters of the loop (training first, then validation).
    ``broadcast_weights``: the master's model and optimizer state to every rank when
    training begins (a pipelined model's ranks hold different optimizer state: no).
    """
    hook = runtime.plugin_manager.hook.tnt_wrap_callback
    context = {"rank": runtime.rank, "size": runtime.size, "framework": "keras", "model": model}
    out: list[keras.callbacks.Callback] = [_Position()] if runtime.size > 1 else []
    for cb in callbacks:
        wrapped = hook(callback=cb, context=context)
        out.append(cb if wrapped is None else wrapped)
    sync_stop = any(isinstance(cb, Callback) and not cb.run_on_all_ranks
                    and not isinstance(cb.keras_callback, (keras.callbacks.ProgbarLogger, *_WRITERS,
                                                           keras.callbacks.TensorBoard,
                                                           keras.callbacks.BackupAndRestore))
                    for cb in out)
    local_logs = any(isinstance(cb, Callback) and not cb.aggregate_logs for cb in out)
    out.append(_Coordinator(runtime, sync_stop, local_logs, adapters, broadcast_weights))
    return out


#: tarantella's own callbacks (they run while a joining rank replays, see
#: ``tarantella.data_parallel.joining``)
INTERNAL = (_Coordinator, _Position)


def _joins(runtime: tnt_core.Runtime) -> bool:
    return getattr(runtime, "membership", None) is not None and runtime.config.elastic_joins
