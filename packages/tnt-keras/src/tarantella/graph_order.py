"""Collectives traced into one graph run in the order they were traced.

TensorFlow runs the ops of a ``tf.function`` in whatever order their data allows: two
collectives with no data dependency between them may start in one order on rank 0 and in
the other on rank 1, and then the ranks wait for each other, or pair wrong buffers. So each
collective a user's code traces (gradient reductions of a custom loop, ``tarantella.horovod``'s
collectives, a broadcast of variables) waits for the one traced before it in the same graph.
Inside ``tnt.Model``'s step the step's own chain is used (``StepContext.last``), so such
calls in a custom ``train_step`` line up with the step's collectives. Eagerly, every op runs
when it is called: there is nothing to order.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import tensorflow as tf

from .steps import current_step

__all__ = ["previous", "record"]

#: graph -> the outputs of the last collective traced into it
_last: weakref.WeakKeyDictionary[tf.Graph, list[tf.Tensor]] = weakref.WeakKeyDictionary()


def previous() -> list[tf.Tensor]:
    """The outputs of the collective traced before this one in the current graph (a new
    collective takes them as control inputs); empty when eager or when it is the first."""
    if tf.executing_eagerly():
        return []
    step = current_step()
    if step is not None:
        return list(step.last)
    return list(_last.get(tf.compat.v1.get_default_graph(), []))


def record(outputs: Sequence[tf.Tensor]) -> None:
    """Remember ``outputs`` as the current graph's last collective."""
    if tf.executing_eagerly():
        return
    step = current_step()
    if step is not None:
        step.last = list(outputs)
    else:
        _last[tf.compat.v1.get_default_graph()] = list(outputs)
