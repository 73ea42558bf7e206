"""Handing the heap that a streamed save or load freed back to the operating system.

Why: a pipelined model is saved and loaded one layer (and one optimizer variable) at a time
(:mod:`tarantella.pipeline.saving`), and every step makes transient copies of those values
(Keras' ``convert_to_numpy`` before HDF5 writes them, the buffer a stage's values arrive in,
the array HDF5 reads before ``assign``). Each is freed at once, yet glibc keeps freed chunks
resident: after a freed mmapped chunk raises its dynamic mmap threshold, copies of a layer's
size come from the heap, and a chunk freed below a live one cannot be returned
by the usual trim of the heap's top. ``malloc_trim(0)`` returns the free pages of every
arena to the operating system, which lowers each rank's peak in its saves and resumes
(measured in docs/pipelining_results.md, "A model larger than one rank").

Only the saving and loading path trims, at a bounded rate (once per :data:`EVERY_BYTES`
streamed, and when a save or load that streamed anything ends): glibc's settings for the
rest of the process, and so training's speed, are untouched. Where the C library has no
``malloc_trim`` (not glibc), this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["EVERY_BYTES", "HeapRelease", "trim"]

#: how many bytes streamed between two trims (a trim costs a walk over the free heap)
EVERY_BYTES = 64 * 2**20


def _load_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # a C library without it (musl)
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_MALLOC_TRIM = _load_trim()


def trim() -> bool:
    """Return the free heap pages of every arena to the operating system; whether any were."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


class HeapRelease:
    """Counts the bytes a save or load has streamed, and trims once per ``every`` bytes."""

    def __init__(self, every: int = EVERY_BYTES) -> None:
        self.every = every
        self.pending = 0

    def streamed(self, nbytes: int) -> None:
        """``nbytes`` of transient copies were made and freed since the last call."""
        self.pending += nbytes
        if self.pending >= self.every:
            self.done()

    def done(self) -> None:
        """The save or load ended: trim if anything was streamed since the last trim (a
        stage serves the writer in every hook of a master-only callback, mostly with nothing
        to send: those hooks do not trim)."""
        if self.pending:
            self.pending = 0
            trim()
