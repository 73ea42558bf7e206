"""``tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING)``: the user's model,
cut into partitions (:mod:`tarantella.partition`: at its SplitLayers, or into
``num_pipeline_stages`` automatically), trained as a pipeline with the results of serial
training.

Why Keras' own loop: ``fit``/``evaluate``/``predict`` stay Keras' (its data adapters,
callbacks, History, progress bar); only the steps change. Every rank reads the same global
batches; the steps run eagerly (they exchange tensors with the neighbouring stages between
micro-batches) and hand the batch to this rank's stage (:class:`~tarantella.pipeline.
StageStep`). The last stage differentiates a loss made as ``compile`` makes the model's
(every output's loss, weighted by ``loss_weights``, summed). After each step the last
stage's outputs (all of the model's outputs) are broadcast, so that every rank runs Keras'
compiled loss and metrics on the same values: the per-output losses, metrics, logs and
History of every rank equal serial Keras'.

A rank holds only its own partition (:mod:`tarantella.stage_variables`): a model built
without values (``keras.StatelessScope(initialize_variables=False)``) gets values for this
rank's partition only; a model built the ordinary way loses the other partitions' values.
Nothing gathers the whole model behind the user's back: ``save``, ``save_weights`` and the
checkpoint callbacks (``ModelCheckpoint``, ``BackupAndRestore``, at any ``save_freq``) write
what serial Keras writes, streamed from the stages to the master (:mod:`tarantella.
stage_saving`); ``load_weights`` (and so ``BackupAndRestore``) reads each rank's own layers
and optimizer slots. ``get_weights``/``set_weights`` are whole-model, the one explicit gather.
What is not supported yet is refused with a message saying what to do: a custom
``train_step``. Callbacks otherwise run as for DATA: writers on the master only (the other
stages serve the master's saves during their hooks).

:class:`PipelinedModel` is the sibling of :class:`~tarantella.data_parallel.DataParallelModel`
over the base :class:`tarantella.model.Model` (identity, saving, the class swap); both run
the argument checks of :mod:`tarantella.arguments` before their loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from . import _keras_compat, arguments, files, losses, native_ops, randomness, stage_saving, timeline
from .callbacks import distribute_callbacks
from .errors import NotSupportedError
from .gradients import GradientReducer
from .model import DistributedState, Model, ParallelStrategy
from .partition import Partitioning, partition, split_layers
from .pipeline import StageStep, check_stage_model
from .stage_saving import StageSaving
from .stage_variables import Ownership, hold_own_partition
from .tracebacks import user_facing

__all__ = ["PipelinedModel"]


class _TracedLoss:
    """Keras' compiled loss of a model, run as Keras' default (compiled) step runs it: in a
    graph whose batch dimension is unknown. Why: the compiled loss adds each output's loss to
    its tracker (``out1_loss``) weighted by the static batch size, which a traced step does
    not know, so serial Keras adds one unweighted value per step; called eagerly, as a
    pipelined step would, it would weigh by the batch size and the per-output logs would
    differ from serial ones (2e-2 with an uneven last batch, measured). One trace per
    structure and per dtype and shape of the samples."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self._traced: dict[Any, Any] = {}

    def __call__(self, y: Any, y_pred: Any, sample_weight: Any) -> tf.Tensor:
        args = (y, y_pred) if sample_weight is None else (y, y_pred, sample_weight)
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(args)]
        structure = tf.nest.map_structure(lambda _: None, args)
        key = (repr(structure), tuple((t.dtype, tuple(t.shape[1:])) for t in flat))
        traced = self._traced.get(key)
        if traced is None:
            compiled = self.compiled  # built (its trackers made) in its first trace, as in Keras

            def loss(*tensors: tf.Tensor) -> tf.Tensor:
                return compiled(*tf.nest.pack_sequence_as(structure, list(tensors)))

            signature = [tf.TensorSpec([None, *t.shape[1:]], t.dtype) for t in flat]
            traced = self._traced[key] = tf.function(loss, input_signature=signature,
                                                     autograph=False)
        return traced(*flat)


