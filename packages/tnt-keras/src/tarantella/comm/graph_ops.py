"""Small collectives as graph ops: summed metric states and logs, gathered predictions and
sparse gradients.

Each goes through the channel (:mod:`tarantella.comm`): ordered behind the collective
traced before it in the same graph, native where the channel's communicator offers the
hand-off and nothing needs Python, else one stateful ``tf.numpy_function``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

import tnt_core

from . import Channel, previous, record

__all__ = ["allreduce_sum", "gather_rows", "gather_slices", "summed_rows"]


def allreduce_sum(vector: tf.Tensor, channel: Channel, *, name: str = "tnt_allreduce",
                  local: Callable[[np.ndarray], None] | None = None) -> tf.Tensor:
    """Graph op: the sum over the channel's ranks of a float64 vector, after the graph's
    previous collective. ``local`` sees this rank's own vector first (rank-local logs).

    Where nothing needs Python it needs no ``numpy_function``: one rank returns the vector
    itself; with the native path the vector goes to the backend as a one-bucket plan agreed
    on once, like the gradients, with no header per step.
    """
    single = channel.size == 1
    if local is None and (single or (vector.shape.is_fully_defined()
                                     and channel.native_reason() is None)):
        with tf.control_dependencies(previous()):
            vector = tf.identity(vector)
        if single:
            record([vector])
            return vector
        reducer = channel.vector_reducer(name, int(vector.shape[0]))
        out = channel.reduce_native(reducer, [vector], tf.constant(1.0, tf.float64))[0]
        record([out])
        return out

    def run(backend: tnt_core.CommBackend, v: np.ndarray) -> np.ndarray:
        if local is not None:
            local(v)
        if backend.size == 1:
            return v
        return backend.allreduce(np.array(v, dtype=np.float64, copy=True))

    out = channel.host_op(run, [vector], tf.float64, name=name)
    out.set_shape(vector.shape)
    return out


def gather_rows(flat: Sequence[tf.Tensor], n: tf.Tensor, b: tf.Tensor,
                channel: Channel) -> list[tf.Tensor]:
    """Graph op: the first ``n`` rows of every tensor of every rank, concatenated in rank
    order (the predictions of the global batch ``b``); with ``b < 0`` (data the user
    distributed) this rank's own rows."""
    if channel.size == 1:  # one rank's micro-batch is the global batch (no Python in its step:
        return list(flat)  # Keras may compile it whole with XLA, see tarantella.data_parallel.xla)

    def gather(backend: tnt_core.CommBackend, *args: np.ndarray) -> list[np.ndarray]:
        *arrays, n_arg, b_arg = args
        n, b = int(n_arg), int(b_arg)
        if b < 0:
            return [a[:n] for a in arrays]
        size = backend.size
        sizes = tnt_core.micro_batch_sizes(b, size, allow_empty=True)
        rows = sizes[0]  # the largest micro-batch
        out = []
        for a in arrays:
            padded = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
            padded[:n] = a[:n]
            every = backend.allgather(padded)
            out.append(np.concatenate([every[k, :sizes[k]] for k in range(size)], axis=0))
        return out

    outs = channel.host_op(gather, [*flat, n, b], [t.dtype for t in flat],
                           name="tnt_gather_predictions")
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for out, t in zip(outs, flat):
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return list(outs)


def gather_slices(indices: tf.Tensor, values: tf.Tensor, keep: tf.Tensor, channel: Channel, *,
                  name: str = "tnt_gather_slices") -> tuple[tf.Tensor, tf.Tensor]:
    """Graph op: a sparse gradient (``tf.IndexedSlices``) of every rank, concatenated in rank
    order, as the serial step has it (rank ``r``'s rows when ``keep`` is true there).

    Keras' optimizers treat a sparse gradient row by row (Adam squares each row before
    adding duplicates up), so summing it densely would change the update.
    """
    if channel.size == 1:  # one rank always has samples (keep); no Python in its step
        return indices, values

    def run(backend: tnt_core.CommBackend, idx: np.ndarray, vals: np.ndarray,
            keep_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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

    out_i, out_v = channel.host_op(run, [indices, values, keep], [indices.dtype, values.dtype],
                                   name=name)
    out_i.set_shape([None])
    out_v.set_shape(tf.TensorShape([None]).concatenate(values.shape[1:]))
    return out_i, out_v


def summed_rows(indices: tf.Tensor, values: tf.Tensor, keep: tf.Tensor, channel: Channel) -> tf.Tensor:
    """Graph op: the sum over the ranks of a sparse gradient's ``values`` whose rows are the
    same on every rank (a lookup that does not depend on the batch:
    :mod:`tarantella.comm.sparse_rows`), zeros where ``keep`` is false (no sample here).
    The ranks' rows are gathered and added in rank order; a rank with other rows than the
    others is an error, never a silent sum."""
    if channel.size == 1:
        return values
    values = tf.where(keep, values, tf.zeros_like(values))
    every_i, every_v = gather_slices(indices, values, tf.constant(True), channel,
                                     name="tnt_gather_shared_rows")
    rows = tf.shape(indices)[0]
    tf.debugging.assert_equal(every_i, tf.tile(indices, [channel.size]), message=(
        "a sparse gradient whose rows do not depend on the batch has other rows on another rank"))
    shape = tf.concat([[channel.size, rows], tf.shape(values)[1:]], 0)
    return tf.reduce_sum(tf.reshape(every_v, shape), axis=0)
