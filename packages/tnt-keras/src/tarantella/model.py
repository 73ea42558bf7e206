"""``tnt.Model``: a Keras model trained data-parallel, with the results of serial training.

``tnt.Model(keras_model)`` behaves as the Keras model (attributes, layers, weights, compile,
summary...); ``fit``, ``evaluate`` and ``predict`` run on every rank with this rank's
micro-batches. Keras' own loop runs them (callbacks, progress bar, validation, History are
Keras'); tarantella supplies the per-rank data (``tarantella.datasets``), the distributed
steps (``tarantella.steps``) and the distributed callbacks (``tarantella.callbacks``), and
broadcasts the master's weights before the first step of every ``fit``/``evaluate``/
``predict`` (so weights set or loaded on the master alone are used everywhere).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import keras
import tnt_core
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

from . import callbacks as tnt_callbacks
from .datasets import DistributedData, prepare_data, split_validation
from .errors import NotSupportedError
from .steps import DistributedSteps
from .weights import broadcast_model_state

__all__ = ["Model", "ParallelStrategy"]

_STEPS = ("train_step", "test_step", "predict_step")
_FUNCTIONS = ("train_function", "test_function", "predict_function")
_BN_MIN_MICRO_BATCH = 16
#: loss reductions that average over the batch's elements: the n / B weighting is exact
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


class ParallelStrategy(enum.Enum):
    """How a ``tnt.Model`` is parallelized (data parallelism is the one there is)."""

    DATA = "data"


def _check_model(model: Any) -> keras.Model:
    if isinstance(model, Model):
        return model.keras_model
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"tnt.Model wraps a keras.Model (Sequential, functional or sub-classed); got "
            f"{type(model).__name__}"
        )
    for name in _STEPS:
        if getattr(type(model), name) is not getattr(TensorFlowTrainer, name):
            raise NotSupportedError(
                f"{type(model).__name__} overrides {name}(): a custom train/test/predict step "
                "is a custom training loop, which tarantella cannot distribute. Override "
                "compute_loss() and compute_metrics() instead (tarantella calls them), or "
                "train the Keras model without tnt.Model"
            )
    return model


class Model:
    """Data-parallel wrapper of a ``keras.Model``; use it as the Keras model itself.

    :param model: the Keras model (its weights are broadcast from the master rank).
    :param parallel_strategy: ``tnt.ParallelStrategy.DATA`` (the default; the only one).
    """

    # attributes of the wrapper itself; everything else lives on the Keras model
    _OWN = ("_tnt_model", "_tnt_runtime", "_tnt_steps", "_tnt_functions", "_tnt_compile_token")

    def __init__(self, model: keras.Model, parallel_strategy: ParallelStrategy | str = ParallelStrategy.DATA) -> None:
        if ParallelStrategy(parallel_strategy.value if isinstance(parallel_strategy, ParallelStrategy)
                            else parallel_strategy) is not ParallelStrategy.DATA:
            raise NotSupportedError("only data parallelism is supported")
        keras_model = _check_model(model)
        object.__setattr__(self, "_tnt_model", keras_model)
        object.__setattr__(self, "_tnt_runtime", tnt_core.init())
        object.__setattr__(self, "_tnt_steps", DistributedSteps(keras_model, self._tnt_runtime))
        object.__setattr__(self, "_tnt_functions", {})
        object.__setattr__(self, "_tnt_compile_token", None)
        if getattr(keras_model, "compiled", False):
            self._check_compiled()

    # -- delegation --------------------------------------------------------------------------

    @property
    def keras_model(self) -> keras.Model:
        """The wrapped Keras model (the same weights; training it directly is serial)."""
        return self._tnt_model

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_tnt_"):
            raise AttributeError(name)
        return getattr(self._tnt_model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # e.g. callbacks setting model.stop_training
            setattr(self._tnt_model, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._tnt_model, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self._tnt_model)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tnt_model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<tnt.Model of {self._tnt_model!r} on rank {self._tnt_runtime.rank}/{self._tnt_runtime.size}>"

    # -- configuration ------------------------------------------------------------------------

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, *args: Any, **kwargs: Any) -> None:
        """As ``keras.Model.compile``; XLA is switched off (the step calls into Python)."""
        if kwargs.get("jit_compile") is True:
            warnings.warn("tnt.Model runs the collectives from Python inside the step, which XLA "
                          "cannot compile; using jit_compile=False", stacklevel=2)
        kwargs["jit_compile"] = False
        self._tnt_model.compile(optimizer, loss, *args, **kwargs)
        self._check_compiled()

    def _check_compiled(self) -> None:
        model = self._tnt_model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise NotSupportedError(
                f"optimizer {type(optimizer).__name__} is not a Keras 3 optimizer; use one from "
                "keras.optimizers (or a subclass of keras.optimizers.Optimizer)"
            )
        if getattr(model, "jit_compile", False):
            model.jit_compile = False
        losses = keras.tree.flatten(getattr(model, "loss", None) or [])
        for loss in losses:
            reduction = getattr(loss, "reduction", "sum_over_batch_size")
            if isinstance(loss, keras.losses.Loss) and reduction not in _MEAN_REDUCTIONS:
                warnings.warn(
                    f"loss {loss.name!r} uses reduction={reduction!r}: tarantella weights each "
                    "rank's gradient by micro-batch / global batch, which gives the serial gradient "
                    "for a loss averaged over the batch (Keras' default 'sum_over_batch_size'); "
                    "with this reduction distributed training differs from serial training. "
                    "Use the default reduction",
                    stacklevel=3,
                )
        self._tnt_functions.clear()
        object.__setattr__(self, "_tnt_compile_token", getattr(model, "_compile_config", None))

    def summary(self, *args: Any, **kwargs: Any) -> None:
        """Print the Keras summary, on the master rank only."""
        if self._tnt_runtime.is_master:
            self._tnt_model.summary(*args, **kwargs)

    # -- distributed loop ---------------------------------------------------------------------

    @contextmanager
    def _distributed(self) -> Iterator[keras.Model]:
        """Put the distributed steps (and the step functions traced from them) in place."""
        model = self._tnt_model
        if getattr(model, "_compile_config", None) is not self._tnt_compile_token:
            self._check_compiled()  # compiled again behind our back: trace again
        saved = {name: model.__dict__.get(name) for name in _STEPS + _FUNCTIONS}
        for name in _STEPS:
            object.__setattr__(model, name, getattr(self._tnt_steps, name))
        for name in _FUNCTIONS:
            object.__setattr__(model, name, self._tnt_functions.get(name))
        try:
            yield model
        finally:
            for name in _FUNCTIONS:
                self._tnt_functions[name] = getattr(model, name, None)
            for name, value in saved.items():
                if name in _STEPS:
                    if value is None:
                        model.__dict__.pop(name, None)
                    else:
                        object.__setattr__(model, name, value)
                else:
                    object.__setattr__(model, name, value)

    def _build(self, data: DistributedData) -> None:
        model = self._tnt_model
        try:
            model._symbolic_build(data_batch=data.batch_spec)  # noqa: SLF001
        except Exception as exc:
            raise type(exc)(
                f"{exc}\n(tarantella builds the model, its metrics and optimizer before the "
                "first step so that the master's weights can be broadcast; build the model "
                "yourself by calling it on a batch before fit/evaluate/predict)"
            ) from exc

    def _warn_batch_norm(self, data: DistributedData) -> None:
        if not data.distributed or not data.micro_batch_sizes or self._tnt_runtime.size == 1:
            return  # one rank computes the serial statistics
        smallest = min(data.micro_batch_sizes)
        if smallest >= _BN_MIN_MICRO_BATCH:
            return
        bn = [layer.name for layer in self._tnt_model._flatten_layers()  # noqa: SLF001
              if isinstance(layer, keras.layers.BatchNormalization)]
        if bn and self._tnt_runtime.is_master:
            warnings.warn(
                f"BatchNormalization layer(s) {', '.join(bn[:5])} see micro-batches of "
                f"{smallest} samples (< {_BN_MIN_MICRO_BATCH}): batch statistics are computed "
                "per rank and will differ from serial training; increase the global batch size "
                "or use fewer ranks",
                stacklevel=3,
            )

    def _callbacks(self, callbacks: Any, *, verbose: Any, epochs: int, steps: int | None,
                   add_history: bool) -> keras.callbacks.CallbackList:
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = callbacks.callbacks
        runtime = self._tnt_runtime
        wrapped = tnt_callbacks.distribute_callbacks(list(callbacks or []), self, runtime)
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

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Any = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool = True, class_weight: Any = None,
            sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int = 1, *, tnt_micro_batch_size: int | None = None,
            tnt_validation_micro_batch_size: int | None = None,
            tnt_distribute_dataset: bool = True,
            tnt_distribute_validation_dataset: bool = True) -> keras.callbacks.History:
        """``keras.Model.fit``, data-parallel. ``batch_size`` and the dataset's batch size are
        the *global* batch size.

        :param tnt_micro_batch_size: the per-rank batch size instead (global = micro x ranks);
            the dataset may then be unbatched.
        :param tnt_validation_micro_batch_size: the same for the validation data.
        :param tnt_distribute_dataset: False when every rank already gets its own data.
        :param tnt_distribute_validation_dataset: the same for the validation data.
        """
        model = self._tnt_model
        model._assert_compile_called("fit")  # noqa: SLF001
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight, validation_split)
        runtime = self._tnt_runtime
        train = prepare_data(x, y, sample_weight, batch_size=batch_size, shuffle=bool(shuffle),
                             micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                             class_weight=class_weight, steps=steps_per_epoch, purpose="training",
                             runtime=runtime)
        val = None
        if validation_data is not None:
            vx, vy, vsw = _unpack_validation(validation_data)
            val = prepare_data(vx, vy, vsw, batch_size=validation_batch_size or
                               (batch_size if not isinstance(vx, _tf_dataset()) else None),
                               shuffle=False, micro_batch_size=tnt_validation_micro_batch_size,
                               distribute=tnt_distribute_validation_dataset, steps=validation_steps,
                               purpose="validation", runtime=runtime)
        self._build(train)
        self._warn_batch_norm(train)
        callback_list = self._callbacks(callbacks, verbose=verbose, epochs=epochs,
                                        steps=train.steps, add_history=True)
        with self._distributed():
            return model.fit(
                train.dataset,
                epochs=epochs,
                verbose=verbose if runtime.is_master else 0,
                callbacks=callback_list,
                shuffle=False,  # the data is shuffled (or not) by prepare_data
                validation_data=val.dataset if val is not None else None,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps,
                validation_freq=validation_freq,
            )

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None,
                 callbacks: Any = None, return_dict: bool = False, *,
                 tnt_micro_batch_size: int | None = None,
                 tnt_distribute_dataset: bool = True) -> Any:
        """``keras.Model.evaluate``, data-parallel; the result equals serial evaluation."""
        model = self._tnt_model
        model._assert_compile_called("evaluate")  # noqa: SLF001
        runtime = self._tnt_runtime
        data = prepare_data(x, y, sample_weight, batch_size=batch_size, shuffle=False,
                            micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                            steps=steps, purpose="evaluation", runtime=runtime)
        self._build(data)
        broadcast_model_state(model, runtime)
        callback_list = self._callbacks(callbacks, verbose=verbose, epochs=1, steps=data.steps,
                                        add_history=False)
        with self._distributed():
            return model.evaluate(data.dataset, verbose=verbose if runtime.is_master else 0,
                                  steps=steps, callbacks=callback_list, return_dict=return_dict)

    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None, *,
                tnt_micro_batch_size: int | None = None,
                tnt_distribute_dataset: bool = True) -> Any:
        """``keras.Model.predict``, data-parallel; every rank returns the whole result, in order."""
        model = self._tnt_model
        runtime = self._tnt_runtime
        data = prepare_data(x, None, None, batch_size=batch_size, shuffle=False,
                            micro_batch_size=tnt_micro_batch_size, distribute=tnt_distribute_dataset,
                            steps=steps, purpose="prediction", runtime=runtime)
        self._build(data)
        broadcast_model_state(model, runtime)
        callback_list = self._callbacks(callbacks, verbose=verbose, epochs=1, steps=data.steps,
                                        add_history=False)
        with self._distributed():
            return model.predict(data.dataset, verbose=verbose if runtime.is_master else 0,
                                 steps=steps, callbacks=callback_list)

    # -- what tarantella cannot distribute ------------------------------------------------------

    def _no_single_batch(self, name: str) -> None:
        raise NotSupportedError(
            f"tnt.Model.{name} is not supported: a single-batch call is a custom training loop, "
            f"which tarantella cannot distribute. Use fit/evaluate/predict with a dataset "
            f"(or use model.keras_model.{name} for serial work on one rank)"
        )

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        self._no_single_batch("train_on_batch")

    def test_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        self._no_single_batch("test_on_batch")

    def predict_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        self._no_single_batch("predict_on_batch")

    # -- weights, saving --------------------------------------------------------------------

    def set_weights(self, weights: list) -> None:
        """As Keras; the master's weights are broadcast before the next step."""
        self._tnt_model.set_weights(weights)

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """As Keras (every rank reads); the master's weights are broadcast before the next step."""
        self._tnt_model.load_weights(filepath, *args, **kwargs)

    def save(self, filepath: Any, overwrite: bool = True, *, tnt_save_all_devices: bool = False,
             **kwargs: Any) -> None:
        """Save the model (``.keras``). Call on every rank: the master writes (every rank with
        ``tnt_save_all_devices=True``) and all ranks return once the file is complete."""
        from .models import save_model

        save_model(self, filepath, overwrite=overwrite, tnt_save_all_devices=tnt_save_all_devices, **kwargs)

    def save_weights(self, filepath: Any, overwrite: bool = True, *, tnt_save_all_devices: bool = False,
                     **kwargs: Any) -> None:
        """Save the weights (``.weights.h5``); the master writes, as :meth:`save`."""
        from .models import write_on_master

        write_on_master(lambda path: self._tnt_model.save_weights(path, overwrite=True, **kwargs),
                        filepath, overwrite=overwrite, all_devices=tnt_save_all_devices,
                        runtime=self._tnt_runtime)

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Model:
        """A new ``tnt.Model`` from ``get_config()`` output (new weights)."""
        from .models import model_from_config

        return model_from_config(config, custom_objects=custom_objects)


def _tf_dataset() -> type:
    import tensorflow as tf

    return tf.data.Dataset


def _unpack_validation(validation_data: Any) -> tuple[Any, Any, Any]:
    if isinstance(validation_data, _tf_dataset()):
        return validation_data, None, None
    if isinstance(validation_data, (list, tuple)) and len(validation_data) in (2, 3):
        vx, vy = validation_data[0], validation_data[1]
        vsw = validation_data[2] if len(validation_data) == 3 else None
        return vx, vy, vsw
    raise ValueError(
        "validation_data must be a tf.data.Dataset or a tuple (x, y) or (x, y, sample_weight)"
    )

