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
History of every rank equal serial Keras'. The model stays whole: at the end of every epoch
and of ``fit``, each weight is broadcast from the stage that trains it, so ``get_weights``,
``save_weights`` and callbacks at epoch end see the whole trained model on every rank.

``save``/``save_weights`` (and ``ModelCheckpoint`` at epoch ends) write what serial Keras
writes: the whole model with one optimizer holding every stage's state, gathered from the
stages. What is not supported yet is refused with a message saying what to do: a custom
``train_step``, checkpoints and backups in the middle of an epoch. ``load_weights`` (and so
``BackupAndRestore``) gives each stage its own part of a saved optimizer state. Callbacks
otherwise run as for DATA: writers on the master only.

:class:`PipelinedModel` is the sibling of :class:`~tarantella.data_parallel.DataParallelModel`
over the base :class:`tarantella.model.Model` (identity, saving, the class swap); both run
the argument checks of :mod:`tarantella.arguments` before their loops.
"""

from __future__ import annotations

import json
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from . import _keras_compat, arguments, losses, native_ops, randomness, timeline
from .callbacks import distribute_callbacks
from .errors import NotSupportedError
from .files import writes_locally
from .gradients import GradientReducer
from .model import DistributedState, Model, ParallelStrategy
from .partition import Partitioning, partition, split_layers
from .pipeline import StageStep, check_stage_model
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
                 strategy: ParallelStrategy) -> None:
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
        #: on the writing rank(s): the optimizer over the whole model holding every stage's
        #: state (what save/save_weights write), gathered since the last step, else None
        self.whole_optimizer: keras.optimizers.Optimizer | None = None
        self.gathered = False
        #: which rank trains each of the model's weights (the stage whose partition holds it)
        self.owners: dict[int, int] = {id(w): p for p in range(parts.num_partitions)
                                       for w in parts.models[p].weights}

    def forget_whole_optimizer(self) -> None:
        """Free the gathered optimizer (the size of the serial one): a step makes it stale."""
        self.whole_optimizer, self.gathered = None, False


class _WeightSync(keras.callbacks.Callback):
    """The whole model on every rank: every weight (and, before a checkpoint callback and
    when training ends, every stage's optimizer state) from its stage, at each epoch's end
    before the user's callbacks see it."""

    def __init__(self, model: PipelinedModel, checkpoints: bool) -> None:
        super().__init__()
        self._model = model
        self._checkpoints = checkpoints

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._model._tnt_gather(optimizer=self._checkpoints)  # noqa: SLF001 - its own helper

    def on_train_end(self, logs: Any = None) -> None:
        self._model._tnt_gather(optimizer=False)  # noqa: SLF001
        self._model._tnt.forget_whole_optimizer()  # noqa: SLF001


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
                f"has {runtime.size} (tnt run -n {stages} ...; for several pipelines use "
                "ParallelStrategy.ALL)")
        if strategy is ParallelStrategy.ALL and runtime.size % stages:
            raise NotSupportedError(
                f"tnt.Model(parallel_strategy=ALL): model {model.name!r} has {stages} partitions, "
                f"so the job needs a multiple of {stages} ranks (one pipeline per {stages}); it "
                f"has {runtime.size}")
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
        check_stage_model(parts.models[runtime.rank % stages], runtime.rank % stages)
        state = _PipelineState(runtime, parts, num_micro_batches, strategy)
        # the replicas of a stage draw their own Dropout masks, for their own samples, as the
        # ranks of DATA do (pipeline 0 keeps the serial stream)
        randomness.fold_rank_into_seeds(model, state.replica)
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

    def train_step(self, data: Any) -> Any:
        state = self._tnt
        assert state.step is not None, "compile() makes the stage's step"
        x, y, sample_weight, batch = self._tnt_batch(data)
        share = self._tnt_share(batch)
        state.forget_whole_optimizer()
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

    def _tnt_gather(self, optimizer: bool, everywhere: bool = False) -> None:
        """The whole model: every weight on every rank, and with ``optimizer`` the
        optimizer state on the master (on every rank with ``everywhere``). A collective of
        all ranks."""
        self._tnt_gather_weights()
        if optimizer:
            self._tnt.whole_optimizer = self._tnt_whole_optimizer(everywhere)
            self._tnt.gathered = True

    def _tnt_whole_optimizer(self, everywhere: bool) -> keras.optimizers.Optimizer | None:
        """The optimizer a serial run would hold, on the master (with ``everywhere`` on
        every rank; None elsewhere): built over all trainable weights, each variable (a
        slot, the iteration count) the value of the stage that holds it. Keras names a
        slot after its weight (``adam/dense_kernel_momentum``), so a stage's variable is
        the whole optimizer's of the same path.

        Only the rank that writes builds it: it is as large as the serial optimizer, which
        is what a pipelined rank saves memory on. The stages send it their variables
        point-to-point; with ``everywhere`` they are broadcast instead."""
        stage_optimizer = getattr(self, "optimizer", None)
        if stage_optimizer is None or not stage_optimizer.built:
            return None
        state = self._tnt
        backend = state.runtime.backend
        mine = {v.path: v for v in stage_optimizer.variables}
        if everywhere:
            whole = _whole_like(stage_optimizer, self.trainable_variables)
            holds = np.array([state.stage + 1 if v.path in mine and state.replica == 0 else 0
                              for v in whole.variables], np.int64)
            owners = backend.allreduce(holds, "max") - 1  # the owning stage is rank `stage`
            for v, owner in zip(whole.variables, owners):
                if owner < 0:
                    raise tnt_core.CommError(f"no stage holds optimizer variable {v.path!r}")
                if v.path in mine:
                    v.assign(mine[v.path])
            _broadcast_variables(backend, list(whole.variables), [int(o) for o in owners])
            return whole
        rank, stages = state.runtime.rank, state.parts.num_partitions
        if rank != 0:
            if state.replica == 0:  # a stage of the first pipeline: its state to the master
                _send_variables(backend, list(stage_optimizer.variables), 0)
            return None
        whole = _whole_like(stage_optimizer, self.trainable_variables)
        by_path = {v.path: v for v in whole.variables}
        received = dict(mine)
        for stage in range(1, stages):
            received.update(_receive_variables(backend, stage))
        missing = [path for path in by_path if path not in received]
        if missing:
            raise tnt_core.CommError(f"no stage holds optimizer variables {missing[:3]}")
        for path, v in by_path.items():
            v.assign(np.asarray(keras.ops.convert_to_numpy(received[path])).reshape(tuple(v.shape)))
        return whole

    def _tnt_as_whole(self, write: Any, everywhere: bool = False) -> None:
        """Run ``write`` (Keras' save or save_weights) with the whole model's optimizer in
        place of this stage's, gathering it first if training ran since the last gather."""
        state = self._tnt
        if not state.gathered or everywhere:
            if writes_locally():
                raise NotSupportedError(
                    "saving a pipelined model from a master-only callback in the middle of an "
                    "epoch: the stages' state is gathered at each epoch's end; save there "
                    "(save_freq='epoch')")
            self._tnt_gather(optimizer=True, everywhere=everywhere)
        stage_optimizer = getattr(self, "optimizer", None)
        whole = state.whole_optimizer
        if whole is not None:
            self.optimizer = whole
        try:
            write()
        finally:
            if whole is not None:
                self.optimizer = stage_optimizer
            if not writes_locally():  # kept for the other checkpoints of this epoch's end
                state.forget_whole_optimizer()

    def _tnt_gather_weights(self) -> None:
        """Each weight from the rank whose stage trains it, to every rank (seed states
        stay each rank's own: ``tarantella.randomness``)."""
        state = self._tnt
        owned = [(w, state.owners[id(w)]) for w in self.weights
                 if id(w) in state.owners and not randomness.is_seed_state(w)]
        _broadcast_variables(state.runtime.backend, [w for w, _ in owned], [o for _, o in owned])

    def _tnt_start(self) -> None:
        """Before a loop: weights set on the master (set_weights, load_weights) go to all."""
        if self._tnt.needs_broadcast:
            weights = [w for w in self.weights if not randomness.is_seed_state(w)]
            _broadcast_variables(self._tnt.runtime.backend, weights, [0] * len(weights))
            self._tnt.needs_broadcast = False

    def _tnt_loop_callbacks(self, callbacks: Any, *, train: bool) -> list[Any]:
        """The user's callbacks as DATA runs them (writers on the master only, tnt
        Callback wrappers honoured, a master's stop request stops every rank), after the
        weight gathering; what would write stale or partial state is refused."""
        callbacks = list(callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList)
                         else callbacks or [])
        checkpoints = False
        for cb in callbacks:
            inner = getattr(cb, "keras_callback", cb)
            if not isinstance(inner, (keras.callbacks.BackupAndRestore,
                                      keras.callbacks.ModelCheckpoint)):
                continue
            if inner.save_freq != "epoch":
                raise NotSupportedError(
                    f"{type(inner).__name__}(save_freq={inner.save_freq!r}) with a pipelined "
                    "model: the whole model is gathered from the stages at each epoch's end; "
                    "use save_freq='epoch'")
            checkpoints = True
        runtime = self._tnt.runtime
        wrapped = distribute_callbacks(callbacks, self, runtime, broadcast_weights=False)
        return ([_WeightSync(self, checkpoints)] if train else []) + wrapped

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
            callbacks=self._tnt_loop_callbacks(callbacks, train=True),
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
            callbacks = self._tnt_loop_callbacks(callbacks, train=False)
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
                               steps=steps, callbacks=self._tnt_loop_callbacks(callbacks, train=False))

    @user_facing
    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Any = None, return_dict: bool = False) -> Any:
        """``keras.Model.train_on_batch`` of the pipeline, on the global batch. The whole
        model is gathered after it (every weight from its stage, as at the end of ``fit``),
        so ``get_weights`` between calls sees it: a loop of these costs one broadcast of the
        weights per step, which ``fit`` spares."""
        arguments.check_compiled(self, "train_on_batch")
        self._tnt_start()
        logs = super().train_on_batch(x, y, sample_weight=sample_weight,
                                      class_weight=class_weight, return_dict=return_dict)
        self._tnt_gather(optimizer=False)
        return logs

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

    @user_facing
    def save(self, filepath: Any, overwrite: bool = True, zipped: Any = None, *,
             tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """Save the whole model as plain Keras would (one ``.keras`` file with every
        weight and the optimizer state of every stage, which plain Keras loads). Call on
        every rank, as for DATA: the stages' state is gathered, the master writes."""
        parent = super().save
        self._tnt_as_whole(lambda: parent(filepath, overwrite=overwrite, zipped=zipped,
                                          tnt_save_all_devices=tnt_save_all_devices, **kwargs),
                           everywhere=tnt_save_all_devices)

    @user_facing
    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """As Keras (every rank reads the file): the whole model's weights, and from a
        ``.weights.h5`` with optimizer state (what :meth:`save_weights` and
        ``BackupAndRestore`` write) each stage's own slots, so training resumes as serial
        training would."""
        stage_optimizer = getattr(self, "optimizer", None)
        if stage_optimizer is None or str(filepath).endswith(".keras"):
            super().load_weights(filepath, *args, **kwargs)
            return
        state = self._tnt
        if not stage_optimizer.built and state.step is not None:
            stage_optimizer.build(state.step.weights)
        whole = _whole_like(stage_optimizer, self.trainable_variables)  # freed on return
        self.optimizer = whole
        try:
            super().load_weights(filepath, *args, **kwargs)
        finally:
            self.optimizer = stage_optimizer
        loaded = {v.path: v for v in whole.variables}
        for v in stage_optimizer.variables:
            if v.path in loaded:
                v.assign(loaded[v.path])
        state.forget_whole_optimizer()

    @user_facing
    def save_weights(self, filepath: Any, overwrite: bool = True, *,
                     tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """The whole model's weights and optimizer state (``.weights.h5``), as serial Keras
        writes them; call on every rank."""
        parent = super().save_weights
        self._tnt_as_whole(lambda: parent(filepath, overwrite=overwrite,
                                          tnt_save_all_devices=tnt_save_all_devices, **kwargs),
                           everywhere=tnt_save_all_devices)


#: tags of the optimizer-state messages to the master (apart from the pipeline's 0, 1, ...)
_META_TAG, _VALUE_TAG = 30001, 30002


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


def _whole_like(optimizer: keras.optimizers.Optimizer, variables: list[Any]) -> Any:
    """A new optimizer configured as ``optimizer``, built over ``variables``."""
    whole = type(optimizer).from_config(optimizer.get_config())
    whole.build(variables)
    return whole


def _send_variables(backend: tnt_core.CommBackend, variables: list[Any], dest: int) -> None:
    """``variables`` to ``dest``: their paths, shapes and dtypes (JSON, as int32 words),
    then each value (see :func:`_receive_variables`)."""
    values = [np.array(keras.ops.convert_to_numpy(v), order="C").reshape(-1) for v in variables]
    meta = json.dumps([[v.path, str(a.dtype), a.size] for v, a in zip(variables, values)]).encode()
    words = np.frombuffer(meta + b" " * (-len(meta) % 4), dtype=np.int32).copy()
    handles = [backend.send_async(np.array([words.size], np.int64), dest, _META_TAG),
               backend.send_async(words, dest, _META_TAG)]
    handles += [backend.send_async(a, dest, _VALUE_TAG) for a in values]
    tnt_core.wait_all(handles)


def _receive_variables(backend: tnt_core.CommBackend, src: int) -> dict[str, np.ndarray]:
    """What :func:`_send_variables` sent from ``src``: path -> value (flat)."""
    count = np.zeros(1, np.int64)
    backend.recv_async(count, src, _META_TAG).wait()
    words = np.zeros(int(count[0]), np.int32)
    backend.recv_async(words, src, _META_TAG).wait()
    meta = json.loads(words.tobytes().decode().rstrip())
    out = {}
    for path, dtype, size in meta:
        buf = np.zeros(int(size), np.dtype(dtype))
        out[path] = backend.recv_async(buf, src, _VALUE_TAG).wait()
    return out


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


