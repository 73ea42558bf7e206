"""Horovod's ``DistributedGradientTape`` and ``DistributedOptimizer``: tarantella's
custom-loop reduction (``tarantella.loops.gradients``: fused buckets, the native path) with
Horovod's weights.

Horovod averages the ranks' gradients (or sums them, ``op=hvd.Sum``). A Horovod script
gives every rank its own batch of the same size, so the average is the share-weighted sum
that ``tnt.DistributedGradientTape`` computes, and scripts scale their learning rate for it;
keeping Horovod's weights keeps their numbers. Where the micro-batches differ (a short last
batch), the average is not the serial gradient: ``tnt.distribute_dataset`` with the
``tnt.*`` wrappers is.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

import tnt_core

from ..errors import NotSupportedError
from ..loops.gradients import DistributedGradientTape as _Tape
from ..loops.gradients import GradientReduction, distribute_optimizer
from ..reporting.tracebacks import user_facing
from ._collectives import Average, Compression, Sum, current_size, reduction_op

__all__ = ["DistributedGradientTape", "DistributedOptimizer"]


def _reduction(where: str, compression: Any, sparse_as_dense: bool, op: Any,
               gradient_predivide_factor: float) -> GradientReduction:
    op = reduction_op(op, None, where)
    if op not in (Average, Sum):
        raise NotSupportedError(f"{where}(op={op}): gradients are averaged (hvd.Average) or "
                                "summed (hvd.Sum)")
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError(f"{where}: gradient_predivide_factor needs op=hvd.Average")
    # where the division by the number of ranks happens (gradient_predivide_factor) changes
    # only round-off: every rank's gradient is weighted 1 / size before the sum; the size
    # of the moment the step runs (an elastic job's ranks leave, its traced steps stay)
    elastic = tnt_core.init().membership is not None

    def weight() -> tf.Tensor:
        if op is not Average:
            return tf.constant(1.0, tf.float64)
        return 1.0 / tf.cast(current_size(), tf.float64)

    return GradientReduction(weight, compression, bool(sparse_as_dense), rebinding=elastic)


@tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
@user_facing
def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802 (Horovod's name)
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0) -> _Tape:
    """The tape, its ``gradient`` averaged over the ranks (summed with ``op=hvd.Sum``).
    ``device_*`` are accepted for compatibility: the gradients move through the host."""
    reduction = _reduction("hvd.DistributedGradientTape", compression, sparse_as_dense, op,
                           gradient_predivide_factor)
    return _Tape(gradtape, reduction=reduction)


@user_facing
def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",  # noqa: N802
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False) -> Any:
    """The Keras optimizer itself, its ``apply``/``apply_gradients`` averaging the gradients
    over the ranks first (as ``tnt.DistributedOptimizer``, with Horovod's weights).

    ``backward_passes_per_step > 1`` is refused: Keras' optimizers accumulate gradients
    themselves (``gradient_accumulation_steps=``, which averages them, as
    ``average_aggregated_gradients=True``). ``name`` and ``device_*`` are accepted for
    compatibility.
    """
    where = "hvd.DistributedOptimizer"
    if backward_passes_per_step != 1:
        raise NotSupportedError(
            f"{where}(backward_passes_per_step={backward_passes_per_step}): make the optimizer "
            f"with gradient_accumulation_steps={backward_passes_per_step} instead (Keras "
            "accumulates and averages the gradients, and each step's gradients are reduced)"
        )
    reduction = _reduction(where, compression, sparse_as_dense, op, gradient_predivide_factor)
    return distribute_optimizer(optimizer, reduction, where)
