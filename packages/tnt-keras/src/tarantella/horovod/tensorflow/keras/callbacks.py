"""``horovod.tensorflow.keras.callbacks``'s path: the callbacks of
:mod:`tarantella.horovod.callbacks`."""

from __future__ import annotations

from ...callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
