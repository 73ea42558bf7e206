"""Small collectives as graph ops: summed metric states and logs, gathered predictions.

Each is one stateful ``tf.numpy_function`` that calls the comm backend. ``after`` orders
it behind the collective issued before it in the same step, so every rank issues its
collectives in the same order whatever order TensorFlow's executor would pick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

import tnt_core

from . import native_ops

__all__ = ["allreduce_sum", "gather_rows", "gather_slices"]


def allreduce_sum(vector: tf.Tensor, runtime: tnt_core.Runtime, *, after: Sequence[tf.Tensor] = (),
                  name: str = "tnt_allreduce",
                  local: Callable[[np.ndarray], None] | None = None) -> tf.Tensor:
    """Graph op: the sum over ranks of a float64 vector. ``local`` sees this rank's own
    vector first (rank-local logs).

    Where nothing needs Python it needs no ``numpy_function``: one rank returns the vector
    itself; with the native path (``tarantella.native_ops``) the vector goes to the backend
    as a one-bucket plan agreed on once, like the gradients, with no header per step.
    """
    backend = runtime.backend
    single = runtime.size == 1
    if local is None and (single or (vector.shape.is_fully_defined()
                                     and native_ops.unavailable_reason(runtime) is None)):
        with tf.control_dependencies(list(after)):
            vector = tf.identity(vector)
        if single:
            return vector
        reducer = native_ops.vector_reducer(runtime, name, int(vector.shape[0]))
        return reducer.reduce([vector], tf.constant(1.0, tf.float64))[0]

    def run(v: np.ndarray) -> np.ndarray:
        if local is not None:
            local(v)
        if single:
            return v
        buf = np.array(v, dtype=np.float64, copy=True)
        return backend.allreduce(buf)

    with tf.control_dependencies(list(after)):
        vector = tf.identity(vector)
    out = tf.numpy_function(run, [vector], tf.float64, stateful=True, name=name)
    out.set_shape(vector.shape)
    return out


def gather_rows(flat: Sequence[tf.Tensor], n: tf.Tensor, b: tf.Tensor,
                runtime: tnt_core.Runtime) -> list[tf.Tensor]:
    """Graph op: the first ``n`` rows of every tensor of every rank, concatenated in rank
    order (the predictions of the global batch ``b``); with ``b < 0`` (data the user
    distributed) this rank's own rows."""
    backend = runtime.backend
    size = runtime.size
    if size == 1:  # one rank's micro-batch is the global batch (no Python in its step: Keras
        return list(flat)  # may compile it whole with XLA, see tarantella.xla)

    def gather(*args: np.ndarray) -> list[np.ndarray]:
        *arrays, n_arg, b_arg = args
        n, b = int(n_arg), int(b_arg)
        if b < 0:
            return [a[:n] for a in arrays]
        sizes = tnt_core.micro_batch_sizes(b, size, allow_empty=True)
        rows = sizes[0]  # the largest micro-batch
        out = []
        for a in arrays:
            padded = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
            padded[:n] = a[:n]
            every = backend.allgather(padded)
            out.append(np.concatenate([every[k, :sizes[k]] for k in range(size)], axis=0))
        return out

    outs = tf.numpy_function(gather, [*flat, n, b], [t.dtype for t in flat], stateful=True,
                             name="tnt_gather_predictions")
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for out, t in zip(outs, flat):
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return list(outs)


def gather_slices(indices: tf.Tensor, values: tf.Tensor, keep: tf.Tensor,
                  runtime: tnt_core.Runtime, *, after: Sequence[tf.Tensor] = (),
                  name: str = "tnt_gather_slices",
                  backend: tnt_core.CommBackend | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Graph op: a sparse gradient (``tf.IndexedSlices``) of every rank, concatenated in
    rank order, as the serial step has it (rank ``r``'s rows when ``keep`` is true there).

    Keras' optimizers treat a sparse gradient row by row (Adam squares each row before
    adding duplicates up), so summing it densely would change the update.

    :param backend: the communicator to gather over (a pipeline stage's replicas); the
        job's by default.
    """
    backend = runtime.backend if backend is None else backend
    if backend.size == 1:  # one rank always has samples (keep); no Python in its step
        return indices, values

    def run(idx: np.ndarray, vals: np.ndarray, keep_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not bool(keep_):
            idx, vals = idx[:0], vals[:0]
        counts = backend.allgather(np.array([idx.shape[0]], dtype=np.int64))[:, 0]
        rows = max(int(counts.max()), 1)
        pad_i = np.zeros((rows,), dtype=idx.dtype)
        pad_v = np.zeros((rows,) + vals.shape[1:], dtype=vals.dtype)
        pad_i[:idx.shape[0]] = idx
        pad_v[:idx.shape[0]] = vals
        every_i, every_v = backend.allgather(pad_i), backend.allgather(pad_v)
        return (np.concatenate([every_i[k, :counts[k]] for k in range(len(counts))]),
                np.concatenate([every_v[k, :counts[k]] for k in range(len(counts))]))

    with tf.control_dependencies(list(after)):
        keep = tf.identity(keep)
    out_i, out_v = tf.numpy_function(run, [indices, values, keep], [indices.dtype, values.dtype],
                                     stateful=True, name=name)
    out_i.set_shape([None])
    out_v.set_shape(tf.TensorShape([None]).concatenate(values.shape[1:]))
    return out_i, out_v
