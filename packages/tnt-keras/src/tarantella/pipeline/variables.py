"""Which variables a pipelined rank holds: its own partition's, and no other.

Why: a pipelined rank trains one partition; holding the whole model on every rank is what
kept pipelining from training models larger than one rank. Keras 3 already builds a model
without values: inside ``keras.StatelessScope(initialize_variables=False)`` (or
:func:`deferred_build`, the same scope) every variable is made with its shape, dtype and
initializer, and no memory. ``tnt.Model`` then gives each rank's own partition its values
(each initializer keeps the seed it drew when the layer was made, so the values are those
a serial run of the same seeded script gives, in any order), and takes every variable of the
model off Keras' list of variables waiting for a value, so that no later scope exit
allocates the other partitions' variables.

A model built the ordinary way has every value on every rank; ``tnt.Model`` releases the
other partitions' values on each rank (their memory is freed unless something else, e.g.
a ``tf.function`` the script traced on the whole model, still holds it). The user's model
object keeps every layer and variable object, as shells: reading a variable of another
partition eagerly raises an error that says what to call instead (``get_weights``, ``save``,
``predict``); while a graph is traced it reads as zeros of its shape (what Keras' own
placeholder for a variable without a value is for). Under DATA, a model built without
values is initialised whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from .._keras_compat import (
    all_layers,
    forget_uninitialized,
    has_value,
    in_stateless_scope,
    initialize_deferred,
    own_variables,
    release_value,
)
from ..errors import NotSupportedError

__all__ = ["NotHeld", "Ownership", "deferred_build", "hold_own_partition", "initialize_whole"]


def deferred_build() -> keras.StatelessScope:
    """``with tnt.deferred_build(): model = build()``: the model's variables get no value
    (Keras' own ``keras.StatelessScope(initialize_variables=False)``, which works the same);
    ``tnt.Model`` gives each rank the values of what it trains."""
    return keras.StatelessScope(initialize_variables=False)


def _check_outside_scope(model: keras.Model) -> None:
    if in_stateless_scope():
        raise NotSupportedError(
            f"tnt.Model({model.name!r}) inside keras.StatelessScope: a variable cannot get its "
            "value inside the scope; call tnt.Model(...) after the `with` block that builds "
            "the model")


def initialize_whole(model: keras.Model) -> int:
    """Every variable of ``model`` without a value gets its initializer's (DATA: every rank
    trains the whole model); returns how many did."""
    _check_outside_scope(model)
    variables = list(model.variables)
    waiting = [v for v in variables if not has_value(v)]
    for v in waiting:
        initialize_deferred(v)
    forget_uninitialized(variables)
    return len(waiting)


class NotHeld:
    """What reading a variable of another partition calls (Keras' initializer slot of a
    variable without a value): an error when run eagerly, zeros while a graph is traced."""

    def __init__(self, path: str, partition: int, stage: int) -> None:
        self.path, self.partition, self.stage = path, partition, stage

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        if tf.executing_eagerly():
            raise NotSupportedError(
                f"variable {self.path!r} belongs to partition {self.partition}, which another "
                f"rank trains; this rank (stage {self.stage}) holds only its own partition's "
                "values. Read the whole model with model.get_weights() or model.save(...), and "
                "compute with model.predict/evaluate instead of calling the model directly")
        return tf.zeros(shape, dtype)


@dataclass(frozen=True)
class Ownership:
    """Which stage holds each variable, by position, so that nothing here holds a variable
    of another partition: ``weights[i]`` for ``model.weights[i]``, ``layers[j]`` for the
    ``j``-th layer of :func:`~tarantella._keras_compat.all_layers` (the stage whose
    partition holds the variables that layer saves; -1 for a layer without any)."""

    stage: int
    weights: tuple[int, ...]
    layers: tuple[int, ...]

    def owns(self, i: int) -> bool:
        return self.weights[i] == self.stage


def _partition_of(parts_variables: list[list[Any]]) -> dict[int, int]:
    found: dict[int, int] = {}
    for p, variables in enumerate(parts_variables):
        for v in variables:
            found.setdefault(id(v), p)
    return found


def hold_own_partition(model: keras.Model, parts_variables: list[list[Any]], stage: int) -> Ownership:
    """Make this rank hold partition ``stage``'s variables and no other's: its own
    variables without a value get their initializer's; the other partitions' lose theirs
    (or never get one). ``parts_variables[p]``: the variables of partition ``p``; a variable
    in none of them (a layer outside the graph) is partition 0's."""
    _check_outside_scope(model)
    partition = _partition_of(parts_variables)
    variables = list(model.variables)
    for v in variables:
        p = partition.get(id(v), 0)
        if p == stage:
            if not has_value(v):
                initialize_deferred(v)
        else:
            release_value(v, NotHeld(v.path, p, stage))
    forget_uninitialized(variables)
    layers = []
    for layer in all_layers(model):
        owners = {partition.get(id(v), 0) for v in own_variables(layer)}
        if len(owners) > 1:
            raise NotSupportedError(
                f"layer {layer.name!r} holds variables of partitions {sorted(owners)}: a layer's "
                "variables must all be in one partition (use one layer per partition)")
        layers.append(owners.pop() if owners else -1)
    return Ownership(stage, tuple(partition.get(id(v), 0) for v in model.weights), tuple(layers))
