"""Buffer dispatch: host arrays, DLPack host memory, device memory staged or passed through.

No GPU is used: device memory is simulated (tests/fake_dlpack.py). The staged path is real
(copy to host, copy back); that it works with CuPy/PyTorch CUDA tensors is untested.
"""

from __future__ import annotations

import numpy as np
import pytest

from fake_dlpack import CPU, CUDA, CUDA_HOST, FakeDeviceArray, ReadOnlyDeviceArray
from tnt_comm_mpi import prepare


def test_numpy_arrays_go_to_mpi_as_they_are() -> None:
    buf = np.arange(6, dtype=np.float32)
    staged = prepare(buf, "allreduce", cuda_aware=False)
    assert staged.path == "host" and staged.host is buf and staged.finish is None


@pytest.mark.parametrize("device", [CPU, CUDA_HOST])
def test_dlpack_host_memory_is_viewed_without_a_copy(device) -> None:
    arr = np.arange(6, dtype=np.int64)
    staged = prepare(FakeDeviceArray(arr, device), "allreduce", cuda_aware=False)
    assert staged.path == "host" and np.shares_memory(staged.host, arr)
    staged.host += 1
    assert arr[0] == 1


def test_device_memory_is_staged_through_host_without_cuda_aware_mpi() -> None:
    arr = np.arange(6, dtype=np.float32)
    dev = FakeDeviceArray(arr, CUDA)
    staged = prepare(dev, "allreduce", cuda_aware=False)
    assert staged.path == "staged" and staged.host is None, "copy must wait for the comm thread"
    staged.load()
    assert not np.shares_memory(staged.host, arr) and np.array_equal(staged.host, arr)
    staged.host *= 2
    staged.finish()
    assert dev.writes == 1 and np.array_equal(arr, np.arange(6, dtype=np.float32) * 2)


def test_device_memory_goes_to_cuda_aware_mpi_directly() -> None:
    dev = FakeDeviceArray(np.zeros(4, np.float64), CUDA)
    staged = prepare(dev, "allreduce", cuda_aware=True)
    assert staged.path == "device" and staged.host is dev and staged.dtype == np.float64
    assert dev.exports == 0, "nothing may be copied on the CUDA-aware path"


def test_bad_buffers_fail_with_clear_errors() -> None:
    with pytest.raises(TypeError, match=r"numpy\.ndarray or an object with __dlpack__"):
        prepare([1.0, 2.0], "allreduce", cuda_aware=False)
    with pytest.raises(TypeError, match="does not support dtype uint8"):
        prepare(FakeDeviceArray(np.zeros(3, np.uint8), CUDA), "allreduce", cuda_aware=False)
    with pytest.raises(TypeError, match="cannot be written back"):
        prepare(ReadOnlyDeviceArray(np.zeros(3, np.float32), CUDA), "allreduce", cuda_aware=False)
    # read-only device buffers are fine where nothing is written back
    staged = prepare(ReadOnlyDeviceArray(np.zeros(3, np.float32), CUDA), "allgather",
                     cuda_aware=False, writeable=False)
    assert staged.path == "staged" and staged.finish is None
    with pytest.raises(ValueError, match="C-contiguous"):
        prepare(FakeDeviceArray(np.zeros((4, 4), np.float32)[:, 1], CPU), "allreduce",
                cuda_aware=False)


def test_collectives_on_device_buffers_through_the_backend(have_mpiexec, tmp_path) -> None:
    import json

    from mpi_jobs import WORKERS, mpiexec
    from tnt_core.testing import launch_ranks

    result = launch_ranks([str(WORKERS / "device_worker.py"), str(tmp_path)], 2, backend="mpi",
                          timeout=120.0, tnt_timeout_s=60.0, launcher=mpiexec(2),
                          env={"TNT_LOG_LEVEL": "INFO", "TNT_MPI_CUDA_AWARE": ""})
    assert result.ok, result.describe()
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        failed = {k: v for k, v in report["checks"].items() if v != "ok"}
        assert not failed, f"rank {rank}: {failed}"
        # the PyPI mpich wheel is built without CUDA: the backend must have noticed
        assert report["cuda_aware"] is False, report
        assert "MPIX_Query_cuda_support() = 0" in report["cuda_reason"], report
    log = result.ranks[0].stderr
    assert "staged through host memory" in log, f"no log line names the staging path:\n{log}"
