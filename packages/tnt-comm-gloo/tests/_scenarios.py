"""Multi-process scenarios run by the tests: ``python _scenarios.py NAME --report DIR``.

Each rank writes ``DIR/rank<R>.json``: ``{"checks": {name: "ok" | error text}}``, so a
test names the check that failed on the rank it failed on.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tnt_core
from tnt_core import CommError


class Report:
    def __init__(self, directory: Path, rank: int) -> None:
        self.path = directory / f"rank{rank}.json"
        self.data: dict = {"rank": rank, "checks": {}, "info": {}}
        self.write()

    def check(self, name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            self.data["checks"][name] = "ok"
        except Exception:  # noqa: BLE001 - every failure is reported to the test, by name
            self.data["checks"][name] = traceback.format_exc()
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def _sum_of_ranks(size: int, n: int, dtype: str) -> np.ndarray:
    return sum(np.arange(n) % 7 + r for r in range(size)).astype(dtype)


# ------------------------------------------------------------------ file store

def file_store(report: Report, backend) -> None:
    def allreduce() -> None:
        for dtype in ("float32", "int64", "float16"):
            buf = (np.arange(1000) % 7 + backend.rank).astype(dtype)
            backend.allreduce(buf)
            assert np.array_equal(buf, _sum_of_ranks(backend.size, 1000, dtype)), dtype

    def others() -> None:
        buf = np.full(5, backend.rank, np.int32)
        backend.broadcast(buf, root=backend.size - 1)
        assert np.all(buf == backend.size - 1), buf
        rows = backend.allgather(np.array([backend.rank], np.float64))
        assert rows.ravel().tolist() == list(range(backend.size)), rows
        frozen = np.full((2, 2), backend.rank, np.int64)
        frozen.flags.writeable = False  # allgather only reads its input
        rows = backend.allgather(frozen)
        assert rows.shape == (backend.size, 2, 2) and rows[:, 0, 0].tolist() == list(range(backend.size))
        backend.barrier()

    def closed() -> None:
        backend.close()
        backend.close()  # idempotent
        for call in (lambda: backend.allreduce_async(np.ones(3, np.float32)),
                     lambda: backend.barrier(),
                     lambda: backend.allgather(np.ones(3, np.float32))):
            try:
                call()
            except CommError as exc:
                assert "closed" in str(exc), str(exc)
            else:
                raise AssertionError("a collective on a closed backend did not fail")

    report.check("allreduce", allreduce)
    report.check("broadcast-allgather-barrier", others)
    report.check("closed-backend-refuses", closed)


# ------------------------------------------------------------------ float16

def _half_input(rank: int, op: str) -> np.ndarray:
    """Awkward float16 values: subnormals, overflow, ties; no NaN, no -0.0 for min/max."""
    rng = np.random.default_rng(1000 + rank)
    parts = [
        rng.normal(0, 1, 4000),
        rng.normal(0, 3e4, 1000),          # sums and products overflow to inf
        rng.normal(0, 1e-5, 1000),         # subnormals (< 6.1e-5)
        rng.integers(-2048, 2048, 1000) + 0.5,  # rounding ties
        np.array([np.inf, -np.inf, 65504.0, -65504.0, 0.0, 6e-8, -6e-8]),
    ]
    values = np.concatenate(parts).astype(np.float16)
    if op in ("min", "max"):
        values[values == 0] = np.float16(0.0)  # std::max and np.maximum differ on -0 vs 0
    if op == "sum":
        values[np.isinf(values)] = np.float16(np.inf)  # inf + -inf would give NaN
    return values


def float16(report: Report, backend) -> None:
    ufuncs = {"sum": np.add, "product": np.multiply, "max": np.maximum, "min": np.minimum}
    for op, ufunc in ufuncs.items():
        def check(op=op, ufunc=ufunc) -> None:
            buf = _half_input(backend.rank, op)
            backend.allreduce(buf, op)
            # With 2 ranks each element is one rounding of one float operation: numpy's
            # float16 arithmetic gives the same bits.
            want = ufunc(_half_input(0, op), _half_input(1, op))
            assert not np.isnan(want).any()
            diff = np.flatnonzero(buf.view(np.uint16) != want.view(np.uint16))
            assert diff.size == 0, (
                f"{diff.size} elements differ, e.g. index {diff[0]}: "
                f"got {buf[diff[0]]!r}, numpy {want[diff[0]]!r}")
        report.check(f"float16-{op}", check)


# ------------------------------------------------------------------ DLPack

class HostTensor:
    """A CPU tensor seen only through DLPack (like a CPU torch tensor)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, stream=None, **kwargs):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = b"dltensor"
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeCudaTensor:
    """Host memory that claims to live on CUDA device ``device_id``: with a fake CUDA
    runtime (cudaMemcpy = memcpy) it drives the staging path end to end."""

    def __init__(self, array: np.ndarray, device_id: int = 0, device_type: int = 2) -> None:
        self.array = array
        self.device_id = device_id
        self.device_type = device_type
        self.nbytes = array.nbytes
        self._keep: list[object] = []

    def __dlpack_device__(self):
        return (self.device_type, self.device_id)

    def __dlpack__(self, stream=None, **kwargs):
        code = {"f": 2, "i": 0}[self.array.dtype.kind]
        shape = (ctypes.c_int64 * self.array.ndim)(*self.array.shape)
        managed = _DLManagedTensor()
        managed.dl_tensor.data = self.array.ctypes.data
        managed.dl_tensor.device = _DLDevice(self.device_type, self.device_id)
        managed.dl_tensor.ndim = self.array.ndim
        managed.dl_tensor.dtype = _DLDataType(code, self.array.dtype.itemsize * 8, 1)
        managed.dl_tensor.shape = shape
        managed.dl_tensor.strides = None
        managed.dl_tensor.byte_offset = 0
        self._keep += [shape, managed]  # the capsule points into these
        return _new_capsule(ctypes.addressof(managed), _CAPSULE_NAME, None)


