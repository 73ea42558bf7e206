"""Metric states reduced across ranks, so logs equal the serial ones.

Averaging per-rank metric *values* is wrong as soon as micro-batches differ in size (and for
any metric that is not a mean, such as AUC or precision). Keras metrics keep additive
*states* (totals and counts, confusion-matrix cells, ...); the serial state after a step is
the state before it plus the increment of the whole global batch, which is the sum of the
ranks' increments. So each step:

1. remembers the states and sets them to zero (:meth:`MetricStates.begin`),
2. lets Keras update them with this rank's micro-batch: they now hold this rank's increment
   exactly as Keras computes it (:meth:`MetricStates.increments`),
3. sums the increments over ranks (in the same fused allreduce as the gradients) and stores
   ``before + sum`` (:meth:`MetricStates.end`).

Every rank then holds the serial states, so ``result()`` — what the progress bar, the
callbacks, ``History`` and ``evaluate`` read — equals the serial value (up to float
round-off of the summation order). Requirement on custom metrics: their states must be
additive over samples (sums and counts), as all built-in Keras metrics are.

What a step's own code does with the metrics is recorded while Keras traces it
(:class:`MetricCalls`), for three things the states alone do not tell:

* **Which logs are metric results.** A step returns what ``result()`` gave it, in any nest
  (``{m.name: m.result() for m in self.metrics}`` nests the compiled metrics' dict); those
  leaves, found by identity, become the results of the summed states.
* **Per-step values.** A ``Mean`` (or ``Sum``) given one scalar per call without a weight is
  not additive over samples: Keras' own per-output loss trackers in a traced step (their
  weight, the static batch size, is unknown there: 1) and the trackers of the guides' custom
  steps (``tracker.update_state(loss)``). Serial Keras adds the *global* batch's value with
  weight 1, so the step replaces their increments by that value: the ranks' values weighed
  by their shares of the global batch, the rule for every per-step value of a custom step.
  A scalar given *with* a weight (Keras' loss tracker passes the batch size) stays
  additive: the ranks' weights add up to the global batch's.
* **The loss.** A ``Mean`` given the loss ``compute_loss`` returned gets, as its total, the
  serial loss of the global batch times its count: the global batch's loss weighs each
  rank's by its loss normaliser (``tarantella.data_parallel.losses``: valid tokens under a mask, the sum
  of the sample weights, ...), which need not be its share of the samples.
* **States that are not additive.** An ``update_state`` that sets a state to anything but
  the state plus an increment (a maximum, a ratio recomputed from other states) would give
  another number than serial Keras once increments are summed; the writes its trace made
  are read (:func:`check_additive`) and such a metric is refused, naming the state. So is
  an increment that pairs every sample with every other (``(n, 1) == (n,)`` broadcast to
  ``(n, n)``, ``tarantella.data_parallel.batch_scaling.pairing``): its ranks' parts miss the pairs
  across ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from ..errors import NotSupportedError
from ..seams.overrides import instance_attributes
from .batch_scaling import pairing

__all__ = ["MetricCalls", "MetricStates", "check_additive"]

_ACC = tf.float64  # increments are summed in float64: exact for counts, no extra round-off


class MetricStates:
    """The state variables of a model's metrics, handled as one float64 vector."""

    def __init__(self, variables: Sequence) -> None:
        self.variables = list(variables)

    def __bool__(self) -> bool:
        return bool(self.variables)

    def begin(self) -> list[tf.Tensor]:
        """Read the states, then zero them; returns the values read."""
        before = [tf.identity(tf.convert_to_tensor(v)) for v in self.variables]
        for v, old in zip(self.variables, before):
            v.assign(tf.zeros_like(old))
        return before

    def increments(self) -> tf.Tensor:
        """This rank's increments of all states, flattened into one float64 vector."""
        parts = [tf.reshape(tf.cast(tf.convert_to_tensor(v), _ACC), [-1]) for v in self.variables]
        return tf.concat(parts, axis=0) if parts else tf.zeros([0], _ACC)

    def end(self, before: Sequence[tf.Tensor], total_increments: tf.Tensor) -> None:
        """Store ``before + total_increments`` (the serial states) into the variables."""
        sizes = [b.shape.num_elements() for b in before]  # metric states have static shapes
        parts = tf.split(total_increments, sizes) if len(sizes) > 1 else [total_increments]
        for v, old, inc in zip(self.variables, before, parts):
            new = tf.cast(old, _ACC) + tf.reshape(inc, tf.shape(old))
            v.assign(tf.cast(new, old.dtype))


