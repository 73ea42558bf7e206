"""Data for a training loop of your own: this rank's part of every global batch, and its share.

``tnt.distribute_dataset(dataset)`` splits each batch of a ``tf.data.Dataset`` batched with
the *global* batch size exactly as ``fit`` does (``tarantella.datasets``: rank ``r`` of
``R`` takes ``B // R`` samples, one more for the first ``B % R`` ranks; a rank left without
a sample gets one stand-in sample). Its elements have the structure of the user's, so the
body of a loop written for serial Keras stays as it is.

Serial results need each rank's gradient weighted by its share ``n_r / B`` of the global
batch (the loss is a mean over the micro-batch), and the share changes from batch to batch
(a short last batch, stand-ins with ``n = 0``). The gradient reduction reads it from one
int64 variable per process, ``[n, B]``, which the distributed dataset's iterator sets as it
hands out each micro-batch. A variable, because the user's step is usually a ``tf.function``
traced once: the traced graph reads the share of the batch it runs on, at run time. So the
share is right when the loop takes its batches from the distributed dataset in Python (the
Keras guide's ``for step, (x, y) in enumerate(dataset)``) and computes the gradients of each
batch before taking the next. Other loops set it with :func:`set_batch_share`. Until then it
is ``[1, R]``: equal shares, which is Horovod's average.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tensorflow as tf

import tnt_core

from ..data_parallel.steps import BATCH_KEY, INFO_KEY
from ..datasets import without_autotune_on_one_cpu
from ..errors import DatasetError, NotSupportedError
from ..reporting.tracebacks import user_facing

__all__ = ["BatchShare", "DistributedDataset", "batch_share", "distribute_dataset", "set_batch_share"]


class BatchShare:
    """This rank's share of the global batch it trains on now: ``[n, B]`` in a variable."""

    def __init__(self, runtime: tnt_core.Runtime) -> None:
        with tf.init_scope():  # made eagerly even when first needed while a step is traced
            self.variable = tf.Variable([1, runtime.size], dtype=tf.int64, trainable=False,
                                        name="tnt_batch_share")

    def set(self, info: Any) -> None:
        """``info = [n, B]`` (eagerly, or as an op of the graph being traced)."""
        self.variable.assign(tf.cast(info, tf.int64))

    def weight(self) -> tf.Tensor:
        """Graph op: ``n / B`` in float64 (0 for a rank without a sample)."""
        info = tf.cast(self.variable.read_value(), tf.float64)
        return info[0] / tf.maximum(info[1], 1.0)


_shares: dict[int, tuple[tnt_core.Runtime, BatchShare]] = {}


def batch_share(runtime: tnt_core.Runtime | None = None) -> BatchShare:
    """The process's batch share (one per runtime; the entry keeps the runtime alive)."""
    runtime = runtime or tnt_core.init()
    entry = _shares.get(id(runtime))
    if entry is None:
        entry = _shares[id(runtime)] = (runtime, BatchShare(runtime))
    return entry[1]


def _as_count(value: Any, name: str) -> Any:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"tnt.set_batch_share({name}={value!r}): pass a number of samples (an "
                         "int >= 0, or an integer tensor)")
    return value


@tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
@user_facing
def set_batch_share(micro_batch_size: Any, global_batch_size: Any) -> None:
    """Say which share of the global batch this rank's next gradients come from.

    Only needed when the batches do not come from :func:`distribute_dataset` iterated in
    Python (which sets it for every batch): data the ranks split themselves, or a dataset
    iterated inside a ``tf.function``. Call it before the gradients of each batch are
    reduced, eagerly or inside the ``tf.function``; each rank's gradient is then weighted by
    ``micro_batch_size / global_batch_size``, which gives the serial gradient when the loss
    is a mean over the micro-batch and the micro-batches add up to the global batch.
    """
    n = _as_count(micro_batch_size, "micro_batch_size")
    b = _as_count(global_batch_size, "global_batch_size")
    if isinstance(n, int) and isinstance(b, int) and not (0 <= n <= b and b > 0):
        raise ValueError(f"tnt.set_batch_share({n}, {b}): a rank holds between 0 and "
                         "global_batch_size samples of a global batch of at least one")
    batch_share().set(tf.stack([tf.cast(n, tf.int64), tf.cast(b, tf.int64)]))


