"""Cutting a Keras model into pipeline partitions: at its ``SplitLayer`` s, or automatically.

Why here, before any training: a cut that cannot work (a layer used on both sides, a model
with no graph) must be refused when ``tnt.Model`` is made, with the layer named, not
surface as wrong numbers or a hang between stages later.

Where each layer goes. With SplitLayers (they always win): a SplitLayer is one partition
further than the latest of its inputs; any other layer is in the latest partition of its
inputs (partition 0 if it reads only model inputs). Without them, ``num_partitions=S`` cuts
the layers, in the graph's order, at ``S - 1`` *cut points*: places that at most one
tensor (besides model outputs on their way to the end) crosses, and that no layer's uses
straddle. In a chain (a Sequential model) every place between two layers is one; in a
residual network the places between the blocks. The cuts balance the **parameters** of
the partitions (the largest partition as small as possible, then the sum of squares): a
rank's weights, gradients and optimizer state grow with them, and that memory is what
pipelining divides between ranks; it is known exactly from the variables' shapes (never
their values: a model built inside ``keras.StatelessScope(initialize_variables=False)``
has none), where a FLOP count needs a rule per layer type and is wrong for embeddings and
recurrent layers. For the dense layers that dominate MLPs and transformers, parameters
are also proportional to the FLOPs per sample; a convolutional network, whose compute
lies where its parameters are not, is better cut with SplitLayers.

Routing. A tensor computed in partition ``p`` and used in ``q > p + 1`` (a residual
connection across two cuts), or a model output computed before the last partition, is
sent through every stage between them unchanged: partition ``r`` receives exactly what
``r - 1`` sends, a list fixed here, in the graph's order. A model input is not routed: every
rank reads the same global batch, so the stage whose partition uses an input reads it from
``x`` itself (cheaper than sending it along, and the same values). Partition 0 takes ``x``
in the model's own input structure.

Each partition is an ordinary functional Keras model from what enters it to what it
computes, sharing the layer objects, so ``models[p].weights`` are the variables that stage
``p`` owns and trains; what passes through a stage unchanged is not part of its model
(:meth:`Partitioning.emitted` adds it). Running the partitions one after another
(:meth:`Partitioning.run`) computes what the whole model computes.

Walking the graph needs each Keras tensor's producer, which Keras 3 keeps in private
attributes (``tarantella._keras_compat.producer``); :func:`_producer` is the one caller.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from .._keras_compat import producer
from ..errors import PartitionError
from ..keras.layers import SplitLayer

__all__ = ["PartitionError", "Partitioning", "partition", "split_layers"]

#: where a value a stage uses or emits comes from: what the previous stage sent (index into
#: its list), the stage's own model inputs read from ``x`` (flat index of the model input),
#: or what the stage's partition computed (index into its outputs)
RECEIVED, X, COMPUTED = "received", "x", "computed"


@dataclass
class Partitioning:
    """The partitions of a model, in pipeline order, and what flows between them."""

    #: partition ``p`` as a functional model (sharing the whole model's layers)
    models: list[keras.Model]
    #: for each cut ``p`` -> ``p + 1``: the names of its SplitLayers, or for an automatic
    #: cut the name of the last layer before it
    cuts: list[list[str]] = field(default_factory=list)
    #: for each partition: what the previous stage sends it (Keras tensors: shape, dtype)
    received: list[list[Any]] = field(default_factory=list)
    #: for each partition ``p > 0``: the inputs of ``models[p]``, each ``(RECEIVED, i)`` or
    #: ``(X, i)`` (partition 0 takes ``x`` as the model does)
    feeds: list[list[tuple[str, int]]] = field(default_factory=list)
    #: for each partition: what it sends on (the last: the model's flat outputs), each
    #: ``(RECEIVED, i)`` (passed through) or ``(COMPUTED, j)``
    emits: list[list[tuple[str, int]]] = field(default_factory=list)
    #: the model's output structure (Keras tensors), into which the last stage packs
    output_structure: Any = None
    #: whether the cuts were chosen automatically (no SplitLayer)
    automatic: bool = False

    @property
    def num_partitions(self) -> int:
        return len(self.models)

    def param_count(self, p: int) -> int:
        """The parameters partition ``p`` holds (``model.local_param_count`` on rank p),
        from the variables' shapes."""
        return sum(math.prod(int(d) for d in w.shape) for w in self.models[p].weights)

    def reads_x(self, p: int) -> bool:
        """Whether stage ``p`` reads model inputs from ``x``."""
        return p == 0 or any(kind == X for kind, _ in self.feeds[p])

    def feed(self, p: int, received: list[Any], x: Any) -> Any:
        """What ``models[p]`` is called with: ``x`` itself on partition 0, else the list of
        its inputs, from ``received`` (what stage ``p - 1`` sent) and ``x``."""
        if p == 0:
            return x
        flat_x = keras.tree.flatten(x) if x is not None else []
        return [received[i] if kind == RECEIVED else keras.ops.convert_to_tensor(flat_x[i])
                for kind, i in self.feeds[p]]

    def emitted(self, p: int, received: list[Any], computed: Any) -> list[Any]:
        """What stage ``p`` sends on (on the last stage: the model's flat outputs), from
        ``received`` and what its partition computed (its outputs, in any structure)."""
        flat = keras.tree.flatten(computed)
        return [received[i] if kind == RECEIVED else flat[i] for kind, i in self.emits[p]]

    def outputs(self, flat: list[Any]) -> Any:
        """The model's flat outputs in the model's output structure."""
        return keras.tree.pack_sequence_as(self.output_structure, list(flat))

    def run(self, x: Any) -> Any:
        """The partitions one after another, in one process: what the whole model computes
        (the reference the pipeline is checked against)."""
        received: list[Any] = []
        for p in range(self.num_partitions):
            received = self.emitted(p, received, self.models[p](self.feed(p, received, x)))
        return self.outputs(received)