class _PipelineState(DistributedState):
    """Rank ``r`` is stage ``r % P`` of pipeline (replica) ``r // P``: a pipeline's stages
    are consecutive ranks, talking point-to-point in the group ``pipe``; with replicas,
    each stage's replicas sum their gradients in the group ``replicas``."""

    def __init__(self, runtime: tnt_core.Runtime, parts: Partitioning, num_micro_batches: int,
                 strategy: ParallelStrategy, ownership: Ownership) -> None:
        super().__init__(runtime, strategy)
        stages = parts.num_partitions
        self.parts = parts
        self.stage, self.replica = runtime.rank % stages, runtime.rank // stages
        self.num_replicas = runtime.size // stages
        self.num_micro_batches = num_micro_batches
        backend = runtime.backend
        self.pipe: tnt_core.CommBackend = backend
        self.replicas: tnt_core.CommBackend | None = None
        if self.num_replicas > 1:  # every rank takes part in making every group
            for r in range(self.num_replicas):
                group = backend.split([r * stages + s for s in range(stages)])
                if group is not None:
                    self.pipe = group
            for stage in range(stages):
                group = backend.split([r * stages + stage for r in range(self.num_replicas)])
                if group is not None:
                    self.replicas = group
        self.step: StageStep | None = None
        #: the model's compiled loss as a traced step runs it (for the logs; set by compile)
        self.logged_loss: _TracedLoss | None = None
        #: which stage holds each weight and each layer's variables (positions, no variables)
        self.ownership = ownership
        self.saving = StageSaving(backend, runtime.rank, stages, ownership)

    def master_writes(self, model: keras.Model, run: Callable[[], None] | None) -> None:
        """A master-only callback's hook: the master runs it, writing alone, while the other
        stages of its pipeline serve its saves until it ends the hook (if it raised, they
        raise too, instead of waiting for it at the next step)."""
        saving = self.saving
        master = tnt_core.get_master_rank()
        if self.runtime.rank == master:
            failed = True
            saving.serving = True
            try:
                if run is not None:
                    with files.local_writes():
                        run()
                failed = False
            finally:
                saving.serving = False
                saving.end(saving.peers(master), failed)
        elif self.runtime.rank in saving.peers(master) and saving.serve(model, master):
            raise NotSupportedError(  # the master's own error is in its output
                    "a callback that runs on the master rank failed there; stopping this rank too")


def _rank_counts_that_work(stages: int, size: int) -> str:
    """What to run a model of ``stages`` partitions with instead of ``size`` ranks: only
    what can work (ALL needs a multiple of ``stages``)."""
    if size % stages == 0:  # PIPELINING was asked for: ALL serves this job as it is
        return (f"run it with tnt run -n {stages}, or keep {size} ranks with "
                f"ParallelStrategy.ALL ({size // stages} pipelines of {stages})")
    multiples = ", ".join(str(stages * k) for k in range(2, 4))
    return (f"run it with tnt run -n {stages} (ParallelStrategy.PIPELINING: one pipeline), or "
            f"with -n {multiples}, ... and ParallelStrategy.ALL (several pipelines)")


