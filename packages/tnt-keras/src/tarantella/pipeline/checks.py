"""What pipelining refuses, each with a message saying what to do instead.

Why in one place: a pipelined model is serial training or a clear refusal. These checks
run before anything is sent (when ``tnt.Model`` cuts the model, when it is compiled, when a
stage's step is made), so a configuration that cannot give the serial result fails at once
with the reason, never as different numbers or a hang between stages later.
"""

from __future__ import annotations

from typing import Any

import keras

import tnt_core

from .._keras_compat import all_layers, get_keras_mask, producer
from ..data_parallel import losses
from ..errors import NotSupportedError
from ..model import ParallelStrategy
from .partition import Partitioning

__all__ = ["check_compile", "check_distribute", "check_file_format", "check_point_to_point",
           "check_stage_model"]


def check_point_to_point(backend: tnt_core.CommBackend) -> None:
    """The stages exchange activations and gradients point-to-point."""
    if not backend.supports("p2p"):
        raise NotSupportedError(
            f"pipelining needs point-to-point messages, which the {backend.name!r} backend "
            "does not provide; use a backend that does (tnt run --backend gloo or mpi)")


def check_stage_model(model: keras.Model, stage: int) -> None:
    """Refuse what micro-batching cannot keep serial, naming the layer."""
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and not getattr(layer, "synchronized", False):
            raise NotSupportedError(
                f"BatchNormalization layer {layer.name!r} (partition {stage}) would compute its "
                "statistics on each micro-batch, not the batch, under pipelining: use "
                "num_micro_batches=1, or a normalisation that does not use batch statistics "
                "(keras.layers.LayerNormalization, GroupNormalization)")
        if getattr(layer, "activity_regularizer", None) is not None:
            raise NotSupportedError(
                f"layer {layer.name!r} (partition {stage}) has an activity_regularizer, which "
                "pipelining does not support yet; use a weight regulariser "
                "(kernel_regularizer=...) or drop it")


def check_distribute(model: keras.Model, strategy: ParallelStrategy, runtime: tnt_core.Runtime,
                     parts: Partitioning) -> None:
    """``tnt.Model(model, parallel_strategy=strategy)`` with ``model`` cut into ``parts``:
    something to pipeline, the ranks the partitions need, a backend with what the strategy
    uses, a model not compiled yet, and stage models micro-batching keeps serial."""
    if parts.num_partitions == 1:
        how = ("run on S ranks (tnt run -n S: it is cut into S partitions), pass "
               "num_pipeline_stages=S" if strategy is ParallelStrategy.PIPELINING else
               "pass num_pipeline_stages=S (the stages of each pipeline)")
        raise NotSupportedError(
            f"tnt.Model(parallel_strategy={strategy.name}): model {model.name!r} has no "
            "tnt.keras.layers.SplitLayer and is to be cut into 1 partition, so there is "
            f"nothing to pipeline; {how}, mark the cuts with SplitLayer, or use "
            "ParallelStrategy.DATA")
    stages = parts.num_partitions
    if strategy is ParallelStrategy.PIPELINING and runtime.size != stages:
        raise NotSupportedError(
            f"tnt.Model(parallel_strategy=PIPELINING): model {model.name!r} has {stages} "
            f"partitions ({len(parts.cuts)} cuts), which need exactly {stages} ranks; this job "
            f"has {runtime.size}: {_rank_counts_that_work(stages, runtime.size)}")
    if strategy is ParallelStrategy.ALL and runtime.size % stages:
        raise NotSupportedError(
            f"tnt.Model(parallel_strategy=ALL): model {model.name!r} has {stages} partitions, "
            f"so the job needs a multiple of {stages} ranks (one pipeline per {stages}); it "
            f"has {runtime.size}: {_rank_counts_that_work(stages, runtime.size)}")
    check_point_to_point(runtime.backend)
    if getattr(model, "compiled", False):
        raise NotSupportedError(
            f"model {model.name!r} was compiled before tnt.Model(..., {strategy.name}): compile "
            "it after, so that each stage's optimizer gets its own weights")
    if strategy is ParallelStrategy.ALL and not runtime.backend.supports("groups"):
        raise NotSupportedError(
            f"ParallelStrategy.ALL needs groups of ranks, which the {runtime.backend.name!r} "
            "backend does not provide; use one that does (gloo, mpi)")
    masked = [t for t in model.outputs if get_keras_mask(t) is not None]
    if masked:
        made = producer(masked[0])
        raise NotSupportedError(
            f"the output of layer {made[0].name if made else masked[0].name!r} of model "
            f"{model.name!r} carries a Keras mask (mask_zero=True, "
            "Masking): its loss is a mean over the batch's unmasked steps, which micro-batches "
            "cannot split by their sizes; weigh the padding with sample_weight instead, or "
            "use ParallelStrategy.DATA")
    for p, part in enumerate(parts.models):  # every partition on every rank: one refusal for all
        check_stage_model(part, p)


