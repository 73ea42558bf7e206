"""Distributed datasets: every rank takes its micro-batch of each global batch.

The user gives what Keras takes (a ``tf.data.Dataset`` batched with the *global* batch size,
or NumPy arrays / dicts of arrays with ``batch_size=``). Every rank runs the whole input
pipeline and keeps its slice of each global batch (``tnt_core.micro_batch_slice``: the
remainder goes to the first ranks), so the ranks' micro-batches concatenated in rank order
are exactly the serial batch, for any pipeline of map/filter/shuffle/cache/repeat/
padded_batch... Every rank sees the same global batches because an unseeded shuffle draws
its seed from the fixed global seed (``tarantella.environment``) and NumPy data is shuffled
with a seed broadcast from the master.

Each element of a distributed dataset is ``(micro_batch, info)`` with ``info = [n, b]``:
``n`` the number of real samples of this rank and ``b`` the global batch size of this step
(``-1`` when the data was not distributed and ``b`` is found by an allreduce in the step).
In the last, partial batch a rank may have no sample; it then gets one stand-in sample
(the first of the global batch) with ``n = 0``, so every rank still runs the same step
(same collectives) and no layer sees an empty batch, while the step weights its gradient
and metric contributions by ``n`` = 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
import tnt_core

from .errors import DatasetError
from .log import logger

__all__ = [
    "DistributedData",
    "detect_batch_size",
    "prepare_data",
    "shard_dataset",
    "split_validation",
    "shard_data",
    "unpack_info",
]

#: ``info[1]`` when the data was not distributed by tarantella.
UNKNOWN_GLOBAL_BATCH = -1


# -- the hook implementation --------------------------------------------------------------


def shard_data(data: Any, context: tnt_core.ShardContext) -> tf.data.Dataset | None:
    """``tnt_shard_data`` for Keras (registered by ``tarantella_plugin``): split a
    ``tf.data.Dataset`` batched with ``context.global_batch_size`` into this rank's part;
    None for other data."""
    if not isinstance(data, tf.data.Dataset):
        return None
    return shard_dataset(data, context)


# -- finding the global batch size ---------------------------------------------------------

_BATCH_CLASSES = ("_BatchDataset", "BatchDataset", "_PaddedBatchDataset", "PaddedBatchDataset",
                  "_ParallelBatchDataset", "ParallelBatchDataset")
_SAMPLE_CLASSES = ("_UnbatchDataset", "UnbatchDataset")  # yields single samples
_UNBATCH_CLASSES = ("_RebatchDataset", "_FlatMapDataset",
                    "FlatMapDataset", "_InterleaveDataset", "InterleaveDataset",
                    "_ParallelInterleaveDataset", "ParallelInterleaveDataset",
                    "_ScanDataset", "_GroupByWindowDataset", "_WindowDataset")


def detect_batch_size(dataset: tf.data.Dataset) -> int | None:
    """The batch size of the last ``batch``/``padded_batch`` of the pipeline, or None when
    the pipeline has none (the dataset yields single samples).

    Raises DatasetError when the pipeline changes its batching in a way that cannot be read
    from the graph (flat_map, interleave, window, zip of batched datasets...).
    """
    ds = dataset
    while True:
        name = type(ds).__name__
        if name in _BATCH_CLASSES:
            size = tf.get_static_value(ds._batch_size)  # noqa: SLF001 (no public accessor)
            if size is None:
                raise DatasetError("the dataset's batch size is not a constant; pass batch_size=")
            return int(size)
        if name in _SAMPLE_CLASSES:
            return None
        if name in _UNBATCH_CLASSES:
            raise DatasetError(
                f"cannot read the global batch size of a pipeline that uses {name.strip('_')} "
                "after its last batch(); pass batch_size=<global batch size> to fit/evaluate/"
                "predict, or tnt_micro_batch_size="
            )
        inputs = getattr(ds, "_input_dataset", None)
        if inputs is None:
            if hasattr(ds, "_datasets"):  # zip / concatenate / choose: many inputs
                raise DatasetError(
                    "cannot read the global batch size of a zipped or concatenated dataset; "
                    "pass batch_size=<global batch size>, or batch after zipping"
                )
            return None
        ds = inputs


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


def _element_fn(spec: Any, fn):
    """``Dataset.map`` unpacks plain tuples (not namedtuples) into arguments; give ``fn``
    the element whole."""
    if type(spec) is tuple:
        return lambda *args: fn(tuple(args))
    return fn


def shard_dataset(dataset: tf.data.Dataset, context: tnt_core.ShardContext) -> tf.data.Dataset:
    """This rank's micro-batches of a dataset batched with ``context.global_batch_size``."""
    global_batch = context.global_batch_size
    if global_batch is None:
        raise DatasetError("the global batch size is unknown; pass batch_size=")
    rank, size = context.rank, context.size
    # tables from tnt-core's arithmetic, indexed by the batch size of a step (the last batch
    # may be short), so every sharder splits exactly alike
    starts = [tnt_core.micro_batch_offset(b, rank, size, allow_empty=True) for b in range(global_batch + 1)]
    sizes = [tnt_core.micro_batch_size(b, rank, size, allow_empty=True) for b in range(global_batch + 1)]
    starts_t = tf.constant(starts, tf.int64)
    sizes_t = tf.constant(sizes, tf.int64)
    spec = dataset.element_spec
    flat_spec = tf.nest.flatten(spec, expand_composites=False)
    batched = [i for i, s in enumerate(flat_spec) if _is_batched(s)]
    if not batched:
        raise DatasetError("the dataset yields only scalars; batch it with the global batch size")

    def split(element):
        flat = tf.nest.flatten(element, expand_composites=False)
        b = _batch_dim(flat[batched[0]])
        checks = [tf.debugging.assert_less_equal(
            b, tf.constant(global_batch, tf.int64),
            message=f"a batch is larger than the global batch size {global_batch} that "
                    "tarantella found for this dataset; pass batch_size=<global batch size>")]
        with tf.control_dependencies(checks):
            n = tf.gather(sizes_t, b)
            start = tf.where(n > 0, tf.gather(starts_t, b), tf.zeros_like(b))
        take = tf.maximum(n, 1)  # a stand-in sample when this rank has none (n == 0)
        parts = [_take(t, start, take) for t in flat]
        info = tf.stack([n, b])
        return tf.nest.pack_sequence_as(element, parts, expand_composites=False), info

    return dataset.map(_element_fn(spec, split))


