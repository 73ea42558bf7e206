"""Cutting a functional Keras model at its ``SplitLayer`` s into pipeline partitions.

Why here, before any training: a cut that cannot work (a branch that bypasses it, a layer
used on both sides, a Sequential model) must be refused when ``tnt.Model`` is made, with
the layer named, not surface as wrong numbers or a hang between stages later.

The rule: every model input is in partition 0; a SplitLayer's output is one partition
further than its input; any other layer's output is in the partition of its inputs, which
must all be in one partition. The model's outputs must all be in the last one. Partition
``p`` is then an ordinary functional model from the tensors entering it (the model inputs,
or the outputs of the SplitLayers into ``p``) to the tensors leaving it (the inputs of the
SplitLayers out of ``p``, or the model's outputs); it shares the layer objects, so its
weights are the whole model's weights. Running the partitions one after another, each on
what the previous one returned, computes what the whole model computes.

Walking the graph needs each Keras tensor's producer, which Keras 3 keeps in private
attributes (``tarantella._keras_compat.producer``); :func:`_producer` is the one caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras

from ._keras_compat import producer
from .errors import PartitionError
from .keras.layers import SplitLayer

__all__ = ["PartitionError", "Partitioning", "partition"]


@dataclass
class Partitioning:
    """The partitions of a model, in pipeline order."""

    #: partition ``p`` as a functional model (sharing the whole model's layers)
    models: list[keras.Model]
    #: for each cut ``p`` -> ``p + 1``: the names of its SplitLayers
    cuts: list[list[str]] = field(default_factory=list)
    #: for each cut ``p`` -> ``p + 1``: input ``j`` of partition ``p + 1`` is output
    #: ``routes[p][j]`` of partition ``p`` (a tensor through two SplitLayers crosses once)
    routes: list[list[int]] = field(default_factory=list)

    def run(self, inputs: Any) -> Any:
        """The partitions one after another, in one process: what the whole model computes
        (the reference the pipeline is checked against)."""
        values = self.models[0](inputs)
        for p in range(1, self.num_partitions):
            flat = values if isinstance(values, (list, tuple)) else [values]
            values = self.models[p]([flat[i] for i in self.routes[p - 1]])
        return values

    @property
    def num_partitions(self) -> int:
        return len(self.models)

    def param_count(self, p: int) -> int:
        """The parameters partition ``p`` holds (``model.local_param_count`` on rank p)."""
        return int(sum(int(keras.ops.size(w)) for w in self.models[p].weights))


def _producer(tensor: Any) -> tuple[Any, Any]:
    """(operation, node) that made ``tensor`` in the functional graph."""
    found = producer(tensor)
    if found is None:
        raise PartitionError(f"{tensor!r} is not a tensor of a functional Keras model")
    return found


def _layer_name(operation: Any) -> str:
    return f"{type(operation).__name__} {operation.name!r}"


def _check_functional(model: Any) -> None:
    if isinstance(model, keras.Sequential):
        raise PartitionError(
            f"model {model.name!r} is a keras.Sequential model: pipelining cuts a functional "
            "model at its SplitLayers; build it with the functional API "
            "(keras.Input(...), layer calls, keras.Model(inputs, outputs))")
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not isinstance(model, keras.Model) or not inputs or not outputs:
        raise PartitionError(
            f"model {getattr(model, 'name', model)!r} is not a functional Keras model (a "
            "sub-classed model has no graph to cut): build it with the functional API "
            "(keras.Input(...), layer calls, keras.Model(inputs, outputs))")


def _nodes(model: keras.Model) -> Iterator[tuple[Any, Any]]:
    """Every (operation, node) between the model's inputs and outputs, each producer
    before its consumers (an iterative post-order walk from the outputs: deep models
    do not hit Python's recursion limit)."""
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(t, False) for t in reversed(model.outputs)]
    inputs = {id(t) for t in model.inputs}
    while stack:
        tensor, expanded = stack.pop()
        if id(tensor) in inputs:
            continue
        operation, node = _producer(tensor)
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            yield operation, node
            continue
        stack.append((tensor, True))
        for parent in reversed(list(node.input_tensors)):
            if id(parent) not in inputs:
                parent_node = _producer(parent)[1]
                if id(parent_node) not in seen:
                    stack.append((parent, False))


