"""One pipelined training step of one stage: micro-batches through the partitions.

Why this shape: rank ``p`` holds partition ``p`` only (:mod:`tarantella.partition`), so a
step is a conversation between neighbours. The global batch is split into micro-batches;
for each, stage ``p`` receives its inputs from ``p - 1`` (point-to-point), runs its
partition under a gradient tape and sends its outputs on, without waiting for the rest of
the pipeline, so stage ``p`` computes micro-batch ``k + 1`` while ``p + 1`` computes ``k``.
What a stage sends is fixed by the partitioning: tensors that skip partitions pass through
the stages between unchanged, and every model output travels to the last stage, which
computes the loss of all outputs at once, as compile does (``Partitioning.emits``); model
inputs a later partition uses are read from ``x`` by its own stage.
The gradients flow back the same way: the last stage differentiates the loss, every other
stage its outputs against the gradients ``p + 1`` sent, and each stage accumulates its own
weights' gradients and applies them once, with its own optimizer, after the last
micro-batch. The order of the passes is 1F1B by default (a stage runs ``P - 1 - p``
forward passes ahead, then alternates): measured against GPipe (all forward passes, then
all backward passes) by ``benchmarks/pipeline_schedules.py``, the step time is the same
within this machine's noise (1F1B / GPipe 0.84-1.08) while a stage holds at most
``P - p`` micro-batches' activations instead of all of them (2 instead of 8).

A stage's whole step is one compiled graph per batch size (``tf.function``, traced once;
a shorter last batch traces once more): every micro-batch's passes unrolled in the
schedule's order, the accumulation, the replicas' sum and the optimizer, with the
messages as graph ops (:mod:`tarantella.stage_messages`: native where the backend offers
point-to-point in its hand-off table). There is no Python per micro-batch. The graph also
makes two things serial that a stage's own optimizer cannot see alone: a
``global_clipnorm`` clips by the whole model's norm (one scalar allreduce over the
stages), and loss scaling (``mixed_float16``) starts the backward pass from the scale and
skips a non-finite step on every stage together.

Serial equivalence: Keras' compiled loss is the mean over the batch, so micro-batch ``k``
of ``b_k`` samples contributes its own mean times ``b_k / B``; the accumulated gradient is
then the full batch's gradient up to float round-off. Weight regularisation is added once
per step, on the stage that holds the weights. What this step cannot make serial (a
``BatchNormalization`` that would see micro-batch statistics, activity regularisers) is
refused by :func:`check_stage_model`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

import tnt_core

from ._keras_compat import all_layers, forgetting_custom_gradients
from .batch_gradients import MicroBatchGradients, Rows, rows_of
from .errors import NotSupportedError
from .gradients import GradientReducer, reduce_weighted
from .partition import COMPUTED, Partitioning
from .stage_messages import StageMessages

__all__ = ["SCHEDULES", "StageStep", "micro_batch_sizes", "check_stage_model"]

_FORWARD, _BACKWARD = 0, 1
#: the orders of a stage's passes (:meth:`StageStep.order`)
SCHEDULES = ("1f1b", "gpipe")


def micro_batch_sizes(batch: int, num_micro_batches: int) -> list[int]:
    """``batch`` samples in ``num_micro_batches`` nearly equal parts, the larger first (the
    part count drops to ``batch`` when the batch is smaller: no empty micro-batches)."""
    if batch <= 0:
        return []
    count = min(batch, num_micro_batches)
    base, extra = divmod(batch, count)
    return [base + 1 if k < extra else base for k in range(count)]


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


def _micro_batches(x: Any, sizes: Sequence[int]) -> list[Any]:
    """``x`` (a tensor or a list/tuple/dict of them; None stays None) cut into micro-batches
    of ``sizes`` samples, each in ``x``'s structure (none for no sizes: a pipeline with no
    sample of a batch, under ALL)."""
    if x is None or not sizes:
        return [None] * len(sizes)
    leaves = [tf.split(tf.convert_to_tensor(t), list(sizes), axis=0) for t in keras.tree.flatten(x)]
    return [keras.tree.pack_sequence_as(x, [parts[k] for parts in leaves]) for k in range(len(sizes))]


def _concat(parts: list[Any]) -> Any:
    if not parts:
        return None
    return keras.tree.map_structure(lambda *ts: tf.concat(ts, axis=0), *parts)


@dataclass
class _InFlight:
    """What micro-batch ``k``'s backward pass needs from its forward pass."""

    tape: tf.GradientTape
    inputs: list[tf.Tensor]
    outputs: list[tf.Tensor]
    loss: tf.Tensor | None