#: the ``update_state`` of the reduction metrics whose scalar updates are per-step values
_REDUCTIONS = (keras.metrics.Mean.update_state, keras.metrics.Sum.update_state)

# -- additive states -----------------------------------------------------------------------

_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
_PASS = ("Identity", "Cast")


def _key(t: tf.Tensor) -> tuple[str, int]:
    return t.op.name, t.value_index


def _through(t: tf.Tensor) -> tf.Tensor:
    while t.op.type in _PASS and t.op.inputs:
        t = t.op.inputs[0]
    return t


def _is_read(t: tf.Tensor, resource: tuple[str, int]) -> bool:
    t = _through(t)
    return t.op.type == "ReadVariableOp" and _key(t.op.inputs[0]) == resource


def _reads(t: tf.Tensor, resource: tuple[str, int]) -> bool:
    """Whether ``t`` is computed from a read of ``resource``."""
    seen: set[tuple[str, int]] = set()
    stack = [t]
    while stack:
        x = stack.pop()
        if _key(x) in seen:
            continue
        seen.add(_key(x))
        if x.op.type == "ReadVariableOp" and _key(x.op.inputs[0]) == resource:
            return True
        stack.extend(x.op.inputs)
    return False


def _adds_to_itself(op: tf.Operation) -> bool:
    """Whether a write ``op`` sets its variable to the variable plus an increment that does
    not read it (``assign_add(x)``, ``assign(v + x)``, ``assign(v - x)``)."""
    resource, value = _key(op.inputs[0]), op.inputs[1]
    if op.type != "AssignVariableOp":
        return not _reads(value, resource)
    value = _through(value)
    parts = list(value.op.inputs)
    if value.op.type in ("AddV2", "Add", "AddN"):
        own = [p for p in parts if _is_read(p, resource)]
        return len(own) == 1 and not any(_reads(p, resource) for p in parts if p is not own[0])
    if value.op.type == "Sub":
        return _is_read(parts[0], resource) and not _reads(parts[1], resource)
    return False


def _state_name(metric: keras.metrics.Metric, resource: tf.Tensor) -> str:
    """The state behind ``resource`` (a captured handle): its variable's path, which starts
    with the name of the metric that owns it (compiled metrics are inside one container)."""
    captures = getattr(resource.graph, "captures", ())
    outer = {_key(inner): external for external, inner in captures if hasattr(inner, "op")}
    external = outer.get(_key(resource))
    for v in metric.variables:
        handle = getattr(getattr(v, "value", None), "handle", None)
        if external is not None and handle is external:
            return f"metric state {v.path!r}"
    return f"a state of metric {metric.name!r}"


def check_additive(metric: keras.metrics.Metric, ops: Sequence[tf.Operation],
                   batch: Sequence[Any] = ()) -> None:
    """Refuse ``metric`` if one of the ``ops`` its ``update_state`` traced writes a state
    other than by adding an increment to it, or by an increment that pairs the samples of
    ``batch`` (the tensors it was given) with each other (see the module docstring)."""
    for op in ops:
        if op.type not in _WRITES:
            continue
        state = _state_name(metric, op.inputs[0])
        paired = pairing(op.inputs[1], batch) if batch else None
        if paired is not None:
            shapes = " against ".join(str(tuple(i.shape)) for i in paired.inputs)
            raise NotSupportedError(
                f"{state} is incremented by update_state with a term that pairs every sample "
                f"of the batch with every other ({paired.type} of {shapes}): "
                "tarantella adds up the ranks' increments, which misses the pairs across ranks. "
                "Give both operands the same shape so each sample adds its own term, or compute "
                "this metric from predict()'s outputs"
            )
        if not _adds_to_itself(op):
            raise NotSupportedError(
                f"{state} is set by update_state to something other than the state plus an "
                "increment (a maximum, a ratio, ...): "
                "tarantella adds up the ranks' increments of each state, which gives the serial "
                "value only for sums and counts. Keep sums and counts as states and compute the "
                "rest in result(), or compute this metric from predict()'s outputs"
            )


