"""Benchmark support: Gloo's algorithms timed directly, off the backend class.

``benchmarks/allreduce_gloo.py`` compares :meth:`GlooBackend.allreduce_async` against
Gloo's own algorithms called from C++ on the caller's thread; that baseline is no part of
the ``CommBackend`` contract, so it lives here rather than on the backend.
"""

from __future__ import annotations

import numpy as np

from tnt_core import check_buffer

from .backend import GlooBackend

__all__ = ["time_direct_allreduce"]


def time_direct_allreduce(backend: GlooBackend, buf: np.ndarray, iters: int,
                          algorithm: str = "ring") -> list[float]:
    """Seconds per call of ``algorithm`` (``ring``: Gloo's ``RING``) summing ``buf`` on
    ``backend``'s context, invoked directly from C++ on this thread, bypassing the queue.
    Over TCP even when the backend's allreduces go through shared memory;
    ``algorithm="shm"`` times the shared-memory allreduce itself. Every rank must call it
    alike."""
    check_buffer(buf, "allreduce")
    backend._check_open("baseline allreduce")
    with backend._translate("baseline allreduce"):
        return backend._comm.time_direct_allreduce(buf, algorithm, iters)
