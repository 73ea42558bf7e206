"""``tnt.Model``: the user's Keras model, trained data-parallel with the results of serial
training.

``tnt.Model(keras_model)`` returns *the same object*, now an instance of a subclass made
for its class: ``class Distributed<Cls>(tnt.Model, Cls)``. So it stays everything it was
(``isinstance(m, keras.Model)`` and ``isinstance(m, Cls)`` hold, it nests in other models,
``self.model`` in callbacks is it, ``keras.saving.save_model`` takes it), its layers,
weights, summary and config are untouched, and the user's own ``train_step``/
``compute_loss`` overrides still run: tnt.Model's methods come first in the method order and
call them through ``super()``. What it adds, only around Keras' own machinery:

* ``fit``/``evaluate``/``predict``/``*_on_batch`` turn the input into this rank's
  micro-batches through Keras' data adapters (``tarantella.datasets``) and run Keras' loop;
* the steps reduce gradients, metric states and logs across ranks (``tarantella.steps``);
* callbacks run on every rank or on the master only (``tarantella.callbacks``);
* the master's weights are broadcast before every ``fit``/``evaluate``/``predict``, and
  every rank folds its rank into the model's random seeds (``tarantella.randomness``);
* writing (``save``, ``save_weights``, ``export``) happens once, atomically
  (``tarantella.files``).

For serialization the distributed subclass reports the user's class as ``__class__``, so a
saved file is exactly the one plain Keras writes and loads without tarantella.
"""

from __future__ import annotations

import enum
import errno
import inspect
import os
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

# Keras' own class-weight map (what its data adapters apply); no public name for it
from keras.src.trainers.data_adapters.data_adapter_utils import class_weight_to_sample_weights

import tnt_core
from tnt_core import TntError

from . import callbacks as tnt_callbacks
from . import files, randomness, steps
from .batchnorm import synchronized_layers
from .datasets import DistributedData, prepare_data, shard_arrays, split_validation
from .errors import DatasetError, NotSupportedError, user_facing
from .gradients import GradientReducer
from .losses import normaliser
from .steps import LocalIncrements, current_step, gradient_factor
from .weights import broadcast_model_state
from .xla import XlaStep, take_jit_compile

__all__ = ["Model", "ParallelStrategy"]

_BN_MIN_MICRO_BATCH = 16


class ParallelStrategy(enum.Enum):
    """How a ``tnt.Model`` is parallelized: ``DATA`` (every rank a replica, the batch
    split), ``PIPELINING`` (the model cut at its SplitLayers, one partition per rank, the
    batch split into micro-batches that flow through them)."""

    DATA = "data"
    PIPELINING = "pipelining"
    ALL = "all"

    def __or__(self, other: object) -> ParallelStrategy:
        """``DATA | PIPELINING`` is ``ALL``, as in the original Tarantella."""
        if not isinstance(other, ParallelStrategy):
            return NotImplemented
        both = {self, other}
        if both == {ParallelStrategy.DATA, ParallelStrategy.PIPELINING} or ParallelStrategy.ALL in both:
            return ParallelStrategy.ALL
        return self


class _DistributedState:
    """What a distributed model keeps besides its Keras state (one per model)."""

    def __init__(self, runtime: tnt_core.Runtime, strategy: ParallelStrategy) -> None:
        self.runtime = runtime
        self.strategy = strategy
        self._reducers: dict[str, GradientReducer] = {}
        self._local = {"train": LocalIncrements(), "test": LocalIncrements()}
        self.seeds_folded = False
        self.warned_batch_norm: set[str] = set()
        #: the model's BatchNormalization(synchronized=True) layers (tarantella.batchnorm)
        self.synchronized_bn: list[keras.layers.BatchNormalization] = []
        self.needs_broadcast = True
        #: what _tnt_build made ready ("predict": the layers; "train": also metrics and
        #: optimizer), so *_on_batch, called every step, need not walk the model again
        self.ready: set[str] = set()
        #: compiles the steps' bodies with XLA when Keras' jit_compile resolved to True
        self.xla: XlaStep | None = None

    def gradient_reducer(self, name: str) -> GradientReducer:
        reducer = self._reducers.get(name)
        if reducer is None:
            reducer = self._reducers[name] = GradientReducer(self.runtime, name)
        return reducer

    def local_increments(self, kind: str) -> LocalIncrements:
        return self._local.setdefault(kind, LocalIncrements())


