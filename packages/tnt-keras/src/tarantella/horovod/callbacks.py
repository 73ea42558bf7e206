"""Horovod's Keras callbacks: ``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateScheduleCallback`` and ``LearningRateWarmupCallback``.

Each runs on every rank (it calls collectives or must decide alike everywhere). With a
``tnt.Model`` none is needed: its weights are broadcast before every ``fit``, and its logs
are exact (the metric states are summed over the ranks); they are harmless there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from numbers import Number
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from ..collectives import ReductionOp, allreduce
from ..data_parallel.weights import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every rank trains from ``root_rank``'s variables (the model's and the optimizer's).

    Horovod broadcasts after the first batch, when the optimizer has made its slots. Here the
    model's variables go out when training begins, so the first step already runs on the
    same weights everywhere (with every rank's own batch of the same size, training then
    equals serial training on their union); Keras builds the optimizer in the first step,
    so its variables follow after the first batch, as in Horovod (at the beginning when it
    exists by then, e.g. restored from a checkpoint).
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def _optimizer_variables(self) -> list[Any]:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not getattr(optimizer, "built", False):
            return []
        return list(optimizer.variables)

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = self._optimizer_variables()
        broadcast_variables(list(self.model.variables) + optimizer, root_rank=self.root_rank)
        self.broadcast_done = bool(optimizer) and bool(self.model.variables)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self.broadcast_done:  # what the first step built
            broadcast_variables(list(self.model.variables) + self._optimizer_variables(),
                                root_rank=self.root_rank)
            self.broadcast_done = True


def _is_number(value: Any) -> bool:
    if isinstance(value, (tf.Tensor, np.ndarray, np.generic)):
        dtype = np.dtype(value.dtype.as_numpy_dtype) if isinstance(value, tf.Tensor) else value.dtype
        return tuple(value.shape) == () and dtype.kind in "fiu"
    return isinstance(value, Number) and not isinstance(value, bool)


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, each numeric log is replaced by its average over the
    ranks, in place, so the callbacks after it (put it first) see the averages."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        numbers = {k: float(v) for k, v in logs.items() if _is_number(v)}
        if not numbers:
            return
        averaged = allreduce(numbers, reduction_op=ReductionOp.AVERAGE)
        logs.update(averaged)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch`` (excluded): once per epoch with ``staircase=True``, else every batch with a
    fractional epoch. ``multiplier`` is a function of the epoch, or a number ``m`` for
    ``m ** (epoch - start_epoch)``. ``momentum_correction`` scales a momentum by the change
    of the learning rate for that batch (``new / old``) where the momentum is a variable;
    Keras 3's SGD compiles its momentum into the step as a number, which cannot be changed
    per batch (a warning says so once).
    """

    def __init__(self, initial_lr: float | None, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("LearningRateScheduleCallback: pass initial_lr=, the learning rate "
                             "the multiplier applies to")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.current_epoch = 0
        self._restore_momentum: float | None = None
        self._warned = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(f"{type(self).__name__}: the number of steps per epoch is unknown "
                                 "(a dataset of unknown length); pass steps_per_epoch=")
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def _in_range(self) -> bool:
        return self.current_epoch >= self.start_epoch and (
            self.end_epoch is None or self.current_epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        momentum = getattr(optimizer, "momentum", None)
        if not self.momentum_correction or momentum is None or old == 0.0:
            return
        if isinstance(momentum, (tf.Variable, keras.Variable)):
            self._restore_momentum = float(keras.ops.convert_to_numpy(momentum))
            momentum.assign(self._restore_momentum * new / old)
        elif not self._warned and new != old and float(momentum) != 0.0:
            self._warned = True
            warnings.warn(f"{type(self).__name__}: the optimizer's momentum is a number compiled "
                          "into the training step; momentum correction is skipped", stacklevel=2)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if not self._in_range():
            return
        if self.staircase:
            if batch == 0:
                self._set(self.current_epoch)
        else:
            assert self.steps_per_epoch
            self._set(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warmup: the learning rate rises from ``initial_lr / size`` to
    ``initial_lr`` over ``warmup_epochs``, batch by batch, reaching it at the last batch of
    the last warmup epoch (for scripts that scale ``initial_lr`` with the number of ranks).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        size = tnt_core.init().size

        def multiplier(epoch: float) -> float:
            assert self.steps_per_epoch
            reached = epoch + 1.0 / self.steps_per_epoch  # the epochs done after this batch
            return (reached * (size - 1) / warmup_epochs + 1.0) / size

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and tnt_core.is_master_rank():
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: learning rate warmup done; learning rate {lr:g}")
