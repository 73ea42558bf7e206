"""Collectives on DLPack buffers through the mpi backend: ``device_worker.py OUT``.

Uses tests/fake_dlpack.py: "device" memory is numpy memory that insists on being copied to
the host, so the staged path (copy out, MPI, copy back) runs for real. Writes
``OUT/rank<R>.json`` with each check's outcome and the backend's CUDA-awareness verdict.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tnt_core
from fake_dlpack import CPU, CUDA, FakeDeviceArray


def main() -> int:
    out = Path(sys.argv[1])
    runtime = tnt_core.init()
    b = runtime.backend
    rank, size = b.rank, b.size
    checks: dict[str, str] = {}

    def check(name, fn) -> None:
        try:
            fn()
            checks[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            checks[name] = traceback.format_exc()

    def staged_allreduce() -> None:
        dev = FakeDeviceArray(np.full(1000, rank + 1, np.float32), CUDA)
        result = b.allreduce_async(dev).wait()
        if result is not dev:
            raise AssertionError("wait() must return the caller's buffer")
        if dev.writes != 1 or not (dev.numpy() == size * (size + 1) / 2).all():
            raise AssertionError(f"writes={dev.writes} values={dev.numpy()[:4]}")

    def staged_float16_max() -> None:
        dev = FakeDeviceArray(np.full(7, rank, np.float16), CUDA)
        b.allreduce_async(dev, "max").wait()
        if not (dev.numpy() == size - 1).all():
            raise AssertionError(f"{dev.numpy()}")

    def cpu_dlpack_allreduce() -> None:
        arr = np.full(10, rank + 1, np.int64)
        b.allreduce_async(FakeDeviceArray(arr, CPU)).wait()
        if not (arr == size * (size + 1) // 2).all():
            raise AssertionError(f"{arr}")

    def staged_broadcast() -> None:
        dev = FakeDeviceArray(np.full(5, 10 * rank, np.int32), CUDA)
        b.broadcast(dev, root=size - 1)
        if not (dev.numpy() == 10 * (size - 1)).all():
            raise AssertionError(f"{dev.numpy()}")

    def staged_allgather() -> None:
        got = b.allgather(FakeDeviceArray(np.full((2, 3), rank, np.float64), CUDA))
        want = np.stack([np.full((2, 3), r, np.float64) for r in range(size)])
        if not isinstance(got, np.ndarray) or not np.array_equal(got, want):
            raise AssertionError(f"{got}")

    for name, fn in (("staged_allreduce", staged_allreduce), ("staged_float16_max", staged_float16_max),
                     ("cpu_dlpack_allreduce", cpu_dlpack_allreduce),
                     ("staged_broadcast", staged_broadcast), ("staged_allgather", staged_allgather)):
        check(name, fn)
    report = {"rank": rank, "checks": checks, "cuda_aware": b._cuda_aware, "cuda_reason": b.cuda_reason}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    tnt_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
