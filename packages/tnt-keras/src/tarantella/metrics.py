"""Metric states reduced across ranks, so logs equal the serial ones.

Averaging per-rank metric *values* is wrong as soon as micro-batches differ in size (and for
any metric that is not a mean, such as AUC or precision). Keras metrics keep additive
*states* (totals and counts, confusion-matrix cells, ...); the serial state after a step is
the state before it plus the increment of the whole global batch, which is the sum of the
ranks' increments. So each step:

1. remembers the states and sets them to zero (:meth:`MetricStates.begin`),
2. lets Keras update them with this rank's micro-batch: they now hold this rank's increment
   exactly as Keras computes it (:meth:`MetricStates.increments`),
3. sums the increments over ranks (in the same fused allreduce as the gradients) and stores
   ``before + sum`` (:meth:`MetricStates.end`).

Every rank then holds the serial states, so ``result()`` — what the progress bar, the
callbacks, ``History`` and ``evaluate`` read — equals the serial value (up to float
round-off of the summation order). Requirement on custom metrics: their states must be
additive over samples (sums and counts), as all built-in Keras metrics are.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

__all__ = ["MetricStates"]

_ACC = tf.float64  # increments are summed in float64: exact for counts, no extra round-off


class MetricStates:
    """The state variables of a model's metrics, handled as one float64 vector."""

    def __init__(self, variables: Sequence) -> None:
        self.variables = list(variables)

    def __bool__(self) -> bool:
        return bool(self.variables)

    def begin(self) -> list[tf.Tensor]:
        """Read the states, then zero them; returns the values read."""
        before = [tf.identity(tf.convert_to_tensor(v)) for v in self.variables]
        for v, old in zip(self.variables, before):
            v.assign(tf.zeros_like(old))
        return before

    def increments(self) -> tf.Tensor:
        """This rank's increments of all states, flattened into one float64 vector."""
        parts = [tf.reshape(tf.cast(tf.convert_to_tensor(v), _ACC), [-1]) for v in self.variables]
        return tf.concat(parts, axis=0) if parts else tf.zeros([0], _ACC)

    def end(self, before: Sequence[tf.Tensor], total_increments: tf.Tensor) -> None:
        """Store ``before + total_increments`` (the serial states) into the variables."""
        sizes = [b.shape.num_elements() for b in before]  # metric states have static shapes
        parts = tf.split(total_increments, sizes) if len(sizes) > 1 else [total_increments]
        for v, old, inc in zip(self.variables, before, parts):
            new = tf.cast(old, _ACC) + tf.reshape(inc, tf.shape(old))
            v.assign(tf.cast(new, old.dtype))
