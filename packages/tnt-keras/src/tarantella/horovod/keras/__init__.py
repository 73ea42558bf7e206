"""``horovod.tensorflow.keras``'s names: ``import tarantella.horovod.keras as hvd``.

The same objects as :mod:`tarantella.horovod`: on TensorFlow 2 and Keras 3 one optimizer
wrapper and one set of collectives serve both of Horovod's modules.
"""

from __future__ import annotations

from .. import callbacks
from .._collectives import (
    Average,
    Compression,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    broadcast,
    broadcast_object,
    broadcast_variables,
)
from .._runtime import init, is_initialized, local_rank, local_size, rank, shutdown, size
from .._training import DistributedGradientTape, DistributedOptimizer
from . import elastic

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
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "elastic",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