def _producer(tensor: Any) -> tuple[Any, Any]:
    """(operation, node) that made ``tensor`` in the functional graph."""
    found = producer(tensor)
    if found is None:
        raise PartitionError(f"{tensor!r} is not a tensor of a functional Keras model")
    return found


def _layer_name(operation: Any) -> str:
    return f"{type(operation).__name__} {operation.name!r}"


def _check_functional(model: Any) -> None:
    name = getattr(model, "name", model)
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if isinstance(model, keras.Sequential) and not inputs:
        raise PartitionError(
            f"keras.Sequential model {name!r} has no input shape yet, so there is no graph to "
            "cut: start it with keras.Input(shape=...) (or give its first layer input_shape=, "
            "or call model.build(input_shape)) before tnt.Model")
    if not isinstance(model, keras.Model) or not inputs or not outputs:
        raise PartitionError(
            f"model {name!r} is not a functional or Sequential Keras model (a sub-classed "
            "model has no graph to cut): build it with the functional API (keras.Input(...), "
            "layer calls, keras.Model(inputs, outputs)) or as a keras.Sequential")


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


def split_layers(model: Any) -> list[str]:
    """The names of the SplitLayers between ``model``'s inputs and outputs."""
    _check_functional(model)
    return [op.name for op, _ in _nodes(model) if isinstance(op, SplitLayer)]


def partition(model: Any, num_partitions: int | None = None) -> Partitioning:
    """Cut ``model`` (see the module doc): at its SplitLayers if it has any (then
    ``num_partitions``, if given, must be their count), else into ``num_partitions``
    (default 1) automatically; refuse a cut that cannot work."""
    _check_functional(model)
    nodes = list(_nodes(model))
    splits = [op.name for op, _ in nodes if isinstance(op, SplitLayer)]
    if splits:
        where, cuts = _at_split_layers(model, nodes)
        if num_partitions is not None and num_partitions != len(cuts) + 1:
            raise PartitionError(
                f"model {model.name!r} has SplitLayers for {len(cuts) + 1} partitions "
                f"({len(cuts)} cuts: {', '.join(repr(n) for n in splits)}), but "
                f"num_pipeline_stages={num_partitions}: the SplitLayers decide; drop "
                "num_pipeline_stages, or the SplitLayers to have the model cut automatically")
        automatic = False
    elif num_partitions is None or num_partitions == 1:
        where, cuts, automatic = [0] * len(nodes), [], False
    else:
        where, cuts = _automatic(model, nodes, num_partitions)
        automatic = True
    count = len(cuts) + 1
    _check_shared_layers(nodes, where)
    parts = _build(model, nodes, where, count, cuts)
    parts.automatic = automatic
    return parts


def _at_split_layers(model: keras.Model, nodes: list[tuple[Any, Any]]) -> tuple[list[int], list[list[str]]]:
    """Each node's partition by the SplitLayer rule, and the SplitLayers of each cut."""
    inputs = {id(t) for t in model.inputs}
    stage: dict[int, int] = {}
    where: list[int] = []
    cuts: dict[int, list[str]] = {}
    for operation, node in nodes:
        p = max((stage[id(t)] for t in node.input_tensors if id(t) not in inputs), default=0)
        if isinstance(operation, SplitLayer):
            cuts.setdefault(p, []).append(operation.name)
            p += 1
        where.append(p)
        for t in node.output_tensors:
            stage[id(t)] = p
    return where, [cuts[p] for p in range(len(cuts))]


