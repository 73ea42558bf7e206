"""``tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING)``: the user's model,
cut into partitions (:mod:`tarantella.pipeline.partition`: at its SplitLayers, or into
``num_pipeline_stages`` automatically), trained as a pipeline with the results of serial
training.

Why Keras' own loop: ``fit``/``evaluate``/``predict`` stay Keras' (its data adapters,
callbacks, History, progress bar); only the steps change. Every rank reads the same global
batches (:mod:`tarantella.pipeline.batch_fingerprint` checks it); the steps run eagerly (they
exchange tensors with the neighbouring stages between micro-batches) and hand the batch to
this rank's stage (:class:`~tarantella.pipeline.stage.StageStep`; the ranks and groups:
:mod:`tarantella.pipeline.groups`). The last stage differentiates a loss made as ``compile`` makes the model's
(every output's loss, weighted by ``loss_weights``, summed). The last stage, which holds
the batch's outputs, updates the compiled metrics inside its step and every rank takes
their states from it (:meth:`PipelinedModel._tnt_step_logs`); where that cannot be serial,
the last stage's outputs (all of the model's outputs) are broadcast after each step, so
that every rank runs Keras' compiled loss and metrics on the same values. Either way the
per-output losses, metrics, logs and History of every rank equal serial Keras'.

A rank holds only its own partition (:mod:`tarantella.pipeline.variables`): a model built
without values (``keras.StatelessScope(initialize_variables=False)``) gets values for this
rank's partition only; a model built the ordinary way loses the other partitions' values.
Nothing gathers the whole model behind the user's back: ``save``, ``save_weights`` and the
checkpoint callbacks (``ModelCheckpoint``, ``BackupAndRestore``, at any ``save_freq``) write
what serial Keras writes, streamed from the stages to the master (:mod:`tarantella.
stage_saving`); ``load_weights`` (and so ``BackupAndRestore``) reads each rank's own layers
and optimizer slots. ``get_weights``/``set_weights`` are whole-model, the one explicit gather.
What is not supported yet is refused with a message saying what to do
(:mod:`tarantella.pipeline.checks`). Callbacks otherwise run as for DATA: writers on the
master only (the other stages serve the master's saves during their hooks).

:class:`PipelinedModel` is the sibling of :class:`~tarantella.data_parallel.model.DataParallelModel`
over the base :class:`tarantella.model.Model` (identity, saving, the class swap); both run
the argument checks of :mod:`tarantella.arguments` before their loops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from .. import _keras_compat, arguments, files, randomness, step_backup, timeline
from ..callbacks import distribute_callbacks
from ..comm import Channel
from ..comm.gradients import GradientReducer
from ..comm.step_reductions import StepReductions
from ..data_parallel.elastic import is_membership_failure
from ..datasets import split_validation, unpack_validation, whole_batches, without_autotune_on_one_cpu
from ..errors import NotSupportedError
from ..model import DistributedState, Model, ParallelStrategy
from ..reporting.log import logger
from ..reporting.tracebacks import user_facing
from ..seams.overrides import instance_attributes
from . import rescue as step_rescue
from . import saving as stage_saving
from .checks import check_compile, check_distribute, check_file_format
from .groups import pipeline_groups
from .micro_batches import pipeline_rows, rows
from .partition import Partitioning, partition, split_layers
from .saving import StageSaving
from .stage import SCHEDULES, StageStep
from .step_ends import StepEnds, StepLog
from .variables import Ownership, hold_own_partition

__all__ = ["PipelinedModel"]


class _TracedLoss:
    """Keras' compiled loss of a model, run as Keras' default (compiled) step runs it: in a
    graph whose batch dimension is unknown. Why: the compiled loss adds each output's loss to
    its tracker (``out1_loss``) weighted by the static batch size, which a traced step does
    not know, so serial Keras adds one unweighted value per step; called eagerly, as a
    pipelined step would, it would weigh by the batch size and the per-output logs would
    differ from serial ones (docs/pipelining_results.md). One trace per structure and per
    dtype and shape of the samples."""

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


def _restart_all_on_failure(runtime: tnt_core.Runtime, replicated: bool = False) -> None:
    """In an elastic job: a stage is held by its ranks alone (a replica's state is not
    handed over), so the job cannot go on with other ranks; under ``tnt run
    --max-restarts`` alone every rank is restarted when one dies, and resumes from the
    last ``BackupAndRestore`` backup at its step (:mod:`tarantella.step_backup`), or, with
    replicas of every stage (``replicated``: ALL), at the step that failed, from the
    survivors' copies (:mod:`tarantella.pipeline.rescue`)."""
    if getattr(runtime, "membership", None) is None:
        return
    if runtime.config.elastic_resizes:
        raise NotSupportedError(
            "a pipelined tnt.Model cannot go on with another number of ranks (tnt run --min-np "
            "below -n, --max-np, --host-discovery-script): a stage is held by its ranks alone; "
            "run with --max-restarts R alone, and every rank restarts from the last "
            "keras.callbacks.BackupAndRestore backup, at its step")
    if replicated:
        runtime.restart_all_on_failure(
            "a pipelined tnt.Model cannot go on with fewer ranks (the survivors back up the "
            "step in flight)")
    else:
        runtime.restart_all_on_failure("a pipelined tnt.Model cannot go on without one of its "
                                       "ranks (a stage is held by its ranks alone)")


