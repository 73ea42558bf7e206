"""Gradient reduction for a training loop of your own: ``tnt.DistributedGradientTape`` and
``tnt.DistributedOptimizer``.

Loops are written two ways, and both are served by one reduction (:func:`reduce_gradients`):
Keras' guide "Writing a training loop from scratch" hands the tape's gradients to
``optimizer.apply`` (or ``apply_gradients``), so wrapping the optimizer distributes the loop
unchanged; Horovod's users wrap the tape, whose ``gradient`` then returns the reduced
gradients. Either way the gradients go through ``fit``'s own reduction
(:func:`tarantella.comm.gradients.reduce_weighted` over a
:class:`tarantella.comm.gradients.GradientReducer`: the native path where the backend offers it,
tnt-core's fused allreducer otherwise), bucket
by bucket in backward order, from eager code or inside a ``tf.function``; sparse gradients
(``tf.IndexedSlices``) are gathered row by row, as ``fit`` does.

Rank ``r`` contributes ``w_r g_r``. With :data:`BATCH_SHARE` (the ``tnt.*`` wrappers),
``w_r = n_r / B``, this rank's share of the global batch (``tarantella.loops.data``): for a
loss that is a mean over the micro-batch, the sum is the serial gradient, also with uneven
batches. ``tarantella.horovod`` passes Horovod's fixed weights instead (``1 / R`` for its
average). Inside ``tnt.Model``'s own step nothing is reduced here: the step reduces what its
optimizers apply, once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from .. import comm
from ..comm import Channel
from ..comm.compression import NO_COMPRESSION, Compression
from ..comm.gradients import GradientReducer, reduce_weighted
from ..data_parallel.steps import current_step
from ..environment import refuse_in_elastic_job
from ..reporting.tracebacks import user_facing
from ..seams.class_swap import disguised_subclass
from .data import batch_share

__all__ = ["BATCH_SHARE", "Compression", "DistributedGradientTape", "DistributedOptimizer",
           "GradientReduction", "distribute_optimizer", "reduce_gradients"]


@dataclass(frozen=True)
class GradientReduction:
    """How a loop's gradients are combined across ranks.

    :param weight: makes the graph op of this rank's weight ``w_r`` (float64 scalar); the
        result is ``sum_r w_r g_r``.
    :param compression: the wire format of dense gradients.
    :param sparse_as_dense: reduce ``tf.IndexedSlices`` densely instead of gathering rows.
    :param rebinding: what is traced must reach the communicator current when it runs (an
        elastic job's custom loop under ``hvd.elastic.run``: its ``tf.function`` is not
        traced again after ranks leave); see :class:`~tarantella.comm.gradients.GradientReducer`.
    """

    weight: Callable[[], tf.Tensor]
    compression: Compression = NO_COMPRESSION
    sparse_as_dense: bool = False
    rebinding: bool = False


def _batch_share_weight() -> tf.Tensor:
    return batch_share().weight()


#: the ``tnt.*`` wrappers' reduction: each rank weighted by its share of the global batch
BATCH_SHARE = GradientReduction(_batch_share_weight)

# -- the reduction ---------------------------------------------------------------------------

#: one reducer per call site of a traced graph (the i-th reduction of a graph uses the i-th),
#: shared by every graph and by eager calls: reductions of one graph are ordered, different
#: graphs run one after the other, and each reducer keeps a plan per set of tensor shapes
_reducers: dict[tuple[int, int, bool], tuple[Channel, GradientReducer]] = {}
_calls: weakref.WeakKeyDictionary[tf.Graph, int] = weakref.WeakKeyDictionary()


def _reducer(channel: Channel, rebinding: bool) -> GradientReducer:
    index = 0
    if not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        index = _calls.get(graph, 0)
        _calls[graph] = index + 1
    key = (id(channel), index, rebinding)
    entry = _reducers.get(key)
    if entry is None:
        entry = _reducers[key] = (channel, GradientReducer(channel, f"loop_{index}",
                                                           rebinding=rebinding))
    return entry[1]


@tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any] | None,
                     reduction: GradientReduction, *, keep_outputs: bool = False) -> list[Any]:
    """``sum_r w_r g_r`` for each gradient (``None`` stays ``None``), eagerly or as graph ops.

    :param variables: the variables (or watched tensors) of ``grads``, for their static
        shapes; None when unknown.
    :param keep_outputs: the caller hands the results to user code, which may keep them past
        the next reduction: on the Python path they are copied out of the reused buckets.
    """
    grads = list(grads)
    if current_step() is not None:  # inside tnt.Model's step: it reduces what is applied
        return grads
    if not reduction.rebinding:  # its trace would keep the communicator of the moment
        refuse_in_elastic_job("a custom training loop (tnt.DistributedOptimizer)")
    channel = comm.world()
    if reduction.sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return grads
    weight = tf.cast(reduction.weight(), tf.float64)
    like = None if variables is None else [v if _has_shape(v) else None for v in variables]
    python_path = reduction.rebinding or channel.native_reason() is not None
    copy = keep_outputs and channel.size > 1 and python_path
    return reduce_weighted(grads, like, weight, lambda: _reducer(channel, reduction.rebinding), channel,
                           keep=tf.not_equal(weight, 0.0), compression=reduction.compression,
                           copy=copy)


def _has_shape(v: Any) -> bool:
    shape = getattr(v, "shape", None)
    return shape is not None and tf.TensorShape(shape).is_fully_defined()


# -- the tape ---------------------------------------------------------------------------------


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient`` returns the gradients reduced over the ranks.

    ``tape = tnt.DistributedGradientTape(tape)`` after the forward pass, or
    ``with tnt.DistributedGradientTape(tf.GradientTape()) as tape:``; everything but
    ``gradient`` is the wrapped tape's. Each rank's gradient is weighted by its share of the
    global batch (see ``tnt.distribute_dataset``), so a loss that is a mean over the
    micro-batch gives the serial gradient on every rank.
    """

    def __init__(self, tape: tf.GradientTape, *, reduction: GradientReduction = BATCH_SHARE) -> None:
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape; got "
                            f"{type(tape).__name__}")
        if not reduction.rebinding:
            refuse_in_elastic_job("a custom training loop (tnt.DistributedGradientTape)")
        self._tape = tape
        self._reduction = reduction

    @tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE) -> Any:
        """As ``tf.GradientTape.gradient``, reduced over the ranks (a collective: every rank
        calls it with the same sources)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, tf.nest.flatten(sources), self._reduction, keep_outputs=True)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:  # watch, stop_recording, reset, jacobian, ...
        return getattr(self._tape, name)


# -- the optimizer ------------------------------------------------------------------------------


class DistributedOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer whose ``apply`` (and ``apply_gradients``) first reduces the gradients
    over the ranks: ``optimizer = tnt.DistributedOptimizer(optimizer)``.

    Returns the optimizer itself, distributed (as ``tnt.Model`` does with a model): its
    state, hyper-parameters and config stay, ``isinstance(opt, keras.optimizers.Adam)`` holds,
    and Keras saves it as the plain optimizer. Each rank's gradient is weighted by its share
    of the global batch (see ``tnt.distribute_dataset``). Compiled into a ``tnt.Model`` it
    reduces nothing itself: the model's step reduces once.
    """

    _tnt_base: type
    _tnt_reduction: GradientReduction

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is DistributedOptimizer:
            optimizer = kwargs.pop("optimizer", args[0] if args else None)
            if len(args) > 1 or kwargs:
                raise TypeError("tnt.DistributedOptimizer(optimizer) takes the optimizer only")
            return distribute_optimizer(optimizer, BATCH_SHARE, "tnt.DistributedOptimizer")
        base = cls.__dict__.get("_tnt_base")
        if base is None:
            raise TypeError("tnt.DistributedOptimizer is not a base class: pass an optimizer "
                            "instance to tnt.DistributedOptimizer(...)")
        return distribute_optimizer(base(*args, **kwargs), BATCH_SHARE, "tnt.DistributedOptimizer")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: ``__new__`` returned the user's optimizer, initialised already."""

    @tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Reduce ``grads`` over the ranks, then apply them as the optimizer does."""
        grads = list(grads)
        variables = None if trainable_variables is None else list(trainable_variables)
        reduced = reduce_gradients(grads, variables, self._tnt_reduction)
        return super().apply(reduced, variables)


@user_facing
def distribute_optimizer(optimizer: Any, reduction: GradientReduction, where: str) -> Any:
    """``optimizer`` made to reduce its gradients with ``reduction`` (in place)."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(f"{where}: {type(optimizer).__name__} is a TensorFlow 1 optimizer "
                        "(tf.compat.v1.train), which Keras 3 cannot use; pass a Keras optimizer, "
                        "e.g. keras.optimizers.SGD(learning_rate=0.1)")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"{where} wraps a Keras optimizer instance (e.g. "
                        f"keras.optimizers.Adam(1e-3)); got {type(optimizer).__name__}")
    if not isinstance(optimizer, DistributedOptimizer):
        object.__setattr__(optimizer, "__class__", disguised_subclass(DistributedOptimizer, type(optimizer)))
    object.__setattr__(optimizer, "_tnt_reduction", reduction)
    return optimizer
