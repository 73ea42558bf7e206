"""Stand-ins for framework tensors: numpy memory behind the DLPack protocol.

``FakeDeviceArray(arr, device_type=2)`` claims to live in CUDA memory (device type 2); its
``__dlpack__`` hands out host memory anyway, so the staging code path (copy to host, MPI,
copy back) runs for real without a GPU. It checks that only host exports are asked for, as
a real device tensor would need a cross-device copy for that.
"""

from __future__ import annotations

import numpy as np

CPU, CUDA, CUDA_HOST = 1, 2, 3


class FakeDeviceArray:
    def __init__(self, arr: np.ndarray, device_type: int = CUDA) -> None:
        self._arr = arr
        self._device = (device_type, 0)
        self.dtype = arr.dtype
        self.shape = arr.shape
        self.writes = 0
        self.exports = 0

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.exports += 1
        if self._device[0] == CUDA and (dl_device is None or tuple(dl_device) != (CPU, 0)):
            raise BufferError("device memory: ask for a host copy (dl_device=(1, 0))")
        source = self._arr.copy() if copy else self._arr
        return source.__dlpack__(max_version=max_version)

    def __setitem__(self, key, value) -> None:
        self.writes += 1
        self._arr[key] = value

    def numpy(self) -> np.ndarray:
        return self._arr


class ReadOnlyDeviceArray(FakeDeviceArray):
    """A device array that cannot be written from the host (no ``__setitem__``)."""

    __setitem__ = None  # type: ignore[assignment]
