"""XLA in the distributed step: the step's body compiled, the collectives between its parts.

Keras compiles its step with XLA when ``jit_compile`` resolves to True: ``True``, or
``"auto"`` (the default) on a machine with a GPU, unless a layer does not support XLA or op
determinism is on (Keras' ``compile`` and its ``jit_compile`` setter, which warns then). A
distributed step cannot be one XLA function: its collectives (the ops of tnt-keras' op
library, or ``tf.numpy_function`` calls into the backend) have no XLA kernel, and XLA has
no stable C API for custom calls. So a ``tnt.Model`` lets Keras resolve ``jit_compile``,
keeps the result (:func:`take_jit_compile`), sets Keras' own to False (its outer
``tf.function``, which loops over ``steps_per_execution``, hosts the collectives) and
compiles what lies between the collectives:

* **train**, by default: the step is traced as without XLA (the gradients of each bucket
  handed to the allreduce as soon as they exist, :mod:`tarantella.comm.gradients`), inside
  TensorFlow's ``jit_scope``, so that XLA compiles *clusters* of it; and every collective
  is made a boundary of the clusters (:func:`cut_at_collectives`). The backward pass then
  runs as one compiled cluster per gradient bucket, and a bucket's allreduce starts while
  XLA computes the rest, as in the step without XLA. Why not one XLA function for the
  body: a compiled function's outputs exist only once all of it has run, so every
  allreduce would wait for the whole backward pass; cutting the backward pass into
  functions would mean replacing the user's ``train_step``, whose one ``tape.gradient``
  computes it. Clusters cut the traced graph instead, the user's step as it is. The
  optimizer's update, after the collectives, is one XLA function of its own
  (:meth:`XlaStep.update`), and variable reads stay TensorFlow's
  (:func:`leave_reads_to_tensorflow`): both were clusters of a few ops each, a launch and
  a copy apiece. A step with two ``apply`` calls (a GAN) or with synchronized
  BatchNormalization (collectives in the forward pass) is cut at those collectives too,
  and compiles;
* **train**, with ``TNT_OVERLAP=false``: one XLA function runs Keras' (or the user's)
  ``train_step`` with each optimizer's ``apply`` replaced by a recorder: forward pass,
  loss, backward pass, metric updates. The recorded gradients are reduced after it (native
  ops or the Python path), and a second XLA function runs the optimizer's own ``apply`` on
  them, so clipping, loss scaling, accumulation and EMA see the serial gradient, as without
  XLA. The loss is weighed inside the first function when its factor is known locally (a
  mean over distributed data: the global batch size); otherwise the reduction applies the
  factor, found by one small allreduce of the normalisers after the body
  (``steps.remaining_factor``). A step this cannot split (two ``apply`` calls, or one inside
  a ``tf.cond``/loop of its own; synchronized BatchNormalization) runs without XLA, with
  one warning line saying why;
* **test**: ``test_step`` in one XLA function; the metric states are summed after it;
* **predict**: ``predict_step`` in one XLA function; the rows are gathered after it.

On one rank there is no collective: Keras compiles the whole step itself (see
:func:`take_jit_compile`).

Where the step is not compiled (``jit_compile="auto"`` on a machine without a GPU), the
optimizer's update alone is (:mod:`tarantella.data_parallel.compiled_update`).

Differences from serial Keras with XLA: XLA compiles clusters, not Keras' whole function,
so fusions across a cut differ (round-off); with ``TNT_OVERLAP=false`` a ``train_step``
that reads an optimizer's state after its ``apply`` (``optimizer.iterations``, a scheduled
learning rate) sees the value before the update. Everything else is serial Keras' step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

import tnt_core

from .._keras_compat import run_after, set_op_attr
from ..comm import traced_collectives
from ..reporting.user_frames import user_stacklevel
from ..seams.overrides import instance_attributes
from .compiled_update import CompiledUpdate, compiled_apply
from .losses import Normaliser
from .steps import StepContext, gradient_factor, model_optimizers, reduce_gradients, remaining_factor, tracing

__all__ = ["XlaStep", "take_jit_compile"]


def take_jit_compile(model: keras.Model, runtime: tnt_core.Runtime) -> XlaStep | None:
    """Keras' resolved ``jit_compile`` of ``model`` as the :class:`XlaStep` that compiles its
    steps' bodies, with Keras' own flag set to False (its outer function hosts the
    collectives); None when the step needs no split. Reading the flag resolves ``"auto"``
    as Keras does for a model that was never compiled.

    One rank's step has no collective and calls no Python (its sums over ranks are the
    tensors themselves), so there Keras' flag stays as it is and Keras compiles the whole
    step, tarantella's bookkeeping included, as it compiles its own; unless the timeline is
    on (``TNT_TIMELINE``: it records times from Python in the step)."""
    on = bool(model.jit_compile)
    if on and runtime.size == 1 and not runtime.config.timeline:
        return None
    model.jit_compile = False
    return XlaStep(runtime.is_master, overlap=runtime.config.overlap) if on else None


class _Recorder:
    """Stands in for ``optimizer.apply`` while a body is traced: records the call."""

    def __init__(self) -> None:
        self.graph = tf.compat.v1.get_default_graph()  # the body's
        self.calls: list[tuple[keras.optimizers.Optimizer, list[Any], list[Any] | None]] = []
        #: an apply traced inside a control-flow branch or loop of the step (its gradients
        #: cannot leave the body)
        self.nested = False

    def apply_of(self, optimizer: keras.optimizers.Optimizer) -> Callable[..., None]:
        def record(grads: Any, trainable_variables: Any = None) -> None:
            if tf.compat.v1.get_default_graph() is not self.graph:
                self.nested = True
            variables = None if trainable_variables is None else list(trainable_variables)
            self.calls.append((optimizer, list(grads), variables))

        return record

    def problem(self) -> str | None:
        if len(self.calls) > 1:
            return (f"its train_step calls optimizer.apply {len(self.calls)} times (a later "
                    "forward pass may need an earlier update)")
        if self.nested:
            return "its train_step calls optimizer.apply inside a tf.cond or loop"
        return None


def _loss_parts(step: StepContext) -> dict[str, Any]:
    """The tensors of what ``compute_loss`` recorded in a body, to leave it as outputs."""
    parts: dict[str, Any] = {}
    if step.loss is not None:
        parts["loss"] = step.loss
    if step.returned_loss is not None:
        parts["returned_loss"] = step.returned_loss
    weights = step.normaliser
    if weights is not None:
        parts["scale"] = tf.convert_to_tensor(weights.scale)
        parts["divisor"] = tf.convert_to_tensor(weights.divisor)
        if weights.total is not None:
            parts["total"] = tf.convert_to_tensor(weights.total)
    return parts


def _take_loss_parts(step: StepContext, traced: dict[str, Any], out: dict[str, Any]) -> None:
    """Give ``step`` (the outer trace) the body's loss, normaliser and outputs, as outer
    tensors (each output leaf paired with the body's own, for the log reduction)."""
    inner: StepContext = traced["inner"]
    if "loss" in out:
        step.loss = out["loss"]
    if "returned_loss" in out:
        step.returned_loss = out["returned_loss"]
    pairs = list(zip(keras.tree.flatten(traced["outputs"]), keras.tree.flatten(out["outputs"])))
    step.compiled_outputs = pairs
    for inside, outside in pairs:  # a log of the returned loss is the one the logs name
        if inner.returned_loss is not None and inside is inner.returned_loss:
            step.returned_loss = outside
            break
    if inner.normaliser is not None:
        step.normaliser = Normaliser(out["scale"], out["divisor"], inner.normaliser.divide,
                                     out.get("total"))
    step.prescaled = inner.prescaled


def _update(optimizer: keras.optimizers.Optimizer, variables: list[Any] | None, reduced: list[Any],
            reducer: Any) -> Callable[[], None]:
    def update() -> None:
        compiled_apply(optimizer.apply, variables)(*reduced)
        if reducer is not None and reducer.timeline is not None and variables:
            reducer.mark_optimizer_done([tf.convert_to_tensor(optimizer.iterations)])

    return update


class XlaStep:
    """Runs the bodies of a model's steps as XLA functions (one per model)."""

    def __init__(self, is_master: bool, overlap: bool = True) -> None:
        self.is_master = is_master
        #: train steps as XLA clusters cut at the collectives (else one compiled body)
        self.overlap = overlap
        self._warned: set[str] = set()

    def run(self, step: StepContext, batch: Any, run: Callable[[Any], Any], state: Any) -> Any:
        """The step's outputs (logs, or predictions), computed by XLA functions and the
        collectives between them; None when the step cannot be split (run it without XLA)."""
        if step.kind == "train":
            if self.overlap:
                return None  # traced as without XLA, inside clusters()
            return self._train(step, batch, run, state)
        return self._evaluate(step, batch, run)

    @contextlib.contextmanager
    def clusters(self) -> Iterator[None]:
        """While a train step is traced: its ops are marked for XLA to cluster, and cut at
        every collective, so that each gradient bucket's reduction starts while XLA still
        computes the backward pass that remains."""
        if not self.overlap:
            yield
            return
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with tf.xla.experimental.jit_scope(compile_ops=True, separate_compiled_gradients=False):
            yield
        made = graph.get_operations()[first:]
        cut_at_collectives(graph, made)
        leave_reads_to_tensorflow(made)

    def update(self, optimizer: keras.optimizers.Optimizer, variables: list[Any] | None,
               apply: Callable[..., Any], grads: list[Any]) -> Any:
        """The optimizer's ``apply`` of the reduced ``grads`` as one XLA function, traced
        in a train step whose ops XLA clusters, but left out of its clusters. Why: clustered,
        the update of each weight became clusters of its own (XLA keeps a cluster's writes
        to a variable apart from later reads of another), two or three XLA launches a weight;
        on the ``gelu`` benchmark (14 weights) one function saved 4 ms of CPU a step."""
        with tf.xla.experimental.jit_scope(compile_ops=False):
            return CompiledUpdate(optimizer, variables, explicit=True, apply=apply)(grads)

    def _body(self, step: StepContext, run: Callable[[Any], Any], traced: dict[str, Any],
              overrides: Callable[[], list[tuple[object, str, Any]]]) -> Callable[[Any], Any]:
        """The body of ``step`` as a function of the batch; each trace leaves its context in
        ``traced`` (tf.function may trace more than once)."""

        def body(batch: Any) -> dict[str, Any]:
            inner = StepContext(step.model, step.kind, step.n, step.b)
            inner.compiled = True
            inner.batch = keras.tree.flatten(batch)
            recorder = _Recorder()
            traced.update(inner=inner, recorder=recorder)
            applies = [(opt, "apply", recorder.apply_of(opt))
                       for opt in model_optimizers(step.model)] if step.kind == "train" else []
            with tracing(inner), instance_attributes(applies + overrides()):
                outputs = run(batch)
            traced["outputs"] = outputs
            grads = [] if recorder.problem() else [grads for _, grads, _ in recorder.calls]
            return {"outputs": outputs, "grads": grads, **_loss_parts(inner)}

        body.__name__ = f"tnt_xla_{step.kind}_body"  # its name in XLA's dumps and profiles
        return body

    def _evaluate(self, step: StepContext, batch: Any, run: Callable[[Any], Any]) -> Any:
        traced: dict[str, Any] = {}
        body = tf.function(self._body(step, run, traced, list), jit_compile=True, autograph=False)
        out = body(batch)
        _take_loss_parts(step, traced, out)
        return out["outputs"]

    def _train(self, step: StepContext, batch: Any, run: Callable[[Any], Any], state: Any) -> Any:
        model = step.model
        if state.synchronized_bn:
            names = ", ".join(repr(layer.name) for layer in state.synchronized_bn)
            self._warn("bn", f"BatchNormalization(synchronized=True) layer(s) {names} compute "
                             "their moments with collectives in the forward pass")
            return None
        # compute_loss marks the start of backprop with a numpy_function: not in XLA
        timed = [reducer for reducer in (state.gradient_reducer(f"train_{opt.name}_0")
                                         for opt in model_optimizers(model))
                 if reducer.timeline is not None]
        traced: dict[str, Any] = {}
        body = tf.function(self._body(step, run, traced,
                                      lambda: [(r, "timeline", None) for r in timed]),
                           jit_compile=True, autograph=False)
        body.get_concrete_function(batch)  # trace only: the recorder decides whether it splits
        recorder: _Recorder = traced["recorder"]
        problem = recorder.problem()
        if problem is not None:
            self._warn("apply", problem)
            return None
        for reducer in timed:
            reducer.mark_backprop_start(step.n)  # forward and backward are one XLA function
        out = body(batch)
        inner: StepContext = traced["inner"]
        _take_loss_parts(step, traced, out)
        for (optimizer, _, variables), grads in zip(recorder.calls, out["grads"]):
            grads = list(grads)
            if all(g is None for g in grads):
                reduced, reducer = grads, None
            else:
                factor = (remaining_factor(step, state) if inner.prescaled
                          else gradient_factor(step, state))
                reduced, reducer = reduce_gradients(step, optimizer, grads, variables, factor,
                                                    state)
            step.after_collectives(_update(optimizer, variables, reduced, reducer))
        return out["outputs"]

    def _warn(self, key: str, why: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if self.is_master:
            warnings.warn(f"jit_compile: this model's train step runs without XLA, because {why}; "
                          "tarantella compiles a step with XLA only around its gradient "
                          "reduction", stacklevel=user_stacklevel())


def _compiled(op: tf.Operation) -> bool:
    """Whether ``op`` was made inside the ``jit_scope``: XLA may cluster it."""
    attr = op.node_def.attr
    return "_XlaCompile" in attr and attr["_XlaCompile"].b


def leave_reads_to_tensorflow(ops: list[tf.Operation]) -> None:
    """Unmark the variable reads among ``ops`` for XLA's clustering. Why: a read whose
    readers XLA cannot compile (TensorFlow's graph optimizer fuses a forward ``MatMul`` with
    its bias and activation into ``_FusedMatMul``, which has no XLA kernel) became a cluster
    of its own, and a cluster's output is a buffer of its own: a copy of the weight every
    step, where TensorFlow's read shares the variable's buffer. A cluster that uses a read
    takes it as an input the same way."""
    for op in ops:
        if op.type == "ReadVariableOp" and _compiled(op):
            set_op_attr(op, "_XlaCompile", False)


def _ancestors(op: tf.Operation, stop: set[tf.Operation]) -> set[tf.Operation]:
    """The ops ``op`` waits for (data and control inputs, transitively), not going past the
    ops in ``stop``."""
    found: set[tf.Operation] = set()
    todo = [op]
    while todo:
        current = todo.pop()
        for before in [t.op for t in current.inputs] + list(current.control_inputs):
            if before not in found and before not in stop:
                found.add(before)
                todo.append(before)
    return found


def _first_stateful_after(graph_ops: list[tf.Operation]) -> dict[tf.Operation, int]:
    """For each op, the position (in ``graph_ops``, the order they were made) of the earliest
    stateful op that waits for it, directly or not; ``len(graph_ops)`` when none does."""
    where = {op: i for i, op in enumerate(graph_ops)}
    after: dict[tf.Operation, list[tf.Operation]] = {op: [] for op in graph_ops}
    for op in graph_ops:
        for before in [t.op for t in op.inputs] + list(op.control_inputs):
            if before in after:
                after[before].append(op)
    first: dict[tf.Operation, int] = {}
    for op in reversed(graph_ops):  # an op's consumers are made after it
        best = len(graph_ops)
        for later in after[op]:
            best = min(best, first.get(later, len(graph_ops)),
                       where[later] if later.op_def.is_stateful else len(graph_ops))
        first[op] = best
    return first


def cut_at_collectives(graph: tf.Graph, ops: list[tf.Operation]) -> None:
    """Make each collective of ``ops`` (in the order they were traced) a boundary of XLA's
    clusters: the compiled ops that the next collective waits for, and this one does not,
    wait for this one. Why: XLA forms the largest clusters it can, and a cluster's outputs
    exist only when all of it has run; one cluster over the whole backward pass would hold
    every gradient bucket until the end. A control edge from a collective to the ops after
    it makes a cluster around both close a cycle, so XLA makes one cluster per segment.

    No edge may close a cycle once ``tf.function`` orders the stateful ops in the order they
    were made (its automatic control dependencies, added after this): so only stateless ops
    get one, and only those that no stateful op made before the collective waits for."""
    names = set(traced_collectives(graph))
    collectives = [op for op in ops if op.name in names]
    if len(collectives) < 2:
        return
    graph_ops = graph.get_operations()
    where = {op: i for i, op in enumerate(graph_ops)}
    first_stateful = _first_stateful_after(graph_ops)
    made = set(ops)
    seen: set[tf.Operation] = set()
    last: tf.Operation | None = None
    for collective in collectives:
        segment = _ancestors(collective, seen)
        if last is not None:
            run_after([op for op in segment
                       if op in made and _compiled(op) and not op.op_def.is_stateful
                       and first_stateful[op] > where[last]], [last])
        seen |= segment
        seen.add(collective)
        last = collective