def _cost(operation: Any) -> int:
    """A layer's parameters, from its variables' shapes (never their values)."""
    return sum(math.prod(int(d) for d in w.shape) for w in getattr(operation, "weights", []))


def _cut_points(model: keras.Model, nodes: list[tuple[Any, Any]]) -> list[int]:
    """The places ``i`` (between ``nodes[i - 1]`` and ``nodes[i]``) where an automatic cut
    may go: crossed by at most one tensor that a later layer uses, between no two uses of
    one layer."""
    inputs = {id(t) for t in model.inputs}
    index = {id(node): i for i, (_, node) in enumerate(nodes)}
    made = {id(t): i for i, (_, node) in enumerate(nodes) for t in node.output_tensors}
    used_until: dict[int, int] = {}  # tensor id -> index of the last node that reads it
    for i, (_, node) in enumerate(nodes):
        for t in node.input_tensors:
            if id(t) not in inputs:
                used_until[id(t)] = i
    crossing = np.zeros(len(nodes) + 1, np.int64)  # crossing[i]: tensors made before i, read at/after i
    for t, last in used_until.items():
        crossing[made[t] + 1:last + 1] += 1
    straddled = np.zeros(len(nodes) + 1, bool)
    uses: dict[int, list[int]] = {}
    for operation, node in nodes:
        uses.setdefault(id(operation), []).append(index[id(node)])
    for positions in uses.values():
        if len(positions) > 1:
            straddled[min(positions) + 1:max(positions) + 1] = True
    return [i for i in range(1, len(nodes)) if crossing[i] <= 1 and not straddled[i]]


def _automatic(model: keras.Model, nodes: list[tuple[Any, Any]],
               count: int) -> tuple[list[int], list[list[str]]]:
    """Each node's partition when ``count`` partitions balance their parameters (see the
    module doc), and for each cut the layer before it."""
    points = _cut_points(model, nodes)
    if len(points) < count - 1:
        found = f"only {len(points)}" if points else "none"
        if points:
            found += f" (after {', '.join(repr(nodes[i - 1][0].name) for i in points[:5])}" \
                     f"{', ...' if len(points) > 5 else ''})"
        fewer = f"use num_pipeline_stages={len(points) + 1} or fewer, or " if points else ""
        raise PartitionError(
            f"model {model.name!r} cannot be cut into {count} partitions automatically: that "
            f"needs {count - 1} places between two layers that one tensor crosses, and it has "
            f"{found}; {fewer}mark the cuts with tnt.keras.layers.SplitLayer")
    seen: set[int] = set()
    costs = []
    for operation, _ in nodes:  # a shared layer's parameters count once
        costs.append(0 if id(operation) in seen else _cost(operation))
        seen.add(id(operation))
    prefix = np.concatenate([[0], np.cumsum(costs, dtype=np.int64)])
    bounds = _balanced_bounds(prefix, [0, *points, len(nodes)], count)
    where = [0] * len(nodes)
    for p in range(count):
        for i in range(bounds[p], bounds[p + 1]):
            where[i] = p
    return where, [[nodes[b - 1][0].name] for b in bounds[1:-1]]


def _balanced_bounds(prefix: np.ndarray, points: list[int], count: int) -> list[int]:
    """``count + 1`` bounds from ``points`` (first and last fixed) whose segments have the
    smallest largest cost and, among those, the smallest sum of squared costs; ``prefix[i]``
    is the cost of the first ``i`` nodes. Two dynamic programmes over the points (each
    exact), vectorised over the previous bound."""
    at = prefix[np.asarray(points)]
    m = len(points)
    big = np.iinfo(np.int64).max
    worst = np.full((count + 1, m), big, np.int64)  # [s, j]: s segments ending at points[j]
    worst[0, 0] = 0
    for s in range(1, count + 1):
        for j in range(s, m):
            worst[s, j] = np.maximum(worst[s - 1, :j], at[j] - at[:j]).min()
    limit = worst[count, m - 1]
    squares = np.full((count + 1, m), np.inf)
    choice = np.zeros((count + 1, m), np.int64)
    squares[0, 0] = 0.0
    for s in range(1, count + 1):
        for j in range(s, m):
            segment = at[j] - at[:j]
            q = squares[s - 1, :j] + segment.astype(np.float64) ** 2
            q[segment > limit] = np.inf
            i = int(np.argmin(q))
            squares[s, j], choice[s, j] = q[i], i
    bounds, j = [m - 1], m - 1
    for s in range(count, 0, -1):
        j = int(choice[s, j])
        bounds.append(j)
    return [points[b] for b in reversed(bounds)]


