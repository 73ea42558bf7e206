"""Every private Keras or TensorFlow name tnt-keras uses, and only here.

tarantella runs Keras' own machinery (its data adapters, its build, its loops) and adds
distribution at a few seams. Where Keras 3 exports no public name for a seam, this module
is the one place that reaches into Keras; every other module calls the functions below.
A Keras release that renames one of them breaks this file alone, and the test that calls
each entry against the installed Keras (``tests/test_keras_compat.py``) says which. The tox
env ``tnt-keras-prevkeras`` runs that test, with the rest of the tnt-keras suite, on the
previous Keras minor.

Each entry says why it is needed and the Keras releases it was checked on (its source read,
and the tests run). What has a public equivalent or takes a few lines of our own is not
here: ``compiled`` for ``_assert_compile_called``, the class-weight map and
``validation_split`` (``tarantella.datasets``), the reduction axes of BatchNormalization
(from ``layer.axis``), the global seed (``tf.compat.v1.random.get_seed``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import keras

# global_state: where Keras keeps the variables made inside a StatelessScope that wait for a
# value ("uninitialized_variables", which the next scope exit initialises). Checked on Keras
# 3.15.1.
from keras.src.backend.common import global_state

# get_keras_mask: where Keras keeps an output's mask (an attribute, or a side table for
# tensors that take no attributes); the loss normaliser counts what the mask keeps.
# Checked on Keras 3.14.1, 3.15.1.
from keras.src.backend.common.masking import get_keras_mask

# in_stateless_scope: whether a StatelessScope is open (a variable cannot get its value
# there). Checked on Keras 3.15.1.
from keras.src.backend.common.stateless_scope import in_stateless_scope

# CompileLoss: the loss compile() makes of its loss= and loss_weights= (each output's loss,
# weighted, summed; a Mean tracker per output's loss when there are several). A pipelined
# model's last stage differentiates one made alike (new_compiled_loss). Checked on Keras
# 3.15.1.
from keras.src.trainers.compile_utils import CompileLoss

# get_data_adapter: the adapter Keras' fit() itself uses, so tarantella's global batches,
# shuffling and class weights are serial Keras' own. Checked on Keras 3.14.1, 3.15.1.
from keras.src.trainers.data_adapters import get_data_adapter

# attr_value_pb2: the proto of a graph op's attribute (set_op_attr; the jit_scope's
# _XlaCompile).
from tensorflow.core.framework import attr_value_pb2

# ops._gradient_registry: TensorFlow's process-wide table of gradient functions, where a
# graph-mode tf.custom_gradient registers its own under a fresh "CustomGradient-<uid>" name
# and never removes it (forgetting_custom_gradients). Checked on TensorFlow 2.21.0.
from tensorflow.python.framework import ops as tf_ops

# TensorFlow's getter of enable_op_determinism() (public only as the setter), which Keras'
# own jit_compile="auto" consults (keras.src.trainers.trainer.model_supports_jit): a stage's
# optimizer update is compiled with XLA by the same rule. Checked on TensorFlow 2.21.0.
from tensorflow.python.framework.config import is_op_determinism_enabled

__all__ = [
    "all_layers",
    "asks_auto_jit_compile",
    "batch_norm_moments",
    "compile_owner",
    "compiled_loss",
    "forget_uninitialized",
    "forgetting_custom_gradients",
    "get_data_adapter",
    "get_keras_mask",
    "has_value",
    "in_stateless_scope",
    "initialize_deferred",
    "is_op_determinism_enabled",
    "is_fit_validation",
    "new_compiled_loss",
    "own_variables",
    "producer",
    "release_value",
    "run_after",
    "set_op_attr",
    "symbolic_build",
]


def all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer inside ``model``, nested models and layers held as attributes included:
    Keras' own traversal (``Layer._flatten_layers``), which ``model.layers`` is not (it stops
    at the first level). Checked on Keras 3.14.1, 3.15.1."""
    return list(model._flatten_layers(include_self=False))  # noqa: SLF001


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Build the model, its compiled metrics and its optimizer from a batch's spec
    (``Trainer._symbolic_build``), as Keras does before the first step under a distribution
    strategy: the master's state must exist before it can be broadcast. Checked on Keras
    3.14.1, 3.15.1."""
    model._symbolic_build(data_batch=data_batch)  # noqa: SLF001


#: the keyword Keras' ``fit`` passes to ``evaluate`` for its validation, whose data the fit
#: of a tnt.Model has distributed already. Checked on Keras 3.14.1, 3.15.1.
_FIT_VALIDATION = "_use_cached_eval_dataset"


def is_fit_validation(evaluate_kwargs: Mapping[str, Any]) -> bool:
    """Whether ``evaluate`` was called by Keras' ``fit`` for the validation data."""
    return bool(evaluate_kwargs.get(_FIT_VALIDATION))


