"""A pipeline stage's own compute on one micro-batch: its forward pass, under a gradient
tape, and its backward pass.

Why apart from the step: these know the partition (what it reads, computes and emits:
:mod:`tarantella.pipeline.partition`) and the loss, and nothing of neighbours, schedules or the
optimizer. The stage's step (:class:`tarantella.pipeline.stage.StageStep`) runs them in its
schedule's order, hands them what the neighbours sent and sends what they return, and
accumulates and applies the weights' gradients they give.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from .partition import COMPUTED, Partitioning

__all__ = ["InFlight", "StagePasses"]


@dataclass
class InFlight:
    """What micro-batch ``k``'s backward pass needs from its forward pass."""

    tape: tf.GradientTape
    #: what the previous stage sent (the gradients of these go back to it)
    inputs: list[tf.Tensor]
    #: what this stage emits: sends on, or on the last stage the model's flat outputs
    outputs: list[tf.Tensor]
    #: the last stage's share of the batch's loss, plus the weight regularisation where
    #: added (None: nothing to differentiate here but what the next stage sends back)
    loss: tf.Tensor | None
    #: the last stage's outputs in the model's output structure (else None)
    predictions: Any = None


class StagePasses:
    """Partition ``stage`` of ``parts`` over one micro-batch at a time.

    :param loss: a ``keras.losses.Loss`` over the model's outputs (the last stage's).
    """

    def __init__(self, parts: Partitioning, stage: int, loss: Any) -> None:
        self.parts, self.stage = parts, stage
        self.model = parts.models[stage]
        self.loss = loss
        self.first, self.last = stage == 0, stage == parts.num_partitions - 1
        self.weights = list(self.model.trainable_weights)

    def run(self, received: list[tf.Tensor], x: Any, training: bool) -> list[Any]:
        """The partition on one micro-batch: what it emits, from its own inputs in
        ``received`` and ``x``."""
        computed = self.model(self.parts.feed(self.stage, received, x), training=training)
        return self.parts.emitted(self.stage, received, computed)

    def forward(self, received: list[tf.Tensor], x: Any, y: Any, sample_weight: Any,
                share: float, regularise: bool, after: Sequence[tf.Tensor] = ()) -> InFlight:
        """The forward pass of one micro-batch, recorded for its backward pass (after the
        ops ``after``). On the last stage the loss is the micro-batch's mean times its
        ``share`` of the batch (:func:`tarantella.pipeline.micro_batches.shares`); ``regularise``
        adds the partition's weight regularisation (once per step)."""
        with tf.GradientTape() as tape, tf.control_dependencies(list(after)):
            tape.watch(received)
            emitted = self.run(received, x, training=True)
            loss = predictions = None
            if self.last:
                predictions = self.parts.outputs(emitted)
                loss = self.loss(y, predictions, sample_weight=sample_weight) * share
            if regularise and self.model.losses:
                # in the loss's dtype (float64 models: float64)
                dtype = tf.float64 if loss is None else loss.dtype
                regularisation = tf.add_n([tf.cast(r, dtype) for r in self.model.losses])
                loss = regularisation if loss is None else loss + regularisation
        return InFlight(tape, received, emitted, loss, predictions)

    def backward(self, flight: InFlight, returned: Sequence[tf.Tensor] | None,
                 loss_seed: tf.Tensor | None, after: Sequence[tf.Tensor] = ()
                 ) -> tuple[list[Any], list[tf.Tensor] | None]:
        """The backward pass of one micro-batch (after the ops ``after``): from the
        gradients the next stage ``returned`` for what this stage sent it (one per tensor;
        None on the last stage) and, where the forward pass made a loss, from ``loss_seed``
        at the loss. Returns the weights' gradients as the tape gives them (a tensor, or
        ``tf.IndexedSlices`` for a gathered weight) and the gradients of the received
        inputs, to send back (None on the first stage); a tensor that passed through this
        stage unchanged has its gradient passed straight back."""
        targets: list[Any] = []
        seeds: list[Any] = []
        through: dict[int, Any] = {}  # received index -> the gradient sent straight back
        if not self.last:
            assert returned is not None, "a stage before the last needs the gradients sent back"
            for (kind, i), sent, grad in zip(self.parts.emits[self.stage], flight.outputs, returned):
                if kind == COMPUTED:
                    targets.append(sent)
                    seeds.append(grad)
                else:
                    through[i] = grad
        if flight.loss is not None:
            targets.append(flight.loss)
            seeds.append(loss_seed)
        sources = self.weights + list(flight.inputs)
        with tf.control_dependencies(list(after)):
            grads = flight.tape.gradient(targets, sources, output_gradients=seeds,
                                         unconnected_gradients=tf.UnconnectedGradients.ZERO) \
                if targets else [tf.zeros_like(s) for s in sources]
        back = None
        if not self.first:
            back = list(grads[len(self.weights):])
            for i, grad in through.items():
                back[i] = back[i] + tf.cast(grad, back[i].dtype)
        return list(grads[:len(self.weights)]), back

