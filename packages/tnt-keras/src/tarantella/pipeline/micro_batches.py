"""How a pipeline cuts a global batch: first between the pipelines (``ALL``), then each
pipeline's rows into micro-batches.

Why these sizes and weights: Keras' compiled loss is the mean over the batch (reduction
``sum_over_batch_size``: the sum of each sample's loss, times its sample weight, over the
number of samples), so the batch's loss is the sum over micro-batches of each micro-batch's
own mean times its share ``b_k / B`` of the global batch of ``B`` samples, whatever the
sample weights; the accumulated gradient is then the batch's gradient up to round-off.
Micro-batches differ in size by at most one sample (the larger first) and are never empty: a
batch smaller than the micro-batch count is cut into fewer, one sample each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

import tnt_core

__all__ = ["concat", "micro_batch_sizes", "pipeline_rows", "rows", "shares", "split"]


def rows(values: Any) -> int:
    """The number of rows (samples) of the first tensor of ``values``: its static leading
    dimension, which every eager tensor has (read without an op), else its dynamic shape."""
    first = keras.tree.flatten(values)[0]
    try:
        lead = first.shape[0]
    except (AttributeError, IndexError, TypeError, ValueError):  # no shape, or unknown rank
        lead = None
    return int(lead) if lead is not None else int(tf.shape(first)[0])


def pipeline_rows(batch: int, replica: int, num_replicas: int) -> slice:
    """Pipeline ``replica``'s rows of a global batch of ``batch`` samples, under ``ALL``
    (as DATA cuts a batch between ranks; a pipeline may get none of a batch smaller than
    the pipeline count)."""
    return tnt_core.micro_batch_slice(batch, replica, num_replicas, allow_empty=True)


def micro_batch_sizes(batch: int, num_micro_batches: int) -> list[int]:
    """``batch`` samples in ``num_micro_batches`` nearly equal parts, the larger first (the
    part count drops to ``batch`` when the batch is smaller: no empty micro-batches)."""
    if batch <= 0:
        return []
    count = min(batch, num_micro_batches)
    base, extra = divmod(batch, count)
    return [base + 1 if k < extra else base for k in range(count)]


def shares(sizes: Sequence[int], global_batch: int) -> list[float]:
    """Each micro-batch's weight in the global batch's mean loss: ``b_k / B`` (with several
    pipelines, ``B`` is the global batch, not this pipeline's rows)."""
    return [b / global_batch for b in sizes]


def split(x: Any, sizes: Sequence[int]) -> list[Any]:
    """``x`` (a tensor or a list/tuple/dict of them; None stays None) cut along the batch
    into micro-batches of ``sizes`` samples, each in ``x``'s structure."""
    if x is None or not sizes:
        return [None] * len(sizes)
    leaves = [tf.split(tf.convert_to_tensor(t), list(sizes), axis=0) for t in keras.tree.flatten(x)]
    return [keras.tree.pack_sequence_as(x, [parts[k] for parts in leaves]) for k in range(len(sizes))]


def concat(parts: list[Any]) -> Any:
    """Micro-batches joined back into one batch in their structure (None for none)."""
    if not parts:
        return None
    return keras.tree.map_structure(lambda *ts: tf.concat(ts, axis=0), *parts)
