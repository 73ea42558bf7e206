"""Collective agreement: every rank calls the same collective with the same buffer shape,
dtype, reduction and root, or every rank raises :class:`~tnt_core.CollectiveMismatchError`.

Why: transports trust their callers. Handed buffers of different sizes, Gloo and MPI
reduce or gather whatever lies in memory and return normally, or abort the process;
handed different roots, a broadcast returns each rank's own data. Either way the job goes
on with numbers no serial run would give. So before each collective of a multi-rank job
the :class:`~tnt_core.WatchedBackend` compares a fixed-size header describing the
call (:data:`HEADER_LEN` int64 words, in one small allreduce: :func:`mismatch`): equal
headers let the collective run; different ones make every rank raise the same error,
naming what each rank passed, before any data moves.

A collective that repeats every step over buffers allocated once (the fused gradient
buckets of :class:`~tnt_core.FusedAllreducer`) agrees once, on the whole plan, when the
buffers are first used; from then on those buffers go out without a header, so the step
pays nothing per bucket.

``allreduce_async`` keeps its promise to return at once: its header goes out asynchronously
and the :class:`Launcher` starts the allreduce when the header agreed, keeping the rank's
collectives in program order (:class:`DeferredHandle` is what the caller waits on).
"""

from __future__ import annotations

import functools
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ._backend import REDUCE_OPS, SUPPORTED_DTYPES, Handle, check_timeout
from ._errors import CollectiveMismatchError, CommError

__all__ = ["HEADER_LEN", "header", "plan_header", "exchange_words", "verdict", "mismatch",
           "disagreement", "DeferredHandle", "Launcher"]

_MAGIC = 0x746E74  # "tnt": a header that met a data buffer of another rank shows as garbage
_KINDS = ("allreduce", "broadcast", "allgather", "barrier", "fused allreduce plan")
_DIMS = 3  # shape dimensions sent in full; longer shapes are compared by a checksum
#: magic, kind, dtype, op or root, element count, ndim, 3 dimensions, shape checksum
HEADER_LEN = 10
_DTYPE_NAMES = {zlib.crc32(str(d).encode()): str(d) for d in SUPPORTED_DTYPES}


def _dtype_name(dtype: Any) -> str:
    name = getattr(dtype, "name", None) or str(dtype)
    return str(name).replace("torch.", "")


def _shape(buf: Any) -> tuple[int, ...]:
    shape = getattr(buf, "shape", None)
    if shape is None:
        return ()
    return tuple(int(d) for d in shape)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def header(kind: str, buf: Any = None, *, op: str | None = None,
           root: int | None = None) -> np.ndarray:
    """The words that describe one call of ``kind`` on ``buf`` (read-only; cached, since a
    program calls the same few collectives over and over)."""
    if buf is None:
        return _words(kind, (), None, op, root)
    shape = buf.shape if isinstance(buf, np.ndarray) else _shape(buf)
    return _words(kind, shape, getattr(buf, "dtype", "?"), op, root)


@functools.lru_cache(maxsize=1024)
def _words(kind: str, shape: tuple[int, ...], dtype_obj: Any, op: str | None,
           root: int | None) -> np.ndarray:
    dtype = _dtype_name(dtype_obj) if dtype_obj is not None else ""
    dims = list(shape[:_DIMS]) + [0] * (_DIMS - len(shape[:_DIMS]))
    arg = REDUCE_OPS.index(op) + 1 if op in REDUCE_OPS else (root if root is not None else -1)
    count = int(np.prod(shape, dtype=np.int64)) if dtype else 0
    words = np.array([_MAGIC, _KINDS.index(kind), _crc(dtype) if dtype else 0, arg, count,
                      len(shape), *dims, _crc(repr(tuple(shape)))], dtype=np.int64)
    words.flags.writeable = False
    return words


def plan_header(buffers: Sequence[np.ndarray], op: str) -> np.ndarray:
    """The words that describe a fixed sequence of allreduces over ``buffers``: their
    number, total elements and bytes, and a checksum of every dtype and size."""
    layout = ";".join(f"{b.dtype}:{b.size}" for b in buffers)
    return np.array([_MAGIC, _KINDS.index("fused allreduce plan"), _crc(layout),
                     REDUCE_OPS.index(op) + 1, sum(b.size for b in buffers), len(buffers),
                     sum(b.nbytes for b in buffers), 0, 0, 0], dtype=np.int64)


def _describe(row: np.ndarray) -> str:
    if int(row[0]) != _MAGIC or not 0 <= int(row[1]) < len(_KINDS):
        return "a collective this check does not know (another framework's, or a corrupt header)"
    kind = _KINDS[int(row[1])]
    if kind == "barrier":
        return "barrier"
    if kind == "fused allreduce plan":
        op = REDUCE_OPS[int(row[3]) - 1] if 0 < int(row[3]) <= len(REDUCE_OPS) else "?"
        n = int(row[5])
        return (f"a fused allreduce plan of {n} bucket{'' if n == 1 else 's'} ({int(row[6])} "
                f"bytes, {op}, layout checksum {int(row[2]):08x})")
    ndim = int(row[5])
    if ndim <= _DIMS:
        shape = "(" + ", ".join(str(int(d)) for d in row[6:6 + ndim]) + ("," if ndim == 1 else "") + ")"
    else:
        shape = f"{ndim}-d shape of {int(row[4])} elements"
    dtype = _DTYPE_NAMES.get(int(row[2]), f"dtype #{int(row[2]):08x}")
    text = f"{kind} of {dtype} {shape}"
    arg = int(row[3])
    if kind == "allreduce":
        text += f" ({REDUCE_OPS[arg - 1] if 0 < arg <= len(REDUCE_OPS) else '?'})"
    elif kind == "broadcast":
        text += f" from root {arg}"
    return text


