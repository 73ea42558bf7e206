"""One pipelined training step of one stage: micro-batches through the partitions.

Why this shape: rank ``p`` holds partition ``p`` only (:mod:`tarantella.pipeline.partition`), so a
step is a conversation between neighbours. The pieces, each its own module:

- the micro-batch split (:mod:`tarantella.pipeline.micro_batches`): the global batch in ``M``
  micro-batches, each weighted by its share of the batch;
- the schedule (:mod:`tarantella.pipeline.schedule`): this stage's list of actions, its passes and
  messages in order, the same lists the schedule's dry run proves free of deadlocks and
  mix-ups (checked when the step is traced);
- the stage's own compute on one micro-batch (:mod:`tarantella.pipeline.passes`): the forward
  pass under a gradient tape, the backward pass from the gradients the next stage sends;
- the messages (:mod:`tarantella.pipeline.messages`): graph ops through the channel
  (:mod:`tarantella.comm`), native where its communicator offers point-to-point.

The step walks its list of actions once, while it is traced: stage ``p`` receives a
micro-batch's inputs from ``p - 1``, runs its partition and sends its outputs on without
waiting for the rest of the pipeline, so stage ``p`` computes micro-batch ``k + 1`` while
``p + 1`` computes ``k``. What a stage sends is fixed by the partitioning: tensors that skip
partitions pass through the stages between unchanged, and every model output travels to the
last stage, which computes the loss of all outputs at once, as compile does
(``Partitioning.emits``); model inputs a later partition uses are read from ``x`` by its own
stage. The gradients flow back the same way, and each stage accumulates its own weights'
gradients and applies them once, with its own optimizer, after the last micro-batch. The
default order is 1F1B (``schedule="1f1b"``; ``"zb-h1"``, zero bubble, runs each weight
gradient as a pass ``W`` of its own; ``"zb-fused"`` places several micro-batches' ``W``
together, and ``W`` one after the other in a list are one pass over their micro-batches'
rows (:mod:`tarantella.pipeline.fused_weights`); ``"gpipe"`` for comparison:
docs/pipelining.md has them measured). The optimizer's update is one XLA-compiled function
unless ``compile(jit_compile=False)`` (:mod:`tarantella.data_parallel.compiled_update`).

A stage's whole step is one compiled graph per batch size (``tf.function``, traced once;
a shorter last batch traces once more): every action unrolled in the schedule's order, the
accumulation, the replicas' sum and the optimizer. There is no Python per micro-batch. The
messages run in the list's order (:mod:`tarantella.pipeline.messages`), and so do each
``F`` and each ``W``: they start after what the action before them made. Why: left to the
dataflow, the first stage's forward passes (all ready at once) would share its core and
the first activations would leave later, and a ``W`` would run with its ``B`` and delay
the input gradient the previous stage waits for. A backward pass follows the gradients it
receives (or, on the last stage, its forward pass), which come just before it. The
graph also makes two things serial that a stage's own optimizer cannot see alone: a
``global_clipnorm`` clips by the whole model's norm (one scalar allreduce over the
stages), and loss scaling (``mixed_float16``) starts the backward pass from the scale and
skips a non-finite step on every stage together.

Serial equivalence: Keras' compiled loss is the mean over the batch, so micro-batch ``k``
of ``b_k`` samples contributes its own mean times ``b_k / B``; the accumulated gradient is
then the full batch's gradient up to float round-off. Weight regularisation is added once
per step, on the stage that holds the weights. What this step cannot make serial (a
``BatchNormalization`` that would see micro-batch statistics, activity regularisers) is
refused by :func:`~tarantella.pipeline.checks.check_stage_model`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from .._keras_compat import forgetting_custom_gradients
from ..comm import Channel, count, previous, record
from ..comm.compression import for_fit
from ..comm.gradients import GradientReducer, reduce_weighted
from ..comm.sparse_rows import RowKind
from ..data_parallel.compiled_update import CompiledUpdate, wants_compiled_update
from . import fused_weights
from . import schedule as schedules
from .batch_fingerprint import fingerprint
from .batch_gradients import MicroBatchGradients, Rows, rows_of
from .checks import check_point_to_point, check_stage_model
from .messages import StageMessages
from .micro_batches import concat, micro_batch_sizes, rows, shares, split
from .partition import Partitioning
from .passes import InFlight, StagePasses, WeightPass, tensors_in
from .schedule import Action, Op
from .shapes import CutShapes, Shapes
from .step_ends import StepEnds, StepLog

__all__ = ["SCHEDULES", "StageStep", "check_stage_model", "micro_batch_sizes"]

#: the tags of a message: ``2 j + direction`` for the ``j``-th tensor crossing a cut
_FORWARD, _BACKWARD = 0, 1
#: the orders of a stage's passes (:mod:`tarantella.pipeline.schedule`), the default first
SCHEDULES = tuple(schedules.SCHEDULES)


class _EndsSlot:
    """The step ends (:mod:`tarantella.pipeline.step_ends`) of the step running now, for
    its graph's host calls: they capture this slot, never the :class:`StageStep` (see
    :mod:`tarantella.pipeline.messages` on what ``numpy_function`` keeps alive)."""

    def __init__(self) -> None:
        self.current: StepEnds | None = None


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
    :param schedule: the name of the schedule (:data:`tarantella.pipeline.schedule.SCHEDULES`),
        ``"1f1b"`` or ``"gpipe"``.
    :param timeline: where to record each micro-batch's forward and backward pass and each
        wait for a neighbour (``TNT_TIMELINE``; lanes ``stage p`` and ``stage p: waits``).
    :param jit_compile: ``compile(jit_compile=...)``: unless False, the optimizer's update is
        one XLA-compiled function (:mod:`tarantella.data_parallel.compiled_update`).
    :param log_step: traced into the step when it runs with its ends (``train(ends=...)``):
        called at the end of the step's graph with a :class:`~tarantella.pipeline.step_ends.StepLog`
        (the batch's loss summed over the ranks, and on the last stage the batch's outputs),
        returns the step's logs (:attr:`logs`): a ``tnt.Model`` updates its loss tracker and
        metrics there (:mod:`tarantella.pipeline.step_ends` says why inside the graph).
    :param recompute: activation recomputation: a micro-batch's forward pass keeps only
        what it was computed from (its inputs), and its backward pass computes it again
        (:meth:`tarantella.pipeline.passes.StagePasses.replay`), where the schedule places
        the backward pass: the same gradients, bit for bit, for one more forward pass.
    """

    def __init__(self, parts: Partitioning, stage: int, backend: tnt_core.CommBackend | Channel, *,
                 loss: Any, optimizer: keras.optimizers.Optimizer, num_micro_batches: int,
                 ranks: Sequence[int] | None = None, replicas: GradientReducer | None = None,
                 regularise: bool = True, timeline: tnt_core.Timeline | None = None,
                 schedule: str = "1f1b", recompute: bool = False,
                 jit_compile: Any = False,
                 log_step: Callable[[StepLog], Any] | None = None) -> None:
        channel = backend if isinstance(backend, Channel) else Channel(tnt_core.init(), backend)
        backend = channel.backend
        check_point_to_point(backend)
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
        self._ends = _EndsSlot()
        # one graph per batch size (static arguments: the micro-batch sizes follow from it)
        self._train_fn = tf.function(self._train_graph, autograph=False, reduce_retracing=False)
        self._forward_fn = tf.function(self._forward_graph, autograph=False)
        self.timeline = timeline
        if schedule not in schedules.SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: one of {', '.join(schedules.SCHEDULES)}")
        self.schedule = schedule
        self.recompute = bool(recompute)

        self._lane = f"stage {stage}"
        self.messages = StageMessages(channel, self.ranks, timeline=timeline, lane=self._lane)
        #: this stage's compute on one micro-batch
        self.passes = StagePasses(parts, stage, loss)
        self.weights = self.passes.weights
        #: the optimizer's update as one XLA-compiled function (None: as TensorFlow ops)
        self._dry_update: Any = None
        self._compiled_update = CompiledUpdate(optimizer, self.weights, explicit=jit_compile is True) \
            if wants_compiled_update(jit_compile) else None
        #: what crosses the cuts, per batch shape (a model of variable-length inputs)
        self.shapes = CutShapes(parts)
        self._rows: list[Rows | None] | None = None  # which gradients are sparse (replicas)
        #: the last stage's outputs of the latest step, micro-batches joined (else None)
        self.predictions: Any = None
        self.log_step = log_step
        #: what ``log_step`` returned in the latest step run with its ends (else None)
        self.logs: Any = None
        #: whether the latest traced training step runs this stage's ``W`` joined after its
        #: last action (:meth:`_defers_weights`); None before one is traced or without ``W``
        self.joined_weights: bool | None = None

    def _span(self, name: str, waits: bool = False) -> AbstractContextManager[None]:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, f"{self._lane}: waits" if waits else self._lane)

    # -- the schedule --------------------------------------------------------------------------

    def actions(self, count: int, name: str | None = None) -> list[Action]:
        """This stage's actions for ``count`` micro-batches under schedule ``name`` (this
        step's by default; ``"forward"`` for evaluation), after a dry run of every stage's
        list proves they match (a schedule that would hang or mix micro-batches up is
        refused here, when the step is traced, before any message)."""
        every = schedules.build(name or self.schedule, self.parts.num_partitions, count)
        schedules.dry_run(every)
        return every[self.stage]

    def order(self, count: int) -> list[tuple[str, int]]:
        """This stage's passes over ``count`` micro-batches, in the order it runs them
        (``("forward", k)``, ``("backward", k)``): its schedule without the messages."""
        names = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.WEIGHT: "weight"}
        every = schedules.SCHEDULES[self.schedule](self.parts.num_partitions, count)
        return [(names[a.op], a.micro_batch) for a in every[self.stage]]

    # -- messages to the neighbours (graph ops: tarantella.pipeline.messages) -------------------

    def _send(self, tensors: Sequence[Any], to: int, direction: int) -> list[tf.Tensor]:
        sent = [self.messages.send(t, to, 2 * j + direction) for j, t in enumerate(tensors)]
        self._tokens += sent
        return sent

    def _receive(self, specs: Sequence[Any], batch: int, frm: int, direction: int,
                 shapes: Shapes | None = None) -> list[tf.Tensor]:
        """The messages of ``specs``' dtypes, of ``shapes`` (without the batch dimension;
        by default the specs')"""
        return [self.messages.receive((batch, *[int(d) for d in (s.shape[1:] if shapes is None
                                                                 else shapes[j])]),
                                      s.dtype, frm, 2 * j + direction)
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

    # -- the step ------------------------------------------------------------------------------

    def train(self, x: Any, y: Any, sample_weight: Any = None, *,
              global_batch: int | None = None, ends: StepEnds | None = None) -> float:
        """One optimizer step on the global batch ``(x, y)`` (``x`` is read by the stages
        whose partitions use model inputs, ``y`` and ``sample_weight`` on the last; every
        stage needs the batch's size from ``y``). Returns this stage's part of the batch's
        loss (the compiled loss on the last stage, plus each stage's weight
        regularisation): their sum is the loss.

        With replicas, ``(x, y)`` is this pipeline's share of a global batch of
        ``global_batch`` samples: the loss is the global batch's mean.

        The step is one graph per batch size (traced on the first batch of a size; a
        shorter last batch traces once more), and per shape of what the stage receives
        (variable-length inputs: :mod:`tarantella.pipeline.shapes`): see :meth:`_train_graph`.

        ``ends``: the loop's batch check and loss sum over every rank
        (:mod:`tarantella.pipeline.step_ends`), waited for and started inside the step: no
        message leaves or is received before ``ends.same_batch()`` (the step fails before
        any if it is false), and this stage's part of the loss goes to ``ends.loss_part``
        after its last forward pass."""
        local = rows(y)
        batch = global_batch or local
        if not self.optimizer.built:  # its slots are made outside the graph, once
            self.optimizer.build(self.weights)
        if self.replicas is not None and self._rows is None:
            self._rows = self._sparse_rows(x if self.parts.reads_x(self.stage) else None)
        self._ends.current = ends
        try:
            with self._span("step"):
                total, predictions, self.logs = self._train_fn(
                    x if self.parts.reads_x(self.stage) else None, y if self.last else None,
                    sample_weight if self.last else None, local, batch,
                    self.shapes.received(self.stage, x),
                    [] if ends is None else ends.fingerprinted, ends is not None)
        finally:
            self._ends.current = None
        if self.replicas is not None:
            self.replicas.record_buckets()
        self.predictions = predictions if self.last else None
        return float(total)

    def _train_graph(self, x: Any, y: Any, sample_weight: Any, local: int,
                     batch: int, incoming: Shapes = (), fingerprinted: Sequence[Any] = (),
                     with_ends: bool = False) -> tuple[tf.Tensor, Any, Any]:
        """The step's graph: this stage's actions of the schedule, unrolled (``local``,
        ``batch`` and the ``incoming`` messages' shapes are static, so the micro-batch sizes
        are), the gradients accumulated, summed over the replicas and applied, and the sends
        completed, in the schedule's order (see the module doc). ``with_ends``: the step's
        ends are given (:meth:`train`): the batch check of ``fingerprinted`` starts first,
        and the logs are made at the end (``log_step``)."""
        sizes = micro_batch_sizes(local, self.num_micro_batches)
        share = shares(sizes, batch)
        xs = split(x, sizes) if self.parts.reads_x(self.stage) else [None] * len(sizes)
        ys = split(y, sizes) if self.last else [None] * len(sizes)
        sws = split(sample_weight, sizes) if self.last else [None] * len(sizes)
        self._tokens = []
        self.messages.begin()
        self._check_same_batch(fingerprinted)
        received: dict[int, list[tf.Tensor]] = {}
        returned: dict[int, list[tf.Tensor]] = {}
        flights: dict[int, InFlight] = {}
        back: dict[int, list[tf.Tensor] | None] = {}
        predictions: dict[int, Any] = {}
        accumulated = MicroBatchGradients(self.weights)
        parts: list[tf.Tensor] = []
        actions = self.actions(len(sizes))
        # the loss is whole after the stage's last forward pass (and its send, not delayed);
        # a replica with no sample of the batch has no pass: its part is 0 from the start
        summed_after = max((i for i, a in enumerate(actions) if a.op is Op.FORWARD), default=-1)
        if 0 <= summed_after < len(actions) - 1 and actions[summed_after + 1].op is Op.SEND_F:
            summed_after += 1
        total: tf.Tensor | None = None
        if summed_after < 0:
            total = tf.constant(0.0, tf.float64)
            self._start_loss_sum(total)
        apart = {a.micro_batch for a in actions if a.op is Op.WEIGHT}  # B without the weights'
        weight_passes: dict[int, WeightPass] = {}
        last: list[Any] = []  # what the latest action made: an F or a W starts after it
        weight_group: list[int] = []  # W actions one after the other: one W (fused_weights)
        deferred: list[int] = []  # the last stage's W, joined after its last action
        defer: bool | None = None  # decided at the first W (:meth:`_defers_weights`)
        for i, action in enumerate(actions):
            k, peer = action.micro_batch, action.peer
            if action.op is Op.RECV_F:
                assert peer is not None
                received[k] = last = self._receive(self.parts.received[self.stage], sizes[k], peer,
                                                   _FORWARD, incoming)
            elif action.op is Op.FORWARD:
                flights[k] = self._forward_pass(k, received.pop(k, []), xs[k], ys[k], sws[k], share[k],
                                                after=last)
                last = [*flights[k].outputs, *([] if flights[k].loss is None else [flights[k].loss])]
                if flights[k].loss is not None:
                    parts.append(tf.cast(flights[k].loss, tf.float64))  # a float64 model's loss
                if self.last:
                    predictions[k] = flights[k].predictions
            elif action.op is Op.SEND_F:
                assert peer is not None
                last = self._send(flights[k].outputs, peer, _FORWARD)
            elif action.op is Op.RECV_B:
                assert peer is not None
                returned[k] = last = self._receive(flights[k].outputs, sizes[k], peer, _BACKWARD)
            elif action.op is Op.BACKWARD:
                flight = flights.pop(k)
                grads, back[k] = self._backward_pass(k, flight, returned.pop(k, None), k in apart,
                                                     after=last)
                if isinstance(grads, WeightPass):  # B alone (none on the first stage)
                    weight_passes[k] = grads
                    last = back[k] or last
                else:
                    accumulated.add(k, grads)
                    last = [*grads, *(back[k] or [])]
            elif action.op is Op.SEND_B:
                sent = back.pop(k)
                assert peer is not None and sent is not None
                last = self._send(sent, peer, _BACKWARD)
            else:
                assert action.op is Op.WEIGHT, action
                if defer is None:
                    defer = self.joined_weights = self._defers_weights(weight_passes[k], sizes, k,
                                                                       actions)
                if defer:
                    deferred.append(k)
                    continue
                weight_group.append(k)
                if i + 1 < len(actions) and actions[i + 1].op is Op.WEIGHT:
                    continue
                last = self._weight_passes(weight_group, [weight_passes.pop(j) for j in weight_group],
                                           last, accumulated)
                weight_group = []
            if i == summed_after:
                total = tf.add_n(parts) if parts else tf.constant(0.0, tf.float64)
                self._start_loss_sum(total)
        if deferred:
            last = self._weight_passes(deferred, [weight_passes.pop(j) for j in deferred],
                                       last, accumulated)
        assert total is not None
        self._optimizer_step(accumulated)
        done = self.messages.complete(self._tokens + [tf.convert_to_tensor(self.optimizer.iterations)])
        with tf.control_dependencies([done]):
            total = tf.identity(total)
        joined = concat([predictions[k] for k in sorted(predictions)]) if self.last else None
        logs = None
        if with_ends and self.log_step is not None:
            with tf.control_dependencies([done]):
                logs = self._logs(batch, y, sample_weight, joined)
        return total, joined, logs

    def _forward_pass(self, k: int, received: list[tf.Tensor], x: Any, y: Any, sample_weight: Any,
                 share: float, after: Sequence[Any] = ()) -> InFlight:
        """Micro-batch ``k``'s forward pass, after ``after`` (what the action before it
        made), marked on the timeline; the weight regularisation joins the loss once per
        step, with micro-batch 0."""
        begun = self._mark(received + keras.tree.flatten(x), f"forward {k}", begin=True)
        flight = self.passes.forward(received, x, y, sample_weight, share,
                                     regularise=k == 0 and self.regularise,
                                     after=[*tensors_in(after), *begun],
                                     recompute=self.recompute)
        self._mark(list(flight.outputs) + ([] if flight.loss is None else [flight.loss]),
                   f"forward {k}", begin=False)
        return flight

    def _backward_pass(self, k: int, flight: InFlight, returned: list[tf.Tensor] | None,
                       apart: bool = False, after: Sequence[Any] = ()
                       ) -> tuple[Any, list[tf.Tensor] | None]:
        """Micro-batch ``k``'s backward pass, marked on the timeline: its weights' gradients
        (with ``apart``, as the :class:`WeightPass` its ``W`` runs) and what goes back to the
        previous stage. A forward pass that kept no activations (recomputation) is computed
        again first, after ``after`` (what the action before this one made): at the
        backward pass's place in the schedule, not as soon as its inputs exist."""
        seed = None if flight.loss is None else self._loss_seed(flight.loss)
        begun = self._mark(list(returned or []) + ([] if seed is None else [seed]),
                           f"backward {k}", begin=True)
        if flight.tape is None:
            flight = self.passes.replay(flight, after=[*begun, *tensors_in(list(after))])
        if apart:
            weight_pass, back = self.passes.backward_apart(flight, returned, seed, after=begun)
            self._mark(back or [], f"backward {k}", begin=False)
            return weight_pass, back
        grads, back = self.passes.backward(flight, returned, seed, after=begun)
        self._mark([g for g in grads + (back or []) if isinstance(g, tf.Tensor)],
                   f"backward {k}", begin=False)
        return grads, back

    def _weight_passes(self, ks: list[int], weight_passes: list[WeightPass], after: list[Any],
                       accumulated: MicroBatchGradients) -> list[Any]:
        """The ``W`` of micro-batches ``ks`` (one after the other in the schedule), after the
        ops ``after`` (the action before them), marked on the timeline, added to
        ``accumulated``: each weight gradient that is a sum over the batch's rows in one op
        over their rows joined (:mod:`tarantella.pipeline.fused_weights`), the others per
        micro-batch. Returns the gradients made."""
        name = f"weight {ks[0]}" if len(ks) == 1 else f"weight {ks[0]}-{ks[-1]}"
        begun = self._mark(tensors_in(after), name, begin=True)
        for weight_pass in weight_passes:
            weight_pass.start_after([*after, *begun])
        gates = [t.op for t in tensors_in([*after, *begun])]
        joined = fused_weights.fused([wp.grads for wp in weight_passes], after=gates)
        made: list[Any] = []
        for n, (k, weight_pass) in enumerate(zip(ks, weight_passes)):
            grads = [(j if n == 0 else None) if j is not None else g
                     for g, j in zip(weight_pass.grads, joined)]
            accumulated.add(k, grads)
            made += [g for g in grads if g is not None]
        self._mark([g for g in made if isinstance(g, tf.Tensor)], name, begin=False)
        return made

    def _defers_weights(self, weight_pass: WeightPass, sizes: Sequence[int], k: int,
                        actions: Sequence[Action]) -> bool:
        """Whether the last stage runs every ``W`` of the step after its last action, as one
        pass over all micro-batches' rows (:mod:`~tarantella.pipeline.fused_weights`),
        instead of where the schedule places them: when that keeps less alive at its peak,
        judged from micro-batch ``k``'s ``W`` (the first).

        Why the last stage: its ``B`` go back as soon as they are made either way, and its
        step ends waiting for the first stage's last ``W``, update and next forward pass
        (the step's boundary): the ``W`` held back fill that wait. Why memory decides:
        joined, the ``W`` hold every micro-batch's inputs (``M h`` bytes, twice while they
        are joined) and make one weight-sized gradient ``G``; in place, they hold those of
        the ``n`` micro-batches the schedule keeps waiting for their ``W`` and add each
        micro-batch's gradient to the sum (two weight-sized tensors at once). Joined when
        ``2 M h + G <= n h + 2 G``: a stage of wide ``Dense`` layers and small micro-batches
        (whose weights, not activations, fill a rank's memory) saves memory by it, and
        ``M - 1`` additions of weight-sized tensors and the small products."""
        if not self.last or self.first or len(sizes) < 2:
            return False
        fp = fused_weights.footprint(weight_pass.grads)
        if fp is None or sizes[k] == 0:
            return False
        per_row = fp.held / sizes[k]
        pending = peak = 0  # the most micro-batches whose B ran and whose W did not
        for action in actions:
            pending += {Op.BACKWARD: 1, Op.WEIGHT: -1}.get(action.op, 0)
            peak = max(peak, pending)
        joined = 2 * per_row * sum(sizes) + fp.made
        in_place = per_row * max(sizes) * peak + 2 * fp.made
        return joined <= in_place

    # -- the gradients to the optimizer -------------------------------------------------------

    def _start_loss_sum(self, total: tf.Tensor) -> None:
        """Graph op in the chain of the step's collectives (after this stage's last forward
        pass, on every stage: the ranks start their collectives in one order): hands this
        stage's part of the loss to the step's ends, which start its sum over the ranks."""
        slot = self._ends

        def run(part: np.ndarray) -> np.int64:
            if slot.current is not None:
                slot.current.loss_part(float(part))
            return np.int64(0)

        with tf.control_dependencies(previous()):
            started = tf.numpy_function(run, [total], tf.int64, stateful=True,
                                        name="tnt_loss_sum_start")
        count(started)  # it reaches the job's channel (the step ends' reductions)
        record([started])

    def _logs(self, batch: int, y: Any, sample_weight: Any, predictions: Any) -> Any:
        """The step's logs: ``log_step`` traced with the loss's sum waited for and, on the
        last stage, the batch's labels, sample weights and outputs."""
        assert self.log_step is not None
        summed = self._loss_sum()
        return self.log_step(StepLog(
            loss=summed, batch=batch, last=self.last, y=y if self.last else None,
            sample_weight=sample_weight if self.last else None, predictions=predictions,
            from_last=lambda values: self._from_last(values, after=summed)))

    def _loss_sum(self) -> tf.Tensor:
        """Graph op: the batch's loss, the sum over the ranks of their parts, waited for
        (started by :meth:`_start_loss_sum`)."""
        slot = self._ends

        def run() -> np.float64:
            assert slot.current is not None, "a step with its ends"
            return np.float64(slot.current.loss())

        summed = tf.numpy_function(run, [], tf.float64, stateful=True, name="tnt_loss_summed")
        count(summed)
        return tf.reshape(summed, [])

    def _from_last(self, values: tf.Tensor, after: tf.Tensor) -> tf.Tensor:
        """Graph op, a collective after ``after`` (the loss's sum): ``values`` (a float64
        vector) as the last stage holds them, on every rank (``StepEnds.from_last``)."""
        slot, last = self._ends, self.last

        def run(mine: np.ndarray) -> np.ndarray:
            assert slot.current is not None, "a step with its ends"
            return slot.current.from_last(mine, last)

        with tf.control_dependencies([*previous(), after]):
            got = tf.numpy_function(run, [values], tf.float64, stateful=True, name="tnt_from_last")
        count(got)
        record([got])
        return tf.reshape(got, tf.shape(values))

    def _check_same_batch(self, fingerprinted: Sequence[Any]) -> None:
        """Graph ops, the first of the chain of the step's messages and collectives: the
        check that every rank read the same batch starts with the checksums of
        ``fingerprinted`` (:func:`~tarantella.pipeline.batch_fingerprint.fingerprint`), and
        the step fails before any message unless it says so (nothing to check without the
        step's ends). A stage's first forward pass does not wait for the check, its first
        message does: by then the other stages have started it."""
        slot = self._ends

        def start(sums: np.ndarray) -> np.int64:
            if slot.current is not None:
                slot.current.start_check(sums)
            return np.int64(0)

        def run() -> np.int64:
            if slot.current is not None and not slot.current.same_batch():
                raise slot.current.refusal()  # the loop raises it again, as itself
            return np.int64(0)

        with tf.control_dependencies(previous()):
            started = tf.numpy_function(start, [fingerprint(list(fingerprinted))], tf.int64,
                                        stateful=True, name="tnt_batch_check_start")
        with tf.control_dependencies([started]):
            checked = tf.numpy_function(run, [], tf.int64, stateful=True, name="tnt_batch_checked")
        count(started, checked)
        record([checked])

    def _optimizer_step(self, accumulated: MicroBatchGradients) -> None:
        """The step's gradients (sparse ones as the batch's rows: :mod:`tarantella.pipeline.batch_gradients`)
        summed over the stage's replicas, agreed on (loss scaling's finiteness,
        ``global_clipnorm``) over the pipeline's stages, and applied."""
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

    def _sum_over_replicas(self, grads: list[Any]) -> list[Any]:
        """The sum of the stage's replicas' gradients, through the one reduction of DATA's
        step: dense ones summed, sparse ones gathered row by row in replica order (the
        order of the batch's shares), as serial Keras' step has them."""
        replicas = self.replicas
        assert replicas is not None
        return reduce_weighted(grads, self.weights, tf.constant(1.0, tf.float64),
                               lambda: replicas, replicas.channel, keep=tf.constant(True),
                               compression=for_fit(replicas.channel.runtime),
                               # a stage's rows are its micro-batches' (shared ones are refused)
                               row_kinds=[RowKind.FROM_BATCH] * len(grads))

    def _sparse_rows(self, x: Any) -> list[Rows | None]:
        """Which weights' gradients are sparse, from the stage's structure: one forward and
        backward pass of the partition with its weight regularisation, traced once and
        never run. Why: the replicas of a stage must agree (a sparse gradient is gathered,
        a dense one summed), and what their own passes give can differ: only one adds the
        regularisation (whose gradient is dense), and one with no sample of a batch makes
        no pass (:mod:`tarantella.pipeline.batch_gradients`)."""
        found: list[Rows | None] = []
        if x is not None:
            x = keras.tree.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t), x)
        rows = 1 if x is None else int(keras.tree.flatten(x)[0].shape[0])

        def probe(x: Any) -> tf.Tensor:
            received = [] if self.first else [
                tf.zeros((rows, *[1 if d is None else int(d) for d in s.shape[1:]]), s.dtype)
                for s in self.parts.received[self.stage]]
            with tf.GradientTape() as tape:
                tape.watch(received)
                emitted = self.passes.run(received, x, training=True)
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
            if self._compiled_update is not None:
                self._compiled_update(grads)
            else:
                self.optimizer.apply(grads, self.weights)

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

    def count_dry_step(self) -> None:
        """What plain Keras' step, traced as a graph (``fit``'s default), does to this
        stage's optimizer when it is called once more after the data ran out (an epoch of
        unknown length ends so): the input fails, but the update's ops that do not wait for
        the data have run (``iterations += 1`` for most optimizers, which Adam's bias
        correction reads; a ``LossScaleOptimizer``'s do wait). Here the same update is
        traced over gradients made from an exhausted iterator's element, so exactly those
        ops run. A pipelined step runs eagerly and would skip them (measured: 3 such epochs
        with Adam, float64, 0.66 relative from plain Keras)."""
        if self._dry_update is None:
            optimizer, weights = self.optimizer, self.weights

            def dry() -> None:
                missing = next(iter(tf.data.Dataset.from_tensors(tf.zeros([], tf.float32)).take(0)))
                optimizer.apply([tf.zeros_like(w) + tf.cast(missing, w.dtype) for w in weights],
                                weights)

            self._dry_update = tf.function(dry, autograph=False)
        try:
            self._dry_update()
        except tf.errors.OutOfRangeError:
            pass  # as Keras' own call: the data-independent ops ran, the rest did not

    def forward(self, x: Any, batch: int, ends: StepEnds | None = None, y: Any = None,
                sample_weight: Any = None) -> float:
        """The model's outputs on ``x`` (a batch of ``batch`` samples), micro-batch by
        micro-batch through the stages, not training: they are left in
        :attr:`predictions` on the last stage. Returns this stage's weight regularisation
        (the stages' sum is what serial ``model.losses`` adds to the loss). One graph per
        batch size, as :meth:`train`. ``ends``: as in :meth:`train`, the batch check starts
        first and is waited for before the first message; this stage's regularisation goes
        to ``ends.loss_part`` at the end (``ends.loss()`` is then the sum). With ``ends``,
        ``log_step`` and no replicas, the last stage adds the loss of ``y`` (and
        ``sample_weight``) to its part and the step's logs are made in the graph, as a
        training step's (:attr:`logs`)."""
        logged = ends is not None and self.log_step is not None and self.replicas is None
        self._ends.current = ends
        try:
            regularisation, predictions, self.logs = self._forward_fn(
                x if self.parts.reads_x(self.stage) else None, batch,
                self.shapes.received(self.stage, x),
                [] if ends is None else ends.fingerprinted, ends is not None,
                y if logged and self.last else None,
                sample_weight if logged and self.last else None, logged)
        finally:
            self._ends.current = None
        self.predictions = predictions if self.last else None
        return float(regularisation)

    def _forward_graph(self, x: Any, batch: int, incoming: Shapes = (),
                       fingerprinted: Sequence[Any] = (), with_ends: bool = False,
                       y: Any = None, sample_weight: Any = None, logged: bool = False
                       ) -> tuple[tf.Tensor, Any, Any]:
        sizes = micro_batch_sizes(batch, self.num_micro_batches)
        xs = split(x, sizes) if self.parts.reads_x(self.stage) else [None] * len(sizes)
        self._tokens = []
        self.messages.begin()
        if with_ends:
            self._check_same_batch(fingerprinted)
        received: dict[int, list[tf.Tensor]] = {}
        emitted: dict[int, list[Any]] = {}
        predictions: list[Any] = []
        for action in self.actions(len(sizes), "forward"):
            k, peer = action.micro_batch, action.peer
            if action.op is Op.RECV_F:
                assert peer is not None
                received[k] = self._receive(self.parts.received[self.stage], sizes[k], peer,
                                            _FORWARD, incoming)
            elif action.op is Op.FORWARD:
                emitted[k] = self.passes.run(received.pop(k, []), xs[k], training=False)
                if self.last:
                    predictions.append(self.parts.outputs(emitted.pop(k)))
            else:
                assert action.op is Op.SEND_F and peer is not None, action
                self._send(emitted.pop(k), peer, _FORWARD)
        done = self.messages.complete(self._tokens)
        losses = self.model.losses if self.regularise else []
        regularisation = tf.add_n([tf.cast(r, tf.float64) for r in losses]) if losses \
            else tf.constant(0.0, tf.float64)
        with tf.control_dependencies([done]):
            regularisation = tf.identity(regularisation)
        joined = concat(predictions) if self.last else None
        part = regularisation
        if logged and self.last:  # the batch's loss, as compile's on the whole outputs
            part = part + tf.cast(self.loss(y, joined, sample_weight=sample_weight), tf.float64)
        if with_ends:
            self._start_loss_sum(part)
        logs = self._logs(batch, y, sample_weight, joined) if logged else None
        return regularisation, joined, logs
