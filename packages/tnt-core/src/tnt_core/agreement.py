"""Collective agreement: every rank calls the same collective with the same buffer shape,
dtype, reduction and root, or every rank raises :class:`~tnt_core.CollectiveMismatchError`.

Why: transports trust their callers. Handed buffers of different sizes, Gloo and MPI
reduce or gather whatever lies in memory and return normally, or abort the process;
handed different roots, a broadcast returns each rank's own data. Either way the job goes
on with numbers no serial run would give. So before each collective of a multi-rank job
the :class:`~tnt_core.stall.WatchedBackend` compares a fixed-size header describing the
call (:data:`HEADER_LEN` int64 words, in one small allreduce: :func:`mismatch`): equal
headers let the collective run; different ones make every rank raise the same error,
naming what each rank passed, before any data moves.

A collective that repeats every step over buffers allocated once (the fused gradient
buckets of :class:`~tnt_core.FusedAllreducer`) agrees once, on the whole plan, when the
buffers are first used; from then on those buffers go out without a header, so the step
pays nothing per bucket.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .backend import REDUCE_OPS, SUPPORTED_DTYPES
from .errors import CollectiveMismatchError

__all__ = ["HEADER_LEN", "header", "plan_header", "mismatch", "disagreement"]

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


def mismatch(backend: Any, words: np.ndarray, seq: int, rank: int) -> CollectiveMismatchError | None:
    """Compare ``words`` across the ranks of ``backend`` (the raw backend): None if every
    rank passed the same, else the :class:`CollectiveMismatchError` every rank raises (the
    caller raises it, so that the traceback ends at the user's call).

    One allreduce with ``max`` over ``words`` and their negation gives every rank the
    maximum and the minimum of each word: all equal exactly when they agree. (An allreduce
    of 160 bytes is the cheapest collective every backend has; Gloo's allgather of the same
    size costs more than ten times as much.) Only when they differ does an allgather fetch
    every rank's words, for the message: every rank sees the same maxima and minima, so
    every rank takes that path alike.
    """
    n = words.size
    extremes = backend.allreduce(np.concatenate([words, -words]), "max")
    if bool((extremes[:n] == -extremes[n:]).all()):
        return None
    rows = np.asarray(backend.allgather(words))
    return CollectiveMismatchError(
        f"collective #{seq} differs between ranks: {disagreement(rows)}. Every rank must "
        "call the same collectives in the same order, with buffers of the same shape and "
        "dtype, the same reduction and the same root (look for code that depends on the "
        "rank or on data only some ranks have)", rank=rank, seq=seq)