def mark_undistributed(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Per-rank data the user split already: ``info = [n, -1]``."""
    spec = dataset.element_spec
    flat_spec = tf.nest.flatten(spec, expand_composites=False)
    batched = [i for i, s in enumerate(flat_spec) if _is_batched(s)]
    if not batched:
        raise DatasetError("the dataset yields only scalars; batch it")

    def mark(element):
        flat = tf.nest.flatten(element, expand_composites=False)
        n = _batch_dim(flat[batched[0]])
        return element, tf.stack([n, tf.constant(UNKNOWN_GLOBAL_BATCH, tf.int64)])

    return dataset.map(_element_fn(spec, mark))


def unpack_info(data: Any) -> tuple[Any, tf.Tensor, tf.Tensor]:
    """``(batch, n, b)`` from an element of a prepared dataset (inside a step)."""
    if not (isinstance(data, tuple) and len(data) == 2):
        raise DatasetError(
            "tnt.Model's step received data that tarantella did not prepare; call fit/"
            "evaluate/predict on the tnt.Model, not on the wrapped Keras model"
        )
    batch, info = data
    return batch, info[0], info[1]


# -- NumPy arrays and user input ------------------------------------------------------------


def _is_array_like(x: Any) -> bool:
    if x is None:
        return True
    if isinstance(x, (np.ndarray, tf.Tensor)) or hasattr(x, "__array__"):
        return True
    if isinstance(x, Mapping):
        return all(_is_array_like(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_is_array_like(v) for v in x)
    return False


def _num_samples(x: Any) -> int:
    flat = [v for v in tf.nest.flatten(x) if v is not None]
    if not flat:
        raise DatasetError("no input data given")
    counts = {int(np.shape(v)[0]) for v in flat}
    if len(counts) != 1:
        raise DatasetError(f"input arrays have different numbers of samples: {sorted(counts)}")
    return counts.pop()


def _slice_arrays(x: Any, start: int, stop: int) -> Any:
    return tf.nest.map_structure(lambda v: None if v is None else v[start:stop], x)


def split_validation(x: Any, y: Any, sample_weight: Any, validation_split: float):
    """Keras' ``validation_split`` for arrays: the last fraction of the samples."""
    if not 0.0 < validation_split < 1.0:
        raise ValueError(f"validation_split must be in (0, 1), got {validation_split}")
    if not (_is_array_like(x) and _is_array_like(y) and _is_array_like(sample_weight)):
        raise DatasetError("validation_split works with NumPy arrays only, as in Keras; "
                           "pass validation_data= for datasets")
    n = _num_samples(x)
    split_at = int(math.floor(n * (1.0 - validation_split)))
    if split_at == 0 or split_at == n:
        raise DatasetError(f"validation_split={validation_split} leaves no training or no "
                           f"validation samples out of {n}")
    train = tuple(_slice_arrays(a, 0, split_at) if a is not None else None
                  for a in (x, y, sample_weight))
    val = tuple(_slice_arrays(a, split_at, n) if a is not None else None
                for a in (x, y, sample_weight))
    return train, val


def _lists_as_tuples(x: Any) -> Any:
    """Lists of arrays (a multi-input model's inputs) as tuples: tf.data would try to stack a
    list into one tensor."""
    if isinstance(x, list):
        return tuple(_lists_as_tuples(v) for v in x)
    if isinstance(x, Mapping):
        return {k: _lists_as_tuples(v) for k, v in x.items()}
    return x


def _broadcast_seed(runtime: tnt_core.Runtime) -> int:
    seed = np.array([np.random.SeedSequence().entropy % (2**31 - 1)], dtype=np.int64)
    if runtime.size > 1:
        runtime.backend.broadcast(seed, root=tnt_core.get_master_rank())
    return int(seed[0])


@dataclass
class DistributedData:
    """This rank's view of the user's data, ready for the Keras loop."""

    dataset: tf.data.Dataset
    global_batch_size: int | None  # None when not distributed
    micro_batch_sizes: list[int] | None
    distributed: bool
    steps: int | None  # batches per epoch when known

    @property
    def batch_spec(self) -> Any:
        """Element spec of one micro-batch (without the info vector)."""
        return self.dataset.element_spec[0]


def _as_dataset(x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool,
                runtime: tnt_core.Runtime, purpose: str) -> tuple[tf.data.Dataset, int | None]:
    """A batched dataset from arrays (or the user's dataset) and its global batch size."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise DatasetError("when x is a tf.data.Dataset, y and sample_weight must be None; "
                               "the dataset yields (x, y) or (x, y, sample_weight)")
        try:
            detected = detect_batch_size(x)
        except DatasetError:
            if batch_size is None:
                raise
            return x, batch_size  # batched in a way the graph does not tell: trust the user
        if detected is None:  # yields single samples
            return (x, None) if batch_size is None else (x.batch(batch_size), batch_size)
        if batch_size is not None and batch_size != detected:
            raise DatasetError(
                f"batch_size={batch_size} but the dataset is batched with {detected}; do not "
                "pass batch_size for a batched dataset (it is the global batch size)"
            )
        return x, detected
    if not (_is_array_like(x) and _is_array_like(y) and _is_array_like(sample_weight)):
        raise DatasetError(
            f"tarantella distributes tf.data.Dataset objects and NumPy arrays (or lists/dicts "
            f"of arrays); got {type(x).__name__} for {purpose}. Wrap Python generators and "
            "PyDataset objects with tf.data.Dataset.from_generator(...).batch(global_batch)"
        )
    x, y, sample_weight = _lists_as_tuples(x), _lists_as_tuples(y), _lists_as_tuples(sample_weight)
    n = _num_samples(x)
    parts = tuple(a for a in (x, y, sample_weight) if a is not None)
    if len(parts) == 2 and sample_weight is not None:  # (x, None, sw): keep positions
        parts = (x, None, sample_weight)
    ds = tf.data.Dataset.from_tensor_slices(parts if len(parts) > 1 else (x,))
    if shuffle:
        ds = ds.shuffle(n, seed=_broadcast_seed(runtime), reshuffle_each_iteration=True)
    batch = batch_size or 32  # Keras' default
    return ds.batch(batch), batch


def prepare_data(x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int | None = None,
                 shuffle: bool = False, micro_batch_size: int | None = None,
                 distribute: bool = True, class_weight: Mapping[int, float] | None = None,
                 steps: int | None = None, purpose: str = "training",
                 runtime: tnt_core.Runtime | None = None) -> DistributedData:
    """Turn what the user passed to fit/evaluate/predict into this rank's dataset."""
    runtime = runtime or tnt_core.init()
    size, rank = runtime.size, runtime.rank
    if micro_batch_size is not None:
        if batch_size is not None and batch_size != micro_batch_size * size:
            raise DatasetError(
                f"tnt_micro_batch_size={micro_batch_size} x {size} ranks != batch_size="
                f"{batch_size}; give one of them"
            )
        batch_size = batch_size or micro_batch_size * size  # an unbatched dataset is batched
    dataset, global_batch = _as_dataset(x, y, sample_weight, batch_size, shuffle, runtime, purpose)
    if class_weight is not None:
        from keras.src.trainers.data_adapters.tf_dataset_adapter import make_class_weight_map_fn

        dataset = dataset.map(make_class_weight_map_fn(class_weight))
    if not distribute:
        logger.info("%s data is not distributed (tnt_distribute_dataset=False): every rank "
                    "uses the data it was given", purpose)
        out = mark_undistributed(dataset)
        return DistributedData(out, None, None, False, _cardinality(out, steps))
    if global_batch is None:
        raise DatasetError(
            f"the {purpose} dataset is not batched: batch it with the global batch size "
            "(dataset.batch(global_batch_size)) or pass tnt_micro_batch_size="
        )
    context = tnt_core.ShardContext(rank=rank, size=size, global_batch_size=global_batch,
                                     micro_batch_size=micro_batch_size,
                                     extras={"framework": "keras", "purpose": purpose})
    sizes = context.sizes  # raises a clear error when global batch < ranks
    sharded = runtime.plugin_manager.hook.tnt_shard_data(data=dataset, context=context)
    if sharded is None:
        raise DatasetError(f"no tnt plugin can distribute a {type(dataset).__name__}")
    return DistributedData(sharded, global_batch, sizes, True, _cardinality(sharded, steps))


def _cardinality(dataset: tf.data.Dataset, steps: int | None) -> int | None:
    if steps is not None:
        return steps
    card = int(dataset.cardinality())
    return card if card >= 0 else None