def _rank_counts_that_work(stages: int, size: int) -> str:
    """What to run a model of ``stages`` partitions with instead of ``size`` ranks: only
    what can work (ALL needs a multiple of ``stages``)."""
    if size % stages == 0:  # PIPELINING was asked for: ALL serves this job as it is
        return (f"run it with tnt run -n {stages}, or keep {size} ranks with "
                f"ParallelStrategy.ALL ({size // stages} pipelines of {stages})")
    multiples = ", ".join(str(stages * k) for k in range(2, 4))
    return (f"run it with tnt run -n {stages} (ParallelStrategy.PIPELINING: one pipeline), or "
            f"with -n {multiples}, ... and ParallelStrategy.ALL (several pipelines)")


def check_compile(model: keras.Model, base: type, loss: Any, steps_per_execution: int) -> None:
    """``compile`` of a pipelined ``model`` (of the user's class ``base``): a loss the last
    stage can differentiate micro-batch by micro-batch into the serial one, Keras' own
    ``train_step``, one batch per step."""
    if loss is None:
        raise NotSupportedError("compile(loss=None): a pipelined model needs the compiled "
                                "loss (its last stage differentiates it); pass loss=...")
    if base.train_step is not keras.Model.train_step:  # type: ignore[attr-defined]
        raise NotSupportedError(
            f"{type(model).__name__} overrides train_step: a pipelined model runs its own "
            "step per stage; use ParallelStrategy.DATA for custom steps")
    means = ("sum_over_batch_size", "mean")
    other = [r for r in losses.reductions(loss, len(model.outputs)) if r not in means]
    if other:
        raise NotSupportedError(
            f"compile(loss=...) with a loss of reduction={other[0]!r} on a pipelined model: "
            "each micro-batch's loss is weighted by its share of the batch, which gives the "
            "serial loss only for a mean over the samples; use "
            "reduction='sum_over_batch_size' (Keras' default)")
    if steps_per_execution != 1:
        raise NotSupportedError("compile(steps_per_execution=...): a pipelined step runs "
                                "eagerly, one batch at a time; leave it at 1")


def check_file_format(method: str, filepath: Any) -> None:
    """``save``, ``save_weights`` or ``load_weights`` (``method``) of a pipelined model: not
    the legacy HDF5 format, which reads or writes every weight on one rank."""
    path = str(filepath)
    if not path.endswith((".h5", ".hdf5")) or path.endswith(".weights.h5"):
        return
    if method == "load_weights":
        raise NotSupportedError(
            f"load_weights({path!r}): a pipelined model reads .keras, .weights.h5 and "
            ".weights.json files; load the legacy HDF5 file into the plain Keras model and "
            "save it as .weights.h5 first")
    raise NotSupportedError(
        f"{method}({path!r}): the legacy HDF5 format reads every weight on the writing rank, "
        "which a pipelined rank does not hold; use a .keras file (or .weights.h5)")
