"""Tarantella-NT for Keras 3: ``import tarantella as tnt; model = tnt.Model(keras_model)``.

Data-parallel, synchronous training that gives the weights of serial training with the same
global batch size, on any number of ranks. Start the script with ``tnt run -n N -- script.py``;
a plain ``python script.py`` is one rank.

Import tarantella before running TensorFlow code: importing it starts the rank runtime
(``tnt_core.init()``), gives this rank its GPU (or its share of CPU threads) and fixes the
default shuffle seed (``tarantella.environment``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import tnt_core as _tnt_core

from . import keras_backend as _keras_backend

try:  # before anything imports Keras: its own error for a missing backend is 20 lines
    _keras_backend.check_keras_backend()
except _keras_backend.NotSupportedError as _refusal:
    raise _refusal.with_traceback(None) from None

from . import environment as _environment

_environment.configure_process(_tnt_core.init())

from tnt_core import get_master_rank, get_rank, get_size, is_master_rank  # noqa: E402

# the model class of each strategy, which registers with tnt.Model in its class statement
from . import keras, models  # noqa: E402
from .collectives import (  # noqa: E402
    Barrier,
    Group,
    ReductionOp,
    TensorAllgatherer,
    TensorAllreducer,
    TensorBroadcaster,
    allgather,
    allreduce,
    broadcast,
    get_group_master_rank,
    is_group_master_rank,
)
from .data_parallel import model as _data_parallel_model  # noqa: E402, F401
from .data_parallel.weights import broadcast_variables  # noqa: E402
from .errors import DatasetError, NotSupportedError, PartitionError, TntKerasError  # noqa: E402
from .loops.data import DistributedDataset, distribute_dataset, set_batch_share  # noqa: E402
from .loops.gradients import DistributedGradientTape, DistributedOptimizer  # noqa: E402
from .model import Model, ParallelStrategy  # noqa: E402
from .pipeline import model as _pipelined_model  # noqa: E402, F401
from .pipeline.variables import deferred_build  # noqa: E402

try:
    __version__ = version("tnt-keras")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "DatasetError",
    "Model",
    "NotSupportedError",
    "ParallelStrategy",
    "PartitionError",
    "deferred_build",
    "TntKerasError",
    "get_master_rank",
    "get_rank",
    "get_size",
    "is_master_rank",
    # collectives a script calls, and groups of ranks (collectives)
    "Barrier",
    "Group",
    "ReductionOp",
    "TensorAllgatherer",
    "TensorAllreducer",
    "TensorBroadcaster",
    "allgather",
    "allreduce",
    "broadcast",
    "get_group_master_rank",
    "is_group_master_rank",
    # a training loop of your own (loop_data, loop_gradients, weights)
    "DistributedDataset",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "broadcast_variables",
    "distribute_dataset",
    "set_batch_share",
    "keras",
    "models",
    "__version__",
]
