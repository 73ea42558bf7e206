"""Weights broadcast from the master rank, so every rank starts from the same model."""

from __future__ import annotations

import zlib

import keras
import numpy as np

import tnt_core

from .randomness import is_seed_state

__all__ = ["broadcast_model_state"]


def broadcast_model_state(model: keras.Model, runtime: tnt_core.Runtime) -> None:
    """Overwrite weights (and built optimizer state) on every rank with the master's.

    The random seed states stay as they are: each rank has its own (``tarantella.randomness``).
    """
    if runtime.size == 1:
        return
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
    _check_same_model(variables, runtime)
    by_dtype: dict[np.dtype, list] = {}
    for v in variables:
        by_dtype.setdefault(np.dtype(v.dtype), []).append(v)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        group = by_dtype[dtype]
        values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in group]
        buf = np.concatenate([a.reshape(-1) for a in values]) if values else np.zeros(0, dtype)
        buf = np.ascontiguousarray(buf, dtype=dtype)
        runtime.backend.broadcast(buf, root=tnt_core.get_master_rank())
        offset = 0
        for v, a in zip(group, values):
            v.assign(buf[offset:offset + a.size].reshape(a.shape))
            offset += a.size


def _check_same_model(variables: list, runtime: tnt_core.Runtime) -> None:
    """Refuse models that differ between ranks (layers, shapes, dtypes), before any weight
    moves: the broadcast would otherwise pour one model's numbers into another's."""
    layout = ";".join(f"{tuple(v.shape)}:{np.dtype(v.dtype)}" for v in variables)
    mine = np.array([zlib.crc32(layout.encode()), len(variables),
                     sum(int(np.prod(v.shape)) for v in variables)], dtype=np.int64)
    every = runtime.backend.allgather(mine)
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
