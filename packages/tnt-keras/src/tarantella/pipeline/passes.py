"""A pipeline stage's own compute on one micro-batch: its forward pass, under a gradient
tape, and its backward pass.

Why apart from the step: these know the partition (what it reads, computes and emits:
:mod:`tarantella.pipeline.partition`) and the loss, and nothing of neighbours, schedules or the
optimizer. The stage's step (:class:`tarantella.pipeline.stage.StageStep`) runs them in its
schedule's order, hands them what the neighbours sent and sends what they return, and
accumulates and applies the weights' gradients they give.

A schedule with a separate weight-gradient pass (``W``, :mod:`tarantella.pipeline.schedule`)
gets it from :meth:`StagePasses.backward_apart`: the same one gradient computation as the
whole backward pass, its ops split in two. ``B`` is every op the gradient of the stage's
inputs needs (what the previous stage waits for); ``W`` the ops only the weights' gradients
need, which consume what ``B`` computed (the gradients at each layer's output, the forward
pass's activations) and wait, in the traced step, for the action before ``W`` in the
schedule. Nothing is computed twice, and the weights' gradients are those of the whole
backward pass, bit for bit.

With recomputation (``recompute=True``) the forward pass keeps no activation: it runs
without a tape, and the micro-batch keeps only what it was computed from (:class:`Kept`: the
received tensors, its slice of the batch, and the values its non-trainable variables had,
the Dropout layers' seed states among them). Its backward pass first computes it again
(:meth:`StagePasses.replay`), under a tape and in a ``keras.StatelessScope`` that reads
those variables at the kept values and drops their updates: the same ops on the same values,
so the same masks and activations, and the same gradients, bit for bit, as without
recomputation. It waits for the action before the backward pass in the schedule, else the
dataflow would run it as soon as its inputs exist, when nothing is saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from .. import _keras_compat
from .partition import COMPUTED, Partitioning

__all__ = ["InFlight", "Kept", "StagePasses", "WeightPass", "tensors_in"]


@dataclass
class Kept:
    """What a micro-batch's forward pass is computed again from, when its activations are
    not kept (recomputation): besides the received tensors (:attr:`InFlight.inputs`)."""

    x: Any
    y: Any
    sample_weight: Any
    share: float
    regularise: bool
    #: each non-trainable variable of the partition with the value it had when the forward
    #: pass began (a Dropout's seed state: the masks are drawn again from the same seeds)
    state: list[tuple[keras.Variable, tf.Tensor]]


@dataclass
class InFlight:
    """What micro-batch ``k``'s backward pass needs from its forward pass."""

    #: the forward pass's tape (None: recomputed in the backward pass, from :attr:`kept`)
    tape: tf.GradientTape | None
    #: what the previous stage sent (the gradients of these go back to it)
    inputs: list[tf.Tensor]
    #: what this stage emits: sends on, or on the last stage the model's flat outputs
    outputs: list[tf.Tensor]
    #: the last stage's share of the batch's loss, plus the weight regularisation where
    #: added (None: nothing to differentiate here but what the next stage sends back)
    loss: tf.Tensor | None
    #: the last stage's outputs in the model's output structure (else None)
    predictions: Any = None
    #: with recomputation, what the forward pass is computed again from (else None)
    kept: Kept | None = None


@dataclass
class WeightPass:
    """Micro-batch ``k``'s weight-gradient pass ``W``, made with its ``B``
    (:meth:`StagePasses.backward_apart`)."""

    #: the weights' gradients, as :meth:`StagePasses.backward` gives them
    grads: list[Any]
    #: the first ops of those only the weights' gradients need (their other ops follow
    #: them); empty when nothing waits (executing eagerly; an op with side effects among
    #: them, which the traced function keeps in the order it was made: ``W`` then runs
    #: with ``B``, as without a ``W``)
    first_ops: list[tf.Operation]

    def start_after(self, after: Sequence[Any]) -> None:
        """In the traced step, ``W`` starts after the tensors or ops ``after`` (those of
        the action before it in the schedule; made after ``W``'s ops, which is why the
        wait is added to them now)."""
        gates = [a for a in after if isinstance(a, tf.Operation)]
        gates += [t.op for t in tensors_in([a for a in after if not isinstance(a, tf.Operation)])]
        if self.first_ops and gates:
            _keras_compat.run_after(self.first_ops, gates)


