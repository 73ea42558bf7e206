"""``horovod.tensorflow.keras.elastic``'s names: :class:`KerasState` and the Keras callbacks
that keep an elastic state's ``batch`` and ``epoch`` and commit it, with ``run`` and the
states of :mod:`tarantella.horovod.elastic`.

The callbacks run on every rank. On Keras 3, :class:`UpdateBatchStateCallback` does not
shorten the first epoch after a reset (Horovod's changes ``params["steps"]``, which Keras 3's
loop does not read once it started): pass the remaining steps to ``fit`` for that.
"""

from __future__ import annotations

from typing import Any

import keras

from ..elastic import (
    HostsUpdatedInterrupt,
    KerasState,
    ObjectState,
    State,
    TensorFlowKerasState,
    TensorFlowState,
    run,
)

__all__ = ["CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` after every ``batches_per_commit`` train batches and at the end of
    each epoch (the count starts anew with each ``fit``, alike on every rank)."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the last train batch of the epoch (0 once the epoch ends)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of epochs done over every ``fit`` of the job: a
    ``fit`` called again after a reset counts its epochs from 0, on top of ``state.epoch``
    as that ``fit`` began."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
