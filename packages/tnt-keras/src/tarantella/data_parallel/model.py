"""``tnt.Model(model)`` (``ParallelStrategy.DATA``): every rank a replica of the whole model,
each global batch split between them, trained with the results of serial training.

What the data-parallel model adds, only around Keras' own machinery:

* ``fit``/``evaluate``/``predict``/``*_on_batch`` turn the input into this rank's
  micro-batches through Keras' data adapters (``tarantella.datasets``) and run Keras' loop;
* the steps reduce gradients, metric states and logs across ranks (``tarantella.data_parallel.steps``);
* callbacks run on every rank or on the master only (``tarantella.callbacks``);
* the master's weights are broadcast before every ``fit``/``evaluate``/``predict``, and
  every rank folds its rank into the model's random seeds (``tarantella.randomness``).

Identity, saving and the class swap are the base's (:mod:`tarantella.model`); the checks of
the loops' arguments are :mod:`tarantella.arguments`'.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import keras
import tensorflow as tf

import tnt_core

from .. import _keras_compat, arguments, randomness, step_backup
from .. import callbacks as tnt_callbacks
from ..comm.gradients import GradientReducer
from ..datasets import (
    DistributedData,
    class_weights_as_sample_weights,
    prepare_data,
    shard_arrays,
    split_validation,
    unpack_validation,
)
from ..errors import NotSupportedError
from ..model import DistributedState, Model, ParallelStrategy
from ..pipeline.variables import initialize_whole
from ..reporting.tracebacks import user_facing
from ..reporting.user_frames import user_stacklevel
from . import joining, steps
from .batchnorm import synchronized_layers
from .compiled_update import wants_compiled_update
from .elastic import ElasticFunction, ElasticLoop
from .losses import normaliser, summed_terms, weigh_backward
from .steps import current_step, gradient_factor
from .weights import broadcast_model_state
from .xla import XlaStep, take_jit_compile

__all__ = ["DataParallelModel", "DataParallelState"]


def _joinable(name: str) -> Any:
    """Run the public loop ``name`` through ``DataParallelModel._tnt_joinable`` (fit's own
    validation, an evaluate inside it, is part of the fit)."""

    def decorate(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(self: DataParallelModel, *args: Any, **kwargs: Any) -> Any:
            if name == "evaluate" and _keras_compat.is_fit_validation(kwargs):
                return fn(self, *args, **kwargs)
            return self._tnt_joinable(name, lambda: fn(self, *args, **kwargs))

        return wrapper

    return decorate


class DataParallelState(DistributedState):
    """What a data-parallel model keeps besides its Keras state."""

    def __init__(self, runtime: tnt_core.Runtime, strategy: ParallelStrategy) -> None:
        super().__init__(runtime, strategy)
        self._reducers: dict[str, GradientReducer] = {}
        self.seeds_folded = False
        self.warned_batch_norm: set[str] = set()
        #: the model's BatchNormalization(synchronized=True) layers (tarantella.data_parallel.batchnorm)
        self.synchronized_bn: list[keras.layers.BatchNormalization] = []
        #: what _tnt_build made ready ("predict": the layers; "train": also metrics and
        #: optimizer), so *_on_batch, called every step, need not walk the model again
        self.ready: set[str] = set()
        #: compiles the steps' bodies with XLA when Keras' jit_compile resolved to True
        self.xla: XlaStep | None = None
        #: the optimizer's update is one XLA function in a step XLA does not compile
        #: (compile's jit_compile="auto" resolved to False: tarantella.data_parallel.compiled_update)
        self.compiled_update = False
        #: this fit's loop may call the step once more after the data ran out, so its update
        #: runs as TensorFlow ops this fit (see DataParallelModel._tnt_update_for)
        self.update_as_ops = False
        #: an elastic job's loop state (tarantella.data_parallel.elastic); None otherwise
        self.elastic: ElasticLoop | None = None

    def gradient_reducer(self, name: str) -> GradientReducer:
        reducer = self._reducers.get(name)
        if reducer is None:
            reducer = self._reducers[name] = GradientReducer(self.channel, name)
        return reducer


class DataParallelModel(Model, strategies=(ParallelStrategy.DATA,)):
    """The data-parallel ``tnt.Model`` (see the module doc); ``tnt.Model(model)`` makes it."""

    _tnt: DataParallelState

    @classmethod
    def _tnt_distribute(cls, model: keras.Model, strategy: ParallelStrategy,
                        num_micro_batches: Any, num_pipeline_stages: Any = None,
                        pipeline_schedule: Any = None, recompute: Any = None) -> Model:
        initialize_whole(model)  # built without values (tnt.deferred_build): trained whole
        state = DataParallelState(tnt_core.init(), strategy)
        distributed = cls._tnt_adopt(model, state)
        if state.runtime.membership is not None:  # an elastic job: survive a rank's departure
            state.elastic = ElasticLoop(distributed, state)
        else:  # (an elastic job goes on without a backup, and its joiners replay their own way)
            state.resumes_at_step = True
            state.step_backup_callback = step_backup.StepBackupAndRestore
        if getattr(distributed, "compiled", False):
            distributed._tnt_check_compiled()  # noqa: SLF001 (the model is this class's now)
        else:  # predict without compile: Keras resolves "auto" (XLA on a GPU machine)
            state.xla = take_jit_compile(distributed, state.runtime)
        return distributed

    # -- configuration ------------------------------------------------------------------------

    @user_facing
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """As ``keras.Model.compile``. ``jit_compile`` resolves as in Keras; when it is on, the
        step's body is compiled with XLA and its collectives run between the compiled parts
        (``tarantella.data_parallel.xla``), so ``self.jit_compile`` (Keras' outer function) reads
        False. When ``"auto"`` resolves to False (no GPU), the optimizer's update alone is
        compiled (``tarantella.data_parallel.compiled_update``)."""
        arguments.check_optimizer(kwargs.get("optimizer", args[0] if args else None))
        with _keras_compat.asks_auto_jit_compile(self) as auto:
            super().compile(*args, **kwargs)  # maybe the user's own compile(...) signature
        self._tnt_check_compiled()
        # "auto" that Keras resolved to no XLA: the update alone is compiled
        self._tnt.compiled_update = (bool(auto) and not any(auto)
                                     and wants_compiled_update("auto"))

    def _tnt_check_compiled(self) -> None:
        super()._tnt_check_compiled()
        self._tnt.xla = take_jit_compile(self, self._tnt.runtime)
        self._tnt.ready.clear()  # new metrics and optimizer to build

    # -- the steps (Keras' own or the user's, distributed) -------------------------------------

    def train_step(self, data: Any) -> Any:
        if not steps.is_distributed(data):
            raise steps.undistributed("train_step")
        return steps.train_step(self, data, super().train_step, self._tnt)

    def test_step(self, data: Any) -> Any:
        if not steps.is_distributed(data):
            raise steps.undistributed("test_step")
        return steps.test_step(self, data, super().test_step, self._tnt)

    def predict_step(self, data: Any) -> Any:
        if not steps.is_distributed(data):
            raise steps.undistributed("predict_step")
        return steps.predict_step(self, data, super().predict_step, self._tnt)

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                     sample_weight: Any = None, training: bool = True) -> Any:
        """Keras' (or the user's) loss; records its global normaliser for the step."""
        parent = super().compute_loss
        if "training" in inspect.signature(parent).parameters:
            loss = parent(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        else:
            loss = parent(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        step = current_step()
        if step is None or step.model is not self or step.loss is not None:
            return loss
        step.loss = step.returned_loss = loss
        if type(self)._tnt_base.compute_loss is keras.Model.compute_loss:  # noqa: SLF001
            step.normaliser = normaliser(self, y_pred, sample_weight, step.n, step.b)
        sums = summed_terms(step.added_losses, step.batch)
        if step.alone or (step.kind != "train" and not sums):  # alone: a sum counts once
            return loss
        if sums and step.compiled:
            raise NotSupportedError(
                "a layer adds a sum over the batch with add_loss(), which a step compiled with "
                "XLA cannot count once per rank: compile with jit_compile=False"
            )
        factor = gradient_factor(step, self._tnt)
        if sums:  # counted once per rank: divided by the weight the whole loss gets
            extra = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float64)) for t in sums])
            inverse = tf.math.divide_no_nan(tf.ones_like(factor), tf.stop_gradient(factor))
            loss = loss + tf.cast(extra * (inverse - 1.0), loss.dtype)
            step.loss = step.returned_loss = loss
        if step.kind != "train":
            return loss
        # Weigh the backward pass from its start, not only the gradients at the end: each
        # sample then carries the magnitudes of the serial one (see losses.weigh_backward).
        factor = tf.cast(factor, loss.dtype)
        step.prescaled = True
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:  # the timeline of the reducer that model.optimizer uses
            reducer = self._tnt.gradient_reducer(f"train_{optimizer.name}_0")
            if reducer.timeline is not None:
                reducer.mark_backprop_start(loss)
        step.returned_loss = tf.where(step.has_data, weigh_backward(loss, factor),
                                      tf.zeros_like(loss))
        return step.returned_loss

    # -- before a loop ---------------------------------------------------------------------------

    def _tnt_build(self, batch_spec: Any, distributed: bool = True, *, predict: bool = False) -> None:
        """Build model, metrics and optimizer before the first step, as Keras does under a
        distribution strategy, so that the master's state can be broadcast first. For
        ``predict``, the layers only (a symbolic call), as Keras' predict needs no metrics.
        What fails here (a wrong input shape, an unknown loss) is Keras' own error, as its
        first step would raise it."""
        if predict:
            if not all(layer.built for layer in [self, *_keras_compat.all_layers(self)]):
                x = batch_spec[0] if isinstance(batch_spec, tuple) else batch_spec
                self(keras.tree.map_structure(
                    lambda s: keras.KerasTensor(s.shape, s.dtype.name), x))
        else:
            try:
                _keras_compat.symbolic_build(self, batch_spec)
            except RuntimeError:
                # A model Keras cannot call on the data (a GAN: no call(), its step calls its
                # parts) trains in plain Keras, which builds lazily; its state is its parts'.
                if not all(layer.built for layer in _keras_compat.all_layers(self)):
                    raise
        self._tnt.synchronized_bn = synchronized_layers(_keras_compat.all_layers(self))
        self._tnt_check_layers(distributed)
        if not self._tnt.seeds_folded:
            randomness.fold_rank_into_seeds(self, self._tnt.runtime.rank)
            self._tnt.seeds_folded = True
        self._tnt.ready.update(("predict",) if predict else ("predict", "train"))

    def _tnt_check_layers(self, distributed: bool) -> None:
        runtime = self._tnt.runtime
        if runtime.size == 1 or not distributed:
            return
        for layer in _keras_compat.all_layers(self):
            if not isinstance(layer, keras.layers.BatchNormalization):
                continue
            if getattr(layer, "synchronized", False):
                continue  # the global batch's moments (tarantella.data_parallel.batchnorm)
            if layer.name not in self._tnt.warned_batch_norm and runtime.is_master:
                self._tnt.warned_batch_norm.add(layer.name)
                warnings.warn(
                    f"BatchNormalization layer {layer.name!r} computes its batch statistics on "
                    "each rank's micro-batch, not the global batch: training differs from serial "
                    "training (use synchronized=True for the global batch's statistics, increase "
                    "the micro-batch size, or use fewer ranks)",
                    stacklevel=user_stacklevel(),
                )

    def _tnt_broadcast(self) -> None:
        elastic = self._tnt.elastic
        if elastic is None:
            broadcast_model_state(self, self._tnt.runtime)
        else:
            elastic.host("weights", lambda: broadcast_model_state(self, self._tnt.runtime))
        self._tnt.needs_broadcast = False

    # -- an elastic job: Keras' step functions, redone over a new membership ---------------------

    def _tnt_rebound(self, channel: Any) -> None:
        super()._tnt_rebound(channel)
        if self._tnt.elastic is not None:  # Keras' loop may be running: it finds functions
            self._tnt.elastic.rebound()

    def _tnt_elastic_function(self, kind: str, attribute: str) -> Any:
        function = getattr(self, attribute)
        elastic = self._tnt.elastic
        if self._tnt.resumes_at_step and kind != "predict" and function is not None and \
                not isinstance(function, step_backup.SkippedWhileReplaying):
            function = step_backup.SkippedWhileReplaying(self, function)
            setattr(self, attribute, function)
        if elastic is not None and function is not None and not isinstance(function, ElasticFunction):
            function = ElasticFunction(elastic, kind, function)
            setattr(self, attribute, function)
        return function

    def make_train_function(self, force: bool = False) -> Any:
        if force or _no_function(self.train_function):
            super().make_train_function(force=True)
        return self._tnt_elastic_function("train", "train_function")

    def make_test_function(self, force: bool = False) -> Any:
        if force or _no_function(self.test_function):
            super().make_test_function(force=True)
        return self._tnt_elastic_function("test", "test_function")

    def make_predict_function(self, force: bool = False) -> Any:
        if force or _no_function(self.predict_function):
            super().make_predict_function(force=True)
        return self._tnt_elastic_function("predict", "predict_function")

    def reset_metrics(self) -> None:
        if self._tnt.elastic is not None:
            self._tnt.elastic.before_reset()
        super().reset_metrics()

    def _tnt_callbacks(self, callbacks: Any, *, verbose: Any, epochs: int, steps: int | None,
                       add_history: bool, data: list[DistributedData]) -> keras.callbacks.CallbackList:
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = callbacks.callbacks
        runtime = self._tnt.runtime
        wrapped = tnt_callbacks.distribute_callbacks(list(callbacks or []), self, runtime,
                                                     adapters=[d.adapter for d in data])
        master = runtime.is_master
        backups = [cb for cb in wrapped if isinstance(cb, step_backup.StepBackupAndRestore)]
        if backups and master and verbose != 0 and \
                not any(isinstance(cb, keras.callbacks.ProgbarLogger) for cb in wrapped):
            wrapped.append(step_backup.QuietProgbar())  # quiet while a resumed fit replays
        loop = self._tnt.elastic
        settings = dict(add_history=add_history, add_progbar=master and verbose != 0, model=self,
                        verbose=verbose if master else 0, epochs=epochs, steps=steps)
        if loop is None or not loop.joins:
            callback_list = keras.callbacks.CallbackList(wrapped, **settings)
            for backup in backups:  # History is Keras' (add_history): the backup holds it
                backup.callbacks = callback_list
            return callback_list
        # a joining rank replays the job's operations with the user's callbacks quiet
        callback_list = joining.ReplayingCallbacks(wrapped, replaying=lambda: loop.replaying,
                                                   **settings)
        if joining.ledger().depth <= 1:
            loop.callbacks = callback_list
        return callback_list

    def _tnt_joinable(self, name: str, run: Any) -> Any:
        """``run()``, the call ``name``; numbered, skipped or replayed by a joining rank
        when ranks may join the elastic job (``tarantella.data_parallel.joining``)."""
        loop = self._tnt.elastic
        if loop is None or not loop.joins:
            return run()
        return joining.run_call(self, loop, name, run)

    # -- the loops -------------------------------------------------------------------------------

    @user_facing
    @_joinable("fit")
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Any = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool = True, class_weight: Any = None,
            sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int = 1, *, tnt_micro_batch_size: int | None = None,
            tnt_validation_micro_batch_size: int | None = None,
            tnt_distribute_dataset: bool = True,
            tnt_distribute_validation_dataset: bool = True) -> keras.callbacks.History:
        """``keras.Model.fit``, data-parallel. ``batch_size`` and the dataset's batches are
        the *global* batch size.

        :param tnt_micro_batch_size: the per-rank batch size instead (global = micro x ranks);
            a dataset may then be unbatched.
        :param tnt_validation_micro_batch_size: the same for the validation data.
        :param tnt_distribute_dataset: False when every rank already gets its own data.
        :param tnt_distribute_validation_dataset: the same for the validation data.
        """
        callbacks = arguments.check_fit(
            self, x=x, y=y, sample_weight=sample_weight, validation_data=validation_data,
            callbacks=callbacks, batch_size=batch_size, epochs=epochs,
            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps, validation_batch_size=validation_batch_size,
            validation_freq=validation_freq, tnt_micro_batch_size=tnt_micro_batch_size,
            tnt_validation_micro_batch_size=tnt_validation_micro_batch_size)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight,
                                                                      validation_split)
        runtime = self._tnt.runtime
        elastic = self._tnt.elastic is not None
        train = prepare_data(x, y, sample_weight, batch_size=batch_size, shuffle=bool(shuffle),
                             micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                             class_weight=class_weight, steps=steps_per_epoch, purpose="training",
                             runtime=runtime, global_batches=elastic)
        loops = [train]
        val = None
        if validation_data is not None:
            vx, vy, vsw = unpack_validation(validation_data)
            val = prepare_data(vx, vy, vsw, batch_size=None if isinstance(vx, tf.data.Dataset) else
                               (validation_batch_size or batch_size),
                               micro_batch_size=tnt_validation_micro_batch_size,
                               distribute=tnt_distribute_validation_dataset, steps=validation_steps,
                               purpose="validation", runtime=runtime, global_batches=elastic)
            loops.append(val)
        self._tnt_build(train.batch_spec, train.distributed)
        self._tnt_update_for(train, steps_per_epoch)
        callback_list = self._tnt_callbacks(callbacks, verbose=verbose, epochs=epochs,
                                            steps=train.steps, add_history=True, data=loops)
        return super().fit(
            train.dataset,
            epochs=epochs,
            verbose=verbose if runtime.is_master else 0,
            callbacks=callback_list,
            validation_data=None if val is None else val.dataset,
            shuffle=False,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_freq=validation_freq,
        )

    def _tnt_update_for(self, train: Any, steps_per_epoch: int | None) -> None:
        """Whether this fit's step runs its optimizer's update compiled (compile's choice,
        :mod:`tarantella.data_parallel.compiled_update`) or as TensorFlow ops. Why: when
        Keras learns an epoch's end by running out of data (a dataset of unknown length, or
        ``steps_per_epoch`` over a finite one), it calls the step once more; that call
        fails at its input, but plain Keras' update ops that do not wait for the data
        (``optimizer.iterations += 1``) have run, so each such epoch counts one iteration
        more (Adam's bias correction reads it). A compiled update waits for the data as a
        whole, so it would count one less: there the update runs as Keras' ops, and the
        result stays plain Keras'. The step is traced anew when this changes."""
        state = self._tnt
        if not state.compiled_update:
            return
        card = int(train.dataset.cardinality())
        dries = card != tf.data.INFINITE_CARDINALITY and (steps_per_epoch is not None
                                                          or train.steps is None)
        if dries != state.update_as_ops:
            state.update_as_ops = dries
            self.train_function = None

    @user_facing
    @_joinable("evaluate")
    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None,
                 callbacks: Any = None, return_dict: bool = False, *,
                 tnt_micro_batch_size: int | None = None, tnt_distribute_dataset: bool = True,
                 **kwargs: Any) -> Any:
        """``keras.Model.evaluate``, data-parallel; the result equals serial evaluation."""
        if _keras_compat.is_fit_validation(kwargs):  # fit's validation: the data is ours already
            return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                    sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                    return_dict=return_dict, **kwargs)
        if kwargs:
            raise TypeError(f"evaluate() got unexpected arguments {sorted(kwargs)}")
        callbacks = arguments.check_evaluate(
            self, x=x, y=y, sample_weight=sample_weight, callbacks=callbacks,
            batch_size=batch_size, steps=steps, tnt_micro_batch_size=tnt_micro_batch_size)
        runtime = self._tnt.runtime
        data = prepare_data(x, y, sample_weight, batch_size=batch_size,
                            micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                            steps=steps, purpose="evaluation", runtime=runtime,
                            global_batches=self._tnt.elastic is not None)
        self._tnt_build(data.batch_spec, data.distributed)
        self._tnt_broadcast()
        callback_list = self._tnt_callbacks(callbacks, verbose=verbose, epochs=1, steps=data.steps,
                                            add_history=False, data=[data])
        return super().evaluate(data.dataset, verbose=verbose if runtime.is_master else 0,
                                steps=steps, callbacks=callback_list, return_dict=return_dict)

    @user_facing
    @_joinable("predict")
    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None, *,
                tnt_micro_batch_size: int | None = None,
                tnt_distribute_dataset: bool = True) -> Any:
        """``keras.Model.predict``, data-parallel; every rank returns the whole result, in order."""
        callbacks = arguments.check_predict(self, x=x, callbacks=callbacks, batch_size=batch_size,
                                            steps=steps, tnt_micro_batch_size=tnt_micro_batch_size)
        runtime = self._tnt.runtime
        data = prepare_data(x, None, None, batch_size=batch_size,
                            micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                            steps=steps, purpose="prediction", runtime=runtime,
                            global_batches=self._tnt.elastic is not None)
        self._tnt_build(data.batch_spec, data.distributed, predict=True)
        self._tnt_broadcast()
        self._tnt.predictions_gathered = data.distributed
        callback_list = self._tnt_callbacks(callbacks, verbose=verbose, epochs=1, steps=data.steps,
                                            add_history=False, data=[data])
        return super().predict(data.dataset, verbose=verbose if runtime.is_master else 0,
                               steps=steps, callbacks=callback_list)

    # -- single batches: the global batch, sharded ------------------------------------------------

    def _tnt_on_batch(self, batch: tuple, predict: bool = False) -> dict[str, Any]:
        runtime = self._tnt.runtime
        rows, n, b = shard_arrays(batch, runtime.rank, runtime.size)
        if ("predict" if predict else "train") not in self._tnt.ready:
            self._tnt_build(keras.tree.map_structure(_spec_of, rows), predict=predict)
        if self._tnt.needs_broadcast:
            self._tnt_broadcast()
        return steps.pack(rows, tf.constant([n, b], tf.int64))

    @user_facing
    @_joinable("train_on_batch")
    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Any = None, return_dict: bool = False) -> Any:
        """``keras.Model.train_on_batch`` on the *global* batch: every rank passes the same
        batch and takes its micro-batch; one step equal to a serial one."""
        arguments.check_compiled(self, "train_on_batch")
        if class_weight is not None:
            if sample_weight is not None:
                raise ValueError("pass either class_weight or sample_weight to train_on_batch, "
                                 "not both (as Keras)")
            sample_weight = class_weights_as_sample_weights(y, class_weight)
        packed = self._tnt_on_batch(_batch_tuple(x, y, sample_weight))
        return super().train_on_batch(packed, return_dict=return_dict)

    @user_facing
    @_joinable("test_on_batch")
    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                      return_dict: bool = False) -> Any:
        """``keras.Model.test_on_batch`` on the global batch (see :meth:`train_on_batch`)."""
        arguments.check_compiled(self, "test_on_batch")
        packed = self._tnt_on_batch(_batch_tuple(x, y, sample_weight))
        return super().test_on_batch(packed, return_dict=return_dict)

    @user_facing
    @_joinable("predict_on_batch")
    def predict_on_batch(self, x: Any) -> Any:
        """``keras.Model.predict_on_batch`` on the global batch; every rank gets all rows."""
        packed = self._tnt_on_batch((x,), predict=True)
        return super().predict_on_batch(packed)


def _no_function(function: Any) -> bool:
    """Whether Keras must make the step function (none, or an elastic job's emptied one)."""
    return function is None or (isinstance(function, ElasticFunction) and function.keras_function is None)


def _batch_tuple(x: Any, y: Any, sample_weight: Any) -> tuple:
    if sample_weight is not None:
        return (x, y, sample_weight)
    if y is not None:
        return (x, y)
    return (x,)


def _spec_of(v: Any) -> Any:
    t = tf.convert_to_tensor(v)
    return tf.TensorSpec(t.shape, t.dtype)