def disagreement(rows: np.ndarray) -> str | None:
    """None if every rank's header equals rank 0's, else who passed what."""
    if bool((rows == rows[0]).all()):
        return None
    groups: dict[str, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(_describe(row), []).append(rank)
    if len(groups) == 1:  # rows differ only in what the text does not show (a checksum)
        groups = {}
        for rank, row in enumerate(rows):
            groups.setdefault(f"{_describe(row)} [header {row.tolist()}]", []).append(rank)
    parts = [f"{_ranks(ranks)} {what}" for what, ranks in groups.items()]
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} called"
    return f"ranks {', '.join(map(str, ranks))} called"


def exchange_words(words: np.ndarray) -> np.ndarray:
    """The buffer of the header exchange: ``words`` and their negation, for one allreduce
    with ``max`` that gives every rank the maximum and the minimum of each word."""
    return np.concatenate([words, -words])


def verdict(backend: Any, words: np.ndarray, extremes: np.ndarray, seq: int,
            rank: int) -> CollectiveMismatchError | None:
    """None if the exchanged ``extremes`` show every rank passed ``words``, else the
    :class:`CollectiveMismatchError` every rank raises (the caller raises it, so that the
    traceback ends at the user's call).

    Only when they differ does an allgather fetch every rank's words, for the message:
    every rank sees the same maxima and minima, so every rank takes that path alike.
    """
    n = words.size
    if bool((extremes[:n] == -extremes[n:]).all()):
        return None
    rows = np.asarray(backend.allgather(words))
    return CollectiveMismatchError(
        f"collective #{seq} differs between ranks: {disagreement(rows)}. Every rank must "
        "call the same collectives in the same order, with buffers of the same shape and "
        "dtype, the same reduction and the same root (look for code that depends on the "
        "rank or on data only some ranks have)", rank=rank, seq=seq)


def mismatch(backend: Any, words: np.ndarray, seq: int, rank: int) -> CollectiveMismatchError | None:
    """Compare ``words`` across the ranks of ``backend`` (the raw backend), blocking: None
    if every rank passed the same, else the error every rank raises.

    One allreduce with ``max`` (:func:`exchange_words`): an allreduce of 160 bytes is the
    cheapest collective every backend has; Gloo's allgather of the same size costs more
    than ten times as much.
    """
    return verdict(backend, words, backend.allreduce(exchange_words(words), "max"), seq, rank)


class DeferredHandle(Handle):
    """An ``allreduce_async`` that starts once its header agreed (:class:`Launcher`).

    Waiting for it waits, as collective ``header_seq``, for the agreement, then for the
    allreduce itself; a disagreement or a failure of the exchange is raised from
    :meth:`wait`, at the user's call.
    """

    __slots__ = ("header_seq", "_launched", "_inner", "_error", "_watch")

    def __init__(self, header_seq: int,
                 watch: Callable[[int, str], AbstractContextManager[None]]) -> None:
        self.header_seq = header_seq
        self._launched = threading.Event()
        self._inner: Handle | None = None
        self._error: BaseException | None = None
        self._watch = watch

    def resolve(self, inner: Handle | None = None, error: BaseException | None = None) -> None:
        """Called by the launcher: the started operation, or why it was not started."""
        self._inner, self._error = inner, error
        self._launched.set()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        check_timeout(timeout)
        start = time.monotonic()
        if not self._launched.is_set():
            # timeout None: the launcher's own wait for the header ends at TNT_TIMEOUT_S
            with self._watch(self.header_seq, "allreduce"):
                if not self._launched.wait(timeout):
                    raise CommError(f"not every rank entered the allreduce within {timeout:g} s "
                                    f"(collective #{self.header_seq}, the agreement on it)",
                                    operation="allreduce")
        if self._error is not None:
            if isinstance(self._error, CommError):
                with self._watch(self.header_seq, "allreduce"):
                    raise self._error
            raise self._error
        assert self._inner is not None
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 1e-3)
        return self._inner.wait(left)

    def done(self) -> bool:
        if not self._launched.is_set():
            return False
        return self._error is not None or (self._inner is not None and self._inner.done())

    def completion_time(self) -> float | None:
        return self._inner.completion_time() if self._inner is not None and self.done() else None


class Launcher:
    """Starts, in program order, the collectives that must wait for an agreement.

    Why: ``allreduce_async`` promises to return at once and to move data while the caller
    computes, but a collective may not start before its header agreed, which takes every
    rank's arrival. So the header goes out asynchronously and this one daemon thread waits
    for it, then starts the collective. While it has work, every later collective of this
    rank is queued behind it (or, if blocking, waits for the queue to empty), so the order
    on the wire is the program's order on every rank; when it has none, collectives go out
    directly and pay nothing.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._jobs: deque[tuple[int, Callable[[], None]]] = deque()
        self._busy = 0  # jobs queued or running; the caller's direct path needs 0
        self._current = 0  # the collective the running job waits for
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        return self._busy == 0

    def defer(self, seq: int, job: Callable[[], None]) -> None:
        """Run ``job`` (which must not raise) after every job deferred before it."""
        with self._cond:
            self._busy += 1
            self._jobs.append((seq, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, watch: Callable[[int, str], AbstractContextManager[None]]) -> None:
        """Block until every deferred job has run (a blocking collective goes next)."""
        if self._busy == 0:
            return
        jobs = self._jobs
        with watch(self._current or (jobs[0][0] if jobs else 0), "allreduce"), self._cond:
            while self._busy:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                self._current, job = self._jobs[0]
            job()
            with self._cond:
                self._jobs.popleft()
                self._busy -= 1
                self._current = 0
                self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def stop(self) -> None:
        """The backend is closing: jobs not yet started fail their handles."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
