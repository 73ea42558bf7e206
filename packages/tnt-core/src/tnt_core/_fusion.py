"""Tensor fusion: many small gradients reduced as a few large buffers, early.

One allreduce per tensor pays the network latency hundreds of times per step; one
allreduce of everything waits for the whole backward pass. Buckets of at least the fusion
threshold sit in between: the bucket plan is made once, before the first step, and each
bucket's allreduce starts as soon as its last gradient has been pushed, while backprop of
earlier layers goes on. Framework-agnostic: tnt-keras feeds numpy arrays.

Rules of the plan:

* tensors are taken in the order given, which is the order their gradients become ready
  (backward order: last layer first);
* a bucket holds one dtype only; each dtype has one open bucket, closed once it holds at
  least ``threshold_bytes`` (a tensor larger than the threshold is a bucket of its own,
  a threshold of 0 gives one bucket per tensor); a bucket also closes with the last tensor
  of its dtype (nothing more can join it, so it need not wait for the end: e.g. a small
  float64 metrics bucket pushed first is reduced during backprop, not after it);
* buckets are numbered in the order they close, and their allreduces are issued in that
  order on every rank (the contract's "same order everywhere"), even when gradients arrive
  out of order: a complete bucket waits for the ones numbered before it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backend import CommBackend, Handle, check_op, wait_all
from ._timeline import Timeline
from ._watched_backend import WatchedBackend

__all__ = ["TensorSpec", "Bucket", "BucketPlan", "plan_buckets", "FusedAllreducer", "BUFFER_ALIGNMENT"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor to reduce."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, obj: Any) -> TensorSpec:
        """From a TensorSpec, an array-like with ``shape``/``dtype``, or ``(shape, dtype)``."""
        if isinstance(obj, TensorSpec):
            return obj
        if isinstance(obj, tuple) and len(obj) == 2:
            shape, dtype = obj
        else:
            shape, dtype = obj.shape, obj.dtype
        return cls(tuple(int(d) for d in shape), np.dtype(dtype))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors packed back to back into one buffer of a single dtype."""

    index: int
    dtype: np.dtype
    tensor_ids: tuple[int, ...]
    offsets: tuple[int, ...]  # element offset of each tensor inside the buffer
    specs: tuple[TensorSpec, ...]

    @property
    def size(self) -> int:
        """Elements in the fused buffer."""
        return self.offsets[-1] + self.specs[-1].size if self.specs else 0

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of a list of tensors, and where each tensor lives in them."""

    buckets: tuple[Bucket, ...]
    threshold_bytes: int
    num_tensors: int

    def location(self, tensor_id: int) -> tuple[int, int]:
        """``(bucket index, position in the bucket)`` of a tensor."""
        return self._locations[tensor_id]

    @property
    def _locations(self) -> dict[int, tuple[int, int]]:
        cache = self.__dict__.get("_loc_cache")
        if cache is None:
            cache = {t: (b.index, p) for b in self.buckets for p, t in enumerate(b.tensor_ids)}
            object.__setattr__(self, "_loc_cache", cache)
        return cache

    def describe(self) -> str:
        """One line per bucket, for logs and the timeline."""
        return "\n".join(
            f"bucket {b.index}: {len(b.tensor_ids)} tensors, {b.nbytes} bytes, {b.dtype}"
            for b in self.buckets
        )


def plan_buckets(tensors: Sequence[Any], threshold_bytes: int, align_bytes: int = 0) -> BucketPlan:
    """Plan buckets for ``tensors`` (in backward order) with the given fusion threshold.

    ``align_bytes`` > 0 starts every tensor at a multiple of it inside its bucket (the gap is
    padding that is reduced too, as zeros): with :class:`FusedAllreducer`'s buffers, which
    start at 64-byte boundaries, ``align_bytes=64`` makes every view ``finish`` returns
    64-byte aligned, which lets a framework wrap it without copying (TensorFlow copies an
    array that is not aligned to 64 bytes).
    """
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    if align_bytes < 0:
        raise ValueError(f"alignment must be >= 0 bytes, got {align_bytes}")
    specs = [TensorSpec.of(t) for t in tensors]
    open_buckets: dict[np.dtype, tuple[list[int], int]] = {}  # dtype -> (ids, bytes)
    closed: list[tuple[np.dtype, list[int]]] = []
    last_of_dtype = {spec.dtype: tid for tid, spec in enumerate(specs)}
    for tid, spec in enumerate(specs):
        ids, nbytes = open_buckets.get(spec.dtype, ([], 0))
        ids.append(tid)
        nbytes += spec.nbytes
        if nbytes >= threshold_bytes or last_of_dtype[spec.dtype] == tid:
            closed.append((spec.dtype, ids))
            open_buckets.pop(spec.dtype, None)
        else:
            open_buckets[spec.dtype] = (ids, nbytes)
    assert not open_buckets  # every dtype's last tensor closed its bucket
    buckets = []
    for index, (dtype, ids) in enumerate(closed):
        offsets, offset = [], 0
        step = max(1, align_bytes // dtype.itemsize) if align_bytes else 1
        for tid in ids:
            offset = -(-offset // step) * step
            offsets.append(offset)
            offset += specs[tid].size
        buckets.append(Bucket(index, dtype, tuple(ids), tuple(offsets), tuple(specs[t] for t in ids)))
    return BucketPlan(tuple(buckets), threshold_bytes, len(specs))


#: every bucket buffer starts at a multiple of this many bytes: TensorFlow's
#: EIGEN_MAX_ALIGN_BYTES with AVX-512, below which it copies an array it wraps; the
#: ``align_bytes`` a framework passes to :func:`plan_buckets` so every view is aligned too
BUFFER_ALIGNMENT = 64


def _aligned_zeros(size: int, dtype: np.dtype) -> np.ndarray:
    """A zeroed 1-d array of ``size`` elements starting at a BUFFER_ALIGNMENT boundary."""
    raw = np.zeros(size * dtype.itemsize + BUFFER_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % BUFFER_ALIGNMENT
    return raw[start:start + size * dtype.itemsize].view(dtype)


class FusedAllreducer:
    """Packs tensors into per-bucket buffers and reduces each bucket asynchronously.

    One step: ``push`` every tensor (any order, any thread), then ``finish`` returns the
    reduced tensors in plan order. Buffers are allocated once and reused every step; the
    arrays ``finish`` returns are views into them, valid until the next step's ``push``.

    :param overlap: False defers every allreduce to ``finish`` (after backprop), the
        baseline benchmarks compare overlap against.
    :param timeline: records each bucket's allreduce from issue to completion.
    """

    def __init__(self, backend: CommBackend, plan: BucketPlan, op: str = "sum", *,
                 overlap: bool = True,
                 timeline: Timeline | None = None) -> None:
        self.backend = backend
        self.plan = plan
        self.op = check_op(op)
        self.overlap = overlap
        self.timeline = timeline
        self._buffers = [_aligned_zeros(b.size, b.dtype) for b in plan.buckets]
        self._views = [
            [buf[o:o + s.size].reshape(s.shape) for o, s in zip(b.offsets, b.specs)]
            for b, buf in zip(plan.buckets, self._buffers)
        ]
        self._lock = threading.Lock()
        self._agreed = False  # the ranks agree on the plan at its first use (WatchedBackend)
        self._reset()

    def _reset(self) -> None:
        self._pushed = [bytearray(len(b.tensor_ids)) for b in self.plan.buckets]
        self._missing = [len(b.tensor_ids) for b in self.plan.buckets]
        self._complete = [False] * len(self.plan.buckets)
        self._handles: list[Handle | None] = [None] * len(self.plan.buckets)
        self._issued_at = [0.0] * len(self.plan.buckets)
        self._next_to_issue = 0

    def push(self, tensor_id: int, array: Any, scale: float | None = None) -> None:
        """Copy one tensor (times ``scale``, if given) into its bucket; start every bucket
        that is complete and next in line."""
        bucket_index, pos = self.plan.location(tensor_id)
        bucket = self.plan.buckets[bucket_index]
        spec = bucket.specs[pos]
        src = np.asarray(array)
        if scale is not None and spec.dtype.kind in "iu" and float(scale) != int(scale):
            raise ValueError(
                f"tensor {tensor_id} is {spec.dtype}: scaling it by {scale} would truncate; "
                "scale only floating-point tensors"
            )
        if src.size != spec.size:
            raise ValueError(
                f"tensor {tensor_id} has shape {src.shape}, the plan expects {spec.shape}"
            )
        with self._lock:  # claim the slot first: never write into a buffer in flight
            if self._pushed[bucket_index][pos]:
                raise ValueError(f"tensor {tensor_id} was pushed twice in one step")
            self._pushed[bucket_index][pos] = 1
        dst = self._views[bucket_index][pos]
        if scale is None:
            np.copyto(dst, src.reshape(spec.shape), casting="same_kind")
        else:
            np.multiply(src.reshape(spec.shape), spec.dtype.type(scale), out=dst, casting="same_kind")
        with self._lock:
            self._missing[bucket_index] -= 1
            if self._missing[bucket_index] == 0:
                self._complete[bucket_index] = True
                if self.overlap:
                    self._issue_ready()

    def _issue_ready(self) -> None:
        # called with the lock held: issue in bucket order, as far as complete
        if not self._agreed and self._complete[self._next_to_issue:self._next_to_issue + 1] == [True]:
            if isinstance(self.backend, WatchedBackend):  # one header for every bucket, once
                self.backend.agree_on_plan([b for b in self._buffers if b.size], self.op)
            self._agreed = True
        while self._next_to_issue < len(self._complete) and self._complete[self._next_to_issue]:
            i = self._next_to_issue
            self._issued_at[i] = time.perf_counter()
            if self._buffers[i].size:
                self._handles[i] = self.backend.allreduce_async(self._buffers[i], self.op)
            self._next_to_issue += 1

    def finish(self, timeout: float | None = None) -> list[np.ndarray]:
        """Wait for every bucket; return the reduced tensors in plan order (views)."""
        with self._lock:
            if not self.overlap:
                self._issue_ready()
            if self._next_to_issue != len(self.plan.buckets):
                missing = [
                    b.tensor_ids[p]
                    for b in self.plan.buckets
                    for p in range(len(b.tensor_ids))
                    if not self._pushed[b.index][p]
                ]
                self._reset()
                raise ValueError(
                    f"finish() before every tensor was pushed; missing tensor ids {missing[:10]}"
                )
            handles, issued_at = self._handles, self._issued_at
            self._reset()
        try:
            # as one batch: a backend may then wake the caller once, not once per bucket
            wait_all([h for h in handles if h is not None], timeout)
            for i, handle in enumerate(handles):
                if self.timeline is not None:
                    end = (handle.completion_time() if handle is not None else None) or time.perf_counter()
                    bucket = self.plan.buckets[i]
                    self.timeline.complete(f"allreduce bucket {i}", f"bucket {i}", issued_at[i], end,
                                           bytes=bucket.nbytes, dtype=str(bucket.dtype),
                                           tensors=len(bucket.tensor_ids))
        except BaseException:
            for handle in handles:  # keep buffers owned until in-flight ops end or fail
                if handle is not None and not handle.done():
                    try:
                        handle.wait(timeout)
                    except Exception:  # noqa: BLE001 - the first error is re-raised below
                        pass
            raise
        result: list[np.ndarray] = [None] * self.plan.num_tensors  # type: ignore[list-item]
        for bucket, views in zip(self.plan.buckets, self._views):
            for tid, view in zip(bucket.tensor_ids, views):
                result[tid] = view
        return result
