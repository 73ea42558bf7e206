"""The global loss normaliser: where Keras divides by a local count, divide by the global one.

Keras reduces a loss over the micro-batch it sees: ``sum_over_batch_size`` divides the sum
of the per-element losses by their number (by the number of *valid* elements when the
prediction carries a mask), ``mean_with_sample_weight`` by the sum of the sample weights,
``sum``/``none`` not at all. The serial loss of the global batch divides by the same count
over the *global* batch. So rank ``r``, whose Keras loss is ``N_r / D_r``, contributes
``D_r / sum_r D_r`` of its gradient, and for ``sum`` all of it (see
``tarantella.comm.gradients``): the reduced gradient is then exactly the serial one.

:func:`normaliser` finds ``(scale_r, divisor_r)`` for the losses given to ``compile``; a
combination whose terms have different normalisers (two masked outputs, ``sum`` next to
a mean, ...) cannot be expressed by one factor per rank and is refused. A loss a custom
``train_step`` computes itself is taken to be a mean over the samples of the micro-batch
(:func:`per_sample`), which is Keras' default.

Terms added with ``add_loss`` are read from the traced graph (:func:`summed_terms`,
``tarantella.data_parallel.batch_scaling``): a mean over the samples (Keras' activity regularizers divide
by the batch size) or a term free of the batch is weighed like the loss; a *sum* over the
samples must count once per rank, so ``compute_loss`` adds it divided by this rank's
weight; a term that is neither (a maximum, a square of a mean) is refused, naming the layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from .._keras_compat import get_keras_mask
from ..errors import NotSupportedError
from .batch_scaling import Scaling, scaling

__all__ = ["Normaliser", "normaliser", "per_sample", "reductions", "summed_terms", "weigh_backward"]

_MEAN = ("sum_over_batch_size", "mean")
_WEIGHTED_MEAN = "mean_with_sample_weight"
_SUM = ("sum", "none", None)


@dataclass(frozen=True)
class Normaliser:
    """How rank ``r`` weighs its gradient: ``scale_r * g_r``, summed over ranks, divided by
    the sum of ``divisor_r`` when ``divide``."""

    scale: tf.Tensor
    divisor: tf.Tensor
    divide: bool
    #: ``sum_r divisor_r`` when known without a collective (the global batch size), or None
    total: tf.Tensor | None = None


def per_sample(n: tf.Tensor, b: tf.Tensor | None = None) -> Normaliser:
    """A loss averaged over the micro-batch's ``n`` samples (Keras' default reduction) of a
    global batch of ``b`` samples (``b < 0``: unknown, the user distributed the data)."""
    n64 = tf.cast(n, tf.float64)
    total = None if b is None else tf.cast(b, tf.float64)
    return Normaliser(n64, n64, True, total)


def weigh_backward(loss: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """``loss`` itself, whose gradient is ``factor`` times the loss's.

    The backward pass then starts from this rank's weight, so each sample carries the
    magnitudes of the serial backward pass (a float16 layer overflows exactly when serial
    does), while the value stays this rank's own loss: what a custom step logs or feeds a
    metric is then a per-rank mean, which the logs reduction averages as it averages
    everything else (``tarantella.data_parallel.steps``)."""

    @tf.custom_gradient
    def weighed(x: tf.Tensor) -> tuple[tf.Tensor, Any]:
        def grad(upstream: tf.Tensor) -> tf.Tensor:
            return upstream * tf.cast(factor, upstream.dtype)

        return tf.identity(x), grad

    return weighed(loss)


def summed_terms(terms: Sequence[tuple[Any, Any]], batch: Sequence[Any]) -> list[tf.Tensor]:
    """Of the ``(layer, term)`` a step added with ``add_loss``, the terms that are sums over
    the samples of the micro-batch (``batch``: its tensors); refuses a term that is neither
    a mean nor a sum over them, nor free of them. A step run eagerly has no graph to read:
    its terms are taken for means, Keras' own kind (its activity regularizers)."""
    sums = []
    for layer, term in terms:
        kind = scaling(term, batch)
        if kind is Scaling.OTHER:
            raise NotSupportedError(
                f"layer {layer.name!r} adds a loss with add_loss() that is neither a mean nor a "
                "sum over the samples of the batch (a maximum, a product of means, a mean over "
                "selected rows, ...): the ranks' parts of such a term do not add up to its "
                "serial value. Write it as a mean (ops.mean) or a sum (ops.sum) over the samples"
            )
        if kind is Scaling.SUM:
            sums.append(term)
    return sums