class DistributedDataset:
    """This rank's micro-batches of a dataset of global batches, for a loop of your own.

    Iterate it in Python, as serial code iterates the dataset: each element has the
    structure of the dataset's (``(x, y)``, dicts, ...), holding this rank's samples of the
    global batch, and taking it sets this rank's batch share for the gradient reduction
    (``tnt.DistributedGradientTape``, ``tnt.DistributedOptimizer``). Every iteration is a new
    pass, as with a ``tf.data.Dataset`` (a shuffled dataset reshuffles).
    """

    def __init__(self, dataset: tf.data.Dataset, runtime: tnt_core.Runtime) -> None:
        context = tnt_core.ShardContext(rank=runtime.rank, size=runtime.size, global_batch_size=None,
                                         extras={"framework": "keras", "purpose": "custom loop"})
        sharded = runtime.plugin_manager.hook.tnt_shard_data(data=dataset, context=context)
        if sharded is None:
            raise DatasetError(f"no tnt plugin can distribute a {type(dataset).__name__}")
        self._dataset: tf.data.Dataset = without_autotune_on_one_cpu(sharded)  # each pass an iterator
        self._share = batch_share(runtime)

    @property
    def element_spec(self) -> Any:
        """The spec of one micro-batch (the user's structure, batch dimension unknown)."""
        return self._dataset.element_spec[BATCH_KEY]

    def cardinality(self) -> tf.Tensor:
        """The number of batches (``tf.data.INFINITE_CARDINALITY``/``UNKNOWN_CARDINALITY`` as
        for the dataset)."""
        return self._dataset.cardinality()

    def __len__(self) -> int:
        n = int(self._dataset.cardinality())
        if n < 0:
            raise TypeError("the length of this distributed dataset is unknown or infinite")
        return n

    def __iter__(self) -> Iterator[Any]:
        if not tf.executing_eagerly():
            raise NotSupportedError(
                "a tnt.DistributedDataset is iterated in Python, outside tf.function (as in "
                "Keras' guide: for x, y in dataset: train_step(x, y)); inside a tf.function "
                "iterate your own per-rank dataset and call tnt.set_batch_share(n, global_batch_size) "
                "before the gradients of each batch"
            )
        return self._elements()

    def _elements(self) -> Iterator[Any]:
        for element in self._dataset:
            self._share.set(element[INFO_KEY])
            yield element[BATCH_KEY]

    def __repr__(self) -> str:
        return f"<tnt.DistributedDataset element_spec={self.element_spec}>"


def _check_batched(dataset: tf.data.Dataset) -> None:
    specs = tf.nest.flatten(dataset.element_spec, expand_composites=False)
    if any(isinstance(s, tf.TensorSpec) and s.shape.rank == 0 for s in specs):
        raise DatasetError(
            "tnt.distribute_dataset: the dataset yields single samples (a component has no batch "
            "dimension); batch it with the global batch size first: "
            "tnt.distribute_dataset(dataset.batch(global_batch_size))"
        )


@user_facing
def distribute_dataset(dataset: tf.data.Dataset) -> DistributedDataset:
    """This rank's part of every batch of ``dataset``, split as ``fit`` splits it.

    :param dataset: a ``tf.data.Dataset`` batched with the *global* batch size (the batch
        serial training uses); every rank must build the same dataset (an unseeded shuffle
        draws from the global seed, which tarantella fixes when the script has not).
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"tnt.distribute_dataset takes a tf.data.Dataset batched with the global batch size; "
            f"got {type(dataset).__name__} (make one with tf.data.Dataset.from_tensor_slices(...)"
            ".batch(global_batch_size))"
        )
    _check_batched(dataset)
    return DistributedDataset(dataset, tnt_core.init())
