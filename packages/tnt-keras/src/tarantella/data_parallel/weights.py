"""Weights broadcast from the master rank, so every rank starts from the same model."""

from __future__ import annotations

import zlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from .. import comm
from ..collectives import broadcast
from ..randomness import is_seed_state
from ..reporting.tracebacks import user_facing

__all__ = ["broadcast_model_state", "broadcast_variables", "model_state_variables"]


def broadcast_model_state(model: keras.Model, runtime: tnt_core.Runtime,
                          root: int | None = None) -> None:
    """Overwrite weights (and built optimizer state) on every rank with the master's (or
    ``root``'s).

    The random seed states stay as they are: each rank has its own (``tarantella.randomness``).
    """
    if runtime.size == 1:
        return
    variables = model_state_variables(model)
    channel = comm.world(runtime)
    _check_same_model(variables, channel)
    values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
    root = tnt_core.get_master_rank() if root is None else root
    for v, value in zip(variables, channel.broadcast_arrays(values, root)):
        v.assign(value)


def model_state_variables(model: keras.Model) -> list[Any]:
    """The variables every rank holds alike: weights and built optimizer state, without the
    random seed states (rank-local)."""
    variables, seen = [], set()
    candidates = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        candidates += list(optimizer.variables)
    for v in candidates:
        if id(v) in seen or is_seed_state(v):
            continue
        seen.add(id(v))
        if np.dtype(v.dtype) in tnt_core.SUPPORTED_DTYPES:  # skips e.g. uint32 RNG states
            variables.append(v)
    return variables


def _check_same_model(variables: list, channel: comm.Channel) -> None:
    """Refuse models that differ between ranks (layers, shapes, dtypes), before any weight
    moves: the broadcast would otherwise pour one model's numbers into another's."""
    layout = ";".join(f"{tuple(v.shape)}:{np.dtype(v.dtype)}" for v in variables)
    mine = np.array([zlib.crc32(layout.encode()), len(variables),
                     sum(int(np.prod(v.shape)) for v in variables)], dtype=np.int64)
    every = channel.backend.allgather(mine)
    master = tnt_core.get_master_rank()
    differing = [r for r in range(len(every)) if not np.array_equal(every[r], every[master])]
    if differing:
        r = differing[0]
        (_, n0, v0), (_, n1, v1) = every[master], every[r]
        other = " of other shapes or dtypes" if (n0, v0) == (n1, v1) else ""
        raise ValueError(
            f"the model differs between ranks: rank {master} has {n0} variables ({v0} values), "
            f"rank {r} has {n1} ({v1} values){other}. Build the same model (layers, shapes, "
            "dtypes) and optimizer on every rank: code that depends on tnt.get_rank() must not change them"
        )


def _as_variables(variables: Any) -> list[Any]:
    flat = tf.nest.flatten(variables)
    for i, v in enumerate(flat):
        if not (isinstance(v, (tf.Variable, keras.Variable))):
            raise TypeError(f"broadcast_variables: item {i} is a {type(v).__name__}, not a variable; "
                            "pass variables, e.g. model.weights or optimizer.variables")
    return flat


@tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
@user_facing
def broadcast_variables(variables: Any, root_rank: int = 0) -> tf.Operation | None:
    """Set every variable to its value on ``root_rank`` (a collective: every rank passes the
    same variables, in the same order).

    Eagerly it assigns at once and returns None; inside a ``tf.function`` it returns the op
    that does (also run without being used: it is stateful), ordered after the collectives
    traced before it (``tarantella.comm``).

    :param variables: Keras or TensorFlow variables, or a nest of them (``model.weights``;
        ``model.variables`` includes the random seed states, which then become the root's
        too).
    :param root_rank: the rank whose values every rank takes.
    """
    flat = _as_variables(variables)
    if not flat:
        return None
    if tf.executing_eagerly():
        values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in flat]
        for v, value in zip(flat, broadcast(values, root_rank=root_rank)):
            v.assign(value)
        return None
    dtypes = [tf.as_dtype(v.dtype) for v in flat]

    def run(_backend: tnt_core.CommBackend, *arrays: np.ndarray) -> list[np.ndarray]:
        return list(broadcast(list(arrays), root_rank=root_rank))

    current = [tf.convert_to_tensor(v) for v in flat]
    received = comm.world().host_op(run, current, dtypes, name="tnt_broadcast_variables")
    if not isinstance(received, (list, tuple)):
        received = [received]
    assigns = []
    for v, value in zip(flat, received):
        value.set_shape(v.shape)
        assigns.append(v.assign(value))
    return tf.group(*assigns, name="tnt_broadcast_variables_assign")
