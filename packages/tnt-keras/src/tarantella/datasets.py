"""Distributed datasets: every rank takes its micro-batch of each global batch.

Whatever the user gives ``fit``/``evaluate``/``predict`` goes through *Keras' own* data
adapter first (``get_data_adapter``: NumPy arrays and dicts, tf.data of any pipeline,
``PyDataset`` with its workers, Python generators, ...), which yields exactly the global
batches serial Keras would train on: the same batching, the same ``shuffle=True``
permutation for the same seed, the same class weights. tarantella then keeps this rank's
slice of each global batch, per sample, at run time: rank ``r`` of ``R`` takes ``B // R``
samples, plus one for the first ``B % R`` ranks, at consecutive offsets
(``tnt_core.micro_batch_slice``), so the ranks' micro-batches concatenated in rank order
are the serial batch, for any batch size, also a short last batch and datasets of unknown
cardinality. Every rank must see the same global batches: an unseeded shuffle draws its
seed from the global seed, which tarantella fixes when the user has not
(``tarantella.environment``).

Each element of a distributed dataset is ``{BATCH_KEY: micro_batch, INFO_KEY: [n, b]}``
(``tarantella.data_parallel.steps``): ``n`` the number of real samples of this rank and ``b`` the size of
the global batch (``-1`` when the user distributed the data). When a batch has fewer
samples than ranks, a rank without a sample gets one stand-in sample (the first of the
batch) with ``n = 0``, so every rank still runs the same step (same collectives) and no
layer sees an empty batch, while the step weighs its contributions by ``n = 0``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from ._keras_compat import get_data_adapter
from .data_parallel.steps import BATCH_KEY, pack
from .errors import DatasetError
from .reporting.log import logger
from .reporting.user_frames import warnings_at_user_line

__all__ = [
    "DistributedData",
    "Resharder",
    "class_weights_as_sample_weights",
    "cpus_of_this_process",
    "mark_undistributed",
    "prepare_data",
    "shard_data",
    "shard_dataset",
    "split_validation",
    "unpack_validation",
    "whole_batches",
    "without_autotune_on_one_cpu",
]

#: ``info[1]`` when the data was not distributed by tarantella.
UNKNOWN_GLOBAL_BATCH = -1


# -- the hook implementation --------------------------------------------------------------


def shard_data(data: Any, context: tnt_core.ShardContext) -> tf.data.Dataset | None:
    """``tnt_shard_data`` for Keras (registered by ``tarantella_plugin``): this rank's part of
    a ``tf.data.Dataset`` of global batches; None for other data."""
    if not isinstance(data, tf.data.Dataset):
        return None
    return shard_dataset(data, context)


# -- reading on one CPU ---------------------------------------------------------------------


#: ``tf.data.Options().autotune``'s settings: a dataset that sets any asks for autotuning
_AUTOTUNE_SETTINGS = ("enabled", "cpu_budget", "ram_budget", "autotune_algorithm",
                      "initial_parallelism", "min_parallelism")


def cpus_of_this_process() -> int:
    """The CPUs this process may run on (its affinity: a bound rank's cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def without_autotune_on_one_cpu(dataset: tf.data.Dataset, cpus: int | None = None) -> tf.data.Dataset:
    """``dataset`` with tf.data's autotuning off when the process has one CPU (``cpus``, by
    default :func:`cpus_of_this_process`) and the dataset's options leave it unset; else as
    it is.

    Why: an iterator with autotuning (tf.data's default) keeps a thread that re-tunes the
    pipeline in periods doubling from 10 ms up to a minute. Deleting the iterator wakes that
    thread *before* TensorFlow marks the iterator cancelled (2.21:
    ``CancellationManager::StartCancelWithStatus`` runs the callbacks, then sets
    ``is_cancelled_``); on a process held to one CPU the woken thread runs first, finds the
    iterator not cancelled, sleeps out the rest of its period, and the deletion waits for it.
    Keras makes an iterator for every epoch, ``evaluate`` and ``predict``, so on a rank bound
    to one core (``tnt run``'s binding where a host has as many cores as ranks; ``srun
    --cpu-bind=cores`` with one CPU a task) every epoch began up to a period late, and
    ``fit`` returned as late (docs/performance.md, "Seconds lost at every epoch"). Plain Keras
    held to one CPU waits alike.

    On one CPU autotuning has little to choose: the parallel calls it tunes share that CPU
    (without it an ``AUTOTUNE`` parallelism keeps its start value, at most the threads that
    run the pipeline), and ``prefetch`` tunes its buffer either way (its own tuner ignores
    the option). A dataset whose options set any of ``autotune``'s settings keeps them.
    """
    if (cpus_of_this_process() if cpus is None else cpus) > 1:
        return dataset
    tuning = dataset.options().autotune
    if any(getattr(tuning, name, None) is not None for name in _AUTOTUNE_SETTINGS):  # the user's
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


# -- slicing --------------------------------------------------------------------------------


def _batch_dim(t: Any) -> tf.Tensor:
    if isinstance(t, tf.RaggedTensor):
        return tf.cast(t.nrows(), tf.int64)
    if isinstance(t, tf.SparseTensor):
        return t.dense_shape[0]
    return tf.shape(t, out_type=tf.int64)[0]


def _take(t: Any, start: tf.Tensor, size: tf.Tensor) -> Any:
    if isinstance(t, tf.SparseTensor):
        begin = tf.concat([[start], tf.zeros_like(t.dense_shape[1:])], 0)
        extent = tf.concat([[size], t.dense_shape[1:]], 0)
        return tf.sparse.slice(t, begin, extent)
    if isinstance(t, tf.RaggedTensor) or t.shape.rank != 0:
        return t[start:start + size]
    return t  # a per-batch scalar: the same for every rank


def _is_batched(spec: Any) -> bool:
    return not (isinstance(spec, tf.TensorSpec) and spec.shape.rank == 0)


def _element_fn(spec: Any, fn: Any) -> Any:
    """``Dataset.map`` unpacks plain tuples (not namedtuples) into arguments; give ``fn``
    the element whole."""
    if type(spec) is tuple:
        return lambda *args: fn(tuple(args))
    return fn


def _batched_components(dataset: tf.data.Dataset, what: str) -> list[int]:
    flat_spec = tf.nest.flatten(dataset.element_spec, expand_composites=False)
    batched = [i for i, s in enumerate(flat_spec) if _is_batched(s)]
    if len(batched) != len(flat_spec):  # a scalar label: the dataset yields single samples
        raise DatasetError(
            f"the {what} yields single samples (a component has no batch dimension); batch it "
            "with the global batch size (dataset.batch(global_batch_size)), or pass "
            "tnt_micro_batch_size= to let tarantella batch it"
        )
    return batched


def micro_batch_of(b: tf.Tensor, rank: Any, size: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """Graph op: ``(offset, count)`` of ``rank``'s samples in a batch of ``b`` (int64), the
    arithmetic of ``tnt_core.micro_batch_slice`` (``rank``, ``size``: numbers or int64 tensors)."""
    size = tf.cast(size, tf.int64)
    base, extra = b // size, b % size
    r = tf.cast(rank, tf.int64)
    count = base + tf.cast(r < extra, tf.int64)
    offset = r * base + tf.minimum(r, extra)
    return offset, count


def micro_batch(element: Any, batched: list[int], rank: Any, size: Any) -> dict[str, Any]:
    """Graph ops: ``rank``'s micro-batch of one global batch, packed with ``[n, b]``;
    ``batched``: the indices of the element's components that have a batch dimension."""
    flat = tf.nest.flatten(element, expand_composites=False)
    b = _batch_dim(flat[batched[0]])
    offset, n = micro_batch_of(b, rank, size)
    start = tf.where(n > 0, offset, tf.zeros_like(offset))
    take = tf.maximum(n, 1)  # a stand-in sample when this rank has none (n == 0)
    parts = [_take(t, start, take) for t in flat]
    batch = tf.nest.pack_sequence_as(element, parts, expand_composites=False)
    return pack(batch, tf.stack([n, b]))


def shard_dataset(dataset: tf.data.Dataset, context: tnt_core.ShardContext) -> tf.data.Dataset:
    """This rank's micro-batches of a dataset of global batches (any batch size)."""
    rank, size = context.rank, context.size
    batched = _batched_components(dataset, "dataset")
    return dataset.map(_element_fn(dataset.element_spec,
                                   lambda element: micro_batch(element, batched, rank, size)))


class Resharder:
    """An elastic job's split: the micro-batch of a global batch for the rank and size of the
    moment (they change when ranks leave), taken when the step runs rather than in the
    dataset, so that a step redone over fewer ranks splits the same global batch anew."""

    def __init__(self) -> None:
        self._split = tf.function(self._micro_batch, reduce_retracing=True, autograph=False)
        self._place: tuple[int, int, tf.Tensor, tf.Tensor] | None = None

    @staticmethod
    def _micro_batch(element: Any, rank: tf.Tensor, size: tf.Tensor) -> dict[str, Any]:
        flat = tf.nest.flatten(element, expand_composites=False)
        batched = [i for i, t in enumerate(flat)
                   if not (isinstance(t, tf.Tensor) and t.shape.rank == 0)]
        return micro_batch(element, batched, rank, size)

    def __call__(self, element: Any, rank: int, size: int) -> dict[str, Any]:
        if self._place is None or self._place[:2] != (rank, size):  # tensors made once a place
            self._place = (rank, size, tf.constant(rank, tf.int64), tf.constant(size, tf.int64))
        return self._split(element, self._place[2], self._place[3])


def mark_undistributed(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Per-rank data the user split already: ``info = [n, -1]``."""
    spec = dataset.element_spec
    batched = _batched_components(dataset, "dataset")

    def mark(element: Any) -> dict[str, Any]:
        flat = tf.nest.flatten(element, expand_composites=False)
        n = _batch_dim(flat[batched[0]])
        return pack(element, tf.stack([n, tf.constant(UNKNOWN_GLOBAL_BATCH, tf.int64)]))

    return dataset.map(_element_fn(spec, mark))


def shard_arrays(batch: Any, rank: int, size: int) -> tuple[Any, int, int]:
    """This rank's rows of one global batch of arrays (``*_on_batch``): ``(rows, n, b)``."""
    flat = [v for v in tf.nest.flatten(batch) if v is not None]
    if not flat:
        raise DatasetError("no input data given")
    counts = {int(tf.shape(v)[0]) if isinstance(v, tf.Tensor) else len(v) for v in flat}
    if len(counts) != 1:
        raise DatasetError(f"input arrays have different numbers of samples: {sorted(counts)}")
    b = counts.pop()
    sl = tnt_core.micro_batch_slice(b, rank, size, allow_empty=True)
    n = sl.stop - sl.start
    if n == 0:
        sl = slice(0, 1)  # a stand-in sample, weighed by n = 0
    rows = tf.nest.map_structure(lambda v: None if v is None else v[sl.start:sl.stop], batch)
    return rows, n, b


# -- user input ------------------------------------------------------------------------------


def split_validation(x: Any, y: Any, sample_weight: Any,
                     validation_split: float) -> tuple[tuple[Any, Any, Any], tuple[Any, ...]]:
    """Keras' ``validation_split``: the last ``validation_split`` of the samples validate,
    the first ``floor(samples x (1 - validation_split))`` train (arrays and tensors only, as
    in Keras: a dataset or generator has no known end to cut)."""
    if not 0.0 < validation_split < 1.0:
        raise ValueError(f"validation_split must be in (0, 1), got {validation_split}")
    arrays = (x, y, sample_weight)
    leaves = [a for a in keras.tree.flatten(arrays) if a is not None]
    unsplittable = sorted({type(a).__name__ for a in leaves if not _splittable(a)})
    if unsplittable:
        raise DatasetError(f"validation_split: only arrays and tensors can be split (got "
                           f"{', '.join(unsplittable)}); pass validation_data= instead")
    if not leaves:
        return arrays, arrays
    total = int(leaves[0].shape[0])
    cut = math.floor(total * (1.0 - validation_split))
    if cut in (0, total):
        raise DatasetError(f"validation_split={validation_split}: the {total} samples cannot be "
                           "split into a training and a validation set; give more data or "
                           "another validation_split")
    return (keras.tree.map_structure(lambda a: _rows(a, 0, cut), arrays),
            keras.tree.map_structure(lambda a: _rows(a, cut, total), arrays))


def unpack_validation(validation_data: Any) -> tuple[Any, Any, Any]:
    """``fit(validation_data=...)`` as ``(x, y, sample_weight)``, as Keras reads it."""
    if isinstance(validation_data, (list, tuple)):
        if len(validation_data) in (2, 3):
            vx, vy = validation_data[0], validation_data[1]
            vsw = validation_data[2] if len(validation_data) == 3 else None
            return vx, vy, vsw
        raise ValueError(
            "validation_data must be a dataset, a generator or a tuple (x, y) or "
            f"(x, y, sample_weight); got a {type(validation_data).__name__} of "
            f"{len(validation_data)} elements"
        )
    return validation_data, None, None


def _splittable(a: Any) -> bool:
    return isinstance(a, (np.ndarray, tf.Tensor, tf.RaggedTensor, tf.SparseTensor)) \
        or hasattr(a, "iloc") or hasattr(a, "tocsr") or hasattr(a, "__array__")


def _rows(a: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of an array, tensor, pandas or SciPy sparse object."""
    if a is None:
        return None
    if isinstance(a, tf.SparseTensor):
        return _take(a, tf.constant(start, tf.int64), tf.constant(stop - start, tf.int64))
    if hasattr(a, "iloc"):  # pandas: by position
        return a.iloc[start:stop]
    if hasattr(a, "tocsr"):  # SciPy sparse: CSR slices by row (COO does not slice)
        return a.tocsr()[start:stop]
    if not isinstance(a, (np.ndarray, tf.Tensor, tf.RaggedTensor)):
        a = np.asarray(a)
    return a[start:stop]


def class_weights_as_sample_weights(y: Any, class_weight: Mapping[int, float]) -> np.ndarray:
    """Keras' class-weight map: each sample weighs its class's weight (1 for a class not in
    ``class_weight``); the class of a one-hot row is its largest entry."""
    labels = np.asarray(keras.ops.convert_to_numpy(y))
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else np.squeeze(labels, -1)
    classes = np.round(labels).astype(np.int32)
    return np.array([class_weight.get(int(c), 1.0) for c in classes], dtype=keras.config.floatx())


def _lists_as_tuples(x: Any) -> Any:
    """Lists of arrays (a multi-input model's inputs) as tuples, as Keras' adapters want."""
    if isinstance(x, list):
        return tuple(_lists_as_tuples(v) for v in x)
    if isinstance(x, Mapping):
        return {k: _lists_as_tuples(v) for k, v in x.items()}
    return x


@dataclass
class DistributedData:
    """This rank's view of the user's data, ready for the Keras loop."""

    dataset: tf.data.Dataset
    adapter: Any  # Keras' data adapter: its epoch hooks drive PyDataset workers
    distributed: bool
    steps: int | None  # batches per epoch when known
    #: the dataset yields whole global batches, split at each step (:class:`Resharder`)
    global_batches: bool = False

    @property
    def batch_spec(self) -> Any:
        """Element spec of one micro-batch (without the batch info)."""
        spec = self.dataset.element_spec
        return spec if self.global_batches else spec[BATCH_KEY]


def _global_batches(x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool,
                    class_weight: Any, steps: int | None, purpose: str) -> tuple[tf.data.Dataset, Any]:
    """Keras' own global batches of the user's data, and the adapter that makes them."""
    if isinstance(x, list) and not isinstance(x, tf.data.Dataset):
        x = _lists_as_tuples(x)
    try:
        # Keras' notices about the user's arguments (shuffle of a dataset is ignored) name
        # the user's call, as in a plain Keras fit
        adapter = warnings_at_user_line(get_data_adapter, x, y, sample_weight, batch_size=batch_size,
                                        steps_per_epoch=steps, shuffle=shuffle,
                                        class_weight=class_weight)
    except (ValueError, TypeError) as exc:
        raise DatasetError(f"cannot use the {purpose} data: {exc}") from None
    return adapter.get_tf_dataset(), adapter


def _with_known_length(dataset: tf.data.Dataset, adapter: Any) -> tf.data.Dataset:
    """Keras' adapter knows its length (arrays, PyDataset): tell Keras' loop too."""
    known = getattr(adapter, "num_batches", None)
    if known is not None and int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY:
        return dataset.apply(tf.data.experimental.assert_cardinality(int(known)))
    return dataset


def prepare_data(x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int | None = None,
                 shuffle: bool = False, micro_batch_size: int | None = None,
                 distribute: bool = True, class_weight: Mapping[int, float] | None = None,
                 steps: int | None = None, purpose: str = "training",
                 runtime: tnt_core.Runtime | None = None,
                 global_batches: bool = False) -> DistributedData:
    """Turn what the user passed to fit/evaluate/predict into this rank's dataset.

    :param global_batches: yield the global batches whole (an elastic job splits them at
        each step, :class:`Resharder`)."""
    runtime = runtime or tnt_core.init()
    size, rank = runtime.size, runtime.rank
    if micro_batch_size is not None:
        if batch_size is not None and batch_size != micro_batch_size * size:
            raise DatasetError(
                f"tnt_micro_batch_size={micro_batch_size} x {size} ranks != batch_size="
                f"{batch_size}; give one of them"
            )
        batch_size = micro_batch_size * size
        if isinstance(x, tf.data.Dataset):  # an unbatched dataset: batch it with the global size
            x = x.batch(batch_size)
            batch_size = None
    if isinstance(x, tf.data.Dataset) and batch_size is not None:
        raise DatasetError(
            f"batch_size={batch_size} was given with a tf.data.Dataset: a dataset yields its own "
            "batches (they are the global batches); batch the dataset instead, or use "
            "tnt_micro_batch_size= for an unbatched one"
        )
    dataset, adapter = _global_batches(x, y, sample_weight, batch_size, bool(shuffle), class_weight,
                                       steps, purpose)
    dataset = without_autotune_on_one_cpu(_with_known_length(dataset, adapter))
    if global_batches:
        if not distribute:
            raise DatasetError(
                f"tnt_distribute_dataset=False: in an elastic job tarantella must split the "
                f"{purpose} data itself, to split each global batch anew when ranks leave; give "
                "every rank the same data (the global batches) and drop that argument")
        _batched_components(dataset, f"{purpose} data")
        return DistributedData(dataset, adapter, True, _steps(adapter, dataset, steps),
                               global_batches=True)
    if not distribute:
        logger.info("%s data is not distributed (tnt_distribute_dataset=False): every rank "
                    "uses the data it was given", purpose)
        out = mark_undistributed(dataset)
        return DistributedData(out, adapter, False, _steps(adapter, out, steps))
    context = tnt_core.ShardContext(rank=rank, size=size, global_batch_size=batch_size,
                                     extras={"framework": "keras", "purpose": purpose})
    sharded = runtime.plugin_manager.hook.tnt_shard_data(data=dataset, context=context)
    if sharded is None:
        raise DatasetError(f"no tnt plugin can distribute a {type(dataset).__name__}")
    return DistributedData(sharded, adapter, True, _steps(adapter, sharded, steps))


def whole_batches(x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int | None = None,
                  shuffle: Any = False, class_weight: Mapping[int, float] | None = None,
                  steps: int | None = None, purpose: str = "training") -> tuple[tf.data.Dataset, Any]:
    """What Keras' ``fit`` takes other than a ``tf.data.Dataset`` (arrays, tensors,
    dataframes, a generator, a ``PyDataset``) as the ``tf.data.Dataset`` of global batches
    Keras' own adapter makes of it (its batch size, sample and class weights and shuffling in
    it), read as :func:`prepare_data` reads data (without tf.data's autotuning on a rank with
    one CPU: :func:`without_autotune_on_one_cpu`), and that adapter, whose epoch hooks the
    loop's callbacks must call (a ``PyDataset``'s workers start and stop there:
    ``tarantella.callbacks.distribute_callbacks(adapters=...)``). For a loop that hands Keras
    every batch whole: a pipeline's, where every rank reads the global batch."""
    dataset, adapter = _global_batches(x, y, sample_weight, batch_size, shuffle, class_weight,
                                       steps, purpose)
    return without_autotune_on_one_cpu(_with_known_length(dataset, adapter)), adapter


def _steps(adapter: Any, dataset: tf.data.Dataset, steps: int | None) -> int | None:
    if steps is not None:
        return steps
    known = getattr(adapter, "num_batches", None)
    if known is not None:
        return int(known)
    card = int(dataset.cardinality())
    return card if card >= 0 else None