def dlpack(report: Report, backend, fake_cudart: str) -> None:
    size, rank = backend.size, backend.rank

    def host_tensor() -> None:
        tensor = HostTensor((np.arange(1001) % 7 + rank).astype(np.float32))
        out = backend.allreduce_async(tensor).wait()
        assert out is tensor, "wait() must return the tensor passed in"
        assert np.array_equal(tensor.array, _sum_of_ranks(size, 1001, "float32"))

    def missing_runtime() -> None:
        os.environ["TNT_GLOO_CUDART"] = "/nonexistent/libcudart.so"
        tensor = FakeCudaTensor(np.ones(4, np.float32))
        try:
            backend.allreduce_async(tensor)
        except CommError as exc:
            assert "CUDA runtime" in str(exc) and "TNT_GLOO_CUDART" in str(exc), str(exc)
        else:
            raise AssertionError("no error without a CUDA runtime")

    def staged() -> None:
        os.environ["TNT_GLOO_CUDART"] = fake_cudart
        fake = ctypes.CDLL(fake_cudart)  # the same instance the backend dlopens
        for dtype, n in (("float32", 3_000_001), ("float16", 17), ("int64", 1), ("int32", 0)):
            tensor = FakeCudaTensor((np.arange(n) % 7 + rank).astype(dtype), device_id=rank)
            out = backend.allreduce_async(tensor, "sum").wait()
            assert out is tensor
            assert np.array_equal(tensor.array, _sum_of_ranks(size, n, dtype)), dtype
        tensor = FakeCudaTensor(np.full(8, rank + 1, np.float64), device_id=rank)
        backend.allreduce_async(tensor, "max").wait()
        assert np.all(tensor.array == size)
        d2h = ctypes.c_int.in_dll(fake, "fake_d2h").value
        h2d = ctypes.c_int.in_dll(fake, "fake_h2d").value
        device = ctypes.c_int.in_dll(fake, "fake_device").value
        allocs = ctypes.c_int.in_dll(fake, "fake_pinned_allocs").value
        report.data["info"].update(d2h=d2h, h2d=h2d, device=device, allocs=allocs)
        # four non-empty buffers were staged (the empty one is not copied)
        assert d2h == 4 and h2d == 4, (d2h, h2d)
        assert device == rank, f"cudaSetDevice({device}) for a tensor on device {rank}"
        assert allocs == 1, f"the pinned buffer was reallocated {allocs} times"

    def pinned_host() -> None:
        os.environ["TNT_GLOO_CUDART"] = fake_cudart
        fake = ctypes.CDLL(fake_cudart)
        syncs = ctypes.c_int.in_dll(fake, "fake_syncs").value
        d2h = ctypes.c_int.in_dll(fake, "fake_d2h").value
        tensor = FakeCudaTensor((np.arange(1001) % 7 + rank).astype(np.float32),
                                device_id=rank, device_type=3)  # kDLCUDAHost
        assert backend.allreduce_async(tensor).wait() is tensor
        assert np.array_equal(tensor.array, _sum_of_ranks(size, 1001, "float32"))
        assert ctypes.c_int.in_dll(fake, "fake_syncs").value == syncs + 1, "no stream sync"
        assert ctypes.c_int.in_dll(fake, "fake_d2h").value == d2h, "pinned memory was copied"

    def strided_rejected() -> None:
        class Strided(FakeCudaTensor):
            def __dlpack__(self, stream=None, **kwargs):
                capsule = super().__dlpack__()
                managed = self._keep[-1]
                strides = (ctypes.c_int64 * 1)(2)
                self._keep.append(strides)
                managed.dl_tensor.strides = strides
                return capsule

        try:
            backend.allreduce_async(Strided(np.zeros(4, np.float32)))
        except ValueError as exc:
            assert "contiguous" in str(exc), str(exc)
        else:
            raise AssertionError("a strided device tensor was accepted")

    report.check("host-tensor", host_tensor)
    report.check("missing-runtime", missing_runtime)
    report.check("staged", staged)
    report.check("pinned-host", pinned_host)
    report.check("strided-rejected", strided_rejected)
    report.check("still-usable", lambda: backend.barrier())


