"""The order of a graph's collectives, and their count.

TensorFlow runs the ops of a ``tf.function`` in whatever order their data allows: two
collectives with no data dependency between them may start in one order on rank 0 and in
the other on rank 1, and then the ranks wait for each other, or pair wrong buffers. So every
collective traced into a graph waits for the one traced before it in that graph
(:func:`previous`, :func:`record`). Eagerly every op runs when called: nothing to order.

The chain and the count are kept on the graph itself (an attribute of the ``tf.Graph``), not
in a table keyed by graph: they go with the graph, and a new trace starts a new chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = ["count", "previous", "record", "traced_collectives"]

#: attribute of a ``tf.Graph``: the outputs of the last collective traced into it
_LAST = "_tnt_last_collective"
#: attribute of a function's outermost ``tf.Graph``: the names of its collective ops
_TRACED = "_tnt_collectives"


def _function_graph(graph: Any) -> bool:
    """Whether ``graph`` is a function's graph (a ``FuncGraph``: it has an outer graph),
    rather than the process' global graph eager code runs in."""
    return getattr(graph, "outer_graph", None) is not None


def _outermost(graph: Any) -> Any:
    """The graph of the function being traced that ``graph`` belongs to (itself, or for a
    branch or an inner function the outermost function graph around it)."""
    while _function_graph(graph) and _function_graph(graph.outer_graph):
        graph = graph.outer_graph
    return graph


def previous() -> list[tf.Tensor]:
    """The outputs of the collective traced before this one (a new collective takes them as
    control inputs): in the current graph or, for a control-flow branch or an inner function
    with no chain of its own, in the nearest enclosing graph that has one (TensorFlow then
    puts the control input on the ``cond`` or the call). Empty when eager or first."""
    if tf.executing_eagerly():
        return []
    graph: Any = tf.compat.v1.get_default_graph()
    while True:
        last = getattr(graph, _LAST, None)
        if last:
            return list(last)
        if not (_function_graph(graph) and _function_graph(graph.outer_graph)):
            return []
        graph = graph.outer_graph


def record(outputs: Sequence[Any]) -> None:
    """Remember ``outputs`` as the last collective of their graph: the next waits for them."""
    outputs = [t for t in outputs if t is not None]
    if tf.executing_eagerly() or not outputs:
        return
    setattr(outputs[0].graph, _LAST, list(outputs))


def count(*outputs: Any) -> None:
    """Record the ops of ``outputs`` (tensors or operations) as collectives of the function
    being traced (its branches and inner functions count with it)."""
    for out in outputs:
        op = out if isinstance(out, tf.Operation) else getattr(out, "op", None)
        if op is None or tf.executing_eagerly():
            continue
        graph = _outermost(op.graph)
        traced = getattr(graph, _TRACED, None)
        if traced is None:
            traced = []
            setattr(graph, _TRACED, traced)
        traced.append(op.name)


def traced_collectives(graph: tf.Graph) -> list[str]:
    """The names of the collective ops traced into the function of ``graph`` (its
    control-flow branches and inner functions included)."""
    return list(getattr(_outermost(graph), _TRACED, []))