class MetricCalls:
    """The calls a step made on the model's metrics while Keras traced it (see the module
    docstring). ``loss`` gives what ``compute_loss`` returned in the step (None before)."""

    def __init__(self, metrics: Sequence[keras.metrics.Metric], variables: Sequence,
                 loss: Callable[[], Any]) -> None:
        self._metrics = list(metrics)
        self._positions = {id(v): i for i, v in enumerate(variables)}
        self._loss = loss
        #: id(metric) -> whether every update so far was an unweighted scalar
        self._unweighted: dict[int, bool] = {}
        self._loss_fed: set[int] = set()
        #: id(tensor) -> (metric, path in its result), and the tensors (kept alive)
        self._results: dict[int, tuple[keras.metrics.Metric, tuple]] = {}
        self._kept: list[Any] = []

    def _update(self, metric: keras.metrics.Metric) -> Callable[..., Any]:
        update = metric.update_state

        def update_state(values: Any, sample_weight: Any = None) -> Any:
            loss = self._loss()
            if loss is not None and values is loss:
                self._loss_fed.add(id(metric))
            scalar = sample_weight is None and tf.convert_to_tensor(values).shape.rank == 0
            self._unweighted[id(metric)] = self._unweighted.get(id(metric), True) and scalar
            return update(values, sample_weight=sample_weight)

        return update_state

    @staticmethod
    def _checked(metric: keras.metrics.Metric, update: Callable[..., Any]) -> Callable[..., Any]:
        """``update``, its writes checked for additive states (graph mode only: a step is
        traced; an eager call writes nothing to read)."""

        def update_state(*args: Any, **kwargs: Any) -> Any:
            if tf.executing_eagerly():
                return update(*args, **kwargs)
            graph = tf.compat.v1.get_default_graph()
            before = len(graph.get_operations())
            result = update(*args, **kwargs)
            check_additive(metric, graph.get_operations()[before:],
                           keras.tree.flatten([args, kwargs]))
            return result

        return update_state

    def _result(self, metric: keras.metrics.Metric) -> Callable[[], Any]:
        result = metric.result

        def recorded_result() -> Any:
            value = result()
            for path, leaf in keras.tree.flatten_with_path(value):
                self._results[id(leaf)] = (metric, path)
                self._kept.append(leaf)
            return value

        return recorded_result

    def recording(self) -> contextlib.AbstractContextManager[None]:
        """While the step is traced, the metrics' updates and results are recorded."""
        updates = [(m, "update_state", self._checked(
            m, self._update(m) if type(m).update_state in _REDUCTIONS else m.update_state))
            for m in self._metrics]
        return instance_attributes(updates + [(m, "result", self._result(m))
                                              for m in self._metrics])

    def _slots(self, metric: keras.metrics.Metric) -> list[int]:
        return [self._positions[id(v)] for v in metric.variables if id(v) in self._positions]

    def per_step_slots(self) -> list[int]:
        """Positions (in the model's ``metrics_variables``) of the states of the metrics
        whose every update in the step was an unweighted scalar."""
        return [i for m in self._metrics if self._unweighted.get(id(m)) for i in self._slots(m)]

    def loss_slots(self) -> list[tuple[int, int]]:
        """``(total, count)`` positions of the ``Mean`` metrics given the step's loss."""
        return [(self._positions[id(m.total)], self._positions[id(m.count)])
                for m in self._metrics if id(m) in self._loss_fed
                and isinstance(m, keras.metrics.Mean)
                and id(m.total) in self._positions and id(m.count) in self._positions]

    def alias(self, outer: Any, inner: Any) -> None:
        """``outer`` is what a compiled body returned as ``inner`` (tarantella.data_parallel.xla): if
        ``inner`` was a metric's result, so is ``outer``."""
        source = self._results.get(id(inner))
        if source is not None and tf.is_tensor(outer):
            self._results[id(outer)] = source
            self._kept.append(outer)

    def result_of(self, leaf: Any) -> tuple[keras.metrics.Metric, tuple] | None:
        """The metric (and the path in its result) a log leaf is the result of, if any."""
        return self._results.get(id(leaf))