# ------------------------------------------------------------------ timeout

def timeout(report: Report, backend, hang_s: float) -> None:
    backend.barrier()
    if backend.rank == backend.size - 1:
        time.sleep(hang_s)  # hung: never joins the allreduce
        report.data["info"]["hung"] = hang_s
        report.write()
        return

    def times_out() -> None:
        t0 = time.monotonic()
        try:
            backend.allreduce(np.ones(1 << 16, np.float32))
        except CommError as exc:
            elapsed = time.monotonic() - t0
            report.data["info"]["error"] = str(exc)
            report.data["info"]["seconds"] = elapsed
            assert f"rank {backend.rank}" in str(exc) and "allreduce" in str(exc), str(exc)
        else:
            raise AssertionError("allreduce with a hung peer returned")

    def later_ops_fail_fast() -> None:
        t0 = time.monotonic()
        for call in (lambda: backend.allreduce_async(np.ones(4, np.float32)).wait(),
                     lambda: backend.barrier(),
                     lambda: backend.broadcast(np.ones(4, np.float32))):
            try:
                call()
            except CommError as exc:
                assert "earlier collective failed" in str(exc), str(exc)
            else:
                raise AssertionError("a collective after a failure succeeded")
        assert time.monotonic() - t0 < 1.0, "failing fast took too long"

    report.check("times-out", times_out)
    report.check("later-ops-fail-fast", later_ops_fail_fast)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=("file-store", "float16", "dlpack", "timeout"))
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--fake-cudart", default="")
    parser.add_argument("--hang", type=float, default=0.0)
    args = parser.parse_args()
    runtime = tnt_core.init()
    report = Report(args.report, runtime.rank)
    report.data["info"]["backend"] = runtime.backend.name
    if args.scenario == "file-store":
        file_store(report, runtime.backend)
    elif args.scenario == "float16":
        float16(report, runtime.backend)
    elif args.scenario == "dlpack":
        dlpack(report, runtime.backend, args.fake_cudart)
    else:
        timeout(report, runtime.backend, args.hang)
    t0 = time.monotonic()
    tnt_core.shutdown()
    report.data["info"]["close_s"] = time.monotonic() - t0
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