def tensors_in(values: Sequence[Any]) -> list[tf.Tensor]:
    """The tensors of ``values``: tensors, and the parts of ``tf.IndexedSlices``."""
    out: list[tf.Tensor] = []
    for v in values:
        parts = (v.values, v.indices, v.dense_shape) if isinstance(v, tf.IndexedSlices) else (v,)
        out += [t for t in parts if isinstance(t, tf.Tensor)]
    return out


def _weight_only_ops(made: Sequence[tf.Operation], grads: Sequence[Any],
                     back: Sequence[Any]) -> list[tf.Operation]:
    """The first ops of ``W`` among ``made`` (one gradient computation's ops): those the
    weights' gradients ``grads`` need and the input gradients ``back`` do not, whose inputs
    all come from elsewhere (``B``, the forward pass)."""
    mine = set(made)

    def reach(tensors: list[tf.Tensor]) -> set[tf.Operation]:
        seen: set[tf.Operation] = set()
        stack = [t.op for t in tensors if t.op in mine]
        while stack:
            op = stack.pop()
            if op not in seen:
                seen.add(op)
                stack += [t.op for t in op.inputs if t.op in mine]
                stack += [c for c in op.control_inputs if c in mine]
        return seen

    weight_only = reach(tensors_in(grads)) - reach(tensors_in(back))
    if any(op.op_def.is_stateful for op in weight_only):
        return []
    return [op for op in made if op in weight_only
            and not any(t.op in weight_only for t in op.inputs)
            and not any(c in weight_only for c in op.control_inputs)]