def _eager_step_function(step: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Keras' step function for a model that runs eagerly (what ``make_train_function``
    makes with ``run_eagerly``), without the scaffolding Keras keeps there for its graph
    path: the batch wrapped in an ``Optional`` and unwrapped again, the step run through
    the default distribution strategy. Why: those are eager ops and Python calls on every
    step, and a pipelined stage's loop is on its pipeline's critical path (measured on the
    pipeline benchmark's 2 stages: 0.5-0.8 ms of a 38-41 ms step on each rank). A model
    compiled with ``steps_per_execution`` 1 (the only one a pipeline takes) runs one step a
    call, on the iterator's next batch, as Keras' does; a batch that holds ``Optional``
    values (a missing part of it) hands them to the step as None, as Keras does."""

    def function(iterator: Any) -> Any:
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            data = iterator.get_next()  # OutOfRangeError when the data ends, as Keras'
        else:  # a list of one batch (train_on_batch) or a Python iterator
            data = next(iter(iterator))
        data = keras.tree.map_structure(
            lambda v: None if isinstance(v, tf.experimental.Optional) else v, data)
        return step(data)

    return function


class _CountingDryCall:
    """Keras' train function of a pipelined model: a call that finds no data left has each
    stage count it as plain Keras' graph step would (:meth:`StageStep.count_dry_step`)."""

    def __init__(self, model: keras.Model, function: Any) -> None:
        self.model, self.function = model, function

    def __call__(self, data: Any) -> Any:
        try:
            return self.function(data)
        except (StopIteration, tf.errors.OutOfRangeError):
            step = self.model._tnt.step  # noqa: SLF001 - the model's own state
            if step is not None:
                step.count_dry_step()
            raise


class _PipelineState(DistributedState):
    """This rank's stage of its pipeline (:mod:`tarantella.pipeline.groups`: the ranks and
    groups), its step, and what it holds."""

    resumes_at_step = True
    step_backup_callback = step_backup.StepBackupAndRestore

    def __init__(self, runtime: tnt_core.Runtime, parts: Partitioning, num_micro_batches: int,
                 strategy: ParallelStrategy, ownership: Ownership, schedule: str = SCHEDULES[0],
                 recompute: bool = False) -> None:
        super().__init__(runtime, strategy)
        stages = parts.num_partitions
        self.parts = parts
        groups = pipeline_groups(self.channel, runtime.rank, runtime.size, stages)
        self.stage, self.replica, self.num_replicas = groups.stage, groups.replica, groups.num_replicas
        self.pipe, self.replicas = groups.pipe, groups.replicas
        self.num_micro_batches = num_micro_batches
        self.schedule = schedule
        #: whether this stage recomputes its activations (tnt.Model(recompute=...))
        self.recompute = recompute
        #: compile(jit_compile=...): whether the stage's optimizer update is XLA-compiled
        self.jit_compile: Any = False
        #: compile(run_eagerly=False): the serial step is a graph, which counts a call that
        #: finds no data (see PipelinedModel.make_train_function)
        self.counts_dry_steps = True
        self.step: StageStep | None = None
        #: the model's compiled loss as a traced step runs it (for the logs; set by compile)
        self.logged_loss: _TracedLoss | None = None
        #: which stage holds each weight and each layer's variables (positions, no variables)
        self.ownership = ownership
        self.saving = StageSaving(self.channel.backend, runtime.rank, stages, ownership)
        #: a new communicator was bound to the job's channel: no loop may run (see
        #: PipelinedModel._tnt_rebound)
        self.rebound = False
        self._reductions: StepReductions | None = None
        #: how many values a step's metric states are (PipelinedModel._tnt_shared_size)
        self.shared_size: int | None = None
        self._loss_updates: dict[int, tuple[Any, Any]] = {}

    def update_loss(self, tracker: keras.metrics.Metric, loss: np.float64, batch: int) -> None:
        """``tracker.update_state(loss, sample_weight=batch)`` as one traced call: the same
        ops as eagerly, without the dozen eager dispatches a step's loop would pay for them
        (measured: 3.6 ms of a 90 ms pipelined step between the loss's sum and the step's
        end, most of it this update)."""
        update = self._loss_updates.get(id(tracker))
        if update is None or update[0] is not tracker:
            traced = tf.function(
                lambda value, weight: tracker.update_state(value, sample_weight=weight),
                autograph=False)
            # its one concrete function, called directly: 52 against 120 us a call for the
            # tf.function's own argument binding (measured alone on one CPU)
            update = (tracker, traced.get_concrete_function(tf.TensorSpec([], tf.float64),
                                                             tf.TensorSpec([], tf.int32)))
            self._loss_updates[id(tracker)] = update
        update[1](tf.constant(loss, tf.float64), tf.constant(batch, tf.int32))

    def reductions(self) -> StepReductions:
        """The step's own allreduces (its loss, its batch's fingerprint) over the job's
        channel, each agreed on once (:mod:`tarantella.comm.step_reductions`)."""
        backend = self.channel.backend
        if self._reductions is None or self._reductions.backend is not backend:
            self._reductions = StepReductions(backend)
        return self._reductions

    def held_model(self, model: keras.Model) -> keras.Model:
        """This rank's partition (it holds no values of the others)."""
        return self.parts.models[self.stage]

    def rescue_copies(self, model: keras.Model) -> step_rescue.StepCopies | None:
        """Under ALL in an elastic job, the copies of this rank's stage that the survivors
        write when a rank dies (:mod:`tarantella.pipeline.rescue`); None otherwise."""
        if not self.survivors_write_steps() or model.optimizer is None or not model.optimizer.built:
            return None  # (compile builds the optimizer: a fit never meets one unbuilt)
        variables = [*self.held_model(model).variables, *model.optimizer.variables]
        return step_rescue.StepCopies(variables, self.stage, self.replica, self.runtime.rank)

    def survivors_write_steps(self) -> bool:
        """Whether the survivors of a rank's death write the step in flight: ALL (every
        stage has replicas) in an elastic job."""
        return self.num_replicas > 1 and getattr(self.runtime, "membership", None) is not None

    def abort_communicators(self, reason: str) -> None:
        """Fail this rank's communicators (the job's, its pipeline's, its stage's replicas'):
        its peers' operations with it fail at once, while it writes its copies."""
        for channel in (self.channel, self.pipe, self.replicas):
            if channel is not None:
                channel.backend.abort(reason)

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


class PipelinedModel(Model, strategies=(ParallelStrategy.PIPELINING, ParallelStrategy.ALL)):
    """The pipelined ``tnt.Model`` (see the module doc); ``tnt.Model(model,
    parallel_strategy=PIPELINING or ALL)`` makes it."""

    _tnt: _PipelineState

    @classmethod
    def _tnt_distribute(cls, model: keras.Model, strategy: ParallelStrategy,
                        num_micro_batches: Any, num_pipeline_stages: Any = None,
                        pipeline_schedule: Any = None, recompute: Any = None) -> Model:
        """Cut ``model`` into its stages and make it this rank's pipelined model; with
        ``ParallelStrategy.ALL``, one pipeline per ``P`` ranks, the batch split between them.
        The cuts are the model's SplitLayers, else ``num_pipeline_stages`` automatic ones
        (under PIPELINING, by default one partition per rank)."""
        num_micro_batches = arguments.check_num_micro_batches(
            1 if num_micro_batches is None else num_micro_batches)
        wanted = arguments.check_num_pipeline_stages(num_pipeline_stages)
        schedule = arguments.check_pipeline_schedule(pipeline_schedule, SCHEDULES)
        runtime = tnt_core.init()
        if wanted is None and strategy is ParallelStrategy.PIPELINING and not split_layers(model):
            wanted = runtime.size
        parts = partition(model, wanted)
        _restart_all_on_failure(runtime, replicated=runtime.size // parts.num_partitions > 1)
        recomputed = arguments.check_recompute(recompute, parts.num_partitions)
        check_distribute(model, strategy, runtime, parts)
        stages = parts.num_partitions
        stage = runtime.rank % stages
        # this rank's partition gets its values (a model built without them), the others
        # lose theirs (a model built with them): stage_variables
        ownership = hold_own_partition(model, [list(m.variables) for m in parts.models], stage)
        state = _PipelineState(runtime, parts, num_micro_batches, strategy, ownership, schedule,
                               recomputed[stage])
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

    @property
    def pipeline_schedule(self) -> str:
        """The order of each stage's passes (``tnt.Model(pipeline_schedule=...)``)."""
        return self._tnt.schedule

    @property
    def recompute(self) -> bool:
        """Whether this rank's stage recomputes its activations in its backward passes
        (``tnt.Model(recompute=...)``)."""
        return self._tnt.recompute

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
        micro-batches), so ``run_eagerly`` does not apply; ``jit_compile`` compiles the stage's
        optimizer update with XLA unless it is False (:mod:`tarantella.data_parallel.compiled_update`)."""
        check_compile(self, type(self)._tnt_base, loss, steps_per_execution)  # noqa: SLF001 - the class's own attribute
        arguments.check_optimizer(optimizer)
        optimizer = keras.optimizers.get(optimizer)
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                        metrics=metrics, weighted_metrics=weighted_metrics, run_eagerly=True,
                        jit_compile=False, auto_scale_loss=auto_scale_loss)
        self._tnt_check_compiled()
        # the last stage differentiates a loss of its own made as compile made the model's
        # (every output's loss weighted and summed): the model's one keeps the per-output
        # loss trackers, which the logs update on every rank alike (_tnt_logs)
        self._tnt.jit_compile = jit_compile
        self._tnt.counts_dry_steps = not run_eagerly
        self._tnt.shared_size = None  # the new compile's metrics
        self._tnt.step = self._tnt_stage_step(
            _keras_compat.new_compiled_loss(self, loss, loss_weights), self.optimizer)
        self._tnt.logged_loss = _TracedLoss(_keras_compat.compiled_loss(self))
        if not self.optimizer.built:  # over this stage's weights only, before any callback
            self.optimizer.build(self._tnt.step.weights)  # (BackupAndRestore) builds it whole
        stage_saving.whole_optimizer_paths(self.optimizer, list(self.trainable_variables))  # savable

    def _tnt_stage_step(self, loss: keras.losses.Loss, optimizer: Any) -> StageStep:
        state = self._tnt
        replicas = None if state.replicas is None else \
            GradientReducer(state.replicas,
                            f"stage{state.stage}_replicas")
        return StageStep(state.parts, state.stage, state.pipe,
                         loss=loss, optimizer=optimizer,
                         num_micro_batches=state.num_micro_batches, replicas=replicas,
                         regularise=state.replica == 0, timeline=timeline.get(state.runtime),
                         schedule=state.schedule, recompute=state.recompute,
                         jit_compile=state.jit_compile, log_step=self._tnt_step_logs())

    def _tnt_step_logs(self) -> Callable[[StepLog], Any] | None:
        """The logs of a step (training, evaluation) made inside its graph
        (:mod:`tarantella.pipeline.step_ends`), or None where the loop makes them after the
        step from the batch's outputs broadcast
        to every rank (:meth:`_tnt_logs`): a model with a ``compute_metrics`` of its own, with
        metrics of its own or of its layers, or with compiled metrics under ALL (each
        pipeline's last stage holds its rows only).

        Inside the graph every rank updates the loss's tracker with the loss summed over the
        ranks, as :meth:`_tnt_logs` does; the last stage, which holds the batch's outputs,
        updates the compiled metrics (and each output's loss tracker) as Keras'
        ``compute_metrics`` does, and every other rank takes their variables' values from it
        (one small collective instead of the whole batch's outputs); the logs are Keras'
        ``get_metrics_result``. Why: on the pipeline benchmark's MLP one metric cost 5.6-6.2
        ms of a 39 ms step in the loop (the outputs' broadcast and eager metric updates)."""
        if type(self).compute_metrics is not keras.Model.compute_metrics:
            return None
        tracker = self._tnt_loss_tracker()
        loss = _keras_compat.compiled_loss(self)
        compiled = {id(m) for m in [_keras_compat.compiled_metrics(self),
                                    *(loss.metrics if loss is not None else [])] if m is not None}
        others = [m for m in self.metrics if m is not tracker]
        if any(id(m) not in compiled for m in others) or (others and self._tnt.num_replicas > 1):
            return None

        def logs(step: StepLog) -> Any:
            if tracker is not None:
                tracker.update_state(step.loss, sample_weight=tf.constant(step.batch, tf.int32))
            variables = self._tnt_shared_variables()
            if variables:
                if step.last:
                    if loss is not None and loss.metrics:  # each output's loss tracker
                        assert self._tnt.logged_loss is not None, "compile() makes it"
                        self._tnt.logged_loss(step.y, step.predictions, step.sample_weight)
                    keras.Model.compute_metrics(self, None, step.y, step.predictions,
                                                step.sample_weight)
                values = step.from_last(tf.concat(
                    [tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in variables], 0))
                if not step.last:
                    offset = 0
                    for v in variables:
                        size = int(np.prod(v.shape))
                        v.assign(tf.cast(tf.reshape(values[offset:offset + size], v.shape), v.dtype))
                        offset += size
            return self.get_metrics_result()

        return logs

    def _tnt_shared_variables(self) -> list[Any]:
        """The variables of the metrics a step's graph updates on the last stage
        and shares with every rank (:meth:`_tnt_step_logs`): all but the loss's tracker."""
        tracker = self._tnt_loss_tracker()
        return [v for m in self.metrics if m is not tracker for v in m.variables]

    def _tnt_shared_size(self, data: Any) -> int:
        """How many values a step's metric states are (:meth:`_tnt_step_logs`),
        their variables built first on every rank alike, from the batch's spec, as Keras
        builds them before a step under a distribution strategy."""
        state = self._tnt
        if state.shared_size is None:
            compiled, loss = _keras_compat.compiled_metrics(self), _keras_compat.compiled_loss(self)
            if (compiled is not None and not compiled.built) or (loss is not None and not loss.built):
                _keras_compat.symbolic_build(self, data)
            state.shared_size = sum(int(np.prod(v.shape)) for v in self._tnt_shared_variables())
        return state.shared_size

    # -- the steps -------------------------------------------------------------------------------

    def _tnt_share(self, batch: int) -> slice:
        """This pipeline's rows of a global batch of ``batch`` samples."""
        return pipeline_rows(batch, self._tnt.replica, self._tnt.num_replicas)

    def _tnt_outputs(self, x: Any, batch: int) -> Any:
        """The model's outputs for the whole batch ``x``, on every rank, in the model's
        output structure: the last stage's, or with several pipelines each last stage's rows
        (an allreduce of the rows over zeros, which adds nothing to them)."""
        state = self._tnt
        parts = state.parts
        last = parts.num_partitions - 1
        assert state.step is not None
        specs = keras.tree.flatten(parts.output_structure)
        bufs = [np.zeros((batch, *shape), dtype=tf.as_dtype(spec.dtype).as_numpy_dtype)
                for spec, shape in zip(specs, state.step.shapes.outputs(x))]
        share = self._tnt_share(batch)
        if state.stage == last and share.stop > share.start:
            for buf, part in zip(bufs, keras.tree.flatten(state.step.predictions)):
                buf[share] = np.asarray(part)
        backend = state.channel.backend
        if state.num_replicas == 1:
            flat = state.channel.broadcast_arrays(bufs, last)
        else:
            flat = [backend.allreduce(buf) for buf in bufs]
        return parts.outputs([tf.convert_to_tensor(v) for v in flat])

    def _tnt_rows(self, values: Any, share: slice) -> Any:
        if self._tnt.num_replicas == 1:  # the whole batch: no copy of it
            return values
        return tf.nest.map_structure(lambda v: None if v is None else v[share.start:share.stop],
                                     values)

    @staticmethod
    def _tnt_unpack(data: Any) -> tuple[Any, Any, Any, int]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return x, y, sample_weight, rows(x)

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

    def _tnt_ends(self, data: Any, logged: bool) -> tuple[Any, Any, Any, int, StepEnds]:
        """The batch and its step's ends: the batch check, the loss's sum and, when the step
        makes its logs (``logged``), the metric states it shares, all run inside the step
        (:mod:`tarantella.pipeline.step_ends`)."""
        x, y, sample_weight, batch = self._tnt_unpack(data)
        shared = self._tnt_shared_size(data) if logged else 0
        ends = StepEnds(self._tnt.reductions(), x, y, batch, shared)  # stage 0 reads x, the last y
        return x, y, sample_weight, batch, ends

    def train_step(self, data: Any) -> Any:
        state = self._tnt
        assert state.step is not None, "compile() makes the stage's step"
        x, y, sample_weight, batch, ends = self._tnt_ends(data, state.step.log_step is not None)
        share = self._tnt_share(batch)
        with ends.refusing_different_batches():
            state.step.train(self._tnt_rows(x, share), self._tnt_rows(y, share),
                             self._tnt_rows(sample_weight, share), global_batch=batch, ends=ends)
        if state.step.logs is not None:  # logged inside the step
            return state.step.logs
        return self._tnt_logs(x, y, sample_weight, batch, 0.0, loss=ends.loss())

    def test_step(self, data: Any) -> Any:
        state = self._tnt
        assert state.step is not None, "compile() makes the stage's step"
        # the logs inside the step only with the whole batch on the last stage (StageStep.forward)
        logged = state.step.log_step is not None and state.num_replicas == 1
        x, y, sample_weight, batch, ends = self._tnt_ends(data, logged)
        share = self._tnt_share(batch)
        with ends.refusing_different_batches():
            state.step.forward(self._tnt_rows(x, share), share.stop - share.start, ends=ends,
                               y=y, sample_weight=sample_weight)
        if state.step.logs is not None:  # logged inside the step
            return state.step.logs
        y_pred = self._tnt_outputs(x, batch)
        return self._tnt_logs(x, y, sample_weight, batch, ends.loss(), y_pred)

    def predict_step(self, data: Any) -> Any:
        state = self._tnt
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        batch = rows(x)
        if state.step is None:  # predict before compile: a step without loss or optimizer
            state.step = self._tnt_stage_step(keras.losses.MeanSquaredError(),
                                              keras.optimizers.SGD())
        share = self._tnt_share(batch)
        state.step.forward(self._tnt_rows(x, share), share.stop - share.start)
        return self._tnt_outputs(x, batch)

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
                y_pred = self._tnt_outputs(x, batch)
            assert self._tnt.logged_loss is not None, "compile() makes it"
            compiled = self._tnt.logged_loss(y, y_pred, sample_weight)
            if loss is None:
                loss = float(compiled) + regularisation
        tracker = self._tnt_loss_tracker()
        if tracker is not None:
            # a NumPy float64: Keras would read a Python float as float32 (a float64 model's
            # History then differs from serial's by 1e-8)
            self._tnt.update_loss(tracker, np.float64(loss), batch)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    # -- the loops ---------------------------------------------------------------------------

    def _tnt_rebound(self, channel: Channel) -> None:
        """A new communicator bound to the job's channel: a stage holds only its partition,
        and its compiled step talks to the old pipeline, so the model refuses its next loop
        (in one line, at :meth:`_tnt_start`) instead of training on a broken pipeline."""
        super()._tnt_rebound(channel)
        self._tnt.rebound = True

    def _tnt_start(self) -> None:
        """Before a loop: after compile, set_weights or load_weights, the replicas of a stage
        (ALL) take replica 0's weights of their partition."""
        state = self._tnt
        if state.rebound:
            raise NotSupportedError(
                "a pipelined model cannot move to a new communicator (each rank holds one "
                "stage's weights only): resume the job from its last BackupAndRestore backup")
        if state.needs_broadcast:
            if state.replicas is not None:
                weights = [w for w in state.parts.models[state.stage].weights
                           if not randomness.is_seed_state(w)]
                values = stage_saving.gather_weights(state.replicas, weights, (0,) * len(weights),
                                                     state.replica)
                for w, value in zip(weights, values):
                    w.assign(value)
            state.needs_broadcast = False

    def _tnt_loop_callbacks(self, callbacks: Any, fit_verbose: Any = None,
                            adapters: list[Any] | None = None) -> list[Any]:
        """The user's callbacks as DATA runs them (writers on the master only, the other
        stages serving their saves; tnt Callback wrappers honoured; a master's stop request
        stops every rank; the epoch hooks of the loop's data ``adapters`` called, training's
        first: :func:`_read_as_keras`). In a fit (``fit_verbose``) with a
        ``BackupAndRestore``, its History and progress bar are given here, so that a resumed
        fit replays quietly and the backup holds the History."""
        callbacks = list(callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList)
                         else callbacks or [])
        out = distribute_callbacks(callbacks, self, self._tnt.runtime, adapters or [],
                                   broadcast_weights=False)
        backups = [cb for cb in out if isinstance(cb, step_backup.StepBackupAndRestore)]
        if fit_verbose is None or not backups:
            return out
        if not any(isinstance(cb, keras.callbacks.History) for cb in out):
            out.append(keras.callbacks.History())  # Keras takes it as the fit's History
        if self._tnt.runtime.is_master and fit_verbose != 0 and \
                not any(isinstance(cb, keras.callbacks.ProgbarLogger) for cb in out):
            out.append(step_backup.QuietProgbar())  # Keras adds no other
        for backup in backups:
            backup.callbacks = out
        return out

    def make_train_function(self, force: bool = False) -> Any:
        """Keras' step function, eager (:func:`_eager_step_function`); it skips its steps
        while a resumed fit replays, and counts the call that finds the data run out as
        plain Keras' graph step does
        (:meth:`StageStep.count_dry_step`; not when compile asked for ``run_eagerly``, as
        plain Keras' eager step counts nothing then)."""
        if self.train_function is None or force:  # Keras declares it None: typed so
            self.train_function = _eager_step_function(self.train_step)  # type: ignore[assignment]
        function = self._tnt_skipping("train_function")
        if self._tnt.counts_dry_steps and not isinstance(function.function, _CountingDryCall):
            function.function = _CountingDryCall(self, function.function)
        return function

    def make_test_function(self, force: bool = False) -> Any:
        if self.test_function is None or force:
            self.test_function = _eager_step_function(self.test_step)  # type: ignore[assignment]
        return self._tnt_skipping("test_function")

    def _tnt_skipping(self, attribute: str) -> Any:
        function = getattr(self, attribute)
        if not isinstance(function, step_backup.SkippedWhileReplaying):
            function = step_backup.SkippedWhileReplaying(self, function)
            setattr(self, attribute, function)
        return function

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
        if validation_split and validation_data is None:  # Keras' loop gets a dataset: cut first
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight,
                                                                      validation_split)
            validation_split = 0.0
        # the training batches first, as Keras' fit makes them (a shuffle draws its seed then)
        train, adapter = _read_as_keras(x, y, sample_weight, batch_size=batch_size,
                                        shuffle=shuffle, class_weight=class_weight,
                                        steps=steps_per_epoch, purpose="training")
        adapters = [adapter]
        if validation_data is not None:
            vx, vy, vsw = unpack_validation(validation_data)
            read, val_adapter = _read_as_keras(vx, vy, vsw, batch_size=validation_batch_size or batch_size,
                                               steps=validation_steps, purpose="validation")
            adapters.append(val_adapter)
            validation_data = tuple(read[k] for k in ("x", "y", "sample_weight") if read[k] is not None)
            validation_data = validation_data[0] if len(validation_data) == 1 else validation_data
        loop_callbacks = self._tnt_loop_callbacks(callbacks, verbose if master else 0, adapters)
        if master and self._tnt.survivors_write_steps() and not any(
                isinstance(cb, (step_backup.StepBackupAndRestore,
                                keras.callbacks.BackupAndRestore)) for cb in loop_callbacks):
            logger.warning(
                "this fit has no keras.callbacks.BackupAndRestore: if a rank dies, every rank "
                "restarts and trains from the start; with one (its backup_dir on a file system "
                "every rank sees), the survivors back up the step in flight and the restarted "
                "fit resumes there")
        try:
            with self._tnt_finalizing_own_weights():
                return super().fit(
                    **train, epochs=epochs, verbose=verbose if master else 0,
                    callbacks=loop_callbacks, validation_split=validation_split,
                    validation_data=validation_data, initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                    validation_batch_size=validation_batch_size, validation_freq=validation_freq)
        except Exception as exc:
            self._tnt_rescue(exc, loop_callbacks)
            raise

    def _tnt_finalizing_own_weights(self) -> Any:
        """While Keras' fit runs, the optimizer's ``finalize_variable_values`` (what fit
        calls at its end with the whole model's weights: an optimizer with ``use_ema``
        overwrites them with their moving averages, pairing the two lists by position)
        takes this stage's weights, the ones its optimizer was built over."""
        optimizer = self.optimizer
        step = self._tnt.step
        if optimizer is None or step is None:
            return contextlib.nullcontext()
        finalize = optimizer.finalize_variable_values

        def own_weights_only(var_list: Any) -> None:
            finalize(step.weights)

        return instance_attributes([(optimizer, "finalize_variable_values", own_weights_only)])

    def _tnt_rescue(self, exc: Exception, loop_callbacks: list[Any]) -> None:
        """A rank of the job died in this fit: under ALL, this survivor writes its copies
        of the steps in flight for the restarted job (:mod:`tarantella.pipeline.rescue`)."""
        runtime = self._tnt.runtime
        backups = [cb for cb in loop_callbacks if isinstance(cb, step_backup.StepBackupAndRestore)]
        if not backups or backups[0].copies is None or not is_membership_failure(exc, runtime):
            return
        try:
            written = backups[0].write_rescue(f"rank {runtime.rank} left: {exc}")
        except OSError as error:
            logger.warning("rank %d could not write its stage's state for the restart (%s); "
                           "the job resumes from its last backup", runtime.rank, error)
            return
        if written:
            epoch, step = written[0]
            logger.info("rank %d wrote its stage's state as batch %d of epoch %d began, for the restart",
                        runtime.rank, step, epoch + 1)

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
            read, adapter = _read_as_keras(x, y, sample_weight, batch_size=batch_size, steps=steps,
                                           purpose="evaluation")
            x, y, sample_weight, batch_size = (read[k] for k in ("x", "y", "sample_weight", "batch_size"))
            callbacks = self._tnt_loop_callbacks(callbacks, adapters=[adapter])
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
        read, adapter = _read_as_keras(x, batch_size=batch_size, steps=steps, purpose="prediction")
        return super().predict(read["x"], batch_size=read["batch_size"],
                               verbose=verbose if self._tnt.runtime.is_master else 0,
                               steps=steps, callbacks=self._tnt_loop_callbacks(callbacks,
                                                                               adapters=[adapter]))

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
        return stage_saving.gather_weights(state.pipe, list(self.weights),
                                           state.ownership.weights, state.stage)

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
        check_file_format(method, filepath)
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
        check_file_format("load_weights", filepath)
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


def _read_as_keras(x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int | None,
                   shuffle: Any = False, class_weight: Any = None, steps: int | None = None,
                   purpose: str) -> tuple[dict[str, Any], Any]:
    """The data arguments of Keras' loop for the user's data, read without tf.data's
    autotuning on a rank with one CPU (:func:`~tarantella.datasets.without_autotune_on_one_cpu`),
    and the Keras data adapter whose epoch hooks the loop's callbacks call (None for a
    ``tf.data.Dataset``, handed on as it is): other data as the dataset of global batches
    Keras' own adapter makes of it (:func:`~tarantella.datasets.whole_batches`)."""
    if isinstance(x, tf.data.Dataset):
        return dict(x=without_autotune_on_one_cpu(x), y=y, sample_weight=sample_weight,
                    batch_size=batch_size, shuffle=shuffle, class_weight=class_weight), None
    batches, adapter = whole_batches(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                                     class_weight=class_weight, steps=steps, purpose=purpose)
    return dict(x=batches, y=None, sample_weight=None, batch_size=None, shuffle=False,
                class_weight=None), adapter
