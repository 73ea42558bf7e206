"""The distributed train, test and predict steps that ``tnt.Model`` puts into Keras' loop.

They follow Keras 3's TensorFlow steps (``keras/src/backend/tensorflow/trainer.py``) and add
what data parallelism needs: gradients weighted by ``n / B`` and reduced through the fused
allreducer while backprop goes on (``tarantella.gradients``), metric states reduced
(``tarantella.metrics``), non-trainable state kept unchanged by a rank that only ran a
stand-in sample, and predictions gathered in global order.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
import tnt_core
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from .datasets import unpack_info
from .gradients import StepReducer, global_batch_size_op
from .metrics import MetricStates

__all__ = ["DistributedSteps"]


def _first_dim(x: Any) -> tf.Tensor:
    first = next(i for i in tree.flatten(x) if i is not None)
    return tf.shape(first)[0]


def _dense(grad: Any) -> tf.Tensor:
    # sparse gradients (Embedding) are reduced densely: every rank's rows differ
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


class DistributedSteps:
    """Step functions bound to one Keras model and the tnt runtime."""

    def __init__(self, model: keras.Model, runtime: tnt_core.Runtime) -> None:
        self.model = model
        self.runtime = runtime
        self.train_reducer = StepReducer(runtime, "train")
        self.test_reducer = StepReducer(runtime, "test")

    # -- helpers ---------------------------------------------------------------------------

    def _global_batch(self, n: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        """``b``, or the sum of ``n`` over ranks for data the user distributed by hand."""
        return tf.cond(b < 0, lambda: global_batch_size_op(self.runtime, n), lambda: b)

    def _call(self, x: Any, training: bool) -> Any:
        if self.model._call_has_training_arg:  # noqa: SLF001 (Keras' own step does this)
            return self.model(x, training=training)
        return self.model(x)

    # -- train -------------------------------------------------------------------------------

    def train_step(self, data: Any) -> dict[str, tf.Tensor]:
        model = self.model
        batch, n, b = unpack_info(data)
        b = self._global_batch(n, b)
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
        states = MetricStates(model.metrics_variables)
        before = states.begin()
        kept = [(v, tf.identity(tf.convert_to_tensor(v))) for v in model.non_trainable_variables]

        with tf.GradientTape() as tape:
            y_pred = self._call(x, training=True)
            loss = model._compute_loss(  # noqa: SLF001
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            model._loss_tracker.update_state(  # noqa: SLF001
                loss_module.unscale_loss_for_distribution(loss), sample_weight=_first_dim(x)
            )
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        reducer = self.train_reducer
        if reducer.timeline is not None:
            reducer.mark_backprop_start(loss)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        increments = states.increments()

        variables = list(model.trainable_weights)
        grads = tape.gradient(loss, variables) if variables else []
        # backward order: the last layer's gradients exist first
        order = [i for i in reversed(range(len(variables))) if grads[i] is not None]
        tensors = [increments] + [_dense(grads[i]) for i in order]
        reducer.plan(tensors)
        tokens = reducer.push_buckets(tensors, n, b, weighted=[False] + [True] * (len(tensors) - 1),
                                      metrics_id=0)
        reduced = reducer.finish(tokens, tensors)

        states.end(before, reduced[0])
        has_data = n > 0
        for v, old in kept:  # a stand-in sample must not move e.g. BatchNorm statistics
            v.assign(tf.where(has_data, tf.convert_to_tensor(v), old))
        if variables:
            new_grads = [None] * len(variables)
            for i, g in zip(order, reduced[1:]):
                new_grads[i] = g
            model.optimizer.apply_gradients(
                [(g, v) for g, v in zip(new_grads, variables) if g is not None]
            )
            if reducer.timeline is not None:  # reads what the update wrote: runs after it
                reducer.mark_optimizer_done([tf.convert_to_tensor(model.optimizer.iterations)]
                                            + [tf.convert_to_tensor(v) for v in variables[:1]])
        return model.get_metrics_result()

    # -- test --------------------------------------------------------------------------------

    def test_step(self, data: Any) -> dict[str, tf.Tensor]:
        model = self.model
        batch, n, b = unpack_info(data)
        b = self._global_batch(n, b)
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
        states = MetricStates(model.metrics_variables)
        before = states.begin()
        y_pred = self._call(x, training=False)
        loss = model._compute_loss(  # noqa: SLF001
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        model._loss_tracker.update_state(  # noqa: SLF001
            loss_module.unscale_loss_for_distribution(loss), sample_weight=_first_dim(x)
        )
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        increments = states.increments()
        reducer = self.test_reducer
        reducer.plan([increments])
        tokens = reducer.push_buckets([increments], n, b, weighted=[False], metrics_id=0)
        (total,) = reducer.finish(tokens, [increments])
        states.end(before, total)
        return model.get_metrics_result()

    # -- predict -----------------------------------------------------------------------------

    def predict_step(self, data: Any) -> Any:
        batch, n, b = unpack_info(data)
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
        y_pred = self._call(x, training=False)
        flat = tree.flatten(y_pred)
        backend = self.runtime.backend
        size = self.runtime.size

        def gather(*args: np.ndarray) -> list[np.ndarray]:
            *arrays, n_, b_ = args
            n_, b_ = int(n_), int(b_)
            if b_ < 0:  # data not distributed: every rank predicts its own data
                return [a[:n_] for a in arrays]
            sizes = tnt_core.micro_batch_sizes(b_, size, allow_empty=True)
            rows = sizes[0]  # the largest micro-batch
            out = []
            for a in arrays:
                padded = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
                padded[:n_] = a[:n_]
                every = backend.allgather(padded)
                out.append(np.concatenate([every[k, :sizes[k]] for k in range(size)], axis=0))
            return out

        outs = tf.numpy_function(gather, flat + [n, b], [t.dtype for t in flat], stateful=True,
                                 name="tnt_gather_predictions")
        if not isinstance(outs, (list, tuple)):
            outs = [outs]
        for out, t in zip(outs, flat):
            out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
        return tree.pack_sequence_as(y_pred, list(outs))