_CLASSES: dict[type, type] = {}


def _distributed_class(cls: type) -> type:
    """``Distributed<cls>(Model, cls)``, made once per class. It reports ``cls`` as its
    ``__class__`` so that Keras serializes its instances as plain ``cls`` objects."""
    sub = _CLASSES.get(cls)
    if sub is None:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "__class__": property(lambda self: cls, doc="The user's class (what Keras saves)."),
            "_tnt_base": cls,
        }
        sub = _CLASSES[cls] = type(cls.__name__, (Model, cls), namespace)
    return sub


#: strategies of the Tarantella design that this release does not implement
_NOT_IMPLEMENTED: dict[str, str] = {}
_ALIASES = {"pipeline": ParallelStrategy.PIPELINING}


def _strategy(value: Any) -> ParallelStrategy:
    if isinstance(value, ParallelStrategy):
        return value
    if isinstance(value, str) and value.lower() in [s.value for s in ParallelStrategy]:
        return ParallelStrategy(value.lower())
    if isinstance(value, str) and value.lower() in _ALIASES:
        return _ALIASES[value.lower()]
    what = _NOT_IMPLEMENTED.get(value.lower()) if isinstance(value, str) else None
    problem = (f"{what} is not implemented in this release" if what is not None
               else "not a parallel strategy")
    raise NotSupportedError(
        f"tnt.Model(parallel_strategy={value!r}): {problem}; use tnt.ParallelStrategy.DATA "
        "(or 'data', the default), tnt.ParallelStrategy.PIPELINING ('pipelining') or "
        "tnt.ParallelStrategy.ALL ('all')"
    )


def _distribute(model: Any, parallel_strategy: Any, num_micro_batches: Any = None) -> Model:
    strategy = _strategy(parallel_strategy)
    if num_micro_batches is not None and strategy is ParallelStrategy.DATA:
        raise TypeError(f"tnt.Model(num_micro_batches={num_micro_batches!r}) splits the batch "
                        "of a pipeline: pass it with parallel_strategy=tnt.ParallelStrategy."
                        "PIPELINING")
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise NotSupportedError(
            f"KERAS_BACKEND={backend}: tarantella trains Keras models on the TensorFlow backend "
            "only; run with KERAS_BACKEND=tensorflow (the default)"
        )
    if isinstance(model, Model):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"tnt.Model wraps a keras.Model (Sequential, functional or sub-classed); got "
            f"{type(model).__name__}"
        )
    if strategy is not ParallelStrategy.DATA:
        from .pipelined_model import pipelined

        return pipelined(model, 1 if num_micro_batches is None else num_micro_batches, strategy)
    object.__setattr__(model, "__class__", _distributed_class(type(model)))
    object.__setattr__(model, "_tnt", _DistributedState(tnt_core.init(), strategy))
    if getattr(model, "compiled", False):
        model._tnt_check_compiled()  # noqa: SLF001 (the model is a tnt.Model by now)
    else:  # predict without compile: Keras resolves "auto" (XLA on a GPU machine)
        model._tnt.xla = take_jit_compile(model, model._tnt.runtime)  # noqa: SLF001
    return model


