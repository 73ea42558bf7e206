"""What a collective hands to MPI: host numpy arrays as they are, device buffers staged.

A buffer is either a ``numpy.ndarray`` or an object speaking DLPack (``__dlpack__`` and
``__dlpack_device__``: CuPy, PyTorch, JAX, TensorFlow through ``tf.experimental.dlpack``).

* host memory (DLPack CPU, CUDA-host or managed memory) is viewed without a copy;
* device memory goes to MPI as it is when the MPI library is CUDA-aware
  (:func:`tnt_comm_mpi.library.cuda_support`), otherwise it is copied to a host array,
  reduced there and copied back with ``buf[...] = host`` (host staging).

Which path a backend takes is logged once per process. The device paths are tested here
with CPU objects that present themselves as device memory; they have not been run on GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tnt_core import SUPPORTED_DTYPES, check_buffer

__all__ = ["Staged", "DLPACK_HOST_DEVICES", "prepare"]

# DLPack device types (dlpack.h): CPU, CUDA host-pinned, ROCm host, CUDA managed memory
DLPACK_HOST_DEVICES = frozenset({1, 3, 11, 13})
_DLPACK_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
                 10: "ROCm", 11: "ROCm host", 13: "CUDA managed", 14: "oneAPI"}


@dataclass
class Staged:
    """A buffer made ready for MPI.

    :param host: what MPI reads and writes (a numpy array, or the device object itself on
        the CUDA-aware path).
    :param dtype: its numpy dtype.
    :param path: ``"host"``, ``"device"`` (CUDA-aware MPI) or ``"staged"`` (host copy).
    :param load: fills ``host`` from the caller's buffer (staged path only; run on the
        communication thread, so the copy overlaps the caller's work).
    :param finish: copies the result back into the caller's buffer (staged path only).
    """

    host: Any
    dtype: np.dtype
    path: str
    load: Callable[[], None] | None = None
    finish: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        return int(getattr(self.host, "nbytes", 0))


def _device_of(buf: Any) -> tuple[int, int] | None:
    get = getattr(buf, "__dlpack_device__", None)
    if get is None or not hasattr(buf, "__dlpack__"):
        return None
    device = get()
    return int(device[0]), int(device[1])


def _dtype_of(buf: Any, operation: str) -> np.dtype:
    raw = getattr(buf, "dtype", None)
    try:
        dtype = np.dtype(getattr(raw, "as_numpy_dtype", None) or str(raw).rsplit(".", 1)[-1])
    except TypeError:
        raise TypeError(
            f"{operation}: cannot tell the dtype of {type(buf).__name__} (dtype={raw!r})"
        ) from None
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{operation} does not support dtype {dtype}; use one of {names}")
    return dtype


def prepare(buf: Any, operation: str, *, cuda_aware: bool, writeable: bool = True) -> Staged:
    """Validate ``buf`` and decide how MPI gets at its memory (runs on the caller's thread).

    Errors are raised here, before anything is queued, so bad arguments fail locally and
    leave the backend usable.
    """
    if isinstance(buf, np.ndarray):
        return Staged(check_buffer(buf, operation, writeable=writeable), buf.dtype, "host")
    device = _device_of(buf)
    if device is None:
        raise TypeError(
            f"{operation} needs a numpy.ndarray or an object with __dlpack__/__dlpack_device__, "
            f"got {type(buf).__name__}; convert with numpy.asarray(...)"
        )
    kind, _ = device
    if kind in DLPACK_HOST_DEVICES:
        try:
            view = np.from_dlpack(buf)
        except (TypeError, BufferError, RuntimeError) as exc:
            raise TypeError(f"{operation}: cannot view {type(buf).__name__} through DLPack: {exc}") from exc
        return Staged(check_buffer(view, operation, writeable=writeable), view.dtype, "host")
    dtype = _dtype_of(buf, operation)
    if cuda_aware and kind == 2:
        return Staged(buf, dtype, "device")
    if writeable and getattr(type(buf), "__setitem__", None) is None:
        raise TypeError(
            f"{operation} reduces in place but {type(buf).__name__} on "
            f"{_DLPACK_NAMES.get(kind, kind)} memory cannot be written back "
            "(no buf[...] = array); pass a mutable device array or a numpy array"
        )
    return _staged(buf, dtype, operation, writeable)


def _staged(buf: Any, dtype: np.dtype, operation: str, writeable: bool) -> Staged:
    """Host staging: the copy to host happens on the communication thread (``load``)."""
    staged = Staged(None, dtype, "staged")

    def load() -> None:
        try:
            host = np.from_dlpack(buf, device="cpu", copy=True)
        except (TypeError, BufferError, RuntimeError, ValueError) as exc:
            raise TypeError(
                f"{operation}: cannot copy {type(buf).__name__} to host memory through DLPack "
                f"({exc}); pass numpy.asarray(buf) or use a CUDA-aware MPI"
            ) from exc
        staged.host = np.ascontiguousarray(host)

    def finish() -> None:
        buf[...] = staged.host

    staged.load = load
    staged.finish = finish if writeable else None
    return staged
