"""What the rows of a sparse gradient are, so that shards of a batch combine into the batch's.

Keras' optimizers treat a sparse gradient (``tf.IndexedSlices``) row by row: Adam and
RMSprop square each row before duplicates are added up. So the rows of the whole batch's
gradient must be rebuilt exactly, and how depends on where the lookup's indices come from:

- **from the batch** (token ids: ``Embedding(x)``): one row per looked-up item, in batch
  order; the batch's rows are the shards' rows concatenated in order;
- **not from the batch** (positions: ``Embedding(ops.arange(length))``, the Transformer
  guides' position embedding): the same rows on every shard, each the sum over that shard's
  samples; the batch's rows are the shards' rows added up.

Read from the traced graph: the indices depend on the batch when a path of values (not of
shapes: ``Shape``, ``Size``) leads back to the step's input data. A gradient whose rows mix
both kinds (one variable looked up both ways) is refused: no combination of the shards'
rows gives the batch's.
"""

from __future__ import annotations

import enum

import tensorflow as tf

from ..errors import NotSupportedError

__all__ = ["RowKind", "row_kind"]


class RowKind(enum.Enum):
    FROM_BATCH = "from the batch"
    SHARED = "shared by the batch's samples"


#: ops whose output is metadata of their input (no value of it flows on)
_METADATA = frozenset({"Shape", "ShapeN", "Size", "Rank", "TensorListLength", "TensorListElementShape"})
#: ops that produce the step's input data inside a step function
_DATA = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue", "IteratorGetNextAsOptional"})


def _from_batch(tensor: tf.Tensor, data_placeholders: frozenset[str]) -> bool:
    seen: set[str] = set()
    stack = [tensor.op]
    while stack:
        op = stack.pop()
        if op.name in seen or op.type in _METADATA:
            continue
        seen.add(op.name)
        if op.type in _DATA or op.name in data_placeholders:
            return True
        stack.extend(t.op for t in op.inputs)
    return False


def _data_placeholders(graph: tf.Graph) -> frozenset[str]:
    """The graph's inputs that carry values (not resource handles nor captured tensors)."""
    captured = {t.op.name for t in getattr(graph, "internal_captures", ())}
    return frozenset(op.name for op in graph.get_operations()
                     if op.type == "Placeholder" and op.name not in captured
                     and op.outputs[0].dtype != tf.resource)


def row_kind(grad: tf.IndexedSlices, variable_name: str = "a weight") -> RowKind | None:
    """How ``grad``'s rows combine over shards of the batch, or None when it is not in a
    graph (an eager step: its rows are treated as coming from the batch)."""
    indices = grad.indices
    if tf.executing_eagerly() or not hasattr(indices, "graph"):
        return None
    data = _data_placeholders(indices.graph)
    # several lookups of one variable: TensorFlow concatenates their rows (ConcatV2's last
    # input is the axis)
    parts = list(indices.op.inputs[:-1]) if indices.op.type == "ConcatV2" else [indices]
    kinds = {RowKind.FROM_BATCH if _from_batch(p, data) else RowKind.SHARED for p in parts}
    if len(kinds) > 1:
        raise NotSupportedError(
            f"{variable_name} is looked up both with indices from the batch and with indices that "
            "are not (e.g. token ids and positions in one Embedding): its sparse gradient's rows "
            "cannot be combined over ranks or micro-batches as the serial step has them; use a "
            "separate Embedding for each kind of lookup")
    return kinds.pop()