class Model(keras.Model):
    """Distributed training of a ``keras.Model``: ``tnt.Model(model)`` returns ``model``,
    distributed; use it as the Keras model itself.

    :param model: the Keras model (its weights are broadcast from the master rank).
    :param parallel_strategy: ``tnt.ParallelStrategy.DATA`` (the default),
        ``PIPELINING`` (a functional model cut at its ``tnt.keras.layers.SplitLayer`` s, one
        partition per rank) or ``ALL`` (several pipelines, data-parallel); see the
        "Pipelining" guide.
    :param num_micro_batches: for ``PIPELINING``/``ALL``, the micro-batches each global
        batch is split into (default 1; ``num_pipeline_stages`` is the same).
    """

    _tnt: _DistributedState
    _tnt_base: type

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Model:
            model, strategy, micro = _model_arguments(*args, **kwargs)
            try:
                return _distribute(model, _strategy(strategy), micro)
            except (TntError, ValueError, TypeError) as exc:  # a refusal: at the user's call
                raise exc.with_traceback(None) from None
        base = cls.__dict__.get("_tnt_base")
        if base is None:
            raise TypeError(
                "tnt.Model is not a base class: subclass keras.Model and pass an instance to "
                "tnt.Model(...)"
            )
        return _distribute(base(*args, **kwargs), ParallelStrategy.DATA)  # e.g. from_config

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: ``__new__`` returned the user's model, initialised already."""

    # -- identity ---------------------------------------------------------------------------

    @property
    def keras_model(self) -> keras.Model:
        """The model itself (``tnt.Model`` distributes the user's model in place)."""
        return self

    @property
    def parallel_strategy(self) -> ParallelStrategy:
        return self._tnt.strategy

    def __repr__(self) -> str:
        runtime = self._tnt.runtime
        base = type(self)._tnt_base.__name__  # noqa: SLF001 (this class's own attribute)
        return f"<tnt.Model {self.name!r} ({base}) on rank {runtime.rank}/{runtime.size}>"

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        """A new ``tnt.Model`` from ``get_config()`` output (new weights)."""
        if cls is Model:
            from .models import model_from_config

            return model_from_config(config, custom_objects=custom_objects)
        base = cls.__dict__["_tnt_base"]
        made = (base.from_config(config) if custom_objects is None
                else base.from_config(config, custom_objects=custom_objects))
        return _distribute(made, ParallelStrategy.DATA)

    # -- configuration ------------------------------------------------------------------------

    @user_facing
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """As ``keras.Model.compile``. ``jit_compile`` resolves as in Keras; when it is on, the
        step's body is compiled with XLA and its collectives run between the compiled parts
        (``tarantella.xla``), so ``self.jit_compile`` (Keras' outer function) reads False."""
        optimizer = kwargs.get("optimizer", args[0] if args else None)
        if isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise ValueError(
                f"compile(optimizer={type(optimizer).__name__}(...)): a TensorFlow 1 optimizer "
                "(tf.compat.v1.train), which Keras 3 cannot use; pass a Keras optimizer, e.g. "
                "keras.optimizers.SGD(learning_rate=0.1), or its name, e.g. 'sgd'"
            )
        super().compile(*args, **kwargs)  # maybe the user's own compile(...) signature
        self._tnt_check_compiled()

    def _tnt_check_compiled(self) -> None:
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise NotSupportedError(
                f"optimizer {type(optimizer).__name__} is not a Keras 3 optimizer; use one from "
                "keras.optimizers (or a subclass of keras.optimizers.Optimizer)"
            )
        self._tnt.xla = take_jit_compile(self, self._tnt.runtime)
        self._tnt.needs_broadcast = True
        self._tnt.ready.clear()  # new metrics and optimizer to build

    def summary(self, *args: Any, **kwargs: Any) -> None:
        """Print the Keras summary, on the master rank only."""
        if self._tnt.runtime.is_master:
            super().summary(*args, **kwargs)

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
        step.loss = loss
        if type(self)._tnt_base.compute_loss is keras.Model.compute_loss:  # noqa: SLF001
            step.normaliser = normaliser(self, y_pred, sample_weight, step.n, step.b)
        if step.kind != "train":
            return loss
        # Weigh the loss, not only its gradient: each sample's backward pass then carries the
        # magnitudes of the serial one (a float16 layer overflows exactly when serial does).
        factor = tf.cast(gradient_factor(step, self._tnt), loss.dtype)
        step.prescaled = True
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:  # the timeline of the reducer that model.optimizer uses
            reducer = self._tnt.gradient_reducer(f"train_{optimizer.name}_0")
            if reducer.timeline is not None:
                reducer.mark_backprop_start(loss)
        return tf.where(step.has_data, loss * factor, tf.zeros_like(loss))

    # -- before a loop ---------------------------------------------------------------------------

    def _tnt_build(self, batch_spec: Any, distributed: bool = True, *, predict: bool = False) -> None:
        """Build model, metrics and optimizer before the first step, as Keras does under a
        distribution strategy, so that the master's state can be broadcast first. For
        ``predict``, the layers only (a symbolic call), as Keras' predict needs no metrics.
        What fails here (a wrong input shape, an unknown loss) is Keras' own error, as its
        first step would raise it."""
        if predict:
            if not all(layer.built for layer in [self, *_all_layers(self)]):
                x = batch_spec[0] if isinstance(batch_spec, tuple) else batch_spec
                self(keras.tree.map_structure(
                    lambda s: keras.KerasTensor(s.shape, s.dtype.name), x))
        else:
            self._symbolic_build(data_batch=batch_spec)
        self._tnt.synchronized_bn = synchronized_layers(_all_layers(self))
        self._tnt_check_layers(distributed)
        if not self._tnt.seeds_folded:
            randomness.fold_rank_into_seeds(self, self._tnt.runtime.rank)
            self._tnt.seeds_folded = True
        self._tnt.ready.update(("predict",) if predict else ("predict", "train"))

    def _tnt_check_layers(self, distributed: bool) -> None:
        runtime = self._tnt.runtime
        if runtime.size == 1 or not distributed:
            return
        for layer in _all_layers(self):
            if not isinstance(layer, keras.layers.BatchNormalization):
                continue
            if getattr(layer, "synchronized", False):
                continue  # the global batch's moments (tarantella.batchnorm)
            if layer.name not in self._tnt.warned_batch_norm and runtime.is_master:
                self._tnt.warned_batch_norm.add(layer.name)
                warnings.warn(
                    f"BatchNormalization layer {layer.name!r} computes its batch statistics on "
                    "each rank's micro-batch, not the global batch: training differs from serial "
                    "training (use synchronized=True for the global batch's statistics, increase "
                    "the micro-batch size, or use fewer ranks)",
                    stacklevel=4,
                )

    def _tnt_broadcast(self) -> None:
        broadcast_model_state(self, self._tnt.runtime)
        self._tnt.needs_broadcast = False

    def _tnt_callbacks(self, callbacks: Any, *, verbose: Any, epochs: int, steps: int | None,
                       add_history: bool, data: list[DistributedData]) -> keras.callbacks.CallbackList:
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = callbacks.callbacks
        runtime = self._tnt.runtime
        wrapped = tnt_callbacks.distribute_callbacks(list(callbacks or []), self, runtime,
                                                     adapters=[d.adapter for d in data])
        master = runtime.is_master
        return keras.callbacks.CallbackList(
            wrapped,
            add_history=add_history,
            add_progbar=master and verbose != 0,
            model=self,
            verbose=verbose if master else 0,
            epochs=epochs,
            steps=steps,
        )

    # -- the loops -------------------------------------------------------------------------------

    @user_facing
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
        self._assert_compile_called("fit")
        callbacks = _check_loop_arguments(
            "fit", callbacks, {"x": x, "y": y, "sample_weight": sample_weight,
                               "validation_data": validation_data},
            batch_size=batch_size, epochs=epochs, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
            tnt_micro_batch_size=tnt_micro_batch_size,
            tnt_validation_micro_batch_size=tnt_validation_micro_batch_size)
        _single_samples(self, "fit", "x", x, tnt_micro_batch_size)
        _single_samples(self, "fit", "validation_data", validation_data,
                        tnt_validation_micro_batch_size)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight,
                                                                      validation_split)
        runtime = self._tnt.runtime
        train = prepare_data(x, y, sample_weight, batch_size=batch_size, shuffle=bool(shuffle),
                             micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                             class_weight=class_weight, steps=steps_per_epoch, purpose="training",
                             runtime=runtime)
        loops = [train]
        val = None
        if validation_data is not None:
            vx, vy, vsw = _unpack_validation(validation_data)
            val = prepare_data(vx, vy, vsw, batch_size=None if _is_dataset(vx) else
                               (validation_batch_size or batch_size),
                               micro_batch_size=tnt_validation_micro_batch_size,
                               distribute=tnt_distribute_validation_dataset, steps=validation_steps,
                               purpose="validation", runtime=runtime)
            loops.append(val)
        self._tnt_build(train.batch_spec, train.distributed)
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

    @user_facing
    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None,
                 callbacks: Any = None, return_dict: bool = False, *,
                 tnt_micro_batch_size: int | None = None, tnt_distribute_dataset: bool = True,
                 **kwargs: Any) -> Any:
        """``keras.Model.evaluate``, data-parallel; the result equals serial evaluation."""
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: the data is ours already
            return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                    sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                    return_dict=return_dict, **kwargs)
        if kwargs:
            raise TypeError(f"evaluate() got unexpected arguments {sorted(kwargs)}")
        self._assert_compile_called("evaluate")
        callbacks = _check_loop_arguments(
            "evaluate", callbacks, {"x": x, "y": y, "sample_weight": sample_weight},
            batch_size=batch_size, steps=steps, tnt_micro_batch_size=tnt_micro_batch_size)
        _single_samples(self, "evaluate", "x", x, tnt_micro_batch_size)
        runtime = self._tnt.runtime
        data = prepare_data(x, y, sample_weight, batch_size=batch_size,
                            micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                            steps=steps, purpose="evaluation", runtime=runtime)
        self._tnt_build(data.batch_spec, data.distributed)
        self._tnt_broadcast()
        callback_list = self._tnt_callbacks(callbacks, verbose=verbose, epochs=1, steps=data.steps,
                                            add_history=False, data=[data])
        return super().evaluate(data.dataset, verbose=verbose if runtime.is_master else 0,
                                steps=steps, callbacks=callback_list, return_dict=return_dict)

    @user_facing
    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None, *,
                tnt_micro_batch_size: int | None = None,
                tnt_distribute_dataset: bool = True) -> Any:
        """``keras.Model.predict``, data-parallel; every rank returns the whole result, in order."""
        callbacks = _check_loop_arguments("predict", callbacks, {"x": x}, batch_size=batch_size,
                                          steps=steps, tnt_micro_batch_size=tnt_micro_batch_size)
        _single_samples(self, "predict", "x", x, tnt_micro_batch_size)
        runtime = self._tnt.runtime
        data = prepare_data(x, None, None, batch_size=batch_size,
                            micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                            steps=steps, purpose="prediction", runtime=runtime)
        self._tnt_build(data.batch_spec, data.distributed, predict=True)
        self._tnt_broadcast()
        callback_list = self._tnt_callbacks(callbacks, verbose=verbose, epochs=1, steps=data.steps,
                                            add_history=False, data=[data])
        return super().predict(data.dataset, verbose=verbose if runtime.is_master else 0,
                               steps=steps, callbacks=callback_list)

    # -- single batches: the global batch, sharded ------------------------------------------------

    def _tnt_on_batch(self, batch: tuple, predict: bool = False) -> dict[str, Any]:
        import tensorflow as tf

        runtime = self._tnt.runtime
        rows, n, b = shard_arrays(batch, runtime.rank, runtime.size)
        if ("predict" if predict else "train") not in self._tnt.ready:
            self._tnt_build(keras.tree.map_structure(_spec_of, rows), predict=predict)
        if self._tnt.needs_broadcast:
            self._tnt_broadcast()
        return steps.pack(rows, tf.constant([n, b], tf.int64))

    @user_facing
    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Any = None, return_dict: bool = False) -> Any:
        """``keras.Model.train_on_batch`` on the *global* batch: every rank passes the same
        batch and takes its micro-batch; one step equal to a serial one."""
        self._assert_compile_called("train_on_batch")
        if class_weight is not None:
            if sample_weight is not None:
                raise ValueError("pass either class_weight or sample_weight to train_on_batch, "
                                 "not both (as Keras)")
            sample_weight = class_weight_to_sample_weights(y, class_weight)
        packed = self._tnt_on_batch(_batch_tuple(x, y, sample_weight))
        return super().train_on_batch(packed, return_dict=return_dict)

    @user_facing
    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                      return_dict: bool = False) -> Any:
        """``keras.Model.test_on_batch`` on the global batch (see :meth:`train_on_batch`)."""
        self._assert_compile_called("test_on_batch")
        packed = self._tnt_on_batch(_batch_tuple(x, y, sample_weight))
        return super().test_on_batch(packed, return_dict=return_dict)

    @user_facing
    def predict_on_batch(self, x: Any) -> Any:
        """``keras.Model.predict_on_batch`` on the global batch; every rank gets all rows."""
        packed = self._tnt_on_batch((x,), predict=True)
        return super().predict_on_batch(packed)

    # -- weights, saving --------------------------------------------------------------------

    @user_facing
    def set_weights(self, weights: list) -> None:
        """As Keras; the master's weights are broadcast before the next step."""
        super().set_weights(weights)
        self._tnt.needs_broadcast = True

    @user_facing
    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """As Keras (every rank reads); the master's weights are broadcast before the next step."""
        path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
        if isinstance(path, str) and "://" not in path and not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        super().load_weights(filepath, *args, **kwargs)
        self._tnt.needs_broadcast = True

    @user_facing
    def save(self, filepath: Any, overwrite: bool = True, zipped: Any = None, *,
             tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """Save the model as Keras does (a plain Keras file). Call on every rank: the master
        writes (every rank with ``tnt_save_all_devices=True``), atomically, and all ranks
        return once the file is complete."""
        parent = super().save
        if zipped is not None:
            kwargs["zipped"] = zipped
        _check_suffix("save", filepath, kwargs)
        files.write_collectively(lambda path: parent(path, overwrite=True, **kwargs), filepath,
                                 overwrite=overwrite, all_devices=tnt_save_all_devices,
                                 runtime=self._tnt.runtime)

    @user_facing
    def save_weights(self, filepath: Any, overwrite: bool = True, *,
                     tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """Save the weights (``.weights.h5``); the master writes, as :meth:`save`."""
        parent = super().save_weights
        _check_suffix("save_weights", filepath, kwargs)
        files.write_collectively(lambda path: parent(path, overwrite=True, **kwargs), filepath,
                                 overwrite=overwrite, all_devices=tnt_save_all_devices,
                                 runtime=self._tnt.runtime)

    @user_facing
    def export(self, filepath: Any, *args: Any, tnt_save_all_devices: bool = False,
               **kwargs: Any) -> None:
        """``keras.Model.export``, written by the master only (every rank waits for it)."""
        parent = super().export
        files.write_collectively(lambda path: parent(path, *args, **kwargs), filepath,
                                 all_devices=tnt_save_all_devices, runtime=self._tnt.runtime)


# -- helpers ---------------------------------------------------------------------------------

def _check_suffix(method: str, filepath: Any, kwargs: dict[str, Any]) -> None:
    """Keras' own refusal of a file name it cannot save to, raised before the collective
    write (so every rank raises it, not only the writer); the cases Keras decides first or
    otherwise are left to Keras."""
    if not isinstance(filepath, (str, os.PathLike)):
        return
    path = str(filepath)
    if method == "save":
        if set(kwargs) - {"include_optimizer", "zipped"} or kwargs.get("zipped") is False \
                or path.startswith("hf://") or path.endswith((".keras", ".h5", ".hdf5")):
            return
        raise ValueError(  # Keras 3's message (keras.saving.save_model)
            "Invalid filepath extension for saving. Please add either a `.keras` extension for "
            "the native Keras format (recommended) or a `.h5` extension. Use "
            "`model.export(filepath)` if you want to export a SavedModel for use with "
            f"TFLite/TFServing/etc. Received: filepath={filepath}."
        )
    sharded = kwargs.get("max_shard_size") is not None
    if not path.endswith(("weights.h5", "weights.json") if sharded else ".weights.h5"):
        raise ValueError(  # Keras 3's messages (keras.saving.save_weights)
            "The filename must end in `.weights.json` when `max_shard_size` is specified. "
            f"Received: filepath={path}" if sharded
            else f"The filename must end in `.weights.h5`. Received: filepath={path}"
        )


#: the counting arguments of fit/evaluate/predict: (smallest value, what it is); each may be
#: None except ``epochs``, ``initial_epoch`` and ``validation_freq``
_COUNTS = {
    "batch_size": (1, "the global batch size"),
    "validation_batch_size": (1, "the global batch size of the validation data"),
    "epochs": (0, "the epoch to train up to"),
    "initial_epoch": (0, "the epoch to start from"),
    "steps_per_epoch": (1, "None: until the data is exhausted"),
    "validation_steps": (1, "None: until the validation data is exhausted"),
    "steps": (1, "None: until the data is exhausted"),
    "validation_freq": (1, "validate every that many epochs"),
    "tnt_micro_batch_size": (1, "the batch size of each rank"),
    "tnt_validation_micro_batch_size": (1, "the validation batch size of each rank"),
}
_NOT_NONE = ("epochs", "initial_epoch", "validation_freq")


def _is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _count_problem(name: str, value: Any) -> tuple[type[Exception], str] | None:
    """What is wrong with the counting argument ``name=value``, if anything."""
    smallest, meaning = _COUNTS[name]
    if value is None and name not in _NOT_NONE:
        return None
    if name == "validation_freq" and isinstance(value, (list, tuple)):  # epochs to validate at
        if all(_is_integer(v) and v >= 1 for v in value):
            return None
        return TypeError, "validation_freq must be an integer >= 1 or a list of epoch numbers >= 1"
    kind = "a positive integer" if smallest == 1 else "an integer >= 0"
    either = "" if name in _NOT_NONE else " or None"
    if not _is_integer(value):
        return TypeError, (f"{name} must be {kind}{either} ({meaning}), not "
                           f"{type(value).__name__}")
    if value < smallest:
        return ValueError, f"{name} must be {kind}{either} ({meaning})"
    return None


def _callbacks_problem(callbacks: Any) -> tuple[list[Any] | None, str | None]:
    """``callbacks`` as a list, as Keras takes it (a list, a tuple or a single callback), or
    what is wrong with it."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks, None
    items = keras.tree.flatten(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for index, cb in enumerate(items):
        if isinstance(cb, keras.callbacks.Callback):
            continue
        where = f"callbacks[{index}]" if isinstance(callbacks, (list, tuple)) else "callbacks"
        if isinstance(cb, type) and issubclass(cb, keras.callbacks.Callback):
            return None, (f"{where} is the class {cb.__name__}, not a callback: pass an instance, "
                          f"{cb.__name__}(...)")
        return None, (f"{where} is {type(cb).__name__} {cb!r:.40}, not a keras.callbacks.Callback; "
                      "pass a list of callback instances")
    return items, None


def _data_problem(name: str, data: Any) -> str | None:
    """A file name, or NumPy arrays of strings or objects, which Keras cannot feed to a model."""
    if isinstance(data, tf.data.Dataset) or data is None:
        return None
    if isinstance(data, (str, bytes, os.PathLike)):
        return (f"{name} is the {type(data).__name__} {data!r:.60}, not data: Keras does not "
                "read files; load it first, into NumPy arrays (e.g. numpy.loadtxt, "
                "pandas.read_csv) or a tf.data.Dataset (e.g. "
                "tf.data.experimental.make_csv_dataset), and pass that")
    try:
        arrays = [a for a in keras.tree.flatten(data) if isinstance(a, np.ndarray)]
    except (TypeError, ValueError):
        return None  # Keras' adapter will say what it cannot use
    for array in arrays:
        if array.dtype.kind in "USO":
            what = "Python objects" if array.dtype.kind == "O" else "strings"
            return (f"{name} holds a NumPy array of {what} (dtype {array.dtype}), which a Keras "
                    "model cannot take; convert it to numbers (e.g. with a StringLookup or "
                    "TextVectorization layer outside the model), or pass a tf.Tensor or "
                    "tf.data.Dataset of strings to a model with string inputs")
    return None


def _first_dimensions(data: Any) -> list[int] | None:
    """The first dimension of every array in ``data`` (NumPy arrays and tensors, nested);
    None when it holds anything else (Keras' adapters judge that)."""
    try:
        leaves = keras.tree.flatten(data)
    except (TypeError, ValueError):
        return None
    sizes = []
    for leaf in leaves:
        if leaf is None:
            continue
        if not isinstance(leaf, (np.ndarray, tf.Tensor)) or len(leaf.shape) == 0 \
                or leaf.shape[0] is None:
            return None
        sizes.append(int(leaf.shape[0]))
    return sizes


def _cardinality_problem(data: dict[str, Any]) -> str | None:
    """Arrays of ``x``, ``y``, ``sample_weight`` with different numbers of samples."""
    sizes: dict[str, list[int]] = {}
    for name, value in data.items():
        if value is None:
            continue
        found = _first_dimensions(value)
        if found is None:
            return None
        sizes[name] = found
    if len({n for found in sizes.values() for n in found}) < 2:
        return None
    names = list(sizes)
    listed = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
    counts = ", ".join(f"{name}: {'/'.join(map(str, dict.fromkeys(found)))}"
                       for name, found in sizes.items())
    return (f"{listed} have different numbers of samples ({counts}); every array must have "
            "one entry per sample along its first dimension")


def _check_loop_arguments(method: str, callbacks: Any, data: dict[str, Any],
                          **counts: Any) -> Any:
    """Check the arguments of ``fit``/``evaluate``/``predict`` before anything else runs (no
    collective yet; every rank has the same arguments, so all decide alike). One line that
    names the argument, as plain Keras would raise or better; returns ``callbacks`` as a list
    (Keras also takes a single callback or a tuple)."""
    for name, value in counts.items():
        problem = _count_problem(name, value)
        if problem is not None:
            raise problem[0](f"{method}({name}={value!r}): {problem[1]}")
    for name, value in data.items():
        message = _data_problem(name, value)
        if message is not None:
            raise TypeError(f"{method}({name}=...): {message}")
    arrays = {name: data.get(name) for name in ("x", "y", "sample_weight")}
    message = _cardinality_problem(arrays)
    if message is not None:
        given = ", ".join(f"{name}=..." for name, value in arrays.items() if value is not None)
        raise DatasetError(f"{method}({given}): {message}")
    validation = data.get("validation_data")
    if isinstance(validation, (list, tuple)) and len(validation) in (2, 3):
        message = _cardinality_problem(dict(zip(("x", "y", "sample_weight"), validation)))
        if message is not None:
            raise DatasetError(f"{method}(validation_data=...): its {message}")
    listed, message = _callbacks_problem(callbacks)
    if message is not None:
        raise TypeError(f"{method}(callbacks=...): {message}")
    return listed



def _single_samples(model: keras.Model, method: str, name: str, data: Any,
                    micro_batch_size: int | None) -> None:
    """Refuse a tf.data.Dataset of single samples (not batched) for a model with one input,
    where Keras' first step would fail on the rank of the input (before any collective)."""
    if not isinstance(data, tf.data.Dataset) or micro_batch_size is not None:
        return
    try:
        inputs = model.inputs  # a sub-classed model has none: its step will say
    except (AttributeError, ValueError):
        return
    if not inputs or len(inputs) != 1:
        return
    spec = data.element_spec
    if isinstance(spec, tuple) and spec:
        spec = spec[0]
    expected = tuple(inputs[0].shape)
    if (not isinstance(spec, tf.TensorSpec) or spec.shape.rank != len(expected) - 1
            or expected[-1] == 1  # Keras adds the last axis of size 1 itself
            or not tf.TensorShape(expected[1:]).is_compatible_with(spec.shape)):
        return
    raise DatasetError(
        f"{method}({name}=...): the tf.data.Dataset yields single samples (x of shape "
        f"{tuple(spec.shape)}; the model takes batches of shape {expected}): batch it with the "
        "global batch size (dataset.batch(global_batch_size)), or pass tnt_micro_batch_size= to "
        "let tarantella batch it"
    )


def _model_arguments(model: Any = None, parallel_strategy: Any = ParallelStrategy.DATA,
                     num_micro_batches: Any = None, **kwargs: Any) -> tuple[Any, Any, Any]:
    if "num_pipeline_stages" in kwargs:  # the original Tarantella's name for the same number
        stages = kwargs.pop("num_pipeline_stages")
        if num_micro_batches is not None and stages != num_micro_batches:
            raise TypeError(f"tnt.Model(num_micro_batches={num_micro_batches!r}, "
                            f"num_pipeline_stages={stages!r}): the same number by two names; "
                            "give one")
        num_micro_batches = stages
    if kwargs:
        raise TypeError(
            f"tnt.Model(model, parallel_strategy=...) got unexpected arguments {sorted(kwargs)}; "
            "build the Keras model first (keras.Model(inputs, outputs), Sequential, or a "
            "subclass) and pass it"
        )
    if model is None:
        raise TypeError("tnt.Model(model): pass the keras.Model to distribute")
    return model, parallel_strategy, num_micro_batches


def _all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer inside ``model``, nested models included (Keras' own traversal)."""
    return list(model._flatten_layers(include_self=False))  # noqa: SLF001 (no public equivalent)


def _is_dataset(x: Any) -> bool:
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


def _unpack_validation(validation_data: Any) -> tuple[Any, Any, Any]:
    if isinstance(validation_data, (list, tuple)):
        if len(validation_data) in (2, 3):
            vx, vy = validation_data[0], validation_data[1]
            vsw = validation_data[2] if len(validation_data) == 3 else None
            return vx, vy, vsw
        raise ValueError(
            "validation_data must be a dataset, a generator or a tuple (x, y) or "
            f"(x, y, sample_weight); got a {type(validation_data).__name__} of "
            f"{len(validation_data)} elements"
        )
    return validation_data, None, None


def _batch_tuple(x: Any, y: Any, sample_weight: Any) -> tuple:
    if sample_weight is not None:
        return (x, y, sample_weight)
    if y is not None:
        return (x, y)
    return (x,)


def _spec_of(v: Any) -> Any:
    import tensorflow as tf

    t = tf.convert_to_tensor(v)
    return tf.TensorSpec(t.shape, t.dtype)
