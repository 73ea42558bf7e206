"""The distributed step around Keras' own (or the user's) ``train_step``/``test_step``/
``predict_step``.

``tnt.Model`` does not copy Keras' steps; it runs them, on this rank's micro-batch, and adds
what data parallelism needs at three public seams of Keras 3:

* ``optimizer.apply`` (which ``apply_gradients`` calls): while a step is traced, every
  optimizer of the model reduces the gradients it is given across ranks before it applies
  them (``tarantella.comm.gradients``). Clipping, loss scaling (its skip decision is then the
  same on every rank), gradient accumulation and EMA all see the serial gradient.
* ``compute_loss``: records the loss and its global normaliser (``tarantella.data_parallel.losses``);
  the terms the layers add with ``add_loss`` while the step is traced are recorded for it
  (a sum over the batch counts once per rank, see ``tarantella.data_parallel.losses.summed_terms``).
* the metric states: zeroed before the step, summed across ranks after it and added back
  (``tarantella.data_parallel.metrics``), so ``result()`` is the serial value. Logs a custom step returns
  that are not metric results are averaged over the global batch (weighted by samples).

A step is traced once; the context of the trace (:class:`StepContext`) lives only while
Keras traces it, so nothing of this stays on the model or optimizer between steps.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from .._keras_compat import all_layers
from ..comm import record
from ..comm.compression import Compression, for_fit, travels_as_is
from ..comm.gradients import reduce_weighted
from ..comm.graph_ops import allreduce_sum, gather_rows
from ..errors import DatasetError, NotSupportedError
from ..seams.overrides import instance_attributes
from .batchnorm import global_moments
from .compiled_update import CompiledUpdate
from .losses import Normaliser, per_sample, summed_terms
from .metrics import MetricCalls, MetricStates

__all__ = ["BATCH_KEY", "INFO_KEY", "LocalIncrements", "StepContext", "current_step",
           "gradient_factor", "model_optimizers", "pack", "predict_step", "reduce_gradients",
           "remaining_factor", "SeveralUpdates", "test_step", "tracing", "train_step", "unpack"]

#: keys of the elements tarantella's datasets yield: the micro-batch and ``[n, b]``
BATCH_KEY = "tnt_micro_batch"
INFO_KEY = "tnt_batch_info"

_active = threading.local()


def pack(batch: Any, info: tf.Tensor) -> dict[str, Any]:
    """One element of a distributed dataset: this rank's micro-batch and ``[n, b]``."""
    return {BATCH_KEY: batch, INFO_KEY: info}


