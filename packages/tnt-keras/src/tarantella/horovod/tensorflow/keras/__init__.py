"""``horovod.tensorflow.keras``'s path: ``import tarantella.horovod.tensorflow.keras as hvd``
is ``import tarantella.horovod.keras as hvd`` (its callbacks also as
``tarantella.horovod.tensorflow.keras.callbacks``)."""

from __future__ import annotations

from ...keras import (
    Average,
    Compression,
    DistributedGradientTape,
    DistributedOptimizer,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    broadcast,
    broadcast_variables,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from . import callbacks

__all__ = [
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_variables",
    "callbacks",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
