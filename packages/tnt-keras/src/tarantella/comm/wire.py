"""Values on the wire: any array as a flat array of a dtype every backend carries.

Backends move float16/32/64 and int32/64 (``tnt_core.SUPPORTED_DTYPES``); other dtypes
(bfloat16, int8, bool, ...) travel as their bytes in int32 words, and come back as the same
bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import tnt_core

__all__ = ["from_wire", "to_wire", "wire_buffer"]


def to_wire(value: Any) -> np.ndarray:
    """``value`` as a flat array a backend carries: itself for the dtypes backends move,
    else its bytes as int32 words (bfloat16, int8, bool...)."""
    array = np.ascontiguousarray(np.asarray(value)).reshape(-1)
    if array.dtype in tnt_core.SUPPORTED_DTYPES:
        return array
    raw = array.view(np.uint8)
    padded = np.zeros(-(-raw.size // 4) * 4, np.uint8)
    padded[:raw.size] = raw
    return padded.view(np.int32)


def wire_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An empty buffer for a value of ``shape`` and ``dtype`` sent by :func:`to_wire`."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype in tnt_core.SUPPORTED_DTYPES:
        return np.empty(count, dtype)
    return np.empty(-(-count * dtype.itemsize // 4), np.int32)


def from_wire(buf: np.ndarray, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """The value :func:`to_wire` sent (a view of ``buf`` where it can be)."""
    dtype = np.dtype(dtype)
    if dtype in tnt_core.SUPPORTED_DTYPES:
        return buf.reshape(shape)
    count = int(np.prod(shape, dtype=np.int64))
    return buf.view(np.uint8)[:count * dtype.itemsize].view(dtype).reshape(shape)
