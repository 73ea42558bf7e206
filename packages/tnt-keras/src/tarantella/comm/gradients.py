"""Gradient reduction inside the compiled step, through the fused allreducer.

One :class:`GradientReducer` per call site of ``optimizer.apply`` in a step (a GAN's step
has two), and one per pipeline stage under ALL, over the group of the stage's replicas
(:mod:`tarantella.pipeline.stage`): the one way tarantella sums gradients. Its bucket plan is
made when the step is traced, with the fusion threshold of ``TNT_FUSION_THRESHOLD_KB``,
for the tensors in the order they become ready: the gradients in backward order (last
layer first).

Inside the ``tf.function`` every bucket is handed to the reducer by its own stateful
``tf.numpy_function`` that depends only on that bucket's tensors, so TensorFlow's dataflow
executor runs it as soon as the bucket's last gradient exists: the copy into the bucket
happens, and its allreduce starts, while backprop of earlier layers goes on. One finishing
``numpy_function`` waits for all buckets and returns the reduced tensors; the optimizer
runs only after it. One call per bucket rather than per tensor: every call into Python
from the step has a fixed cost (docs/performance_results.md), and a bucket cannot start
before its last tensor anyway.

Weighting (see ``tarantella.data_parallel.losses``): rank ``r`` pushes ``factor_r * g_r`` with
``factor_r = scale_r / sum_r divisor_r``; the sum over ranks is the serial gradient. For
Keras' default loss (a mean over the micro-batch) ``factor_r = n_r / B``, also for uneven
micro-batches and for a rank with no sample (``n_r = 0``: it pushes zeros).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import tnt_core

from .. import timeline as _timeline
from . import Channel, count, previous, record
from . import native as native_ops
from .compression import NO_COMPRESSION, Compression, travels_as_is
from .graph_ops import gather_slices, summed_rows
from .native import NativeReducer
from .sparse_rows import RowKind, row_kind

__all__ = ["CurrentAllreducer", "GradientReducer", "dense_gradient", "reduce_weighted"]

#: bucket views start at multiples of this (TensorFlow's EIGEN_MAX_ALIGN_BYTES with AVX-512):
#: the reduced tensors are handed to TensorFlow without a copy
_ALIGN = tnt_core.BUFFER_ALIGNMENT


def dense_gradient(grad: tf.Tensor | tf.IndexedSlices, like: tf.Variable | None) -> tf.Tensor:
    """The gradient as a dense tensor with the variable's static shape.

    A gradient may lose its static shape on the way (``Dense`` on a 3-D input of unknown
    batch size gives a kernel gradient of shape ``(None, units)``); the variable's shape
    restores it. (Sparse gradients do not come here: :func:`reduce_weighted` gathers them
    row by row, as the serial step has them.)
    """
    dense = tf.convert_to_tensor(grad)
    if like is not None:
        dense = tf.ensure_shape(dense, like.shape)
    return dense


def reduce_weighted(grads: Sequence[Any], variables: Sequence[Any] | None, weight: tf.Tensor,
                    reducer: Callable[[], GradientReducer], channel: Channel, *,
                    keep: tf.Tensor,
                    dense_after: Callable[[list[tf.Tensor]], list[tf.Tensor]] | None = None,
                    compression: Compression = NO_COMPRESSION, copy: bool = False,
                    row_kinds: Sequence[RowKind | None] | None = None) -> list[Any]:
    """``sum_r weight_r g_r`` for each gradient (None stays None): the one reduction of
    ``fit``'s step and of a custom loop. Dense gradients go to ``reducer()`` in backward order
    (the last layer's exist first), after the graph's previous collective (and
    ``dense_after(dense)``); sparse ones (``tf.IndexedSlices``) are gathered row by row, as the
    serial step has them (Adam squares rows), keeping this rank's rows where ``keep``.
    ``copy`` copies the results out of reused buckets (for callers that hand them to user
    code). With ``compression``, each dense gradient is weighted in its own dtype first,
    then compressed (:mod:`tarantella.comm.compression`: so the narrow sum cannot
    overflow), summed, and cast back to its dtype; sparse ones are gathered as they are.

    :param variables: the variables of ``grads`` (None where a static shape is unknown).
    :param channel: the ranks the gradients are summed (and sparse rows gathered) over: the
        channel of ``reducer()``.
    :param row_kinds: how each sparse gradient's rows combine over ranks, where the caller
        knows it (:mod:`tarantella.comm.sparse_rows`); else read from the graph.
    """
    out: list[Any] = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    dense_ids = [i for i in present[::-1] if not isinstance(grads[i], tf.IndexedSlices)]
    sparse_ids = [i for i in present if isinstance(grads[i], tf.IndexedSlices)]
    if dense_ids:
        dense = [dense_gradient(grads[i], variables[i] if variables is not None else None)
                 for i in dense_ids]
        after = previous() + (dense_after(dense) if dense_after is not None else [])
        compressed = not travels_as_is(compression) and channel.size > 1  # one rank: nothing travels
        if not compressed:
            packed, factor = [(d, None) for d in dense], weight
        else:  # weighted before the cast: the compressed sum is a gradient's size
            factor64 = tf.cast(weight, tf.float64)
            packed = [compression.compress(_scaled(d, factor64)) for d in dense]
            factor = tf.constant(1.0, tf.float64)
        reduced = reducer().reduce([c for c, _ in packed], factor, after=after)
        record(reduced[:1])
        for i, r, d, (_, context) in zip(dense_ids, reduced, dense, packed):
            if compressed:
                r = tf.cast(compression.decompress(r, context), d.dtype)
            out[i] = tf.raw_ops.DeepCopy(x=r) if copy else r
    for i in sparse_ids:
        g = grads[i]
        name = getattr(variables[i], "path", None) if variables is not None else None
        kind = row_kinds[i] if row_kinds is not None else row_kind(
            g, f"the weight {name}" if name else "a weight")
        values = g.values * tf.cast(weight, g.values.dtype)
        if kind is RowKind.SHARED:  # the same rows on every rank: the batch's are their sum
            out[i] = tf.IndexedSlices(summed_rows(g.indices, values, keep, channel), g.indices,
                                      g.dense_shape)
            continue
        indices, values = gather_slices(g.indices, values, keep, channel)
        out[i] = tf.IndexedSlices(values, indices, g.dense_shape)
    return out


def _scaled(g: tf.Tensor, factor64: tf.Tensor) -> tf.Tensor:
    """``factor * g`` as the buckets compute it (in ``g``'s dtype; zeros for a factor of 0,
    never 0 * NaN). A ``cond`` on the scalar rather than a ``where``: only the branch taken
    runs, one pass over ``g``, where a ``where`` makes three (the zeros, the product, the
    select), each as long as the compressed path's cast."""
    factor = tf.cast(factor64, g.dtype)
    return tf.cond(tf.equal(factor64, 0.0), lambda: tf.zeros_like(g), lambda: g * factor)


def _spec(t: tf.Tensor) -> tnt_core.TensorSpec:
    shape = t.shape
    if not shape.is_fully_defined():
        raise tnt_core.TntError(
            f"cannot reduce a gradient of unknown shape {shape}: pass the variables to "
            "optimizer.apply(grads, variables) so tarantella knows the shapes"
        )
    spec = tnt_core.TensorSpec(tuple(int(d) for d in shape), np.dtype(t.dtype.as_numpy_dtype))
    if spec.dtype not in tnt_core.SUPPORTED_DTYPES:
        raise tnt_core.TntError(
            f"cannot allreduce a gradient of dtype {spec.dtype}; supported: "
            f"{', '.join(map(str, tnt_core.SUPPORTED_DTYPES))}"
        )
    return spec


class CurrentAllreducer:
    """The Python path's fused allreducer of one bucket plan over the communicator the
    channel holds when a step runs: a new one after each :meth:`Channel.bind`.

    The plan depends on the tensors only, so a graph traced once keeps its buckets and its
    overlap with backprop, whichever communicator (and number of ranks) it runs over."""

    def __init__(self, channel: Channel, plan: tnt_core.BucketPlan, overlap: bool,
                 timeline: tnt_core.Timeline | None) -> None:
        self.channel = channel
        self.plan = plan
        self._overlap = overlap
        self._timeline = timeline
        self._bound: tuple[int, tnt_core.FusedAllreducer] | None = None

    def current(self) -> tnt_core.FusedAllreducer:
        generation = self.channel.generation
        if self._bound is None or self._bound[0] != generation:
            self._bound = (generation, tnt_core.FusedAllreducer(
                self.channel.backend, self.plan, overlap=self._overlap, timeline=self._timeline))
        return self._bound[1]

    def push(self, tensor_id: int, array: Any, scale: float | None = None) -> None:
        self.current().push(tensor_id, array, scale)

    def finish(self, timeout: float | None = None) -> list[np.ndarray]:
        return self.current().finish(timeout)


class GradientReducer:
    """Pushes one step's gradients into a fused allreducer from graph ops; finishes it.

    The one gradient reducer of tarantella: DATA's step sums over the job's channel, and a
    pipeline stage under ALL over its replicas' (a group's channel), through the same plan,
    the same path (native where that communicator offers the hand-off, else
    ``numpy_function``) and the same overlap.

    :param channel: the channel whose ranks the gradients are summed over.
    :param rebinding: the traced reduction must outlive its communicator: a graph traced by
        user code that tarantella cannot trace again (a custom loop's ``tf.function`` in an
        elastic Horovod job) reaches whatever communicator the channel holds when it runs.
        It takes the Python path (a native reducer is made for one communicator).
    """

    def __init__(self, channel: Channel, name: str, *, rebinding: bool = False) -> None:
        self.channel = channel
        self.rebinding = rebinding
        self.runtime = runtime = channel.runtime
        self.name = name
        self.threshold_bytes = runtime.config.fusion_threshold_bytes
        self.overlap = runtime.config.overlap
        #: the rank's timeline (TNT_TIMELINE), None when off: then no timeline op is traced
        self.timeline = _timeline.get(runtime)
        self._backprop_start: float | None = None
        self._push_times: list[float] = []
        self._finished_at = 0.0
        self._plans: dict[tuple, tnt_core.FusedAllreducer | NativeReducer | CurrentAllreducer] = {}
        self._native: NativeReducer | None = None  # the plan of the last trace, when native
        self._zeros: dict[tuple[int, int], np.ndarray] = {}
        channel.on_bind(self._forget_plans)

    def _forget_plans(self, _channel: Channel) -> None:
        """A new communicator: the plans of the old one go (the next trace makes new ones)."""
        self._plans.clear()
        self._native = None

    def _reducer_for(self, tensors: Sequence[tf.Tensor]
                     ) -> tnt_core.FusedAllreducer | NativeReducer | CurrentAllreducer:
        specs = tuple(_spec(t) for t in tensors)
        reducer = self._plans.get(specs)
        if reducer is None and self.rebinding:
            plan = tnt_core.plan_buckets(specs, self.threshold_bytes, align_bytes=_ALIGN)
            reducer = self._plans[specs] = CurrentAllreducer(self.channel, plan, self.overlap,
                                                             self.timeline)
        if reducer is None:
            plan = tnt_core.plan_buckets(specs, self.threshold_bytes, align_bytes=_ALIGN)
            why = self.channel.native_reason()
            native_ops.tell_once(why)
            if why is None:
                reducer = self.channel.native_reducer(plan, name=self.name, overlap=self.overlap)
            else:
                reducer = tnt_core.FusedAllreducer(self.channel.backend, plan,
                                                   overlap=self.overlap, timeline=self.timeline)
            self._plans[specs] = reducer
        return reducer

    def reduce(self, grads: Sequence[tf.Tensor], factor: tf.Tensor,
               after: Sequence[tf.Tensor] = ()) -> list[tf.Tensor]:
        """Graph ops: ``sum_r factor_r g_r`` for each of ``grads`` (dense, in backward
        order). ``factor_r`` is at most 1 (``n_r / B`` for a mean loss), so a loss-scaled
        gradient cannot overflow on the way.

        ``after``: tensors of the collective issued before this one in the step; the pushes
        wait for them, so every rank issues its collectives in the same order.
        """
        factor64 = tf.cast(factor, tf.float64)
        with tf.control_dependencies(list(after)):
            factor64 = tf.identity(factor64)
        if self.channel.size == 1:
            # one rank: the sum over ranks is this rank's scaled gradient, no collective;
            # its factor is 1 for a mean loss (n = B), and then nothing is computed
            grads = list(grads)
            return tf.cond(tf.equal(factor64, 1.0), lambda: [tf.identity(g) for g in grads],
                           lambda: [_scaled(g, factor64) for g in grads])
        reducer = self._reducer_for(grads)
        if isinstance(reducer, NativeReducer):
            self._native = reducer
            return self.channel.reduce_native(reducer, grads, factor64)
        tokens = [self._push_bucket(reducer, bucket.tensor_ids,
                                    [grads[i] for i in bucket.tensor_ids], factor64)
                  for bucket in reducer.plan.buckets]
        outs = self._finish(reducer, tokens, grads)
        count(*tokens, outs[0])
        return outs

    def _push_bucket(self, reducer: tnt_core.FusedAllreducer | CurrentAllreducer, ids: Sequence[int],
                     tensors: Sequence[tf.Tensor], scale: tf.Tensor) -> tf.Tensor:
        push_times = self._push_times if self.timeline is not None else None
        ids = tuple(ids)
        zeros = self._zeros

        def run(*args: np.ndarray) -> np.int64:
            if push_times is not None:
                push_times.append(time.perf_counter())
            *arrays, factor_ = args
            factor = float(factor_)
            for tensor_id, array in zip(ids, arrays):
                if factor == 0.0:  # no sample here: zeros, never 0 * (a stand-in's NaN)
                    key = (id(reducer), tensor_id)
                    z = zeros.get(key)
                    if z is None:
                        z = zeros[key] = np.zeros_like(array)
                    reducer.push(tensor_id, z)
                elif factor == 1.0:
                    reducer.push(tensor_id, array)
                else:
                    reducer.push(tensor_id, array, factor)
            return np.int64(ids[0])

        return tf.numpy_function(run, [*tensors, scale], tf.int64, stateful=True,
                                 name=f"tnt_push_{self.name}_bucket_{ids[0]}")

    def _finish(self, reducer: tnt_core.FusedAllreducer | CurrentAllreducer, tokens: Sequence[tf.Tensor],
                like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        timeout = self.runtime.config.timeout_s
        timeline = self.timeline

        def run(*_tokens: np.ndarray) -> list[np.ndarray]:
            if timeline is not None:
                self._record_backprop(timeline)
            # No copy: TensorFlow wraps a 64-byte aligned array without copying (every view
            # is, see _ALIGN). The reducer writes these buffers again only in the next step's
            # pushes, which depend on that step's forward pass, which reads the variables
            # this step's optimizer updated from them: nothing reads them after that.
            out = [a if a.ctypes.data % _ALIGN == 0 else np.array(a, copy=True)
                   for a in reducer.finish(timeout)]
            if timeline is not None:
                self._finished_at = time.perf_counter()
            return out

        outs = tf.numpy_function(run, list(tokens), [t.dtype for t in like], stateful=True,
                                 name=f"tnt_finish_{self.name}")
        if not isinstance(outs, (list, tuple)):
            outs = [outs]
        for out, t in zip(outs, like):
            out.set_shape(t.shape)
        return list(outs)

    # -- timeline (only traced when TNT_TIMELINE is set) ------------------------------------

    def record_buckets(self) -> None:
        """The last reduction's buckets on the timeline, for a caller that runs the reduce
        outside a traced step (a pipeline stage): the native path's times are read from its
        C reducer; the Python path's allreducer recorded its own."""
        if self.timeline is not None and self._native is not None:
            self._native.record_timeline(self.timeline, None)

    def mark_backprop_start(self, loss: tf.Tensor) -> tf.Tensor:
        """Graph op: backprop begins once ``loss`` exists (records the time)."""

        def run(_loss: np.ndarray) -> np.int64:
            self._backprop_start = time.perf_counter()
            return np.int64(0)

        return tf.numpy_function(run, [loss], tf.int64, stateful=True,
                                 name=f"tnt_timeline_{self.name}_backprop")

    def _record_backprop(self, timeline: tnt_core.Timeline) -> None:
        # from the loss to the last gradient pushed (pushes run as gradients appear)
        times, self._push_times[:] = list(self._push_times), []
        start, self._backprop_start = self._backprop_start, None
        if start is not None and times:
            timeline.complete("backprop", "backprop", start, max(times))

    def mark_optimizer_done(self, after: Sequence[tf.Tensor]) -> tf.Tensor:
        """Graph op run after ``after`` (the optimizer's update): records the optimizer
        apply, from the reduced gradients being back to now."""
        timeline = self.timeline

        def run(*_after: np.ndarray) -> np.int64:
            if timeline is not None and self._native is not None:
                start, self._backprop_start = self._backprop_start, None
                self._finished_at = self._native.record_timeline(timeline, start)
            if timeline is not None:
                timeline.complete("optimizer apply", "optimizer", self._finished_at,
                                  time.perf_counter())
            return np.int64(0)

        return tf.numpy_function(run, list(after), tf.int64, stateful=True,
                                 name=f"tnt_timeline_{self.name}_optimizer")
