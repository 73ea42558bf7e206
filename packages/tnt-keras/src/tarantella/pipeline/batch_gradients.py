"""A pipeline stage's gradients of the whole batch, made from its micro-batches' gradients
as serial Keras' step would hand them to the optimizer.

Why not only a sum: Keras' optimizers treat a sparse gradient (``tf.IndexedSlices``, what an
``Embedding`` or any ``tf.gather`` of a variable gets) row by row: Adam and RMSprop square
each row before duplicate rows are added up, so handing them the dense sum of the
micro-batches' gradients changes the update (not round-off: it shows in float64). Serial
Keras differentiates the whole batch at once, and the batch's rows are the micro-batches'
rows one after the other, so its IndexedSlices is theirs concatenated in micro-batch order,
each already weighted by its share of the batch (the micro-batch's loss is). A dense
gradient is summed as it arrives, as before. A weight whose gradient is sparse in some
micro-batches and dense in others (a weight regulariser adds its dense gradient to the
first) is dense in the serial step too (TensorFlow densifies a mix): summed densely.

The replicas of a stage (``ParallelStrategy.ALL``) must agree on which gradients are
sparse, since a sparse one is gathered and a dense one summed, each a collective: they
decide it from the stage's structure (:class:`Rows`, one per sparse weight), not from what
their own micro-batches gave (only one replica adds the regularisation, and one with no
sample of a batch has no micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from ..comm.gradients import dense_gradient
from ..comm.sparse_rows import RowKind, row_kind
from ..errors import NotSupportedError

__all__ = ["MicroBatchGradients", "Rows", "rows_of"]


@dataclass(frozen=True)
class Rows:
    """A weight's gradient is a ``tf.IndexedSlices`` with indices, values and dense shape
    of these dtypes."""

    indices: tf.DType
    values: tf.DType
    shape: tf.DType

    @classmethod
    def of(cls, g: tf.IndexedSlices) -> Rows:
        return cls(g.indices.dtype, g.values.dtype, g.dense_shape.dtype)


def rows_of(grads: Sequence[Any]) -> list[Rows | None]:
    """For each gradient, its :class:`Rows` if it is sparse, else None."""
    return [Rows.of(g) if isinstance(g, tf.IndexedSlices) else None for g in grads]


class MicroBatchGradients:
    """The gradients of ``variables`` over one step's micro-batches: :meth:`add` each
    micro-batch's (in any order), then :meth:`whole`."""

    def __init__(self, variables: Sequence[Any]) -> None:
        self.variables = list(variables)
        self._dense: list[tf.Tensor | None] = [None] * len(self.variables)
        self._rows: list[dict[int, tf.IndexedSlices]] = [{} for _ in self.variables]

    def add(self, k: int, grads: Sequence[Any]) -> None:
        """Micro-batch ``k``'s gradients: dense ones are summed now, sparse ones kept; a
        None is one given with another micro-batch's (a gradient of several at once)."""
        for i, (g, v) in enumerate(zip(grads, self.variables)):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                self._rows[i][k] = g
            else:
                g = dense_gradient(g, v)
                total = self._dense[i]
                self._dense[i] = g if total is None else total + g

    def rows(self) -> list[Rows | None]:
        """Which gradients this step's micro-batches make sparse: those that were sparse in
        every micro-batch."""
        return [Rows.of(next(iter(r.values()))) if r and d is None else None
                for d, r in zip(self._dense, self._rows)]

    def whole(self, rows: Sequence[Rows | None] | None = None) -> list[Any]:
        """The batch's gradient of each variable: sparse where ``rows`` has a :class:`Rows`
        (every micro-batch's rows in micro-batch order; no row from a step without
        micro-batches), dense elsewhere (zeros without any micro-batch). ``rows``
        defaults to :meth:`rows`."""
        rows = self.rows() if rows is None else list(rows)
        out: list[Any] = []
        for v, total, parts, kind in zip(self.variables, self._dense, self._rows, rows):
            ordered = [parts[k] for k in sorted(parts)]
            if kind is not None:
                if total is not None:
                    raise NotSupportedError(
                        f"the gradient of {getattr(v, 'path', v.name)!r} is sparse "
                        "(tf.IndexedSlices) in the stage's structure but dense in this step: "
                        "pipelining cannot hand it to the optimizer as serial Keras would; "
                        "use ParallelStrategy.DATA for this model")
                name = getattr(v, "path", v.name)
                if ordered and row_kind(ordered[0], f"the weight {name!r}") is RowKind.SHARED:
                    raise NotSupportedError(
                        f"the weight {name!r} is looked up with indices that do not come from "
                        "the batch (e.g. positions with `arange`): a pipeline's micro-batches "
                        "cannot hand its sparse gradient to the optimizer as serial Keras does; "
                        "use ParallelStrategy.DATA for this model")
                out.append(_concatenated(ordered, v, kind))
                continue
            for part in ordered:
                g = dense_gradient(part, v)
                total = g if total is None else total + g
            out.append(tf.zeros_like(v) if total is None else total)
        return out


def _concatenated(parts: list[tf.IndexedSlices], like: Any, kind: Rows) -> tf.IndexedSlices:
    if not parts:  # no sample here: no row (a replica with no share of the batch)
        shape = tf.TensorShape(like.shape)
        return tf.IndexedSlices(tf.zeros([0, *shape[1:]], kind.values),
                                tf.zeros([0], kind.indices),
                                tf.constant(shape.as_list(), kind.shape))
    if len(parts) == 1:
        return parts[0]
    return tf.IndexedSlices(tf.concat([p.values for p in parts], axis=0),
                            tf.concat([p.indices for p in parts], axis=0), parts[0].dense_shape)
