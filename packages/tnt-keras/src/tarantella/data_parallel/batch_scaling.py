"""How a value a step computes scales with its micro-batch, read from the traced graph.

Data parallelism gives the serial value of a per-batch quantity only when it decomposes
over the ranks' micro-batches:

* a **mean** over the samples is the ranks' means weighed by their shares of the batch;
* a **sum** over the samples is the ranks' sums added;
* a **constant** (a weight penalty: no sample in it) is the same on every rank.

A maximum over the batch, a product or square of means, a mean over a data-dependent
selection of rows do not decompose. Keras gives no way to say which of these a loss term
added with ``add_loss`` is, so :func:`scaling` reads it from the graph: it walks back from
the value to the reductions that remove the batch axis (a tensor that depends on the
micro-batch and whose first dimension is the batch's), through the operations that keep
the kind (a cast, a product with a constant, a sum of terms of one kind, a division of a
sum by the batch size, which makes it a mean). The batch size may be read from a shape as
Keras' ``Loss`` objects read it (``sum_over_batch_size``: the sum over all elements divided
by the product of the dimensions, the batch's times per-sample ones the ranks share, since
they split one global batch). Whatever else it meets is :attr:`Scaling.OTHER`: the caller
refuses it rather than guess.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = ["Scaling", "pairing", "scaling"]


class Scaling(enum.Enum):
    """How a value depends on the micro-batch."""

    CONSTANT = "constant"
    MEAN = "mean"
    SUM = "sum"
    OTHER = "other"


# internal kinds: a tensor with one row per sample; the batch size (times per-sample
# dimensions); a shape vector with the batch size in one entry; a per-sample dimension
_ROWS = "rows"
_SIZE = "size"
_SHAPE = "shape"
_DIM = "dim"

#: operations that pass the kind of their first input on unchanged
_KEEP = frozenset({"Identity", "Cast", "Neg", "Squeeze", "ExpandDims", "Reshape", "StopGradient",
                   "PreventGradient", "EnsureShape", "CheckNumerics"})
#: operations that select rows by the data: a mean over their rows is no mean over samples
_SELECT = frozenset({"Where", "GatherV2", "GatherNd", "DynamicPartition", "Unique",
                     "UniqueV2", "BooleanMask", "SparseSegmentMean", "RaggedGather"})
_ADD = frozenset({"AddV2", "Add", "Sub", "AddN"})
_DIV = frozenset({"RealDiv", "Div", "DivNoNan", "TrueDiv"})
#: element-wise operations that broadcast their inputs against each other
_BROADCAST = _ADD | _DIV | frozenset({
    "Mul", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "Maximum",
    "Minimum", "LogicalAnd", "LogicalOr", "SquaredDifference", "Pow", "FloorDiv", "FloorMod",
    "SelectV2"})
#: operations whose output depends on the shape of their input, not on its values
_SHAPE_OF = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _key(t: tf.Tensor) -> tuple[str, int]:
    return t.op.name, t.value_index


class _Walk:
    def __init__(self, batch: Sequence[Any]) -> None:
        tensors = [t for t in batch if tf.is_tensor(t) and not isinstance(t, tf.SparseTensor)]
        self.batch = {_key(t) for t in tensors if hasattr(t, "op")}
        dims = {t.shape[0] if t.shape.rank else None for t in tensors}
        self.n = dims.pop() if len(dims) == 1 else None
        self.depends: dict[tuple[str, int], bool] = {}
        self.depends_on_values: dict[tuple[str, int], bool] = {}
        self.kinds: dict[tuple[str, int], Any] = {}

    def depends_on_batch(self, t: tf.Tensor, values: bool = False) -> bool:
        """Whether ``t`` is computed from the micro-batch (iteratively: graphs are deep);
        ``values``: from the values of its samples, not only from its shape."""
        depends = self.depends if not values else self.depends_on_values
        stack = [(t, False)]
        while stack:
            x, expanded = stack.pop()
            k = _key(x)
            if k in depends:
                continue
            if k in self.batch:
                depends[k] = True
            elif values and x.op.type in _SHAPE_OF:
                depends[k] = False
            elif expanded:
                depends[k] = any(depends.get(_key(i), False) for i in x.op.inputs)
            else:
                stack.append((x, True))
                stack.extend((i, False) for i in x.op.inputs if _key(i) not in depends)
        return depends[_key(t)]

    def rows(self, t: tf.Tensor) -> bool:
        """One row per sample of the micro-batch: depends on it, and its first dimension is
        the batch's (unknown, or the batch's static size)."""
        shape = t.shape
        if shape.rank is None or shape.rank == 0 or not self.depends_on_batch(t):
            return False
        return shape[0] is None if self.n is None else shape[0] == self.n

    def sample_rows(self, t: tf.Tensor) -> bool:
        """Rows computed from the values of the samples (not, say, a range over a dimension)."""
        return self.rows(t) and self.depends_on_batch(t, values=True)

    def pairing(self, t: tf.Tensor) -> tf.Operation | None:
        """The first operation ``t`` is computed with that broadcasts rows of samples of one
        rank against rows of another: ``(n, 1)`` against ``(n,)`` is ``(n, n)``, each
        sample paired with every other one, which grows as the square of the batch. (The
        walk goes on below an operation found, so the error names where the pairs begin.)"""
        seen: set[tuple[str, int]] = set()
        found = None
        stack = [t]
        while stack:
            x = stack.pop()
            if _key(x) in seen or not self.depends_on_batch(x, values=True):
                continue
            seen.add(_key(x))
            if x.op.type in _BROADCAST:
                ranks = {i.shape.rank for i in x.op.inputs if self.sample_rows(i)}
                if len(ranks) > 1:
                    found, stack = x.op, []
            stack.extend(x.op.inputs)
        return found

    def selected(self, t: tf.Tensor) -> bool:
        """Whether a tensor of rows came from selecting rows by the data."""
        seen: set[tuple[str, int]] = set()
        stack = [t]
        while stack:
            x = stack.pop()
            if _key(x) in seen or not self.rows(x):
                continue
            seen.add(_key(x))
            if x.op.type in _SELECT:
                return True
            stack.extend(x.op.inputs)
        return False

    def kind(self, t: tf.Tensor) -> Any:
        k = _key(t)
        if k not in self.kinds:
            self.kinds[k] = self._kind(t)
        return self.kinds[k]

    def _kind(self, t: tf.Tensor) -> Any:
        if not self.depends_on_batch(t):
            return Scaling.CONSTANT
        if self.rows(t):
            return _ROWS
        op = t.op
        kind = op.type
        inputs = list(op.inputs)
        if kind in ("Sum", "Mean"):
            inner = self.kind(inputs[0])
            if inner is _ROWS:
                if kind == "Sum":
                    return Scaling.SUM
                return Scaling.OTHER if self.selected(inputs[0]) else Scaling.MEAN
            return inner if inner in (Scaling.MEAN, Scaling.SUM) else Scaling.OTHER
        if kind in ("Shape", "Size"):
            if not self.rows(inputs[0]):
                return Scaling.OTHER
            return _SHAPE if kind == "Shape" else _SIZE
        if kind == "StridedSlice":
            return self._slice(op) if self.kind(inputs[0]) is _SHAPE else Scaling.OTHER
        if kind in _KEEP:
            inner = self.kind(inputs[0])
            return inner if inner is not _ROWS else Scaling.OTHER
        kinds = [self.kind(i) for i in inputs]
        if kind in ("Pack", "ConcatV2"):  # dimensions gathered into a shape vector
            parts = kinds[:-1] if kind == "ConcatV2" else kinds
            if not all(k in (Scaling.CONSTANT, _DIM, _SIZE, _SHAPE) for k in parts):
                return Scaling.OTHER
            batch = sum(k in (_SIZE, _SHAPE) for k in parts)
            if (kind == "Pack" and _SHAPE in parts) or batch > 1:
                return Scaling.OTHER
            return _SHAPE if batch else _DIM
        if kind == "Prod" and kinds[0] in (_SHAPE, _DIM) and kinds[1] is Scaling.CONSTANT \
                and op.get_attr("keep_dims") is False and inputs[0].shape.rank == 1:
            return _SIZE if kinds[0] is _SHAPE else _DIM
        if kind in _ADD:
            moving = {k for k in kinds if k is not Scaling.CONSTANT}
            if moving == {Scaling.MEAN}:
                return Scaling.MEAN  # a constant next to a mean: the shares add up to one
            if moving == {Scaling.SUM} and Scaling.CONSTANT not in kinds:
                return Scaling.SUM  # a constant next to a sum would be added once per rank
            return Scaling.OTHER
        if kind == "Mul" and len(kinds) == 2 and _SIZE in kinds \
                and set(kinds) <= {_SIZE, _DIM, Scaling.CONSTANT} and kinds.count(_SIZE) == 1:
            return _SIZE  # the batch size times per-sample dimensions
        if kind == "Mul" and len(kinds) == 2 and Scaling.CONSTANT in kinds:
            other = kinds[1] if kinds[0] is Scaling.CONSTANT else kinds[0]
            return other if other in (Scaling.MEAN, Scaling.SUM, _SIZE, _DIM) else Scaling.OTHER
        if kind in _DIV and len(kinds) == 2:
            top, bottom = kinds
            if top is Scaling.SUM and bottom is _SIZE:
                return Scaling.MEAN
            if bottom is Scaling.CONSTANT and top in (Scaling.MEAN, Scaling.SUM):
                value = tf.get_static_value(inputs[1])
                if top is Scaling.SUM and self.n is not None and value is not None \
                        and value.size == 1 and float(value) == float(self.n):
                    return Scaling.MEAN  # divided by the (static) batch size
                return top
        return Scaling.OTHER

    def _slice(self, op: tf.Operation) -> Any:
        """A slice of a shape vector: the batch size, a shape vector holding it, or per-sample
        dimensions; OTHER when the slice is not static."""
        shape, begin, end, strides = op.inputs
        rank = shape.shape[0]
        values = [tf.get_static_value(t) for t in (begin, end, strides)]
        if rank is None or any(v is None or v.shape != (1,) for v in values) \
                or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
            return Scaling.OTHER
        b, e, s = (int(v[0]) for v in values)
        index = list(range(rank))
        if op.get_attr("shrink_axis_mask") & 1:
            if not -rank <= b < rank:
                return Scaling.OTHER
            return _SIZE if index[b] == 0 else _DIM
        picked = index[slice(None if op.get_attr("begin_mask") & 1 else b,
                             None if op.get_attr("end_mask") & 1 else e, s)]
        return _SHAPE if 0 in picked else _DIM


def scaling(value: Any, batch: Sequence[Any]) -> Scaling | None:
    """How ``value`` (a tensor of the traced step, a scalar or what Keras sums into one)
    scales with the micro-batch whose tensors are ``batch``; None for an eager tensor (a
    step run with ``run_eagerly=True``), which has no graph to read."""
    if not tf.is_tensor(value):
        return Scaling.CONSTANT
    if tf.executing_eagerly() or not hasattr(value, "graph"):
        return None
    walk = _Walk(batch)
    kind = walk.kind(value)
    if kind is _ROWS:
        return Scaling.SUM  # Keras sums a term with one entry per sample
    return kind if isinstance(kind, Scaling) else Scaling.OTHER


def pairing(value: Any, batch: Sequence[Any]) -> tf.Operation | None:
    """The operation of the traced step that pairs each sample of the micro-batch (whose
    tensors are ``batch``) with every other one on the way to ``value``, or None: a sum over
    such pairs is no sum over the samples, the ranks' parts miss the pairs across ranks."""
    if not tf.is_tensor(value) or tf.executing_eagerly() or not hasattr(value, "graph"):
        return None
    return _Walk(batch).pairing(value)
