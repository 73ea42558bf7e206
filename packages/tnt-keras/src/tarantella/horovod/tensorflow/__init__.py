"""``horovod.tensorflow``'s path: ``import tarantella.horovod.tensorflow as hvd`` is
``import tarantella.horovod as hvd``, so that moving a Horovod script is one mechanical
rename of ``horovod`` to ``tarantella.horovod`` in its imports."""

from __future__ import annotations

from .. import (
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
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