def compile_owner() -> type:
    """The class that defines ``keras.Model.compile`` (``Trainer``). Loading a model
    compiles it only when the model's class has that class's ``compile``
    (``Trainer.compile_from_config`` compares them), so a replacement of Keras' ``compile``
    (``tarantella.horovod``'s Keras 2 spelling) must sit on it. Checked on Keras 3.15.1."""
    return next(cls for cls in keras.Model.__mro__ if "compile" in vars(cls))


def batch_norm_moments(layer: keras.layers.BatchNormalization,
                       moments: Any) -> tuple[keras.layers.BatchNormalization, str, Any]:
    """The ``(object, attribute, value)`` that replaces how ``layer`` computes its batch
    moments (``BatchNormalization._moments(inputs, mask)``, the one place Keras computes
    them), for ``tarantella.seams.overrides.instance_attributes``. Checked on Keras 3.14.1,
    3.15.1."""
    return layer, "_moments", moments


def producer(tensor: Any) -> tuple[Any, Any] | None:
    """``(operation, node)`` that made a symbolic tensor of a functional model, or None for
    any other value: ``KerasTensor._keras_history`` and ``Operation._inbound_nodes``, what
    Keras' own ``clone_graph_nodes`` walks. Checked on Keras 3.14.1, 3.15.1."""
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        return None
    operation, node_index = history[0], history[1]
    return operation, operation._inbound_nodes[node_index]  # noqa: SLF001


def compiled_loss(model: keras.Model) -> Any:
    """The loss ``compile`` made (``Trainer._compile_loss``, a ``CompileLoss``): called with
    ``(y, y_pred, sample_weight)`` it returns every output's loss weighted and summed, and
    updates the per-output loss trackers that serial logs show (``out1_loss``, ...).
    Checked on Keras 3.15.1."""
    return model._compile_loss  # noqa: SLF001


def compiled_metrics(model: keras.Model) -> Any:
    """The metrics ``compile`` made (``Trainer._compile_metrics``, a ``CompileMetrics``, or
    None without ``metrics``/``weighted_metrics``): one metric in ``model.metrics`` whose
    variables are all of theirs once built. Checked on Keras 3.15.1."""
    return model._compile_metrics  # noqa: SLF001


def new_compiled_loss(model: keras.Model, loss: Any, loss_weights: Any) -> keras.losses.Loss:
    """A ``CompileLoss`` made as ``model.compile(loss=loss, loss_weights=loss_weights)``
    makes the model's (its own trackers, which nobody reads). Checked on Keras 3.15.1."""
    return CompileLoss(loss, loss_weights, output_names=getattr(model, "output_names", None))
# -- variables without a value (a model built in ``keras.StatelessScope(initialize_variables=
# False)``; tarantella.pipeline.variables). Checked on Keras 3.15.1.

_UNINITIALIZED = "uninitialized_variables"


def has_value(variable: keras.Variable) -> bool:
    """Whether ``variable`` holds a value: False for a variable made inside a
    ``StatelessScope`` and not initialised since (``Variable._value``)."""
    return variable._value is not None  # noqa: SLF001


def initialize_deferred(variable: keras.Variable) -> None:
    """Give a variable made inside a ``StatelessScope`` its value from its own initializer
    (with its seed): what the scope's exit does to every such variable
    (``Variable._deferred_initialize``), for this one only."""
    variable._deferred_initialize()  # noqa: SLF001