class PipelinedModel(Model, strategies=(ParallelStrategy.PIPELINING, ParallelStrategy.ALL)):
    """The pipelined ``tnt.Model`` (see the module doc); ``tnt.Model(model,
    parallel_strategy=PIPELINING or ALL)`` makes it."""

    _tnt: _PipelineState

    @classmethod
    def _tnt_distribute(cls, model: keras.Model, strategy: ParallelStrategy,
                        num_micro_batches: Any, num_pipeline_stages: Any = None) -> Model:
        """Cut ``model`` into its stages and make it this rank's pipelined model; with
        ``ParallelStrategy.ALL``, one pipeline per ``P`` ranks, the batch split between them.
        The cuts are the model's SplitLayers, else ``num_pipeline_stages`` automatic ones
        (under PIPELINING, by default one partition per rank)."""
        num_micro_batches = arguments.check_num_micro_batches(
            1 if num_micro_batches is None else num_micro_batches)
        wanted = arguments.check_num_pipeline_stages(num_pipeline_stages)
        runtime = tnt_core.init()
        if wanted is None and strategy is ParallelStrategy.PIPELINING and not split_layers(model):
            wanted = runtime.size
        parts = partition(model, wanted)
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
        if not runtime.backend.supports("p2p"):
            raise NotSupportedError(
                f"pipelining needs point-to-point messages, which the {runtime.backend.name!r} "
                "backend does not provide; use one that does (tnt run --backend gloo or mpi)")
        if getattr(model, "compiled", False):
            raise NotSupportedError(
                f"model {model.name!r} was compiled before tnt.Model(..., {strategy.name}): compile "
                "it after, so that each stage's optimizer gets its own weights")
        if strategy is ParallelStrategy.ALL and not runtime.backend.supports("groups"):
            raise NotSupportedError(
                f"ParallelStrategy.ALL needs groups of ranks, which the {runtime.backend.name!r} "
                "backend does not provide; use one that does (gloo, mpi)")
        stage = runtime.rank % stages
        check_stage_model(parts.models[stage], stage)
        # this rank's partition gets its values (a model built without them), the others
        # lose theirs (a model built with them): stage_variables
        ownership = hold_own_partition(model, [list(m.variables) for m in parts.models], stage)
        state = _PipelineState(runtime, parts, num_micro_batches, strategy, ownership)
        # the replicas of a stage draw their own Dropout masks, for their own samples, as the
        # ranks of DATA do (pipeline 0 keeps the serial stream)
        randomness.fold_rank_into_seeds(parts.models[stage], state.replica)
        pipelined = cls._tnt_adopt(model, state)
        pipelined.run_eagerly = True  # predict before compile too: the steps talk to the neighbours
        return pipelined

    @property
    def local_param_count(self) -> int:
        """The number of parameters this rank's stage holds and trains."""
        return self._tnt.parts.param_count(self._tnt.stage)

    @property
    def num_micro_batches(self) -> int:
        """The micro-batches each global batch is split into."""
        return self._tnt.num_micro_batches

    def __repr__(self) -> str:
        runtime = self._tnt.runtime
        state = self._tnt
        replica = f", pipeline {state.replica} of {state.num_replicas}" if state.num_replicas > 1 else ""
        return (f"<tnt.Model {self.name!r} (pipelined, stage {state.stage} of "
                f"{state.parts.num_partitions}{replica}) on rank {runtime.rank}/{runtime.size}>")

    # -- configuration ----------------------------------------------------------------------

    @user_facing
    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, loss_weights: Any = None,
                metrics: Any = None, weighted_metrics: Any = None, run_eagerly: bool = False,
                steps_per_execution: int = 1, jit_compile: Any = "auto",
                auto_scale_loss: bool = True) -> None:
        """As ``keras.Model.compile``; the steps run eagerly (they exchange tensors between
        micro-batches), so ``run_eagerly`` and ``jit_compile`` do not apply."""
        if loss is None:
            raise NotSupportedError("compile(loss=None): a pipelined model needs the compiled "
                                    "loss (its last stage differentiates it); pass loss=...")
        base: Any = type(self)._tnt_base  # noqa: SLF001 - the class's own attribute
        if base.train_step is not keras.Model.train_step:
            raise NotSupportedError(
                f"{type(self).__name__} overrides train_step: a pipelined model runs its own "
                "step per stage; use ParallelStrategy.DATA for custom steps")
        means = ("sum_over_batch_size", "mean")
        other = [r for r in losses.reductions(loss, len(self.outputs)) if r not in means]
        if other:
            raise NotSupportedError(
                f"compile(loss=...) with a loss of reduction={other[0]!r} on a pipelined model: "
                "each micro-batch's loss is weighted by its share of the batch, which gives the "
                "serial loss only for a mean over the samples; use "
                "reduction='sum_over_batch_size' (Keras' default)")
        if steps_per_execution != 1:
            raise NotSupportedError("compile(steps_per_execution=...): a pipelined step runs "
                                    "eagerly, one batch at a time; leave it at 1")
        arguments.check_optimizer(optimizer)
        optimizer = keras.optimizers.get(optimizer)
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                        metrics=metrics, weighted_metrics=weighted_metrics, run_eagerly=True,
                        jit_compile=False, auto_scale_loss=auto_scale_loss)
        self._tnt_check_compiled()
        # the last stage differentiates a loss of its own made as compile made the model's
        # (every output's loss weighted and summed): the model's one keeps the per-output
        # loss trackers, which the logs update on every rank alike (_tnt_logs)
        self._tnt.step = self._tnt_stage_step(
            _keras_compat.new_compiled_loss(self, loss, loss_weights), self.optimizer)
        self._tnt.logged_loss = _TracedLoss(_keras_compat.compiled_loss(self))
        if not self.optimizer.built:  # over this stage's weights only, before any callback
            self.optimizer.build(self._tnt.step.weights)  # (BackupAndRestore) builds it whole
        stage_saving.whole_optimizer_paths(self.optimizer, list(self.trainable_variables))  # savable

    def _tnt_stage_step(self, loss: keras.losses.Loss, optimizer: Any) -> StageStep:
        state = self._tnt
        replicas = None if state.replicas is None else \
            GradientReducer(state.runtime, f"stage{state.stage}_replicas", state.replicas)
        return StageStep(state.parts, state.stage, state.pipe, loss=loss, optimizer=optimizer,
                         num_micro_batches=state.num_micro_batches, replicas=replicas,
                         regularise=state.replica == 0, timeline=timeline.get(state.runtime),
                         native=native_ops.point_to_point(state.runtime, state.pipe))

    # -- the steps -------------------------------------------------------------------------------

    def _tnt_share(self, batch: int) -> slice:
        """This pipeline's rows of a global batch of ``batch`` samples."""
        state = self._tnt
        return tnt_core.micro_batch_slice(batch, state.replica, state.num_replicas, allow_empty=True)

    def _tnt_outputs(self, batch: int) -> Any:
        """The model's outputs for the whole batch, on every rank, in the model's output
        structure: the last stage's, or with several pipelines each last stage's rows (an
        allreduce of the rows over zeros, which adds nothing to them)."""
        state = self._tnt
        parts = state.parts
        last = parts.num_partitions - 1
        specs = keras.tree.flatten(parts.output_structure)
        bufs = [np.zeros((batch, *[int(d) for d in spec.shape[1:]]),
                         dtype=tf.as_dtype(spec.dtype).as_numpy_dtype) for spec in specs]
        share = self._tnt_share(batch)
        if state.stage == last and share.stop > share.start:
            assert state.step is not None
            for buf, rows in zip(bufs, keras.tree.flatten(state.step.predictions)):
                buf[share] = np.asarray(rows)
        backend = state.runtime.backend
        if state.num_replicas == 1:
            flat = [backend.broadcast(buf, root=last) for buf in bufs]
        else:
            flat = [backend.allreduce(buf) for buf in bufs]
        return parts.outputs([tf.convert_to_tensor(v) for v in flat])

    def _tnt_rows(self, values: Any, share: slice) -> Any:
        return tf.nest.map_structure(lambda v: None if v is None else v[share.start:share.stop],
                                     values)

    def _tnt_sum(self, value: float) -> float:
        return float(self._tnt.runtime.backend.allreduce(np.array([value], np.float64))[0])

    def _tnt_batch(self, data: Any) -> tuple[Any, Any, Any, int]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = int(tf.shape(tf.nest.flatten(x)[0])[0])
        self._tnt_check_batch(x, y, batch)
        return x, y, sample_weight, batch

    def _tnt_check_batch(self, x: Any, y: Any, batch: int) -> None:
        """Every rank must hold the same batch (stage 0 reads x, the last stage y): compare
        a fingerprint, so that data read differently on two ranks fails loudly."""
        parts = [np.float64(batch)]
        for t in tf.nest.flatten(x) + ([] if y is None else tf.nest.flatten(y)):
            parts.append(np.float64(_checksum(t)))
        words = np.array(parts, np.float64)
        both = np.concatenate([words, -words])
        extremes = self._tnt.runtime.backend.allreduce(both, "max")
        if not np.array_equal(extremes[:words.size], -extremes[words.size:]):
            raise tnt_core.CommError(
                "the ranks of a pipelined model read different batches (their batch sizes or "
                "contents differ): every rank must read the same data in the same order; pass "
                "the same arrays or dataset on every rank and do not shard it by rank")

    def _tnt_loss_tracker(self) -> Any:
        return next((m for m in self.metrics if m.name == "loss"), None)

    def _tnt_logs_read_outputs(self) -> bool:
        """Whether a training step's logs need the whole batch's outputs on every rank:
        for compiled metrics, for the loss of each of several outputs (``out1_loss``), or
        for a ``compute_metrics`` of the model's own. Else the step's loss is all they
        need, and the outputs stay on the last stage."""
        several = len(keras.tree.flatten(self._tnt.parts.output_structure)) > 1
        own = type(self).compute_metrics is not keras.Model.compute_metrics
        others = any(m is not self._tnt_loss_tracker() for m in self.metrics)
        return several or own or others

    def train_step(self, data: Any) -> Any:
        state = self._tnt
        assert state.step is not None, "compile() makes the stage's step"
        x, y, sample_weight, batch = self._tnt_batch(data)
        share = self._tnt_share(batch)
        part = state.step.train(self._tnt_rows(x, share), self._tnt_rows(y, share),
                                self._tnt_rows(sample_weight, share), global_batch=batch)
        return self._tnt_logs(x, y, sample_weight, batch, 0.0, loss=self._tnt_sum(part))

    def test_step(self, data: Any) -> Any:
        state = self._tnt
        assert state.step is not None, "compile() makes the stage's step"
        x, y, sample_weight, batch = self._tnt_batch(data)
        share = self._tnt_share(batch)
        regularisation = self._tnt_sum(state.step.forward(self._tnt_rows(x, share),
                                                          share.stop - share.start))
        y_pred = self._tnt_outputs(batch)
        return self._tnt_logs(x, y, sample_weight, batch, regularisation, y_pred)

    def predict_step(self, data: Any) -> Any:
        state = self._tnt
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        batch = int(tf.shape(tf.nest.flatten(x)[0])[0])
        if state.step is None:  # predict before compile: a step without loss or optimizer
            state.step = self._tnt_stage_step(keras.losses.MeanSquaredError(),
                                              keras.optimizers.SGD())
        share = self._tnt_share(batch)
        state.step.forward(self._tnt_rows(x, share), share.stop - share.start)
        return self._tnt_outputs(batch)

    def _tnt_logs(self, x: Any, y: Any, sample_weight: Any, batch: int, regularisation: float,
                  y_pred: Any = None, loss: float | None = None) -> Any:
        """The same metric updates on every rank (the outputs are everyone's now). Keras'
        compiled loss runs on the whole batch's outputs as in a serial step
        (:class:`_TracedLoss`): it updates the per-output loss trackers (``out1_loss``, ...)
        and gives the loss (plus the stages' ``regularisation``) unless the step's own sum
        ``loss`` is given."""
        if loss is not None and not self._tnt_logs_read_outputs():
            y_pred = None  # nothing reads them: no broadcast of the batch's outputs
        else:
            if y_pred is None:
                y_pred = self._tnt_outputs(batch)
            assert self._tnt.logged_loss is not None, "compile() makes it"
            compiled = self._tnt.logged_loss(y, y_pred, sample_weight)
            if loss is None:
                loss = float(compiled) + regularisation
        tracker = self._tnt_loss_tracker()
        if tracker is not None:
            tracker.update_state(loss, sample_weight=batch)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    # -- the loops ---------------------------------------------------------------------------

    def _tnt_start(self) -> None:
        """Before a loop: after compile, set_weights or load_weights, the replicas of a stage
        (ALL) take replica 0's weights of their partition."""
        state = self._tnt
        if state.needs_broadcast:
            if state.replicas is not None:
                weights = [w for w in state.parts.models[state.stage].weights
                           if not randomness.is_seed_state(w)]
                _broadcast_variables(state.replicas, weights, [0] * len(weights))
            state.needs_broadcast = False

    def _tnt_loop_callbacks(self, callbacks: Any) -> list[Any]:
        """The user's callbacks as DATA runs them (writers on the master only, the other
        stages serving their saves; tnt Callback wrappers honoured; a master's stop request
        stops every rank)."""
        callbacks = list(callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList)
                         else callbacks or [])
        return distribute_callbacks(callbacks, self, self._tnt.runtime, broadcast_weights=False)

    @user_facing
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Any = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool = True, class_weight: Any = None,
            sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int = 1, *, tnt_micro_batch_size: int | None = None,
            tnt_validation_micro_batch_size: int | None = None,
            tnt_distribute_dataset: bool = True,
            tnt_distribute_validation_dataset: bool = True) -> keras.callbacks.History:
        """``keras.Model.fit`` of the pipeline: ``batch_size`` is the global batch, split
        into ``num_micro_batches`` micro-batches; every rank passes the same data."""
        arguments.refuse_data_parallel_arguments(
            "fit", tnt_micro_batch_size=tnt_micro_batch_size,
            tnt_validation_micro_batch_size=tnt_validation_micro_batch_size,
            tnt_distribute_dataset=not tnt_distribute_dataset,
            tnt_distribute_validation_dataset=not tnt_distribute_validation_dataset)
        callbacks = arguments.check_fit(
            self, x=x, y=y, sample_weight=sample_weight, validation_data=validation_data,
            callbacks=callbacks, batch_size=batch_size, epochs=epochs,
            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps, validation_batch_size=validation_batch_size,
            validation_freq=validation_freq)
        self._tnt_start()
        master = self._tnt.runtime.is_master
        return super().fit(
            x, y, batch_size=batch_size, epochs=epochs, verbose=verbose if master else 0,
            callbacks=self._tnt_loop_callbacks(callbacks),
            validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
            class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq)

    @user_facing
    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None,
                 callbacks: Any = None, return_dict: bool = False, *,
                 tnt_micro_batch_size: int | None = None, tnt_distribute_dataset: bool = True,
                 **kwargs: Any) -> Any:
        """``keras.Model.evaluate`` of the pipeline; every rank returns the serial result."""
        if not _keras_compat.is_fit_validation(kwargs):  # fit's validation: set up by fit
            arguments.refuse_data_parallel_arguments(
                "evaluate", tnt_micro_batch_size=tnt_micro_batch_size,
                tnt_distribute_dataset=not tnt_distribute_dataset)
            callbacks = arguments.check_evaluate(
                self, x=x, y=y, sample_weight=sample_weight, callbacks=callbacks,
                batch_size=batch_size, steps=steps)
            self._tnt_start()
            callbacks = self._tnt_loop_callbacks(callbacks)
            verbose = verbose if self._tnt.runtime.is_master else 0
        return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                return_dict=return_dict, **kwargs)

    @user_facing
    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None, *,
                tnt_micro_batch_size: int | None = None,
                tnt_distribute_dataset: bool = True) -> Any:
        """``keras.Model.predict`` of the pipeline; every rank returns the whole result."""
        arguments.refuse_data_parallel_arguments(
            "predict", tnt_micro_batch_size=tnt_micro_batch_size,
            tnt_distribute_dataset=not tnt_distribute_dataset)
        callbacks = arguments.check_predict(self, x=x, callbacks=callbacks, batch_size=batch_size,
                                            steps=steps)
        self._tnt_start()
        return super().predict(x, batch_size=batch_size,
                               verbose=verbose if self._tnt.runtime.is_master else 0,
                               steps=steps, callbacks=self._tnt_loop_callbacks(callbacks))

    @user_facing
    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Any = None, return_dict: bool = False) -> Any:
        """``keras.Model.train_on_batch`` of the pipeline, on the global batch."""
        arguments.check_compiled(self, "train_on_batch")
        self._tnt_start()
        return super().train_on_batch(x, y, sample_weight=sample_weight,
                                      class_weight=class_weight, return_dict=return_dict)

    @user_facing
    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                      return_dict: bool = False) -> Any:
        """``keras.Model.test_on_batch`` of the pipeline, on the global batch."""
        arguments.check_compiled(self, "test_on_batch")
        self._tnt_start()
        return super().test_on_batch(x, y, sample_weight=sample_weight, return_dict=return_dict)

    @user_facing
    def predict_on_batch(self, x: Any) -> Any:
        """``keras.Model.predict_on_batch`` of the pipeline; every rank gets all rows."""
        self._tnt_start()
        return super().predict_on_batch(x)

    # -- weights, saving (stage_saving) ------------------------------------------------------

    @user_facing
    def get_weights(self) -> list[np.ndarray]:
        """The whole model's weights, as serial Keras returns them, on every rank: each from
        the stage that holds it. The one explicit gather of a pipelined model: the list
        holds the whole model on every rank for as long as it is kept. Call on every rank."""
        state = self._tnt
        return stage_saving.gather_weights(state.pipe, list(self.weights), state.ownership.weights,
                                           state.stage)

    @user_facing
    def set_weights(self, weights: list) -> None:
        """The whole model's weights, as ``get_weights`` returns them: each rank takes its
        own partition's from the list (the replicas of a stage take replica 0's)."""
        mine = list(self.weights)
        weights = list(weights)
        if len(weights) != len(mine):
            raise ValueError(f"set_weights(weights): model {self.name!r} has {len(mine)} weights, "
                             f"the list has {len(weights)}")
        for i, (v, value) in enumerate(zip(mine, weights)):
            if tuple(np.shape(value)) != tuple(v.shape):
                raise ValueError(f"set_weights(weights): weights[{i}] has shape "
                                 f"{tuple(np.shape(value))}, {v.path!r} has {tuple(v.shape)}")
        for i, (v, value) in enumerate(zip(mine, weights)):
            if self._tnt.ownership.owns(i):
                v.assign(value)
        self._tnt.needs_broadcast = True

    def _tnt_write(self, method: str, write: Callable[[str], None], filepath: Any,
                   overwrite: bool, all_devices: bool) -> None:
        path = str(filepath)
        if path.endswith((".h5", ".hdf5")) and not path.endswith(".weights.h5"):
            raise NotSupportedError(
                f"{method}({path!r}): the legacy HDF5 format reads every weight on the writing rank, "
                "which a pipelined rank does not hold; use a .keras file (or .weights.h5)")
        self._tnt.saving.write_collectively(self, write, filepath, overwrite=overwrite,
                                            all_devices=all_devices, runtime=self._tnt.runtime)

    @user_facing
    def save(self, filepath: Any, overwrite: bool = True, zipped: Any = None, *,
             tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """Save the whole model as plain Keras would: one ``.keras`` file with every weight
        and the optimizer state of every stage, which plain Keras loads. Call on every rank:
        the master writes, each stage sends it its layers one at a time, so no rank holds
        the whole model (``tnt_save_all_devices=True``: every rank writes, in turn)."""
        keras_save = super(Model, self).save
        arguments.check_save_path("save", filepath,
                                  {**kwargs, **({} if zipped is None else {"zipped": zipped})})
        hub = str(filepath).startswith("hf://")

        def write(path: str) -> None:
            if zipped is False or hub or not path.endswith(".keras"):
                keras_save(path, overwrite=True, zipped=zipped, **kwargs)
            else:  # Keras' zipped writer would hold the whole weights file in memory
                stage_saving.zip_directory(
                    lambda folder: keras_save(folder, overwrite=True, zipped=False, **kwargs), path)

        self._tnt_write("save", write, filepath, overwrite, tnt_save_all_devices)

    @user_facing
    def save_weights(self, filepath: Any, overwrite: bool = True, *,
                     tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """The whole model's weights and optimizer state (``.weights.h5``, or sharded
        ``.weights.json`` with ``max_shard_size``), as serial Keras writes them; call on
        every rank (the master writes, streamed from the stages, as :meth:`save`)."""
        keras_save_weights = super(Model, self).save_weights
        arguments.check_save_path("save_weights", filepath, kwargs)
        self._tnt_write("save_weights", lambda path: keras_save_weights(path, overwrite=True, **kwargs),
                        filepath, overwrite, tnt_save_all_devices)

    @user_facing
    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """As Keras (every rank reads the file, a ``.keras``, ``.weights.h5`` or
        ``.weights.json``): each rank reads only its own partition's layers and, from a file
        with optimizer state (``save_weights``, ``BackupAndRestore``, ``save``), its own
        stage's slots, so training resumes as serial training would."""
        path = str(filepath)
        if path.endswith((".h5", ".hdf5")) and not path.endswith(".weights.h5"):
            raise NotSupportedError(
                f"load_weights({path!r}): a pipelined model reads .keras, .weights.h5 and "
                ".weights.json files; load the legacy HDF5 file into the plain Keras model and "
                "save it as .weights.h5 first")
        with self._tnt.saving.reading(self):
            super().load_weights(filepath, *args, **kwargs)

    @user_facing
    def export(self, filepath: Any, *args: Any, tnt_save_all_devices: bool = False,
               **kwargs: Any) -> None:
        """Refused: an export traces the whole model, which no pipelined rank holds."""
        raise NotSupportedError(
            "export(...) of a pipelined model: no rank holds the whole model. Save it "
            "(model.save('m.keras')), load it with keras.saving.load_model in one process, and "
            "export that model")


def _checksum(tensor: Any) -> int:
    """The sum of ``tensor``'s bit patterns as int32 words, wrapping: equal for equal
    contents on every rank whatever the reduction order (integer sums are exact), and a
    view of the data, not a float64 copy of it (measured on a 1 MB float32 tensor: 0.26
    against 0.80 ms for the float64 sum it replaces)."""
    t = tf.convert_to_tensor(tensor)
    if t.dtype == tf.string:
        return int(tf.strings.to_hash_bucket_fast(tf.reshape(t, [-1]), 2**31 - 1)
                   .numpy().astype(np.int64).sum() % 2**31)
    width = t.dtype.size
    if t.dtype.is_bool or width == 1:
        words = tf.cast(t, tf.int32)
    elif width == 2:
        words = tf.cast(tf.bitcast(t, tf.int16), tf.int32)
    else:  # 4, 8 or 16 bytes: whole int32 words
        words = t if t.dtype == tf.int32 else tf.bitcast(t, tf.int32)
    return int(tf.reduce_sum(words))


def _broadcast_variables(backend: tnt_core.CommBackend, variables: list[Any],
                         roots: list[int]) -> None:
    """Every variable set to its value on its root rank: one broadcast per (root, dtype),
    in an order every rank derives alike; types the backend does not carry stay as they
    are."""
    groups: dict[tuple[int, str], list[Any]] = {}
    for v, root in zip(variables, roots):
        if np.dtype(v.dtype) in tnt_core.SUPPORTED_DTYPES:
            groups.setdefault((root, np.dtype(v.dtype).str), []).append(v)
    for key in sorted(groups):
        members = groups[key]
        values = [np.asarray(keras.ops.convert_to_numpy(v)).reshape(-1) for v in members]
        flat = backend.broadcast(np.concatenate(values), root=key[0])
        offset = 0
        for v, value in zip(members, values):
            v.assign(flat[offset:offset + value.size].reshape(tuple(v.shape)))
            offset += value.size


