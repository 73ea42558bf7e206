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
import numpy as np
import tensorflow as tf

import tnt_core

from ._keras_compat import all_layers
from .errors import NotSupportedError
from .gradients import GradientReducer, dense_gradient
from .partition import COMPUTED, Partitioning

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
    of ``sizes`` samples, each in ``x``'s structure."""
    if x is None:
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
    """

    def __init__(self, parts: Partitioning, stage: int, backend: tnt_core.CommBackend, *,
                 loss: Any, optimizer: keras.optimizers.Optimizer, num_micro_batches: int,
                 ranks: Sequence[int] | None = None, replicas: GradientReducer | None = None,
                 regularise: bool = True, timeline: tnt_core.Timeline | None = None,
                 schedule: str = "1f1b") -> None:
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
        # the replicas' sum as a graph, traced once per gradient signature: see _sum_over_replicas
        self._replicas_sum = None if replicas is None else tf.function(self._sum_graph, autograph=False)
        self.timeline = timeline
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: one of {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self._lane = f"stage {stage}"
        self.weights = list(self.model.trainable_weights)
        #: the last stage's outputs of the latest step, micro-batches joined (else None)
        self.predictions: Any = None

    def _span(self, name: str, waits: bool = False) -> AbstractContextManager[None]:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, f"{self._lane}: waits" if waits else self._lane)

    # -- messages to the neighbours --------------------------------------------------------

    def _send(self, tensors: Sequence[Any], to: int, direction: int) -> list[tnt_core.Handle]:
        handles = []
        for j, t in enumerate(tensors):
            buf = np.ascontiguousarray(np.asarray(t))
            handles.append(self.backend.send_async(buf, self.ranks[to], 2 * j + direction))
        return handles

    def _receive(self, specs: Sequence[Any], batch: int, frm: int, direction: int) -> list[tf.Tensor]:
        bufs = [np.empty((batch, *[int(d) for d in s.shape[1:]]), dtype=tf.as_dtype(s.dtype).as_numpy_dtype)
                for s in specs]
        handles = [self.backend.recv_async(buf, self.ranks[frm], 2 * j + direction)
                   for j, buf in enumerate(bufs)]
        what = "activations" if direction == _FORWARD else "gradients"
        with self._span(f"receive {what}", waits=True):
            return [tf.convert_to_tensor(h.wait()) for h in handles]

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
        ``global_batch`` samples: the loss is the global batch's mean."""
        local = int(tf.shape(keras.tree.flatten(y)[0])[0])
        batch = global_batch or local
        sizes = micro_batch_sizes(local, self.num_micro_batches)
        xs = _micro_batches(x, sizes) if self.parts.reads_x(self.stage) else [None] * len(sizes)
        ys = _micro_batches(y, sizes) if self.last else [None] * len(sizes)
        sws = _micro_batches(sample_weight, sizes) if self.last else [None] * len(sizes)
        pending: list[tnt_core.Handle] = []
        flights: dict[int, _InFlight] = {}
        predictions: dict[int, Any] = {}
        accumulated: list[Any] = [None] * len(self.weights)
        emits = self.parts.emits[self.stage]
        total = 0.0

        def forward(k: int) -> None:
            b = sizes[k]
            received = self._received(b)
            with self._span(f"forward {k}"), tf.GradientTape() as tape:
                tape.watch(received)
                emitted = self._run(received, xs[k], training=True)
                loss = None
                if self.last:
                    predictions[k] = self.parts.outputs(emitted)
                    loss = self.loss(ys[k], predictions[k], sample_weight=sws[k]) * (b / batch)
                if k == 0 and self.regularise and self.model.losses:  # once per step
                    regularisation = tf.add_n([tf.cast(r, tf.float32) for r in self.model.losses])
                    loss = regularisation if loss is None else loss + regularisation
            if not self.last:
                pending.extend(self._send(emitted, self.stage + 1, _FORWARD))
            flights[k] = _InFlight(tape, received, emitted, loss)

        def backward(k: int) -> None:
            nonlocal total
            flight = flights.pop(k)  # the tape's activations go with it
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
                seeds.append(tf.ones_like(flight.loss))
                total += float(flight.loss)
            sources = self.weights + list(flight.inputs)
            with self._span(f"backward {k}"):
                grads = flight.tape.gradient(targets, sources, output_gradients=seeds,
                                             unconnected_gradients=tf.UnconnectedGradients.ZERO) \
                    if targets else [tf.zeros_like(s) for s in sources]
            for i, g in enumerate(grads[:len(self.weights)]):
                accumulated[i] = g if accumulated[i] is None else accumulated[i] + g
            if not self.first:
                back = list(grads[len(self.weights):])
                for i, grad in through.items():
                    back[i] = back[i] + tf.cast(grad, back[i].dtype)
                pending.extend(self._send(back, self.stage - 1, _BACKWARD))

        for kind, k in self.order(len(sizes)):
            (forward if kind == "forward" else backward)(k)
        grads = [tf.zeros_like(w) if g is None else g for g, w in zip(accumulated, self.weights)]
        if self.replicas is not None:
            with self._span("allreduce over replicas", waits=True):
                grads = self._sum_over_replicas(grads)
        with self._span("optimizer"):
            self.optimizer.apply(grads, self.weights)
        with self._span("sends complete", waits=True):
            tnt_core.wait_all(pending)
        self.predictions = _concat([predictions[k] for k in sorted(predictions)]) if self.last else None
        return total

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

    def _sum_over_replicas(self, grads: list[Any]) -> list[Any]:
        """The replicas' gradients summed through the gradient reducer DATA uses: one
        bucket plan agreed on once, native where the replicas' communicator offers the
        hand-off. Each replica computed its share of the global batch's mean loss, so the
        sum is the serial gradient: every replica pushes with factor 1.

        Why a ``tf.function`` while the step itself is eager: in the graph every bucket's
        push runs as soon as its tensors exist, side by side with the others, and the
        Python path's finish hands the buckets to TensorFlow without a copy. Called eagerly,
        the same ops run one by one and every reduced tensor is copied out. Measured by
        ``benchmarks/replica_sum.py`` (2 ranks, gloo): for 16.8 MB of gradients the graph
        takes the same time as eager calls on the native path and half the time on the
        Python path (8.8 against 17.9 ms of CPU), at a fixed cost of 0.3-0.4 ms of CPU
        per step, which shows only for a tiny model."""
        assert self.replicas is not None and self._replicas_sum is not None
        dense = [dense_gradient(g, w) for g, w in zip(grads, self.weights)]
        reduced = self._replicas_sum(dense)
        self.replicas.record_buckets()
        return list(reduced)

    def _sum_graph(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        assert self.replicas is not None
        return self.replicas.reduce(grads, tf.constant(1.0, tf.float64))

    def forward(self, x: Any, batch: int) -> float:
        """The model's outputs on ``x`` (a batch of ``batch`` samples), micro-batch by
        micro-batch through the stages, not training: they are left in
        :attr:`predictions` on the last stage. Returns this stage's weight regularisation
        (the stages' sum is what serial ``model.losses`` adds to the loss)."""
        sizes = micro_batch_sizes(batch, self.num_micro_batches)
        xs = _micro_batches(x, sizes) if self.parts.reads_x(self.stage) else [None] * len(sizes)
        pending: list[tnt_core.Handle] = []
        predictions: list[Any] = []
        for k, b in enumerate(sizes):
            emitted = self._run(self._received(b), xs[k], training=False)
            if self.last:
                predictions.append(self.parts.outputs(emitted))
            else:
                pending += self._send(emitted, self.stage + 1, _FORWARD)
        tnt_core.wait_all(pending)
        self.predictions = _concat(predictions) if self.last else None
        losses = self.model.losses if self.regularise else []
        return float(tf.add_n([tf.cast(r, tf.float32) for r in losses])) if losses else 0.0