def forget_uninitialized(variables: list[keras.Variable]) -> None:
    """Take ``variables`` off Keras' list of variables that the next ``StatelessScope`` exit
    initialises (``global_state`` "uninitialized_variables")."""
    waiting = global_state.get_global_attribute(_UNINITIALIZED)
    if not waiting:
        return
    drop = {id(v) for v in variables}
    global_state.set_global_attribute(_UNINITIALIZED, [v for v in waiting if id(v) not in drop])


def release_value(variable: keras.Variable, placeholder: Any) -> None:
    """Drop ``variable``'s value (its memory is freed when nothing else holds it) and make
    it read as a variable without one: ``placeholder(shape, dtype)`` is what reading it
    then calls (``Variable._value``, ``Variable._initializer``)."""
    variable._value = None  # noqa: SLF001
    variable._initializer = placeholder  # noqa: SLF001


@contextlib.contextmanager
def forgetting_custom_gradients() -> Iterator[None]:
    """Unregister, on exit, the gradient functions of the graph-mode custom gradients
    traced inside. TensorFlow keeps each for the rest of the process, and its closure holds
    the traced graph's tensors, so the graph and every variable it captured stay allocated
    after their model is deleted. Only for graph code that nothing differentiates (an
    optimizer's update)."""
    registry = tf_ops._gradient_registry._registry  # noqa: SLF001
    before = set(registry)
    try:
        yield
    finally:
        for name in set(registry) - before:
            if name.startswith("CustomGradient-"):
                registry.pop(name, None)


def run_after(ops: list[Any], after: list[Any]) -> None:
    """Make the traced graph ops ``ops`` wait for ``after`` (ops made later too): a control
    edge added to an op that exists, what TensorFlow's own automatic control dependencies
    do to a traced function (``Operation._add_control_inputs``). Why: a micro-batch's
    weight gradient is made by the same gradient computation as its input gradient, and
    only later, at its place in the schedule, is it known what it waits for. Checked on
    TensorFlow 2.21.0."""
    for op in ops:
        op._add_control_inputs(after)  # noqa: SLF001


def set_op_attr(op: Any, name: str, value: bool) -> None:
    """Set the boolean attribute ``name`` of the traced graph op ``op`` (what TensorFlow's
    ``jit_scope`` sets when the op is made, ``Operation._set_attr``). Checked on
    TensorFlow 2.21.0."""
    op._set_attr(name, attr_value_pb2.AttrValue(b=value))  # noqa: SLF001


def own_variables(layer: keras.layers.Layer) -> list[keras.Variable]:
    """The variables ``layer`` itself saves and loads (``Layer.save_own_variables`` writes
    ``_trainable_variables + _non_trainable_variables``), not those of its sub-layers."""
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)  # noqa: SLF001


@contextlib.contextmanager
def asks_auto_jit_compile(model: keras.Model) -> Iterator[list[bool]]:
    """While ``model``'s ``compile`` runs (the user's own ``compile`` too): records in the
    list it gives what Keras resolved ``jit_compile="auto"`` to (empty: "auto" was not
    asked), which its ``compile`` does through ``Trainer._resolve_auto_jit_compile`` (when
    not ``run_eagerly``). Why: Keras
    keeps only the resolved value, and "auto" (False on a machine without a GPU) and an
    explicit False are not the same request. The ``jit_compile`` getter resolves too when
    nothing was set yet (the setter reads it first): only calls from ``compile`` count.
    Checked on Keras 3.15.1."""
    asked: list[bool] = []
    resolve = model._resolve_auto_jit_compile  # noqa: SLF001

    def recording() -> Any:
        resolved = resolve()
        if sys._getframe(1).f_code.co_name == "compile":  # noqa: SLF001
            asked.append(bool(resolved))
        return resolved

    object.__setattr__(model, "_resolve_auto_jit_compile", recording)
    try:
        yield asked
    finally:
        object.__delattr__(model, "_resolve_auto_jit_compile")
