"""Horovod's TensorFlow 2 API on tarantella: ``import tarantella.horovod as hvd`` in place of
``import horovod.tensorflow as hvd`` (``tarantella.horovod.keras`` for
``horovod.tensorflow.keras``), and the script runs with ``tnt run -n N -- script.py``;
``import tarantella.horovod as horovod`` gives ``horovod.run`` (its ranks started by ``tnt run``).

The names keep Horovod's meaning: ``hvd.DistributedGradientTape`` and
``hvd.DistributedOptimizer`` average the gradients (``op=hvd.Sum`` sums them), through
tarantella's fused, native gradient path; ``hvd.allreduce`` averages by default. For serial
results with any batch (a short last batch included), use ``tnt.distribute_dataset`` with
``tnt.DistributedGradientTape``/``tnt.DistributedOptimizer``, which weigh each rank by its
share of the global batch (see the guide "Custom training loops and Horovod scripts").
``hvd.elastic`` is Horovod's elastic API: under ``tnt run --min-np`` a function decorated
with ``hvd.elastic.run`` goes on over the ranks that are left when ranks die.
"""

from __future__ import annotations

from . import _keras2, callbacks, elastic
from ._collectives import (
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
from ._launch import run
from ._runtime import init, is_initialized, local_rank, local_size, rank, shutdown, size
from ._training import DistributedGradientTape, DistributedOptimizer

_keras2.install()  # Horovod's Keras 2 spellings: compile(experimental_run_tf_function=), opt.variables()

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
    "run",
    "shutdown",
    "size",
]
