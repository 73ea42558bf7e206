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
  rank's by its loss normaliser (``tarantella.losses``: valid tokens under a mask, the sum
  of the sample weights, ...), which need not be its share of the samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from .overrides import instance_attributes

__all__ = ["MetricCalls", "MetricStates"]

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
        updates = [(m, "update_state", self._update(m)) for m in self._metrics
                   if type(m).update_state in _REDUCTIONS]
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
        """``outer`` is what a compiled body returned as ``inner`` (tarantella.xla): if
        ``inner`` was a metric's result, so is ``outer``."""
        source = self._results.get(id(inner))
        if source is not None and tf.is_tensor(outer):
            self._results[id(outer)] = source
            self._kept.append(outer)

    def result_of(self, leaf: Any) -> tuple[keras.metrics.Metric, tuple] | None:
        """The metric (and the path in its result) a log leaf is the result of, if any."""
        return self._results.get(id(leaf))
