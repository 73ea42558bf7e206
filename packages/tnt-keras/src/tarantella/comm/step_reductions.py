"""Small allreduces a training loop makes at every step (a pipelined step's loss, its batch
fingerprint), each through a buffer agreed on once.

Why: the job's backend makes the ranks agree on every collective before its data moves (a
header exchange: ``tnt_core``'s ``WatchedBackend``), so a scalar allreduce costs two round
trips between the ranks, and in a pipelined step both lie on the critical path. A
reduction that is the same at every step (its size and operation) agrees once, on its first
call, as the gradients' bucket plan does (``agree_on_plan``); each later call is one
exchange. Every rank makes the same calls in the same order (they are the loop's own), so
what the header would check holds by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import tnt_core

__all__ = ["PendingReduction", "StepReductions"]


class PendingReduction:
    """An allreduce of :meth:`StepReductions.start` in flight: :meth:`result` waits for it
    once and keeps a copy (the buffer is the next call's)."""

    def __init__(self, handle: tnt_core.Handle) -> None:
        self._handle: tnt_core.Handle | None = handle
        self._result: np.ndarray | None = None

    def result(self) -> np.ndarray:
        if self._result is None:
            assert self._handle is not None
            handle, self._handle = self._handle, None
            self._result = np.array(handle.wait(), np.float64, copy=True)
        return self._result


class StepReductions:
    """The float64 allreduces of ``backend`` a loop repeats, one agreed buffer per size
    and operation."""

    def __init__(self, backend: tnt_core.CommBackend) -> None:
        self.backend = backend
        self._buffers: dict[tuple[int, str], np.ndarray] = {}

    def agree(self, size: int, op: str = "sum") -> np.ndarray:
        """The buffer of the reductions of ``size`` values under ``op``, agreed on by every
        rank on its first call (a blocking collective: call it where every rank does, not
        from inside a step whose ranks may be elsewhere)."""
        key = (size, op)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = np.zeros(size, np.float64)
            agree = getattr(self.backend, "agree_on_plan", None)
            if agree is not None:  # the job's backend (else a raw one: no header anyway)
                agree([buf], op)
        return buf

    def start(self, values: Sequence[float] | np.ndarray, op: str = "sum") -> PendingReduction:
        """Start the reduction over the ranks of ``values``; at most one of each size and
        ``op`` in flight (its buffer is reused)."""
        values = np.asarray(values, np.float64).reshape(-1)
        buf = self.agree(values.size, op)
        buf[...] = values
        return PendingReduction(self.backend.allreduce_async(buf, op))

    def allreduce(self, values: Sequence[float] | np.ndarray, op: str = "sum") -> np.ndarray:
        """The reduction over the ranks of ``values`` (a new array)."""
        return self.start(values, op).result()