def _is_packed(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == {BATCH_KEY, INFO_KEY}


def _packed(data: Any) -> Any:
    """The element of a distributed dataset in what Keras hands a step (``*_on_batch`` wrap
    it as ``(element, None, None)``), or None."""
    if isinstance(data, tuple) and data and _is_packed(data[0]) and all(d is None for d in data[1:]):
        data = data[0]
    return data if _is_packed(data) else None


def undistributed(method: str) -> DatasetError:
    """The error of a step that was handed data tarantella did not distribute."""
    return DatasetError(
        f"{method}() of a tnt.Model was given data that tarantella did not distribute (was it "
        "called directly?): call fit/evaluate/predict or train_on_batch/test_on_batch/"
        "predict_on_batch on the tnt.Model, which run the step on each rank's part of the "
        "global batch"
    )


def is_distributed(data: Any) -> bool:
    """Whether a step was handed data tarantella distributed."""
    return _packed(data) is not None


def unpack(data: Any) -> tuple[Any, tf.Tensor, tf.Tensor]:
    """``(micro_batch, n, b)`` from what Keras hands a step: an element of a distributed
    dataset, or the ``(x, y, sample_weight)`` / ``(x,)`` of ``*_on_batch`` around one."""
    data = _packed(data)
    if data is None:
        raise undistributed("the step")
    info = data[INFO_KEY]
    return data[BATCH_KEY], info[0], info[1]


class LocalIncrements:
    """This rank's own metric increments since the metrics were reset (rank-local logs of
    callbacks wrapped with ``aggregate_logs=False``).

    Only a step traced while ``enabled`` records them (the others keep the native path,
    with no Python in the step), so ``traced`` says how the step Keras holds was traced:
    a loop that wants them from a step traced without them must have the step traced anew
    (``tarantella.callbacks``)."""

    def __init__(self) -> None:
        self.enabled = False
        #: ``enabled`` when the step function was last traced; None: not traced yet
        self.traced: bool | None = None
        self.total: np.ndarray | None = None

    def reset(self) -> None:
        self.total = None

    def add(self, vector: np.ndarray, size: int) -> None:
        if not self.enabled:
            return
        part = np.array(vector[:size], dtype=np.float64, copy=True)
        if self.total is None or self.total.shape != part.shape:
            self.total = part
        else:
            self.total += part


class SeveralUpdates(Exception):
    """Raised while an elastic job's step is traced: it applies updates more than once, so
    they cannot wait for its last collective; the loop traces it again applying at once."""


class StepContext:
    """What one trace of a distributed step knows (lives while Keras traces the step)."""

    def __init__(self, model: keras.Model, kind: str, n: tf.Tensor, b: tf.Tensor) -> None:
        self.model = model
        self.kind = kind
        self.n = n
        self.b = b
        self.has_data = n > 0
        #: set by compute_loss: this rank's loss, what compute_loss returned (the same value;
        #: in a train step its gradient is weighed, see losses.weigh_backward), normaliser
        self.loss: tf.Tensor | None = None
        self.returned_loss: tf.Tensor | None = None
        self.normaliser: Normaliser | None = None
        self.applies = 0
        #: True once compute_loss weighted the loss itself: the gradients are then summed
        self.prescaled = False
        #: the model has synchronized BatchNormalization layers: no overlap (see batchnorm)
        self.sync_bn = False
        #: the step's body is being traced into an XLA function (``tarantella.data_parallel.xla``): no
        #: collective may be traced, the gradient factor's global part comes after it
        self.compiled = False
        #: (inner, outer) leaves of the outputs of an XLA body: what it returned as the body's
        #: trace had them, and as this (outer) trace has them
        self.compiled_outputs: list[tuple[Any, Any]] = []
        #: the micro-batch's tensors in this trace, and the (layer, term) added with add_loss
        self.batch: list[Any] = []
        self.added_losses: list[tuple[keras.layers.Layer, Any]] = []
        #: in an elastic job, the optimizers' updates, run after the step's last collective
        #: (:meth:`after_collectives`); None: at once
        self.pending: list[Callable[[], Any]] | None = None
        #: nothing to combine across ranks (:func:`alone`): Keras' step runs as it is
        self.alone = False

    def after_collectives(self, update: Callable[[], Any]) -> Any:
        """Run ``update`` (an optimizer's apply) now, or, in an elastic job, once the step's
        last collective has finished: a step a failed collective ends is then applied on no
        rank or whole (``tarantella.data_parallel.elastic``)."""
        if self.pending is None:
            return update()
        if self.pending:  # a second update may be read by what the step traces next (a GAN)
            raise SeveralUpdates()
        self.pending.append(update)
        return None



    def weights(self) -> Normaliser:
        return self.normaliser if self.normaliser is not None else per_sample(self.n, self.b)


def current_step() -> StepContext | None:
    """The step being traced on this thread, if any."""
    return getattr(_active, "step", None)


@contextlib.contextmanager
def tracing(step: StepContext) -> Iterator[StepContext]:
    """Make ``step`` the step being traced on this thread (what ``compute_loss`` sees)."""
    outer = current_step()
    _active.step = step
    try:
        yield step
    finally:
        _active.step = outer


# -- optimizers ------------------------------------------------------------------------------


def model_optimizers(model: keras.Model) -> list[keras.optimizers.Optimizer]:
    """The optimizers a step may apply: ``model.optimizer`` and every optimizer the model
    holds as an attribute (a GAN's ``d_optimizer``/``g_optimizer``)."""
    found: dict[int, keras.optimizers.Optimizer] = {}
    candidates = [getattr(model, "optimizer", None), *vars(model).values()]
    for value in candidates:
        if isinstance(value, keras.optimizers.Optimizer):
            found.setdefault(id(value), value)
    return list(found.values())


def reduce_gradients(step: StepContext, optimizer: keras.optimizers.Optimizer, grads: list[Any],
                     variables: list[Any] | None, factor: tf.Tensor,
                     state: Any) -> tuple[list[Any], Any]:
    """Graph ops: ``sum_r factor_r g_r`` for the gradients one ``optimizer.apply`` call is
    given (None where a variable has none), in the order the step issues its collectives;
    returns them with the reducer (its timeline marks; None when there was no gradient)."""
    if all(g is None for g in grads):
        return list(grads), None
    reducer = state.gradient_reducer(f"{step.kind}_{optimizer.name}_{step.applies}")
    step.applies += 1

    def sync_bn_first(dense: list[tf.Tensor]) -> list[tf.Tensor]:
        # the backward pass's collectives (chained before) first, no overlap with them
        return dense if step.sync_bn else []

    out = reduce_weighted(grads, variables, factor, lambda: reducer, state.channel,
                          keep=step.has_data, dense_after=sync_bn_first,
                          compression=step_compression(optimizer, state.runtime))
    return out, reducer


def step_compression(optimizer: keras.optimizers.Optimizer, runtime: tnt_core.Runtime) -> Compression:
    """How the step's gradients for ``optimizer`` travel: as its Horovod compressor says
    (``hvd.DistributedOptimizer(..., compression=)`` compiled into the model), else as
    ``TNT_GRADIENT_COMPRESSION`` says."""
    reduction = getattr(optimizer, "_tnt_reduction", None)
    own = getattr(reduction, "compression", None)
    if own is not None and not travels_as_is(own):
        return own
    return for_fit(runtime)


def _reducing_apply(step: StepContext, optimizer: keras.optimizers.Optimizer,
                    apply: Callable[..., Any], state: Any) -> Callable[..., Any]:
    def reduced_apply(grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        variables = None if trainable_variables is None else list(trainable_variables)
        if all(g is None for g in grads):
            return apply(grads, trainable_variables)
        if step.alone:  # one rank's gradients are the serial ones
            out, reducer = grads, None
        else:
            factor = (tf.constant(1.0, tf.float64) if step.prescaled
                      else gradient_factor(step, state))
            out, reducer = reduce_gradients(step, optimizer, grads, variables, factor, state)

        def update() -> Any:
            if state.xla is not None and state.xla.overlap:  # clustered: one XLA function
                result = state.xla.update(optimizer, variables, apply, out)
            elif state.compiled_update and not state.update_as_ops:
                result = CompiledUpdate(optimizer, variables, apply=apply)(out)
            else:
                result = apply(out, trainable_variables)
            if reducer is not None and reducer.timeline is not None and variables:
                reducer.mark_optimizer_done([tf.convert_to_tensor(optimizer.iterations)])
            return result

        return step.after_collectives(update)

    return reduced_apply


def gradient_factor(step: StepContext, state: Any) -> tf.Tensor:
    """This rank's weight of its loss or gradient: ``scale_r / sum_r divisor_r``
    (``scale_r`` for a summed loss), 0 without a sample. The sum is known for a mean loss of
    distributed data (the global batch size); otherwise one small allreduce finds it.

    In a body compiled with XLA (``step.compiled``) no collective may run: there it is the
    part known locally (the whole factor when the global batch size is known, else 1), and
    :func:`remaining_factor`, after the body, gives the rest."""
    weights = step.weights()
    scale = tf.where(step.has_data, weights.scale, tf.zeros_like(weights.scale))
    if not weights.divide:
        return scale
    if step.compiled:
        if weights.total is None:
            return tf.ones_like(scale)
        known = weights.total
        return tf.where(known >= 0, scale / tf.maximum(known, 1e-300), tf.ones_like(scale))
    divisor = tf.where(step.has_data, weights.divisor, tf.zeros_like(weights.divisor))

    def summed() -> tf.Tensor:
        return allreduce_sum(tf.reshape(divisor, [1]), state.channel,
                             name=f"tnt_{step.kind}_loss_normaliser")[0]

    if weights.total is None:
        total = summed()
    else:  # the global batch size; -1 for data the user distributed: then sum
        known = weights.total
        total = tf.cond(known >= 0, lambda: known, summed)
    record([total])  # computed in a branch: the chain goes on from the cond's output
    return scale / tf.maximum(total, 1e-300)


def remaining_factor(step: StepContext, state: Any) -> tf.Tensor:
    """What :func:`gradient_factor` left for after a compiled body that weighed its loss by
    the local part: 1 when that was the whole factor, else ``scale_r / sum_r divisor_r``
    (one small allreduce)."""
    weights = step.weights()
    one = tf.constant(1.0, tf.float64)
    if not weights.divide:
        return one
    whole = gradient_factor(step, state)  # step.compiled is False here: the global sum
    if weights.total is None:
        return whole
    return tf.where(weights.total >= 0, one, whole)


def _reducing_gradients(model: keras.Model, step: StepContext,
                        state: Any) -> contextlib.AbstractContextManager[None]:
    """While the step is traced, the model's optimizers reduce what they apply."""
    return instance_attributes([(opt, "apply", _reducing_apply(step, opt, opt.apply, state))
                                for opt in model_optimizers(model)])


def _clustered(state: Any) -> contextlib.AbstractContextManager[Any]:
    """While a train step is traced with ``jit_compile`` on, XLA clusters its computation
    between the collectives (``tarantella.data_parallel.xla``)."""
    return contextlib.nullcontext() if state.xla is None else state.xla.clusters()


# -- losses added by layers ----------------------------------------------------------------


def _recording_added_losses(model: keras.Model,
                            step: StepContext) -> contextlib.AbstractContextManager[None]:
    """While the step is traced, what the model and its layers add with ``add_loss`` is
    recorded in the step being traced (an XLA body's own context included)."""

    def recording(layer: keras.layers.Layer) -> Callable[[Any], Any]:
        add = layer.add_loss

        def add_loss(loss: Any) -> Any:
            (current_step() or step).added_losses.extend(
                (layer, term) for term in keras.tree.flatten(loss))
            return add(loss)

        return add_loss

    layers = [model, *all_layers(model)]
    return instance_attributes([(layer, "add_loss", recording(layer)) for layer in layers])


def _check_added_losses(step: StepContext) -> None:
    """A step whose loss compute_loss did not make (a custom step's own) cannot count a sum
    added with ``add_loss`` once per rank: refused, as a term that is no mean or sum is."""
    if step.loss is not None or step.kind != "train":
        return
    for layer, term in step.added_losses:
        if not summed_terms([(layer, term)], step.batch):
            continue
        raise NotSupportedError(
            f"layer {layer.name!r} adds a sum over the batch with add_loss(), and the train "
            "step computes its loss without compute_loss(): tarantella weighs that loss as a "
            "mean over the samples. Call self.compute_loss(...) in train_step, or divide the "
            "term by the batch size"
        )


# -- the steps -------------------------------------------------------------------------------


@contextlib.contextmanager
def _recording(model: keras.Model, step: StepContext, calls: MetricCalls) -> Iterator[None]:
    """While Keras' step is traced: ``step`` is the current step, and what the step does with
    the metrics and what the layers add with ``add_loss`` are recorded for it."""
    with tracing(step), calls.recording(), _recording_added_losses(model, step):
        yield


def alone(state: Any, kind: str) -> bool:
    """Whether a step traced now has nothing to combine across ranks: one rank, not in an
    elastic job (which may grow, and applies its updates after its last collective), with no
    XLA body split around collectives, no rank-local logs and no timeline recorded (its
    spans are the reduction's marks). A change of any of these traces the step again."""
    return (state.channel.size == 1 and getattr(state, "elastic", None) is None
            and state.xla is None and not state.local_increments(kind).enabled
            and not state.runtime.config.timeline)


def _run_alone(model: keras.Model, step: StepContext, batch: Any, run: Callable[[Any], Any],
               state: Any) -> Any:
    """Keras' step as it is, on the one rank's batch (the global batch): no metric state is
    zeroed and summed, no loss or gradient weighed, so the graph is plain Keras' (with the
    compiled update). Why: those sums over one rank were 150 of the 249 nodes of the
    benchmark MLP's step and 0.04-0.08 ms of its 1.9 ms of CPU. What more ranks would
    refuse is refused here too (the metrics' writes, the losses added with ``add_loss``,
    the logs), so a script behaves alike on every world size."""
    calls = MetricCalls(model.metrics, model.metrics_variables, lambda: step.returned_loss)
    with _recording(model, step, calls):
        if step.kind == "train":
            with _reducing_gradients(model, step, state):
                logs = run(batch)
        else:
            logs = run(batch)
    _check_added_losses(step)
    _averaged_logs(model, step, calls, logs)  # for its refusals: the logs pass as they are
    state.local_increments(step.kind).traced = False
    return logs


def _run_step(model: keras.Model, kind: str, data: Any, run: Callable[[Any], Any],
              state: Any) -> Any:
    batch, n, b = unpack(data)
    step = StepContext(model, kind, n, b)
    step.batch = keras.tree.flatten(batch)
    step.alone = alone(state, kind)
    if step.alone:
        return _run_alone(model, step, batch, run, state)
    if getattr(state, "elastic", None) is not None and state.elastic.defer_updates:
        step.pending = []
    variables = model.metrics_variables
    states = MetricStates(variables)
    # the loss compute_loss returned in the trace being recorded (an XLA body's own context)
    calls = MetricCalls(model.metrics, variables,
                        lambda: (current_step() or step).returned_loss)
    # Only once the batch exists: when the input runs out (a dataset of unknown length), the
    # step stops at fetching it and the metric states must still hold the epoch's values.
    with tf.control_dependencies([n]):
        before = states.begin()
        kept = [(v, tf.identity(tf.convert_to_tensor(v))) for v in model.non_trainable_variables]
    with _recording(model, step, calls):
        # XLA (tarantella.data_parallel.xla): the body compiled, the collectives around it; None when this
        # step cannot be split so
        logs = None if state.xla is None else state.xla.run(step, batch, run, state)
        if logs is None and kind == "train":
            step.sync_bn = bool(state.synchronized_bn)
            with _reducing_gradients(model, step, state), \
                    global_moments(state.synchronized_bn, step, state.channel), \
                    _clustered(state):
                logs = run(batch)
        elif logs is None:
            logs = run(batch)
    _check_added_losses(step)
    for inner, outer in step.compiled_outputs:  # an XLA body's logs, as the outer trace has them
        calls.alias(outer, inner)
    # a stand-in sample (n == 0) must not move e.g. BatchNorm statistics or the RNG
    for v, old in kept:
        v.assign(tf.where(step.has_data, tf.convert_to_tensor(v), old))
    return _reduce_logs(model, step, states, calls, before, logs, state)


class _Parts:
    """The pieces of the one float64 vector a step sums over ranks, and where each lands."""

    def __init__(self) -> None:
        self.parts: list[tf.Tensor] = []
        self.size = 0

    def add(self, t: tf.Tensor) -> slice:
        t = tf.reshape(t, [-1])
        count = int(t.shape[0])
        self.parts.append(t)
        self.size += count
        return slice(self.size - count, self.size)


def _averaged(leaf: Any) -> bool:
    """Whether a log leaf is a number to average over the global batch (a numeric or bool
    tensor); anything else (strings, None, Python values) is passed on as Keras would."""
    return tf.is_tensor(leaf) and leaf.dtype != tf.string


def _returned_scalar(step: StepContext) -> tf.Tensor | None:
    """The scalar loss compute_loss returned: a log of it is the global batch's loss."""
    return step.returned_loss if getattr(step.returned_loss, "shape", None) == () else None


def _averaged_logs(model: keras.Model, step: StepContext, calls: MetricCalls,
                   logs: Any) -> tuple[list[tuple[Any, Any]], list[tuple[int, tf.Tensor]]]:
    """The step's logs flattened with their paths, and (position, leaf) of the leaves to
    average over the global batch (neither a metric's result nor the loss); refuses logs
    that are not a dict and leaves without a static shape."""
    if not isinstance(logs, Mapping):
        raise tnt_core.TntError(
            f"{type(model).__name__}.{step.kind}_step returned {type(logs).__name__}; "
            "tarantella needs a dict of logs, as Keras' fit/evaluate do"
        )
    flat = keras.tree.flatten_with_path(logs)
    returned = _returned_scalar(step)
    averaged = []
    for i, (path, leaf) in enumerate(flat):
        if not _averaged(leaf) or calls.result_of(leaf) is not None or leaf is returned:
            continue
        if not leaf.shape.is_fully_defined():
            raise tnt_core.TntError(f"log {'/'.join(map(str, path))!r} of the {step.kind} step "
                                    "has no static shape")
        averaged.append((i, leaf))
    return flat, averaged


def _reduce_logs(model: keras.Model, step: StepContext, states: MetricStates, calls: MetricCalls,
                 before: list, logs: Any, state: Any) -> Any:
    """Sum the metric states (and average the other logs) over ranks; the serial logs.

    ``logs`` may be any nest Keras accepts from a step (a dict at the top; dicts, lists and
    tuples inside): a leaf a metric's ``result()`` gave becomes that metric's serial result,
    the loss ``compute_loss`` returned becomes the global batch's loss, other numeric leaves
    are averaged over the global batch (weighted by samples), the rest is passed on."""
    flat, averaged_leaves = _averaged_logs(model, step, calls, logs)
    has_data = tf.cast(step.has_data, tf.float64)
    increments = states.increments() * has_data
    size = int(increments.shape[0])
    returned = _returned_scalar(step)
    per_step = calls.per_step_slots()
    loss_slots = calls.loss_slots()
    n64 = tf.cast(step.n, tf.float64) * has_data
    vector = _Parts()
    vector.add(increments)
    at_samples = vector.add(n64)
    # per-step values: each rank's share of the global batch's value (metrics.MetricCalls)
    at_per_step = vector.add(tf.gather(increments, per_step) * n64) if per_step else None
    averaged = {i: vector.add(tf.cast(leaf, tf.float64) * n64) for i, leaf in averaged_leaves}
    weights = step.weights()
    needs_loss = returned is not None and (
        bool(loss_slots) or any(leaf is returned for _, leaf in flat))
    if needs_loss:  # the global batch's loss, from each rank's own (see tarantella.data_parallel.losses)
        own = tf.reshape(tf.cast(step.loss, tf.float64), [-1])
        own = tf.reduce_sum(own) / tf.cast(tf.size(own), tf.float64)
        at_loss = vector.add(weights.scale * has_data * own)
        at_divisor = vector.add(weights.divisor * has_data)
    local = state.local_increments(step.kind)
    local.traced = local.enabled
    total = allreduce_sum(tf.concat(vector.parts, axis=0), state.channel,
                          name=f"tnt_{step.kind}_metrics",
                          local=(lambda v: local.add(v, size)) if local.enabled else None)
    if step.pending:  # elastic: the updates once the last collective has finished
        with tf.control_dependencies([total]), _clustered(state):
            for update in step.pending:
                update()
    summed = total[:size]
    samples = tf.maximum(total[at_samples][0], 1.0)
    if at_per_step is not None:  # the global batch's value, with weight 1 per update
        summed = tf.tensor_scatter_nd_update(summed, [[i] for i in per_step],
                                             total[at_per_step] / samples)
    batch_loss = None
    if needs_loss:
        loss_sum, divisor_sum = total[at_loss][0], total[at_divisor][0]
        batch_loss = loss_sum / divisor_sum if weights.divide else loss_sum
        for at_total, at_count in loss_slots:  # the serial loss times the (serial) count
            summed = tf.tensor_scatter_nd_update(summed, [[at_total]],
                                                 [batch_loss * summed[at_count]])
    if states:
        states.end(before, summed)
    out = []
    for i, (_path, leaf) in enumerate(flat):
        source = calls.result_of(leaf) if tf.is_tensor(leaf) else None
        if source is not None:  # the metric's result, now of the summed states
            metric, where = source
            value = metric.result()
            for key in where:
                value = value[key]
            out.append(value)
        elif batch_loss is not None and returned is not None and leaf is returned:
            out.append(tf.cast(batch_loss, returned.dtype))
        elif i in averaged:
            value = total[averaged[i]] / samples
            out.append(tf.cast(tf.reshape(value, leaf.shape), leaf.dtype))
        else:
            out.append(leaf)
    return keras.tree.pack_sequence_as(logs, out)


def train_step(model: keras.Model, data: Any, run: Callable[[Any], Any], state: Any) -> Any:
    """The distributed train step: ``run`` is Keras' (or the user's) ``train_step``."""
    return _run_step(model, "train", data, run, state)


def test_step(model: keras.Model, data: Any, run: Callable[[Any], Any], state: Any) -> Any:
    """The distributed test step (metric states summed across ranks)."""
    return _run_step(model, "test", data, run, state)


def predict_step(model: keras.Model, data: Any, run: Callable[[Any], Any], state: Any) -> Any:
    """The distributed predict step: this rank's predictions, gathered in global order."""
    batch, n, b = unpack(data)
    step = StepContext(model, "predict", n, b)
    with tracing(step):
        y_pred = None if state.xla is None else state.xla.run(step, batch, run, state)
        if y_pred is None:
            y_pred = run(batch)
    flat = keras.tree.flatten(y_pred)
    gathered = gather_rows(flat, n, b, state.channel)
    return keras.tree.pack_sequence_as(y_pred, gathered)