def _reduction(loss: Any) -> str | None:
    if isinstance(loss, keras.losses.Loss):
        return loss.reduction
    return "sum_over_batch_size"  # a name or function: Keras wraps it with this reduction


def _terms(loss: Any, outputs: int) -> list[Any]:
    """The compiled loss terms, one per output that has a loss."""
    if isinstance(loss, (dict, list, tuple)):
        return [term for term in keras.tree.flatten(loss) if term is not None]
    return [loss] * outputs  # one loss for every output


def reductions(loss: Any, outputs: int) -> list[str | None]:
    """The reduction of each term of a ``compile(loss=...)`` (one loss, a list or a dict)
    for a model of ``outputs`` outputs."""
    return [_reduction(term) for term in _terms(loss, outputs)]


def _count(mask: tf.Tensor | None, sample_weight: Any) -> tf.Tensor:
    """The divisor of ``mean_with_sample_weight``: the sum of the (masked) weights."""
    if mask is None:
        return tf.reduce_sum(tf.cast(sample_weight, tf.float64))
    m = tf.cast(mask, tf.float64)
    if sample_weight is None:
        return tf.reduce_sum(m)
    w = tf.cast(sample_weight, tf.float64)
    while w.shape.rank is not None and m.shape.rank is not None and w.shape.rank < m.shape.rank:
        w = tf.expand_dims(w, -1)
    return tf.reduce_sum(m * w)


def normaliser(model: keras.Model, y_pred: Any, sample_weight: Any, n: tf.Tensor,
               b: tf.Tensor | None = None) -> Normaliser:
    """The normaliser of ``model``'s compiled loss for this micro-batch (``n`` samples of a
    global batch of ``b``)."""
    outputs = keras.tree.flatten(y_pred)
    has_data = tf.cast(n > 0, tf.float64)
    loss = getattr(model, "loss", None)
    if loss is None:  # only losses added by layers (add_loss): means over the batch
        return per_sample(n, b)
    terms = _terms(loss, len(outputs))
    reductions = [_reduction(t) for t in terms]
    masks = [m for m in (get_keras_mask(o) for o in outputs) if m is not None]
    weighted = sample_weight is not None
    if all(r in _SUM for r in reductions):
        if len(terms) > 1 or model.losses:
            raise NotSupportedError(
                "a loss with reduction='sum' (or 'none') next to "
                + ("other losses" if len(terms) > 1 else "regularization losses")
                + " cannot be normalised like serial training: each rank's sum adds up to the "
                "serial sum, but the other terms are means. Use reduction='sum_over_batch_size'"
                ", or one summed loss without regularizers"
            )
        return Normaliser(has_data, has_data, False)
    if not masks and all(r in _MEAN or (r == _WEIGHTED_MEAN and not weighted) for r in reductions):
        return per_sample(n, b)
    if len(terms) == 1 and len(outputs) == 1:
        mask = masks[0] if masks else None
        if reductions[0] in _MEAN:
            count = tf.reduce_sum(tf.cast(mask, tf.float64))
        elif reductions[0] == _WEIGHTED_MEAN:
            count = _count(mask, sample_weight)
        else:
            raise NotSupportedError(f"unknown loss reduction {reductions[0]!r}")
        count = count * has_data
        return Normaliser(count, count, True)
    raise NotSupportedError(
        f"the compiled losses have reductions {reductions} on {len(outputs)} outputs"
        + (" with masks" if masks else "") + ": their normalisers differ from output to output, "
        "so no single weight per rank gives the serial gradient. Use "
        "reduction='sum_over_batch_size' on unmasked outputs, or one output per model"
    )
