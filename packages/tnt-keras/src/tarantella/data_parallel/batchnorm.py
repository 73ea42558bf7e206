"""``BatchNormalization(synchronized=True)``: the moments of the global batch on every rank.

Keras computes synchronized moments from the per-replica sums of ``x``, ``x**2`` and the
element count, all-reduced through ``tf.distribute``'s replica context (which is the
identity without a strategy), as ``E[x**2] - E[x]**2``. While a distributed train step is
traced, tarantella gives each synchronized layer the same computation over tnt's backend:
one allreduce of the three sums per layer in the forward pass, and, since every rank's
output depends on every rank's input, one allreduce of their gradients in the backward pass.
The result is serial training's, statistics and gradients alike. A rank without a sample
(``n = 0``, a stand-in) contributes nothing.

Ordering: the collectives go through the channel's one chain, the forward ones in the order
the layers are traced, the backward ones after them in the order the gradient is traced; the
step then waits for the whole backward pass before it pushes gradient buckets (no overlap for
such models), so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import tensorflow as tf

from .._keras_compat import batch_norm_moments
from ..comm import Channel
from ..comm.graph_ops import allreduce_sum
from ..errors import NotSupportedError
from ..seams.overrides import instance_attributes

__all__ = ["global_moments", "synchronized_layers"]


def synchronized_layers(layers: list[keras.layers.Layer]) -> list[keras.layers.BatchNormalization]:
    """The ``BatchNormalization(synchronized=True)`` layers among ``layers``."""
    return [layer for layer in layers
            if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "synchronized", False)]


def _summed(vector: tf.Tensor, channel: Channel, name: str) -> tf.Tensor:
    """Allreduce-sum with its gradient (the allreduce-sum of the upstream gradients)."""

    @tf.custom_gradient
    def summed(v: tf.Tensor) -> Any:
        out = allreduce_sum(v, channel, name=f"{name}_forward")

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return allreduce_sum(dy, channel, name=f"{name}_backward")

        return out, grad

    return summed(vector)


def _moments(layer: keras.layers.BatchNormalization, step: Any, channel: Channel,
             inputs: tf.Tensor, mask: Any) -> tuple[tf.Tensor, tf.Tensor]:
    if mask is not None:
        raise NotSupportedError(
            f"BatchNormalization layer {layer.name!r} has synchronized=True and gets a mask: "
            "tarantella synchronizes unmasked batch statistics only; use synchronized=False"
        )
    rank = len(inputs.shape)
    axes = [i for i in range(rank) if i != layer.axis % rank]  # what Keras' moments reduce
    x = inputs
    dtype = x.dtype
    if dtype in (tf.float16, tf.bfloat16):  # statistics in float32, as Keras does
        x = tf.cast(x, tf.float32)
    has_data = tf.cast(step.has_data, x.dtype)
    local_sum = tf.reduce_sum(x, axis=axes, keepdims=True) * has_data
    local_squares = tf.reduce_sum(tf.square(x), axis=axes, keepdims=True) * has_data
    per_channel = tf.cast(tf.size(x) // tf.size(local_sum), x.dtype) * has_data
    flat = tf.concat([tf.reshape(local_sum, [-1]), tf.reshape(local_squares, [-1]),
                      tf.reshape(per_channel, [1])], axis=0)
    total = tf.cast(_summed(tf.cast(flat, tf.float64), channel, f"tnt_bn_{layer.name}"), x.dtype)
    channels = tf.size(local_sum)
    count = total[2 * channels]
    mean = tf.math.divide_no_nan(tf.reshape(total[:channels], tf.shape(local_sum)), count)
    squares = tf.math.divide_no_nan(tf.reshape(total[channels:2 * channels], tf.shape(local_sum)), count)
    variance = tf.maximum(squares - tf.square(mean), 0.0)
    mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    if dtype != x.dtype:
        mean, variance = tf.cast(mean, dtype), tf.cast(variance, dtype)
    return mean, variance


def global_moments(layers: list[keras.layers.BatchNormalization], step: Any,
                   channel: Channel) -> contextlib.AbstractContextManager[None]:
    """While a train step is traced, ``layers`` normalise with the global batch's moments."""

    def moments_of(layer: keras.layers.BatchNormalization) -> Any:
        def moments(inputs: tf.Tensor, mask: Any = None) -> tuple[tf.Tensor, tf.Tensor]:
            return _moments(layer, step, channel, inputs, mask)

        return moments

    return instance_attributes([batch_norm_moments(layer, moments_of(layer)) for layer in layers])
