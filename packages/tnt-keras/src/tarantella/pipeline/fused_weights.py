"""The weight gradients of several micro-batches in one op, where a layer's weight gradient
is a sum over the batch's rows.

Why: a ``Dense`` kernel's gradient is ``x^T dz``, a sum over the rows of the batch. Made per
micro-batch, ``M`` micro-batches cost ``M`` matrix products of ``1/M`` of the rows each (each
packing the whole kernel-sized result again) and ``M - 1`` additions of kernel-sized tensors
(each streaming three of them through memory); one product over the micro-batches' rows
joined costs neither. On one core of the development machine (1024 x 1024 float32, 1
intra-op thread) four products of 64 rows and three additions took 8.0 ms, one product of
the 256 rows 4.3 ms (``benchmarks/pipeline.py`` measures what it gives a step). It is also
serial Keras' own order of summation: the whole batch's product, rows in batch order.

Only the weight-gradient ops whose result is such a sum and whose inputs hold the rows on
their first axis are joined: ``MatMul`` with its first operand transposed (a ``Dense`` or
``EinsumDense`` kernel on 2-D inputs) and ``BiasAddGrad`` (every bias). Any other gradient
(convolution filters, normalisation scales, sparse rows) stays per micro-batch, summed as
before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["Footprint", "footprint", "fused"]


def _rows_summed(grad: Any) -> tf.Operation | None:
    """The op of ``grad`` if it sums per-row terms over its inputs' first axis (see the
    module doc), else None."""
    if not isinstance(grad, tf.Tensor) or tf.executing_eagerly():
        return None
    op = grad.op
    if op.type == "MatMul":
        if op.get_attr("transpose_a") and not op.get_attr("transpose_b"):
            return op
    elif op.type == "BiasAddGrad":
        return op
    return None


def _same_kind(ops: Sequence[tf.Operation]) -> bool:
    first = ops[0]
    if any(op.type != first.type for op in ops):
        return False
    if first.type == "BiasAddGrad":
        return len({op.get_attr("data_format") for op in ops}) == 1
    return True


@dataclass(frozen=True)
class Footprint:
    """One micro-batch's ``W``, in bytes: what it keeps alive until it runs (the inputs of
    its ops: for a ``Dense`` layer, the layer's input and the gradient at its output) and
    what it makes (the weights' gradients)."""

    held: int
    made: int


def _bytes(t: tf.Tensor) -> int | None:
    shape = t.shape
    if shape.rank is None or any(d is None for d in shape.as_list()):
        return None
    return int(np.prod(shape.as_list(), dtype=np.int64)) * t.dtype.size


def footprint(grads: Sequence[Any]) -> Footprint | None:
    """The :class:`Footprint` of a ``W`` giving ``grads`` when every one of them can be
    joined with other micro-batches' (:func:`fused`: a sum over rows) and has a static
    shape; else None."""
    held: dict[str, int] = {}  # by tensor: a layer's kernel and bias gradients share one
    made = 0
    for g in grads:
        if g is None:
            continue
        op = _rows_summed(g)
        if op is None:
            return None
        size = _bytes(g)
        inputs = [op.inputs[0], op.inputs[1]] if op.type == "MatMul" else [op.inputs[0]]
        sizes = [_bytes(t) for t in inputs]
        if size is None or any(n is None for n in sizes):
            return None
        made += size
        for t, n in zip(inputs, sizes):
            held[t.name] = int(n)  # type: ignore[arg-type]
    return Footprint(sum(held.values()), made) if made else None


def fused(per_micro_batch: Sequence[Sequence[Any]], after: Sequence[tf.Operation] = ()
          ) -> list[tf.Tensor | None]:
    """For each weight, the gradient of the micro-batches of ``per_micro_batch`` (each a list
    of the weights' gradients, in micro-batch order) made by one op over their rows joined,
    starting after the ops ``after``; None for a weight whose gradients are not such sums
    (the caller adds those up itself). The per-micro-batch ops replaced are left without a
    consumer, so TensorFlow prunes them from the traced function."""
    if len(per_micro_batch) < 2:
        return [None] * len(per_micro_batch[0]) if per_micro_batch else []
    out: list[tf.Tensor | None] = []
    for grads in zip(*per_micro_batch):
        ops = [_rows_summed(g) for g in grads]
        if any(op is None for op in ops) or not _same_kind(ops):
            out.append(None)
            continue
        first = ops[0]
        assert first is not None
        with tf.control_dependencies(list(after)):
            if first.type == "MatMul":
                rows = tf.concat([op.inputs[0] for op in ops], axis=0)  # type: ignore[union-attr]
                terms = tf.concat([op.inputs[1] for op in ops], axis=0)  # type: ignore[union-attr]
                out.append(tf.linalg.matmul(rows, terms, transpose_a=True))
            else:
                terms = tf.concat([op.inputs[0] for op in ops], axis=0)  # type: ignore[union-attr]
                layout = first.get_attr("data_format")
                out.append(tf.raw_ops.BiasAddGrad(
                    out_backprop=terms,
                    data_format=layout.decode() if isinstance(layout, bytes) else layout))
    return out