def _check_shared_layers(nodes: list[tuple[Any, Any]], where: list[int]) -> None:
    parts: dict[int, tuple[Any, set[int]]] = {}
    for (operation, _), p in zip(nodes, where):
        parts.setdefault(id(operation), (operation, set()))[1].add(p)
    for operation, used in parts.values():
        if len(used) > 1 and not isinstance(operation, SplitLayer):
            raise PartitionError(
                f"{_layer_name(operation)} is used in partitions {sorted(used)}: a layer "
                "shared across a cut would have its weights on two ranks. Use a separate "
                "layer on each side, or move the cut so that every use is on one side")


def _build(model: keras.Model, nodes: list[tuple[Any, Any]], where: list[int], count: int,
           cuts: list[list[str]]) -> Partitioning:
    """The partition models and what flows between them, given each node's partition."""
    inputs = {id(t): i for i, t in enumerate(model.inputs)}
    # a Sequential model has one input and one output (and no ``input``/``output`` of its own
    # until it is called as a layer)
    input_structure, output_structure = ((model.inputs[0], model.outputs[0])
                                         if isinstance(model, keras.Sequential)
                                         else (model.input, model.output))
    made: dict[int, int] = {}      # tensor id -> partition that computes it
    order: list[Any] = []          # the computed tensors, in the graph's order
    last_use: dict[int, int] = {}  # tensor id -> latest partition that needs it
    reads: list[list[int]] = [[] for _ in range(count)]  # model inputs each partition reads
    for (_, node), p in zip(nodes, where):
        for t in node.input_tensors:
            if id(t) in inputs:
                if inputs[id(t)] not in reads[p]:
                    reads[p].append(inputs[id(t)])
            else:
                last_use[id(t)] = max(last_use.get(id(t), p), p)
        for t in node.output_tensors:
            made[id(t)] = p
            order.append(t)
    for t in model.outputs:  # every output travels to the last stage
        if id(t) in inputs:
            raise PartitionError(f"model {model.name!r} returns its input {t.name!r} as an "
                                 "output: pipelining needs every output computed by a layer")
        last_use[id(t)] = count - 1
    # sent[q]: what crosses cut q -> q + 1, in the graph's order
    sent: list[list[Any]] = [[] for _ in range(max(count - 1, 0))]
    for t in order:
        for q in range(made[id(t)], last_use.get(id(t), made[id(t)])):
            sent[q].append(t)
    for p in range(count):
        if not any(w == p and not isinstance(op, SplitLayer) for (op, _), w in zip(nodes, where)):
            names = ", ".join(repr(n) for n in (cuts[p - 1] if p > 0 else []) +
                              (cuts[p] if p < count - 1 else []))
            raise PartitionError(
                f"partition {p} of model {model.name!r} holds no layer: nothing is computed "
                f"between SplitLayers {names}; remove one of them (each partition runs on a "
                "rank of its own)")
    models, received, feeds, emits = [], [], [], []
    for p in range(count):
        incoming = sent[p - 1] if p > 0 else []
        position = {id(t): i for i, t in enumerate(incoming)}
        mine = [w == p for w in where]
        used = {id(t) for (_, node), m in zip(nodes, mine) if m for t in node.input_tensors}
        feed = [(RECEIVED, i) for i, t in enumerate(incoming) if id(t) in used] + \
            [(X, i) for i in sorted(reads[p])]
        leaving = sent[p] if p < count - 1 else list(model.outputs)
        computed = [t for t in leaving if made[id(t)] == p]
        computed_at = {id(t): j for j, t in enumerate(computed)}
        emit = [(COMPUTED, computed_at[id(t)]) if id(t) in computed_at else (RECEIVED, position[id(t)])
                for t in leaving]
        model_inputs: Any = input_structure if p == 0 else \
            [incoming[i] if kind == RECEIVED else model.inputs[i] for kind, i in feed]
        try:
            models.append(keras.Model(inputs=model_inputs, outputs=computed,
                                      name=f"{model.name}_partition{p}"))
        except ValueError as exc:
            raise PartitionError(f"partition {p} of model {model.name!r} cannot be built as a "
                                 f"Keras model: {exc}") from None
        received.append(list(incoming))
        feeds.append(feed if p > 0 else [])
        emits.append(emit)
    return Partitioning(models, cuts, received, feeds, emits, output_structure)