class StagePasses:
    """Partition ``stage`` of ``parts`` over one micro-batch at a time.

    :param loss: a ``keras.losses.Loss`` over the model's outputs (the last stage's).
    """

    def __init__(self, parts: Partitioning, stage: int, loss: Any) -> None:
        self.parts, self.stage = parts, stage
        self.model = parts.models[stage]
        self.loss = loss
        self.first, self.last = stage == 0, stage == parts.num_partitions - 1
        self.weights = list(self.model.trainable_weights)

    def run(self, received: list[tf.Tensor], x: Any, training: bool) -> list[Any]:
        """The partition on one micro-batch: what it emits, from its own inputs in
        ``received`` and ``x``."""
        computed = self.model(self.parts.feed(self.stage, received, x), training=training)
        return self.parts.emitted(self.stage, received, computed)

    def forward(self, received: list[tf.Tensor], x: Any, y: Any, sample_weight: Any,
                share: float, regularise: bool, after: Sequence[tf.Tensor] = (),
                recompute: bool = False) -> InFlight:
        """The forward pass of one micro-batch, recorded for its backward pass (after the
        ops ``after``). On the last stage the loss is the micro-batch's mean times its
        ``share`` of the batch (:func:`tarantella.pipeline.micro_batches.shares`); ``regularise``
        adds the partition's weight regularisation (once per step). With ``recompute``
        nothing is recorded: the backward pass computes it again (:meth:`replay`)."""
        if recompute:
            with tf.control_dependencies(list(after)):
                # read before the pass updates them (traced functions order a variable's
                # reads and writes as traced)
                state = [(v, tf.identity(v.value)) for v in self.model.non_trainable_variables]
            emitted, loss, predictions = self._compute(received, x, y, sample_weight, share,
                                                       regularise, after=after)
            kept = Kept(x, y, sample_weight, share, regularise, state)
            return InFlight(None, received, emitted, loss, predictions, kept)
        with tf.GradientTape() as tape:
            tape.watch(received)
            emitted, loss, predictions = self._compute(received, x, y, sample_weight, share,
                                                       regularise, after=after)
        return InFlight(tape, received, emitted, loss, predictions)

    def replay(self, flight: InFlight, after: Sequence[tf.Tensor] = ()) -> InFlight:
        """The forward pass of a micro-batch whose activations were not kept, computed
        again under a tape, after the ops ``after``: from the same inputs, with the
        non-trainable variables at the values they had in the first pass, whose updates
        (a seed state's step) are dropped, as they happened then."""
        kept = flight.kept
        assert kept is not None, "replay() is for a forward pass made with recompute=True"
        with tf.GradientTape() as tape:
            tape.watch(flight.inputs)
            emitted, loss, predictions = self._compute(
                flight.inputs, kept.x, kept.y, kept.sample_weight, kept.share, kept.regularise,
                kept.state, after=after)
        return InFlight(tape, flight.inputs, emitted, loss, predictions)

    def _compute(self, received: list[tf.Tensor], x: Any, y: Any, sample_weight: Any,
                 share: float, regularise: bool,
                 state: list[tuple[keras.Variable, tf.Tensor]] | None = None,
                 after: Sequence[tf.Tensor] = ()) -> tuple[list[Any], tf.Tensor | None, Any]:
        """The partition, its loss (last stage) and regularisation on one micro-batch:
        ``(emitted, loss, predictions)``, the partition's own ops after the ops ``after``;
        with ``state``, its variables read from it and left unchanged (a
        ``keras.StatelessScope``)."""
        scope = contextlib.nullcontext() if state is None else \
            keras.StatelessScope(state_mapping=state, initialize_variables=False)
        with scope:
            # only the partition's own ops wait for ``after``: the loss below may make its
            # metrics' variables in the step's first trace, and TensorFlow lifts their
            # initialisers out of the graph and runs them with whatever they wait for (a
            # receive would then take a micro-batch's message before the step runs)
            with tf.control_dependencies(list(after)):
                emitted = self.run(received, x, training=True)
            loss = predictions = None
            if self.last:
                predictions = self.parts.outputs(emitted)
                loss = self.loss(y, predictions, sample_weight=sample_weight) * share
        # outside the scope: Keras reads a regularised weight from the scope's mapping there
        if regularise and self.model.losses:
            # in the loss's dtype (float64 models: float64)
            dtype = tf.float64 if loss is None else loss.dtype
            regularisation = tf.add_n([tf.cast(r, dtype) for r in self.model.losses])
            loss = regularisation if loss is None else loss + regularisation
        return emitted, loss, predictions

    def backward(self, flight: InFlight, returned: Sequence[tf.Tensor] | None,
                 loss_seed: tf.Tensor | None, after: Sequence[tf.Tensor] = ()
                 ) -> tuple[list[Any], list[tf.Tensor] | None]:
        """The backward pass of one micro-batch (after the ops ``after``): from the
        gradients the next stage ``returned`` for what this stage sent it (one per tensor;
        None on the last stage) and, where the forward pass made a loss, from ``loss_seed``
        at the loss. Returns the weights' gradients as the tape gives them (a tensor, or
        ``tf.IndexedSlices`` for a gathered weight) and the gradients of the received
        inputs, to send back (None on the first stage); a tensor that passed through this
        stage unchanged has its gradient passed straight back."""
        targets: list[Any] = []
        seeds: list[Any] = []
        through: dict[int, Any] = {}  # received index -> the gradient sent straight back
        if not self.last:
            assert returned is not None, "a stage before the last needs the gradients sent back"
            for (kind, i), sent, grad in zip(self.parts.emits[self.stage], flight.outputs, returned):
                if kind == COMPUTED:
                    targets.append(sent)
                    seeds.append(grad)
                else:
                    through[i] = grad
        if flight.loss is not None:
            targets.append(flight.loss)
            seeds.append(loss_seed)
        sources = self.weights + list(flight.inputs)
        assert flight.tape is not None, "a forward pass made with recompute=True: replay() it first"
        with tf.control_dependencies(list(after)):
            grads = flight.tape.gradient(targets, sources, output_gradients=seeds,
                                         unconnected_gradients=tf.UnconnectedGradients.ZERO) \
                if targets else [tf.zeros_like(s) for s in sources]
        back = None
        if not self.first:
            back = list(grads[len(self.weights):])
            for i, grad in through.items():
                back[i] = back[i] + tf.cast(grad, back[i].dtype)
        return list(grads[:len(self.weights)]), back

    def backward_apart(self, flight: InFlight, returned: Sequence[tf.Tensor] | None,
                       loss_seed: tf.Tensor | None, after: Sequence[tf.Tensor] = ()
                       ) -> tuple[WeightPass, list[tf.Tensor] | None]:
        """:meth:`backward` as ``B``, with the weights' gradients as a :class:`WeightPass`
        apart (see the module doc): the input gradients to send back come without waiting
        for the weights' gradients."""
        if tf.executing_eagerly():
            grads, back = self.backward(flight, returned, loss_seed, after)
            return WeightPass(grads, []), back
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        grads, back = self.backward(flight, returned, loss_seed, after)
        made = graph.get_operations()[before:]
        return WeightPass(grads, _weight_only_ops(made, grads, back or [])), back

