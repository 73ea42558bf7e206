"""The shapes of what crosses each cut, for the shapes of a batch's inputs.

Why: a stage's receive needs the shape of the message before it arrives (the buffer is
made for it), and what a model built on ``keras.Input((None,))`` exchanges has a size only
per batch: sequence bucketing feeds each batch at its own length. Every rank reads the same
global batch, so every stage knows the inputs' shapes, and from them each stage derives the
shapes of everything the stages before it send, as Keras derives a functional model's
shapes (``compute_output_spec`` of each partition in turn, on symbolic tensors: nothing
is computed, no weight is read, and the model's graph is left as it was). The stages
therefore agree on every message's shape without a message about it, and each stage's step
is traced once per shape, as Keras' own step is. A model whose cut tensors have fixed
shapes (the usual case) skips all this.

A shape that depends on the values (not only on the shapes) of the inputs cannot be
derived this way, and is refused in one line.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ..errors import NotSupportedError
from .partition import RECEIVED, Partitioning

__all__ = ["CutShapes", "Shapes"]

#: the shapes without the batch dimension, of each tensor in a list
Shapes = tuple[tuple[int, ...], ...]


def _fixed(specs: list[Any]) -> Shapes | None:
    """The specs' shapes without the batch dimension, or None if one is not known."""
    shapes = tuple(tuple(s.shape[1:]) for s in specs)
    return None if any(d is None for s in shapes for d in s) else shapes


class CutShapes:
    """The shapes of what each partition receives and of the model's outputs, per batch.

    :param parts: the model's partitions.
    """

    def __init__(self, parts: Partitioning) -> None:
        self.parts = parts
        self._fixed = [_fixed(r) for r in parts.received] + \
            [_fixed(keras.tree.flatten(parts.output_structure))]
        #: whether every shape is known from the model alone (the same for every batch)
        self.fixed = all(s is not None for s in self._fixed)
        self._derived: dict[Any, list[Shapes]] = {}

    def received(self, stage: int, x: Any) -> Shapes:
        """What ``stage`` receives for the batch ``x`` (the whole model input; batch
        dimension left out)."""
        return self._shapes(stage, x)

    def outputs(self, x: Any) -> Shapes:
        """The model's flat outputs for the batch ``x`` (batch dimension left out)."""
        return self._shapes(self.parts.num_partitions, x)

    def _shapes(self, index: int, x: Any) -> Shapes:
        if self.fixed:
            return self._fixed[index]  # type: ignore[return-value]
        # every rank derives every cut's shapes, so that a shape it cannot know is refused
        # on every rank alike (not only on the stages that receive it)
        flat = [tf.convert_to_tensor(t) for t in keras.tree.flatten(x)]
        key = tuple((t.dtype, tuple(t.shape[1:])) for t in flat)
        derived = self._derived.get(key)
        if derived is None:
            derived = self._derived[key] = self._derive(x, flat)
        return derived[index]

    def _derive(self, x: Any, flat: list[tf.Tensor]) -> list[Shapes]:
        """Every partition's received shapes and the outputs', through the partitions'
        ``compute_output_spec`` on symbolic inputs of the batch's shapes."""
        parts = self.parts
        symbolic = [keras.KerasTensor((None, *t.shape[1:]), t.dtype.name) for t in flat]
        inputs = keras.tree.pack_sequence_as(x, symbolic)
        found: list[Shapes] = []
        received: list[Any] = []
        for p in range(parts.num_partitions):
            if p:
                found.append(self._checked(received, f"partition {p} receives", flat))
            else:
                found.append(())
            feed = inputs if p == 0 else [received[i] if kind == RECEIVED else symbolic[i]
                                          for kind, i in parts.feeds[p]]
            computed = parts.models[p].compute_output_spec(feed)
            received = parts.emitted(p, received, computed)
        found.append(self._checked(received, "the model returns", flat))
        return found

    @staticmethod
    def _checked(specs: list[Any], what: str, flat: list[tf.Tensor]) -> Shapes:
        shapes = _fixed(specs)
        if shapes is None:
            given = ", ".join(str(tuple(t.shape)) for t in flat)
            raise NotSupportedError(
                f"pipelining: for inputs of shape {given}, {what} tensors of shape "
                f"{', '.join(str(tuple(s.shape)) for s in specs)}: a size that depends on the "
                "input's values, not only its shape, is not known before the message arrives; "
                "cut the model where the shapes follow from the inputs' shapes")
        return shapes