class StageStep:
    """Stage ``stage`` of a pipeline over ``parts``: :meth:`train` runs one step.

    :param backend: a communicator with point-to-point (``backend.supports("p2p")``) in
        which stage ``p`` is rank ``ranks[p]``.
    :param loss: a ``keras.losses.Loss`` taking ``(y, outputs, sample_weight)`` in the
        model's output structure, reducing over the batch with ``sum_over_batch_size`` as
        compiled losses do (a ``tnt.Model`` passes Keras' compiled loss: every output's
        loss, weighted by ``loss_weights``, summed).
    :param optimizer: this stage's optimizer (over its partition's weights only).
    :param replicas: for data and pipeline parallelism combined, the gradient reducer over
        the group of this stage's replicas (one per pipeline): their accumulated gradients
        are summed through it, as DATA's are, before each applies the same update.
    :param regularise: whether this stage adds its weight regularisation to the loss (one
        replica of each stage does, so that the sum over replicas counts it once).
    :param schedule: the order of the passes (:meth:`order`), ``"1f1b"`` or ``"gpipe"``.
    :param timeline: where to record each micro-batch's forward and backward pass and each
        wait for a neighbour (``TNT_TIMELINE``; lanes ``stage p`` and ``stage p: waits``).
    :param native: the native point-to-point ops over ``backend``
        (``native_ops.point_to_point``), or None for the Python path.
    """

    def __init__(self, parts: Partitioning, stage: int, backend: tnt_core.CommBackend, *,
                 loss: Any, optimizer: keras.optimizers.Optimizer, num_micro_batches: int,
                 ranks: Sequence[int] | None = None, replicas: GradientReducer | None = None,
                 regularise: bool = True, timeline: tnt_core.Timeline | None = None,
                 schedule: str = "1f1b", native: Any = None) -> None:
        if not backend.supports("p2p"):
            raise NotSupportedError(
                f"pipelining needs point-to-point messages, which the {backend.name!r} backend "
                "does not provide; use a backend that does (tnt run --backend gloo or mpi)")
        self.parts, self.stage, self.backend = parts, stage, backend
        self.model = parts.models[stage]
        check_stage_model(self.model, stage)
        if not isinstance(loss, keras.losses.Loss):
            raise TypeError(f"StageStep(loss=...) takes a keras.losses.Loss (it reduces over the "
                            f"batch as a compiled loss does), got {loss!r}")
        self.loss = loss
        self.optimizer = optimizer
        self.num_micro_batches = int(num_micro_batches)
        self.ranks = list(ranks) if ranks is not None else list(range(parts.num_partitions))
        self.first, self.last = stage == 0, stage == parts.num_partitions - 1
        self.replicas, self.regularise = replicas, regularise
        self._tokens: list[tf.Tensor] = []
        # one graph per batch size (static arguments: the micro-batch sizes follow from it)
        self._train_fn = tf.function(self._train_graph, autograph=False, reduce_retracing=False)
        self._forward_fn = tf.function(self._forward_graph, autograph=False)
        self.timeline = timeline
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: one of {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self._lane = f"stage {stage}"
        self.messages = StageMessages(backend, self.ranks, native=native, timeline=timeline,
                                      lane=self._lane)
        self.weights = list(self.model.trainable_weights)
        self._rows: list[Rows | None] | None = None  # which gradients are sparse (replicas)
        #: the last stage's outputs of the latest step, micro-batches joined (else None)
        self.predictions: Any = None

    def _span(self, name: str, waits: bool = False) -> AbstractContextManager[None]:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, f"{self._lane}: waits" if waits else self._lane)

    # -- messages to the neighbours (graph ops: tarantella.stage_messages) -------------------

    def _send(self, tensors: Sequence[Any], to: int, direction: int) -> None:
        for j, t in enumerate(tensors):
            self._tokens.append(self.messages.send(t, to, 2 * j + direction))

    def _receive(self, specs: Sequence[Any], batch: int, frm: int, direction: int) -> list[tf.Tensor]:
        return [self.messages.receive((batch, *[int(d) for d in s.shape[1:]]), s.dtype,
                                      frm, 2 * j + direction)
                for j, s in enumerate(specs)]

    def _mark(self, after: Sequence[Any], name: str, begin: bool) -> list[tf.Tensor]:
        """With a timeline: a graph op marking the beginning or end of a pass (its token,
        for a control dependency); without: nothing is traced."""
        if self.timeline is None:
            return []
        token = self.messages.mark([tf.convert_to_tensor(a) for a in after if a is not None],
                                   name, begin)
        self._tokens.append(token)
        return [token]

    def _received(self, b: int) -> list[tf.Tensor]:
        """What the previous stage sends for a micro-batch of ``b`` samples (nothing on the
        first stage)."""
        if self.first:
            return []
        return self._receive(self.parts.received[self.stage], b, self.stage - 1, _FORWARD)

    def _run(self, received: list[tf.Tensor], x: Any, training: bool) -> list[Any]:
        """This stage's partition on one micro-batch: what it emits (sends on, or on the
        last stage the model's flat outputs), its own inputs from ``received`` and ``x``."""
        computed = self.model(self.parts.feed(self.stage, received, x), training=training)
        return self.parts.emitted(self.stage, received, computed)

    # -- the step ------------------------------------------------------------------------------

    def train(self, x: Any, y: Any, sample_weight: Any = None, *,
              global_batch: int | None = None) -> float:
        """One optimizer step on the global batch ``(x, y)`` (``x`` is read by the stages
        whose partitions use model inputs, ``y`` and ``sample_weight`` on the last; every
        stage needs the batch's size from ``y``). Returns this stage's part of the batch's
        loss (the compiled loss on the last stage, plus each stage's weight
        regularisation): their sum is the loss.

        With replicas, ``(x, y)`` is this pipeline's share of a global batch of
        ``global_batch`` samples: the loss is the global batch's mean.

        The step is one graph per batch size (traced on the first batch of a size; a
        shorter last batch traces once more): see :meth:`_train_graph`."""
        local = int(tf.shape(keras.tree.flatten(y)[0])[0])
        batch = global_batch or local
        if not self.optimizer.built:  # its slots are made outside the graph, once
            self.optimizer.build(self.weights)
        if self.replicas is not None and self._rows is None:
            self._rows = self._sparse_rows(x if self.parts.reads_x(self.stage) else None)
        with self._span("step"):
            total, predictions = self._train_fn(
                x if self.parts.reads_x(self.stage) else None, y if self.last else None,
                sample_weight if self.last else None, local, batch)
        if self.replicas is not None:
            self.replicas.record_buckets()
        self.predictions = predictions if self.last else None
        return float(total)

    def _train_graph(self, x: Any, y: Any, sample_weight: Any, local: int,
                     batch: int) -> tuple[tf.Tensor, Any]:
        """The step's graph: every pass of the schedule, unrolled (``local`` and ``batch``
        are static, so the micro-batch sizes are), the gradients accumulated, summed over
        the replicas and applied, and the sends completed. The messages run in the
        schedule's order (:mod:`tarantella.stage_messages`); the compute between them runs
        as the dataflow allows."""
        sizes = micro_batch_sizes(local, self.num_micro_batches)
        xs = _micro_batches(x, sizes) if self.parts.reads_x(self.stage) else [None] * len(sizes)
        ys = _micro_batches(y, sizes) if self.last else [None] * len(sizes)
        sws = _micro_batches(sample_weight, sizes) if self.last else [None] * len(sizes)
        self._tokens = []
        self.messages.begin()
        flights: dict[int, _InFlight] = {}
        predictions: dict[int, Any] = {}
        accumulated = MicroBatchGradients(self.weights)
        emits = self.parts.emits[self.stage]
        parts: list[tf.Tensor] = []

        def forward(k: int) -> None:
            b = sizes[k]
            received = self._received(b)
            begun = self._mark(received + keras.tree.flatten(xs[k]), f"forward {k}", begin=True)
            with tf.GradientTape() as tape, tf.control_dependencies(begun):
                tape.watch(received)
                emitted = self._run(received, xs[k], training=True)
                loss = None
                if self.last:
                    predictions[k] = self.parts.outputs(emitted)
                    loss = self.loss(ys[k], predictions[k], sample_weight=sws[k]) * (b / batch)
                if k == 0 and self.regularise and self.model.losses:  # once per step
                    # in the loss's dtype (float64 models: float64)
                    dtype = tf.float64 if loss is None else loss.dtype
                    regularisation = tf.add_n([tf.cast(r, dtype) for r in self.model.losses])
                    loss = regularisation if loss is None else loss + regularisation
            self._mark(list(emitted) + ([] if loss is None else [loss]), f"forward {k}", begin=False)
            if not self.last:
                self._send(emitted, self.stage + 1, _FORWARD)
            flights[k] = _InFlight(tape, received, emitted, loss)

        def backward(k: int) -> None:
            flight = flights.pop(k)
            targets: list[Any] = []
            seeds: list[Any] = []
            through: dict[int, Any] = {}  # received index -> the gradient sent straight back
            if not self.last:
                # one gradient per tensor sent on; what passed through this stage unchanged
                # has its gradient passed straight back
                returned = self._receive(flight.outputs, sizes[k], self.stage + 1, _BACKWARD)
                for (kind, i), sent, grad in zip(emits, flight.outputs, returned):
                    if kind == COMPUTED:
                        targets.append(sent)
                        seeds.append(grad)
                    else:
                        through[i] = grad
            if flight.loss is not None:
                targets.append(flight.loss)
                seeds.append(self._loss_seed(flight.loss))
                parts.append(tf.cast(flight.loss, tf.float64))  # a float64 model's loss
            sources = self.weights + list(flight.inputs)
            begun = self._mark(seeds, f"backward {k}", begin=True)
            with tf.control_dependencies(begun):
                grads = flight.tape.gradient(targets, sources, output_gradients=seeds,
                                             unconnected_gradients=tf.UnconnectedGradients.ZERO) \
                    if targets else [tf.zeros_like(s) for s in sources]
            self._mark([g for g in grads if isinstance(g, tf.Tensor)], f"backward {k}", begin=False)
            accumulated.add(k, grads[:len(self.weights)])
            if not self.first:
                back = list(grads[len(self.weights):])
                for i, grad in through.items():
                    back[i] = back[i] + tf.cast(grad, back[i].dtype)
                self._send(back, self.stage - 1, _BACKWARD)

        for kind, k in self.order(len(sizes)):
            (forward if kind == "forward" else backward)(k)
        if self.replicas is None:
            grads = accumulated.whole()
        else:
            grads = self._sum_over_replicas(accumulated.whole(self._rows))
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            grads = self._agree_on_finite(grads)
        clipnorm = getattr(self.optimizer, "global_clipnorm", None)
        if clipnorm:
            grads = self._clip_by_global_norm(grads, clipnorm)
            self.optimizer.global_clipnorm = None  # read when traced: clipped once, above
            try:
                self._apply(grads)
            finally:
                self.optimizer.global_clipnorm = clipnorm
        else:
            self._apply(grads)
        done = self.messages.complete(self._tokens + [tf.convert_to_tensor(self.optimizer.iterations)])
        total = tf.add_n(parts) if parts else tf.constant(0.0, tf.float64)
        with tf.control_dependencies([done]):
            total = tf.identity(total)
        joined = _concat([predictions[k] for k in sorted(predictions)]) if self.last else None
        return total, joined

    def _sum_over_replicas(self, grads: list[Any]) -> list[Any]:
        """The sum of the stage's replicas' gradients, through the one reduction of DATA's
        step: dense ones summed, sparse ones gathered row by row in replica order (the
        order of the batch's shares), as serial Keras' step has them."""
        replicas = self.replicas
        assert replicas is not None
        last: list[tf.Tensor] = []

        def record(outputs: list[tf.Tensor]) -> None:
            last[:] = outputs

        return reduce_weighted(grads, self.weights, tf.constant(1.0, tf.float64),
                               lambda: replicas, replicas.runtime,
                               keep=tf.constant(True), previous=lambda: list(last),
                               record=record, backend=replicas.backend)

    def _sparse_rows(self, x: Any) -> list[Rows | None]:
        """Which weights' gradients are sparse, from the stage's structure: one forward and
        backward pass of the partition with its weight regularisation, traced once and
        never run. Why: the replicas of a stage must agree (a sparse gradient is gathered,
        a dense one summed), and what their own passes give can differ: only one adds the
        regularisation (whose gradient is dense), and one with no sample of a batch makes
        no pass (:mod:`tarantella.batch_gradients`)."""
        found: list[Rows | None] = []
        if x is not None:
            x = keras.tree.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t), x)
        rows = 1 if x is None else int(keras.tree.flatten(x)[0].shape[0])

        def probe(x: Any) -> tf.Tensor:
            received = [] if self.first else [
                tf.zeros((rows, *[int(d) for d in s.shape[1:]]), s.dtype)
                for s in self.parts.received[self.stage]]
            with tf.GradientTape() as tape:
                tape.watch(received)
                emitted = self._run(received, x, training=True)
                targets = [tf.reduce_sum(e) for e in emitted if e.dtype.is_floating]
                targets += [tf.reduce_sum(r) for r in self.model.losses]
            grads = tape.gradient(targets, self.weights,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO) \
                if targets else [None] * len(self.weights)
            found.extend(rows_of(grads))
            return tf.constant(0)

        with forgetting_custom_gradients():  # the probe's graph is dropped
            tf.function(probe, autograph=False).get_concrete_function(x)
        return found

    def _apply(self, grads: list[tf.Tensor]) -> None:
        """The stage's optimizer applies ``grads`` to its weights.

        Why the wrapper: traced in a replica context (a stage's step is), Keras' optimizer
        first sums the gradients over ``tf.distribute``'s replicas (one here: tarantella
        sums over a stage's replicas itself), and that sum is a graph-mode
        ``tf.custom_gradient``, whose gradient function TensorFlow registers process-wide
        and never removes. The registry then held the step's graph and, through its
        captures, every weight and optimizer slot of the stage, so a deleted pipelined
        model's stage stayed allocated (and a second model in the same process, one that
        resumes, added its own on top: docs/pipelining.md, "Models larger than one rank").
        Nothing differentiates the update, so the registrations are dropped once traced."""
        with forgetting_custom_gradients():
            self.optimizer.apply(grads, self.weights)

    def order(self, count: int) -> list[tuple[str, int]]:
        """This stage's passes over ``count`` micro-batches, in the order it runs them.

        ``gpipe``: every forward pass, then every backward pass, the last micro-batch's
        first (each stage holds all ``count`` micro-batches' activations at the turn).
        ``1f1b``: stage ``p`` runs ``P - 1 - p`` forward passes ahead, then alternates one
        forward and one backward pass, then drains; it holds at most ``P - p``
        micro-batches' activations. Both make the same passes; neighbours agree on the
        order of what they exchange, since both follow the same schedule."""
        if self.schedule == "gpipe":
            return [("forward", k) for k in range(count)] + \
                [("backward", k) for k in reversed(range(count))]
        ahead = min(self.parts.num_partitions - 1 - self.stage, count)
        passes = [("forward", k) for k in range(ahead)]
        for k in range(count - ahead):
            passes += [("forward", ahead + k), ("backward", k)]
        return passes + [("backward", k) for k in range(count - ahead, count)]

    def _loss_seed(self, loss: tf.Tensor) -> tf.Tensor:
        """The gradient the backward pass starts from at this stage's loss: 1, or with loss
        scaling (``LossScaleOptimizer``, what ``mixed_float16`` compiles) the optimizer's
        current scale, as serial Keras differentiates ``optimizer.scale_loss(loss)``. The
        stages' scales are equal: they start equal and take the same decisions."""
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return tf.cast(self.optimizer.scale_loss(tf.ones_like(loss, tf.float32)), loss.dtype)
        return tf.ones_like(loss)

    def _agree_on_finite(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """Loss scaling skips a step whose gradients are not all finite, over the whole
        model: the stages count their non-finite verdicts with one scalar allreduce, and a
        stage whose own gradients are finite while another's are not hands its optimizer
        NaN gradients, so that every stage's ``LossScaleOptimizer`` skips the step and
        lowers its scale alike."""
        assert isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        finite = self.optimizer.check_finite(grads)
        others = self.messages.allreduce_sum(1.0 - tf.cast(finite, tf.float64))
        factor = tf.where(others > 0.0, float("nan"), 1.0)
        return [tf.IndexedSlices(g.values * tf.cast(factor, g.dtype), g.indices, g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else g * tf.cast(factor, g.dtype)
                for g in grads]

    def _clip_by_global_norm(self, grads: list[tf.Tensor], clipnorm: float) -> list[tf.Tensor]:
        """``optimizer.global_clipnorm`` as serial Keras applies it, over the whole model:
        the norm of every stage's gradients, agreed with one scalar allreduce over the
        pipeline's stages (the replicas' gradients are summed already), and Keras' formula
        (``keras.optimizers``: ``clip * min(1 / norm, 1 / clip)``, NaN for a non-finite
        norm; a sparse gradient's rows each count, as Keras squares them), in the
        gradients' dtype as Keras computes it (float64 for a float64 model). The scaled
        gradients are Keras' ``g * scale``: a sparse one comes back dense, as in serial
        Keras."""
        local = tf.add_n([tf.reduce_sum(tf.square(tf.cast(
            g.values if isinstance(g, tf.IndexedSlices) else g, tf.float64))) for g in grads]) \
            if grads else tf.constant(0.0, tf.float64)
        norm = tf.sqrt(self.messages.allreduce_sum(local))
        widest = max((g.dtype for g in grads), key=lambda d: d.size, default=None)
        norm = tf.cast(norm, widest or keras.config.floatx())
        scale = clipnorm * tf.minimum(1.0 / norm, 1.0 / clipnorm) + (norm - norm)
        return [g * tf.cast(scale, g.dtype) for g in grads]

    def forward(self, x: Any, batch: int) -> float:
        """The model's outputs on ``x`` (a batch of ``batch`` samples), micro-batch by
        micro-batch through the stages, not training: they are left in
        :attr:`predictions` on the last stage. Returns this stage's weight regularisation
        (the stages' sum is what serial ``model.losses`` adds to the loss). One graph per
        batch size, as :meth:`train`."""
        regularisation, predictions = self._forward_fn(
            x if self.parts.reads_x(self.stage) else None, batch)
        self.predictions = predictions if self.last else None
        return float(regularisation)

    def _forward_graph(self, x: Any, batch: int) -> tuple[tf.Tensor, Any]:
        sizes = micro_batch_sizes(batch, self.num_micro_batches)
        xs = _micro_batches(x, sizes) if self.parts.reads_x(self.stage) else [None] * len(sizes)
        self._tokens = []
        self.messages.begin()
        predictions: list[Any] = []
        for k, b in enumerate(sizes):
            emitted = self._run(self._received(b), xs[k], training=False)
            if self.last:
                predictions.append(self.parts.outputs(emitted))
            else:
                self._send(emitted, self.stage + 1, _FORWARD)
        done = self.messages.complete(self._tokens)
        losses = self.model.losses if self.regularise else []
        regularisation = tf.add_n([tf.cast(r, tf.float64) for r in losses]) if losses \
            else tf.constant(0.0, tf.float64)
        with tf.control_dependencies([done]):
            regularisation = tf.identity(regularisation)
        return regularisation, (_concat(predictions) if self.last else None)