def partition(model: Any) -> Partitioning:
    """Cut ``model`` at its SplitLayers (see the module doc); refuse a cut that cannot work."""
    _check_functional(model)
    stage: dict[int, int] = {id(t): 0 for t in model.inputs}
    where: dict[int, tuple[Any, set[int]]] = {}  # operation id -> (operation, its partitions)
    entering: dict[int, list[Any]] = {}  # p -> tensors entering partition p (p >= 1)
    leaving: dict[int, list[Any]] = {}   # p -> tensors leaving partition p
    routes: dict[int, list[int]] = {}  # p -> for each tensor entering p + 1: its index in leaving[p]
    cuts: dict[int, list[str]] = {}
    for operation, node in _nodes(model):
        sources = list(node.input_tensors)
        stages = {stage[id(t)] for t in sources}
        if len(stages) > 1:
            names = ", ".join(f"{_producer(t)[0].name!r} (partition {stage[id(t)]})"
                              if id(t) not in {id(i) for i in model.inputs}
                              else f"model input {t.name!r} (partition 0)" for t in sources)
            kind = "SplitLayer" if isinstance(operation, SplitLayer) else "layer"
            raise PartitionError(
                f"the cut does not separate the model: {kind} {operation.name!r} takes tensors "
                f"of different partitions: {names}. Every tensor that crosses a cut must go "
                "through a SplitLayer of that cut (add one on the branch that bypasses it)")
        p = stages.pop() if stages else 0
        if isinstance(operation, SplitLayer):
            out = leaving.setdefault(p, [])
            for t in sources:  # a tensor through two SplitLayers is sent once
                index = next((i for i, s in enumerate(out) if s is t), None)
                if index is None:
                    index = len(out)
                    out.append(t)
                routes.setdefault(p, []).append(index)
            cuts.setdefault(p, []).append(operation.name)
            out_stage = p + 1
            entering.setdefault(out_stage, []).extend(node.output_tensors)
        else:
            out_stage = p
        where.setdefault(id(operation), (operation, set()))[1].add(p)
        for t in node.output_tensors:
            stage[id(t)] = out_stage
    for operation, parts in where.values():
        if len(parts) > 1 and not isinstance(operation, SplitLayer):
            raise PartitionError(
                f"{_layer_name(operation)} is used in partitions {sorted(parts)}: a layer "
                "shared across a cut would have its weights on two ranks. Use a separate "
                "layer on each side, or move the cut so that every use is on one side")
    last = max((stage[id(t)] for t in model.outputs), default=0)
    for t in model.outputs:
        if stage[id(t)] != last:
            raise PartitionError(
                f"model output {t.name!r} is computed in partition {stage[id(t)]}, before the "
                f"last cut: every output must be in the last partition ({last}); route it "
                "through the SplitLayers after it")
    count = last + 1
    if sorted(cuts) != list(range(count - 1)):
        missing = sorted(set(range(count - 1)) - set(cuts))
        raise PartitionError(f"cuts {missing} have no SplitLayer")  # not reachable by the rule
    models = []
    for p in range(count):
        inputs = model.input if p == 0 else entering[p]
        outputs = model.output if p == count - 1 else leaving[p]
        if p > 0 and all(any(t is i for i in entering[p]) for t in keras.tree.flatten(outputs)):
            names = ", ".join(repr(n) for n in cuts[p - 1] + (cuts[p] if p < count - 1 else []))
            raise PartitionError(
                f"partition {p} of model {model.name!r} holds no layer: nothing is computed "
                f"between SplitLayers {names}; remove one of them (each partition runs on a "
                "rank of its own)")
        try:
            models.append(keras.Model(inputs=inputs, outputs=outputs,
                                      name=f"{model.name}_partition{p}"))
        except ValueError as exc:
            raise PartitionError(f"partition {p} of model {model.name!r} cannot be built as a "
                                 f"Keras model: {exc}") from None
    return Partitioning(models, [cuts[p] for p in range(count - 1)],
                        [routes[p] for p in range(count - 1)])
