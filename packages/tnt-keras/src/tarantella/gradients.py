"""Gradient (and metric-state) reduction inside the compiled train step.

One :class:`StepReducer` per kind of step owns a ``tnt_core.FusedAllreducer`` whose bucket
plan is made once, when the step is first traced (before the first step runs), with the
fusion threshold of ``TNT_FUSION_THRESHOLD_KB``. Tensors are planned in the order they
become ready: the metric-state increments (ready after the forward pass), then the
gradients in backward order (last layer first).

Inside the ``tf.function`` every bucket is handed to the reducer by its own stateful
``tf.numpy_function`` that depends only on that bucket's tensors, so TensorFlow's dataflow
executor runs it as soon as the bucket's last gradient exists: the copy into the bucket
happens, and its allreduce starts, while backprop of earlier layers goes on. One finishing
``numpy_function`` that consumes every push's token waits for all buckets and returns the
reduced tensors; the optimizer runs only after it. One call per bucket rather than per
tensor: every call into Python from the step costs ~50 µs (measured: the mlp step of
benchmarks/ with a push per tensor spent 1.0 ms of its 5.1 ms in them), and a bucket
cannot start before its last tensor anyway.

Weighting: Keras' default loss reduction averages over the micro-batch, so rank ``r``'s
gradient is ``mean_r``; pushed times ``n_r / B`` and summed over ranks it is
``sum_i g_i / B``, the serial gradient of the global batch, also for uneven micro-batches
and for a rank with no sample (``n_r = 0``: it pushes zeros).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tnt_core

from . import timeline as _timeline

__all__ = ["StepReducer", "global_batch_size_op"]

#: bucket views start at multiples of this (TensorFlow's EIGEN_MAX_ALIGN_BYTES with AVX-512):
#: the reduced tensors are handed to TensorFlow without a copy
_ALIGN = 64


class StepReducer:
    """Pushes tensors of one step into a fused allreducer from graph ops; finishes it."""

    def __init__(self, runtime: tnt_core.Runtime, name: str) -> None:
        self.runtime = runtime
        self.name = name
        self.threshold_bytes = runtime.config.fusion_threshold_bytes
        self.overlap = runtime.config.overlap
        #: the rank's timeline (TNT_TIMELINE), None when off: then no timeline op is traced
        self.timeline = _timeline.get(runtime)
        self._backprop_start: float | None = None
        self._push_times: list[float] = []
        self._finished_at = 0.0
        self._plans: dict[tuple, tnt_core.FusedAllreducer] = {}
        self._reducer: tnt_core.FusedAllreducer | None = None
        self._zeros: dict[int, np.ndarray] = {}
        #: when True, :attr:`local_increments` sums this rank's own metric increments
        self.track_local = False
        self.local_increments: np.ndarray | None = None

    def reset_local(self) -> None:
        """Forget this rank's metric increments (the metrics were reset)."""
        self.local_increments = None

    # -- at trace time -------------------------------------------------------------------

    def plan(self, tensors: Sequence[tf.Tensor]) -> tnt_core.BucketPlan:
        """Make (once per set of shapes) the bucket plan of ``tensors``, in push order."""
        specs = tuple(tnt_core.TensorSpec(tuple(int(d) for d in t.shape), np.dtype(t.dtype.as_numpy_dtype))
                      for t in tensors)
        for spec, t in zip(specs, tensors):
            if spec.dtype not in tnt_core.SUPPORTED_DTYPES:
                raise tnt_core.TntError(
                    f"cannot allreduce {t.name if hasattr(t, 'name') else 'a tensor'} of dtype "
                    f"{spec.dtype}; supported: {', '.join(map(str, tnt_core.SUPPORTED_DTYPES))}"
                )
        reducer = self._plans.get(specs)
        if reducer is None:
            plan = tnt_core.plan_buckets(specs, self.threshold_bytes, align_bytes=_ALIGN)
            reducer = tnt_core.FusedAllreducer(self.runtime.backend, plan, overlap=self.overlap,
                                               timeline=self.timeline)
            self._plans[specs] = reducer
        self._reducer = reducer
        return reducer.plan

    def push_buckets(self, tensors: Sequence[tf.Tensor], n: tf.Tensor, b: tf.Tensor,
                     weighted: Sequence[bool], metrics_id: int | None = None) -> list[tf.Tensor]:
        """Graph ops, one per bucket of the plan: hand the bucket's ``tensors`` (tensor ``i``
        times ``n / b`` when ``weighted[i]``; zeros when ``n == 0``) to the reducer; return
        tokens for :meth:`finish`. Tensor ``metrics_id`` holds this rank's metric increments
        (kept in :attr:`local_increments` when tracked)."""
        reducer = self._reducer
        return [self._push_bucket(reducer, bucket.tensor_ids, [tensors[i] for i in bucket.tensor_ids],
                                  n, b, [weighted[i] for i in bucket.tensor_ids], metrics_id)
                for bucket in reducer.plan.buckets]

    def _push_bucket(self, reducer: tnt_core.FusedAllreducer, ids: Sequence[int],
                     tensors: Sequence[tf.Tensor], n: tf.Tensor, b: tf.Tensor,
                     weighted: Sequence[bool], metrics_id: int | None) -> tf.Tensor:
        push_times = self._push_times if self.timeline is not None else None
        ids, weighted = tuple(ids), tuple(weighted)

        def run(*args: np.ndarray) -> np.ndarray:
            if push_times is not None:
                push_times.append(time.perf_counter())
            *arrays, n_, b_ = args
            n_, b_ = int(n_), int(b_)
            for tensor_id, array, weigh in zip(ids, arrays, weighted):
                if tensor_id == metrics_id and self.track_local and n_ > 0:
                    if self.local_increments is None or self.local_increments.shape != array.shape:
                        self.local_increments = np.array(array, dtype=np.float64, copy=True)
                    else:
                        self.local_increments += array
                if n_ == 0:
                    zeros = self._zeros.get(tensor_id)
                    if zeros is None or zeros.shape != array.shape or zeros.dtype != array.dtype:
                        zeros = self._zeros[tensor_id] = np.zeros_like(array)
                    reducer.push(tensor_id, zeros)
                elif weigh:
                    reducer.push(tensor_id, array, n_ / b_)
                else:
                    reducer.push(tensor_id, array)
            return np.int64(ids[0])

        return tf.numpy_function(run, [*tensors, n, b], tf.int64, stateful=True,
                                 name=f"tnt_push_{self.name}_bucket_{ids[0]}")

    def finish(self, tokens: Sequence[tf.Tensor], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Graph op: wait for every bucket; the reduced tensors, shaped like ``like``."""
        reducer = self._reducer
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

    def mark_backprop_start(self, loss: tf.Tensor) -> tf.Tensor:
        """Graph op: backprop begins once ``loss`` exists (records the time)."""

        def run(_loss: np.ndarray) -> np.ndarray:
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

        def run(*_after: np.ndarray) -> np.ndarray:
            timeline.complete("optimizer apply", "optimizer", self._finished_at, time.perf_counter())
            return np.int64(0)

        return tf.numpy_function(run, list(after), tf.int64, stateful=True,
                                 name=f"tnt_timeline_{self.name}_optimizer")


def global_batch_size_op(runtime: tnt_core.Runtime, n: tf.Tensor) -> tf.Tensor:
    """Graph op: the sum of ``n`` over ranks (data the user distributed by hand)."""
    backend = runtime.backend

    def run(n_: np.ndarray) -> np.ndarray:
        buf = np.array([int(n_)], dtype=np.int64)
        return backend.allreduce(buf)[0]

    total = tf.numpy_function(run, [n], tf.int64, stateful=True, name="tnt_global_batch")
    total.set_shape([])
    return total
