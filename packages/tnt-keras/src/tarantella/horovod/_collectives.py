"""Horovod's tensor collectives: ``allreduce`` (averaging by default), ``allgather``,
``broadcast``, ``broadcast_variables``, the reduction ops and the compressors.

They take and return TensorFlow tensors, eagerly or inside a ``tf.function``. The data goes
through tarantella's user collectives (``tarantella.collectives``: every rank checks
that the others passed the same shapes and dtypes before any data moves); inside a
``tf.function`` each call is one stateful op of the channel (``tarantella.comm``), ordered
after the collectives traced before it. The training gradients do not come here: they take the
fused, native path (``tarantella.loops.gradients``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import comm
from ..collectives import ReductionOp
from ..collectives import allgather as _allgather
from ..collectives import allreduce as _allreduce
from ..collectives import broadcast as _broadcast
from ..comm.compression import FP16Compression, NoCompression, travels_as_is
from ..data_parallel.weights import broadcast_variables
from ..errors import NotSupportedError
from ..reporting.tracebacks import user_facing

__all__ = ["Average", "Compression", "Max", "Min", "Product", "Sum", "allgather", "allreduce",
           "broadcast", "broadcast_object", "broadcast_variables", "current_size", "reduction_op"]

#: Horovod's reduction ops
Average = ReductionOp.AVERAGE
Sum = ReductionOp.SUM
Min = ReductionOp.MIN
Max = ReductionOp.MAX
Product = ReductionOp.PROD


def reduction_op(op: Any, average: bool | None, where: str) -> ReductionOp:
    """Horovod's ``op``/``average`` arguments as one op (``Average`` when neither is given)."""
    if op is not None and average is not None:
        raise ValueError(f"{where}: pass op= or the older average=, not both")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, ReductionOp):
        return op
    raise NotSupportedError(f"{where}(op={op!r}): use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or "
                            "hvd.Product (Adasum is not available)")


#: tensors travel as they are (the custom loops' own default)
NoneCompressor = NoCompression


#: floating-point tensors travel as float16 (half the bytes of float32; float16's precision)
FP16Compressor = FP16Compression


class Compression:
    """Horovod's compressors: ``hvd.Compression.none`` and ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _on_host(fn: Callable[[list[np.ndarray]], Sequence[np.ndarray]], tensors: Sequence[tf.Tensor],
             dtypes: Sequence[tf.DType], name: str) -> list[tf.Tensor]:
    """``fn`` over the tensors' values, eagerly or as one ordered graph op."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(a, dtype=d) for a, d in zip(fn([t.numpy() for t in tensors]), dtypes)]
    outs = comm.world().host_op(lambda _backend, *arrays: list(fn(list(arrays))), tensors,
                                list(dtypes), name=name)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _gather(tensor: tf.Tensor, name: str) -> tf.Tensor:
    out = _on_host(lambda a: [_allgather(a[0])], [tensor], [tensor.dtype], name)[0]
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def current_size() -> tf.Tensor:
    """The number of ranks as an int64 tensor: in a traced function of an elastic job, read
    when the function runs (ranks leave, and ``hvd.elastic.run`` does not trace the user's
    functions again); elsewhere a constant."""
    channel = comm.world()
    if tf.executing_eagerly() or channel.runtime.membership is None:
        return tf.constant(channel.size, tf.int64)
    link = channel.link

    def size() -> np.int64:
        return np.int64(link.backend.size)

    out = tf.numpy_function(size, [], tf.int64, stateful=True, name="hvd_size")
    out.set_shape([])
    return out


def _divided(t: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
    """``t`` over the number of ranks (TensorFlow's division rule: integers give float64)."""
    return t / tf.cast(size, t.dtype)


def _scaled(t: tf.Tensor, factor: float) -> tf.Tensor:
    return t if factor == 1.0 else t * tf.cast(factor, t.dtype)


@tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
@user_facing
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None) -> Any:
    """The tensor reduced over the ranks: their average by default (``op=hvd.Sum``,
    ``Min``, ``Max``, ``Product``); a ``tf.IndexedSlices`` is gathered (and its values
    divided by the number of ranks for the average). An average of integers is their sum
    divided by the number of ranks, with TensorFlow's integer division rule (a float64
    result). ``compression=hvd.Compression.fp16`` sends floating-point tensors as float16
    (an average is divided by the number of ranks before, so the float16 sum cannot
    overflow). ``device_*`` are accepted for compatibility: the data moves through the host.
    """
    where = "hvd.allreduce"
    op = reduction_op(op, average, where)
    label = name or "hvd_allreduce"
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Average, Sum):
            raise NotSupportedError(f"{where}: a tf.IndexedSlices is gathered, so only hvd.Sum and "
                                    "hvd.Average reduce it")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotSupportedError(f"{where}: prescale_factor/postscale_factor with a tf.IndexedSlices")
        values = _gather(tensor.values, label + "_values")
        indices = _gather(tensor.indices, label + "_indices")
        if op is Average:
            values = _divided(values, current_size())
        return tf.IndexedSlices(values, indices, tensor.dense_shape)
    t = _scaled(tf.convert_to_tensor(tensor), prescale_factor)
    # compressed, an average is divided before the narrow sum (which cannot overflow then)
    predivide = op is Average and not travels_as_is(compression) and t.dtype.is_floating
    if predivide:
        t = _divided(t, current_size())
    wire, context = compression.compress(t)
    inner = ReductionOp.SUM if op is Average else op
    reduced = _on_host(lambda a: [_allreduce(a[0], reduction_op=inner)], [wire], [wire.dtype], label)[0]
    reduced.set_shape(wire.shape)
    result = compression.decompress(reduced, context)
    if op is Average and not predivide:
        result = _divided(result, current_size())
    return _scaled(result, postscale_factor)


@tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
@user_facing
def allgather(tensor: Any, name: str | None = None) -> tf.Tensor:
    """Every rank's tensor, concatenated along the first axis in rank order (the first
    dimensions may differ between ranks)."""
    return _gather(tf.convert_to_tensor(tensor), name or "hvd_allgather")


@tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
@user_facing
def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """The tensor of ``root_rank``, on every rank."""
    t = tf.convert_to_tensor(tensor)
    out = _on_host(lambda a: [_broadcast(a[0], root_rank=root_rank)], [t], [t.dtype],
                   name or "hvd_broadcast")[0]
    out.set_shape(t.shape)
    return out


@user_facing
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (any picklable object; eagerly, on the host)."""
    channel = comm.world()
    payload = pickle.dumps(obj) if channel.rank == root_rank else b""
    length = channel.broadcast_arrays([np.array([len(payload)], dtype=np.int64)], root_rank)[0]
    buffer = np.frombuffer(payload, dtype=np.uint8) if channel.rank == root_rank \
        else np.zeros(int(length[0]), dtype=np.uint8)
    received = channel.broadcast_arrays([buffer], root_rank)[0].tobytes()
    return obj if channel.rank == root_rank else pickle.loads(received)  # the job's own ranks sent it
