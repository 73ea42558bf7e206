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

* **train**: one XLA function runs Keras' (or the user's) ``train_step`` with each
  optimizer's ``apply`` replaced by a recorder: forward pass, loss, backward pass, metric
  updates. The recorded gradients are reduced after it (native ops or the Python path), and
  a second XLA function runs the optimizer's own ``apply`` on them, so clipping, loss
  scaling, accumulation and EMA see the serial gradient, as without XLA. The loss is weighed
  inside the first function when its factor is known locally (a mean over distributed data:
  the global batch size); otherwise the reduction applies the factor, found by one small
  allreduce of the normalisers after the body (``steps.remaining_factor``);
* **test**: ``test_step`` in one XLA function; the metric states are summed after it;
* **predict**: ``predict_step`` in one XLA function; the rows are gathered after it.

On one rank there is no collective: Keras compiles the whole step itself (see
:func:`take_jit_compile`).

Steps this cannot split run without XLA, with one warning line saying why (as Keras warns
when a layer cannot be compiled): a step that calls ``apply`` more than once (a GAN: its
second forward pass may need the first update) or inside a ``tf.cond``/loop of its own,
and a model with synchronized BatchNormalization (collectives in the forward pass).

Not done: a finer split, per gradient bucket, so that the last layers' allreduce overlaps
the backward pass of the first (as the step without XLA does). An XLA function's outputs
exist only once the whole function has run, and the backward pass is one ``tape.gradient``
inside Keras' or the user's ``train_step``; segments would need tarantella to own the
backward pass, i.e. to replace the user's step.

Differences from serial Keras with XLA: a ``train_step`` that reads an optimizer's state
after its ``apply`` (``optimizer.iterations``, a scheduled learning rate) sees the value
before the update; everything else is serial Keras' step, compiled as Keras compiles it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

import tnt_core

from ..reporting.user_frames import user_stacklevel
from ..seams.overrides import instance_attributes
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
    return XlaStep(runtime.is_master) if on else None


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


def _compiled_apply(optimizer: keras.optimizers.Optimizer,
                    variables: list[Any] | None) -> Callable[[list[Any]], Any]:
    """``optimizer.apply(grads, variables)`` as an XLA function of the gradients."""

    def tnt_xla_apply(grads: list[Any]) -> Any:
        return optimizer.apply(grads, variables)

    return tf.function(tnt_xla_apply, jit_compile=True, autograph=False)


def _update(optimizer: keras.optimizers.Optimizer, variables: list[Any] | None, reduced: list[Any],
            reducer: Any) -> Callable[[], None]:
    def update() -> None:
        _compiled_apply(optimizer, variables)(reduced)
        if reducer is not None and reducer.timeline is not None and variables:
            reducer.mark_optimizer_done([tf.convert_to_tensor(optimizer.iterations)])

    return update


class XlaStep:
    """Runs the bodies of a model's steps as XLA functions (one per model)."""

    def __init__(self, is_master: bool) -> None:
        self.is_master = is_master
        self._warned: set[str] = set()

    def run(self, step: StepContext, batch: Any, run: Callable[[Any], Any], state: Any) -> Any:
        """The step's outputs (logs, or predictions), computed by XLA functions and the
        collectives between them; None when the step cannot be split (run it without XLA)."""
        if step.kind == "train":
            return self._train(step, batch, run, state)
        return self._evaluate(step, batch, run)

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
