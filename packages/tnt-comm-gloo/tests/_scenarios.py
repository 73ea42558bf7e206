"""Multi-process scenarios run by the tests: ``python _scenarios.py NAME --report DIR``.

Each rank writes ``DIR/rank<R>.json``: ``{"checks": {name: "ok" | error text}}``, so a
test names the check that failed on the rank it failed on.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import gc
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
        try:  # raised by the call, or (agreement first, then the start) by its wait
            backend.allreduce_async(tensor).wait()
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

        try:  # raised by the call, or (agreement first, then the start) by its wait
            backend.allreduce_async(Strided(np.zeros(4, np.float32))).wait()
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


# ------------------------------------------------------------------ shared memory

_UFUNCS = {"sum": np.add, "product": np.multiply, "max": np.maximum, "min": np.minimum}
_SHM_DTYPES = ("float16", "float32", "float64", "int32", "int64")


def _shm_info(report: Report, backend) -> None:
    from tnt_comm_gloo.backend import _job_token
    from tnt_core import Config

    report.data["info"].update(
        transport=backend.allreduce_transport, reason=backend._comm.shm_reason,
        segment=backend._comm.shm_segment_name, pid=os.getpid(),
        job_prefix=f"tnt-gloo-{_job_token(Config.from_env())}-")
    report.write()


def _shm_input(rank: int, n: int, dtype: str, op: str) -> np.ndarray:
    """Random values whose reduction is well defined bit for bit: no NaN, no -0.0 for
    min/max (numpy and std::min disagree on 0 vs -0), products that stay finite."""
    rng = np.random.default_rng([rank, n, _SHM_DTYPES.index(dtype), list(_UFUNCS).index(op)])
    if dtype.startswith("int"):
        if op == "product":
            return rng.choice(np.array([-1, 1, 2, 3], dtype=dtype), n)
        return rng.integers(-10_000, 10_000, n).astype(dtype)
    if op == "product":
        values = rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)
    else:
        values = rng.normal(0.0, 100.0, n)
    values = values.astype(dtype)
    if op in ("min", "max"):
        values[values == 0] = 1
    return values


def shm_reduce(report: Report, backend, chunk_bytes: int) -> None:
    """Every dtype x op, sizes around the chunk and one of more than 1 MiB (its result
    written past the caches), against numpy's reduction in rank order (which the
    shared-memory allreduce follows for every element: bitwise equal)."""
    _shm_info(report, backend)
    report.check("transport-is-shm", lambda: _expect(backend.allreduce_transport == "shm",
                                                     backend._comm.shm_reason))
    for dtype in _SHM_DTYPES:
        per_chunk = chunk_bytes // np.dtype(dtype).itemsize
        sizes = (0, 1, 1001, per_chunk + 1, 3 * per_chunk + per_chunk // 2,
                 (1 << 20) // np.dtype(dtype).itemsize + per_chunk // 3)
        for op, ufunc in _UFUNCS.items():
            def check(dtype=dtype, op=op, ufunc=ufunc, sizes=sizes) -> None:
                for n in sizes:
                    buf = _shm_input(backend.rank, n, dtype, op)
                    out = backend.allreduce_async(buf, op).wait()
                    assert out is buf
                    want = _shm_input(0, n, dtype, op)
                    for r in range(1, backend.size):
                        want = ufunc(want, _shm_input(r, n, dtype, op))
                    bits = f"u{np.dtype(dtype).itemsize}"
                    diff = np.flatnonzero(buf.view(bits) != want.view(bits))
                    assert diff.size == 0, (
                        f"n={n}: {diff.size} elements differ, e.g. index {diff[0]}: got "
                        f"{buf[diff[0]]!r}, numpy {want[diff[0]]!r}")
            report.check(f"{dtype}-{op}", check)

    def unaligned() -> None:
        # a view 4 bytes into its array, of a length no multiple of 16 bytes: copied into
        # the slots by streaming stores from an unaligned start, with a tail (and, past 1
        # MiB, its result streamed out to that start)
        for n in (1025, 3 * (chunk_bytes // 4) + 5, (1 << 18) + 5):
            base = np.zeros(n + 1, np.float32)
            buf = base[1:]
            buf[:] = _shm_input(backend.rank, n, "float32", "sum")
            backend.allreduce_async(buf).wait()
            want = _shm_input(0, n, "float32", "sum")
            for r in range(1, backend.size):
                want = want + _shm_input(r, n, "float32", "sum")
            assert np.array_equal(buf.view("u4"), want.view("u4")), n
            assert base[0] == 0

    report.check("unaligned-view", unaligned)

    def scaled() -> None:
        # the native table's gathered allreduce, pieces times 0.5 (a gradient of a mean
        # loss arrives so, scaled by the rank's share): written into the slots the way
        # TNT_GLOO_SHM_COPY says (past the caches for floats under "stream"), pieces at odd
        # offsets so that a slot's part starts unaligned, against numpy's multiply and sum
        table = tnt_core.native_comm(backend)
        assert table is not None and table.has_gather
        n = 3 * (chunk_bytes // 4) + 1503  # float32 and float64: a last streamed part of
        cuts = [(0, 3), (5, n // 2 + 1), (n // 2 + 4, n)]  # 1503 elements, a tail
        for dtype in ("float16", "float32", "float64"):
            source = _shm_input(backend.rank, n, dtype, "sum")
            out = np.full(n, 7, dtype)
            done = threading.Event()
            errors: list[str | None] = []

            def finished(err: str | None, errors=errors, done=done) -> None:
                errors.append(err)
                done.set()

            table.allreduce_gather([(source[a:b].copy(), a) for a, b in cuts], 0.5, out, "sum",
                                   finished)
            assert done.wait(60) and errors == [None], (dtype, errors)
            want = np.zeros(n, dtype)
            for r in range(backend.size):
                filled = np.zeros(n, dtype)
                for a, b in cuts:
                    filled[a:b] = _shm_input(r, n, dtype, "sum")[a:b] * np.dtype(dtype).type(0.5)
                want = want + filled if r else filled
            bits = f"u{np.dtype(dtype).itemsize}"
            diff = np.flatnonzero(out.view(bits) != want.view(bits))
            assert diff.size == 0, f"{dtype}: {diff.size} elements differ, e.g. index {diff[0]}"

    report.check("scaled-pieces", scaled)

    def interleaved() -> None:
        # allreduces over shared memory, the rest over TCP, all in one queue order
        bufs = [np.full(70_000 + k, backend.rank + k, np.float64) for k in range(8)]
        handles = [backend.allreduce_async(b) for b in bufs[:4]]
        root = np.full(3, backend.rank, np.int64)
        backend.broadcast(root, root=backend.size - 1)
        handles += [backend.allreduce_async(b, "max") for b in bufs[4:]]
        backend.barrier()
        for k, h in enumerate(handles):
            h.wait()
            base = sum(range(backend.size)) + backend.size * k
            want = base if k < 4 else backend.size - 1 + k
            assert np.all(bufs[k] == want), (k, bufs[k][:3], want)
        assert np.all(root == backend.size - 1)

    report.check("interleaved-with-tcp-collectives", interleaved)
    report.data["info"]["copy"] = backend._comm.shm_copy  # after every copy above
    report.write()


def _expect(condition: bool, detail: str) -> None:
    assert condition, detail


def shm_kill(report: Report, backend, after: float) -> None:
    """The last rank exits (os._exit) `after` seconds into a stream of large allreduces;
    the others must get CommError naming it."""
    _shm_info(report, backend)
    victim = backend.size - 1
    buf = np.ones(16 << 20, np.float32)  # 64 MiB: with small chunks, thousands of steps
    backend.barrier()
    if backend.rank == victim:
        report.data["info"]["dies_at"] = time.time() + after
        report.write()
        threading.Timer(after, lambda: os._exit(0)).start()
        while True:
            backend.allreduce(buf)

    def fails() -> None:
        t0 = time.time()
        try:
            for _ in range(10_000):
                backend.allreduce(buf)
        except CommError as exc:
            report.data["info"].update(error=str(exc), failed_at=time.time(),
                                       ops_s=time.time() - t0)
        else:
            raise AssertionError("allreduce went on after a peer exited")

    report.check("fails", fails)


def shm_setup(report: Report, variant: str) -> None:
    """Start-up decisions, with this rank's environment changed first."""
    rank = int(os.environ["TNT_RANK"])
    if variant in ("hosts-auto", "hosts-required", "hosts-hierarchy-required"):
        os.environ["TNT_GLOO_SHM_HOST_ID"] = f"host-{rank}"  # as if on different hosts
    if variant == "hosts-hierarchy-required":
        os.environ["TNT_GLOO_HIERARCHY"] = "1"
    if variant == "hosts-unequal":  # ranks 0 and 1 on one host, rank 2 on another
        os.environ["TNT_GLOO_SHM_HOST_ID"] = f"host-{rank // 2}"
    if variant == "hosts-required":
        os.environ["TNT_GLOO_SHM"] = "1"
    if variant == "chunks-differ":  # rank 1's segments cannot be mapped by the others
        os.environ["TNT_GLOO_SHM_CHUNK_BYTES"] = str(65536 * (1 + (rank == 1)))
    if variant == "one-rank-off":
        os.environ["TNT_GLOO_SHM"] = "0" if rank == 1 else "auto"
    try:
        runtime = tnt_core.init()
    except tnt_core.ConfigError as exc:
        report.data["info"]["error"] = str(exc)
        report.write()
        return
    backend = runtime.backend
    _shm_info(report, backend)
    report.data["info"]["repr"] = repr(backend)

    def collectives() -> None:
        buf = np.arange(1000, dtype=np.float32) + backend.rank
        backend.allreduce(buf)
        want = np.arange(1000, dtype=np.float32) * backend.size + sum(range(backend.size))
        assert np.array_equal(buf, want)
        backend.barrier()

    report.check("collectives", collectives)


def _float_tolerance(inputs: list[np.ndarray], op: str) -> np.ndarray | float:
    """How far two orders of reducing ``inputs`` may differ: each order's rounding error
    is at most (p - 1) units of round-off (eps / 2) of sum |x| (sum) or |product|."""
    eps = float(np.finfo(inputs[0].dtype).eps)
    wide = [x.astype(np.float64) for x in inputs]
    if op == "sum":
        scale = sum(np.abs(x) for x in wide)
    elif op == "product":
        scale = np.abs(functools.reduce(np.multiply, wide))
    else:
        return 0.0  # min and max pick an input: exact in any order
    return (len(inputs) - 1) * eps * scale


def hierarchy(report: Report, victim_after: float) -> None:
    """Ranks 2h and 2h+1 on "host" h (TNT_GLOO_SHM_HOST_ID): the hierarchical allreduce
    against numpy and against the flat ring over the same ranks, then the last rank
    exits in the middle of a stream of allreduces."""
    rank = int(os.environ["TNT_RANK"])
    os.environ["TNT_GLOO_SHM_HOST_ID"] = f"host-{rank // 2}"
    runtime = tnt_core.init()
    backend = runtime.backend
    _shm_info(report, backend)
    report.data["info"]["layout"] = list(backend._comm.host_layout)
    report.check("transport-is-hierarchical", lambda: _expect(
        backend.allreduce_transport == "hierarchical" and "hierarchical" in repr(backend),
        f"{backend!r}: {backend._comm.shm_reason}"))
    from tnt_comm_gloo.backend import GlooBackend  # a second communicator, flat

    flat = GlooBackend(backend._config, dataclasses.replace(
        backend._settings, hierarchy="0", algorithm="ring"))
    report.check("flat-is-tcp", lambda: _expect(flat.allreduce_transport == "tcp", repr(flat)))

    def algorithm_between_hosts() -> None:
        # `auto` chooses for what crosses TCP: a half-size slice between 2 hosts
        choices = [backend.allreduce_algorithm(n << 10) for n in (100, 1536, 3072)]
        assert choices == ["doubling", "doubling", "ring"], choices
        assert backend._settings.algorithm_for(100 << 10, backend.size) == "bcube"  # flat, 4 ranks

    report.check("algorithm-between-hosts", algorithm_between_hosts)

    def messages_within_and_between_hosts() -> None:
        # the peer on this host through a ring, the one on the other host over TCP
        near, far = rank ^ 1, (rank + 2) % 4
        got = (backend.p2p_transport(near), backend.p2p_transport(far))
        assert got == ("shm", "tcp"), got
        outs = {p: np.full(1000, 10 * rank + p, np.float64) for p in (near, far)}
        recvs = {p: backend.recv_async(np.zeros(1000), p, tag=6) for p in (near, far)}
        for p, out in outs.items():
            backend.send_async(out, p, tag=6).wait(timeout=20)
        for p, h in recvs.items():
            assert np.all(h.wait(timeout=20) == 10 * p + rank), p

    report.check("messages-within-and-between-hosts", messages_within_and_between_hosts)
    size = backend.size
    per_slot = int(os.environ["TNT_GLOO_SHM_CHUNK_BYTES"])
    for dtype in _SHM_DTYPES:
        itemsize = np.dtype(dtype).itemsize
        # tiny (fewer elements than ranks); uneven slices over several slot-fulls; 4 MiB
        # (2 pipelined blocks)
        sizes = (0, 1, size - 1, 3 * per_slot // itemsize + 5)
        for op, ufunc in _UFUNCS.items():
            large = op == "sum" and dtype == "float32"

            def check(dtype=dtype, op=op, ufunc=ufunc, itemsize=itemsize,
                      sizes=sizes + (((4 << 20) // itemsize + 3,) if large else ())) -> None:
                for n in sizes:
                    inputs = [_shm_input(r, n, dtype, op) for r in range(size)]
                    got = backend.allreduce_async(inputs[rank].copy(), op).wait()
                    ring = flat.allreduce_async(inputs[rank].copy(), op).wait()
                    # within a host in rank order, then the two hosts' partial results
                    want = ufunc(ufunc(inputs[0], inputs[1]), ufunc(inputs[2], inputs[3]))
                    bits = f"u{itemsize}"
                    diff = np.flatnonzero(got.view(bits) != want.view(bits))
                    assert diff.size == 0, (
                        f"n={n}: {diff.size} elements differ from numpy, e.g. index {diff[0]}: "
                        f"got {got[diff[0]]!r}, numpy {want[diff[0]]!r}")
                    if dtype.startswith("int"):
                        assert np.array_equal(got, ring), f"n={n}: differs from the ring"
                    else:
                        gap = np.abs(got.astype(np.float64) - ring.astype(np.float64))
                        tolerance = _float_tolerance(inputs, op)
                        assert np.all(gap <= tolerance), (
                            f"n={n}: the ring differs by up to {gap.max()!r}")
            report.check(f"{dtype}-{op}", check)
    flat.close()

    def native() -> None:  # the native hand-off's allreduce takes the same path
        table = tnt_core.native_comm(runtime.backend)
        dones = NativeDone()
        for key, n in enumerate((size - 1, 1001)):
            python_buf = _shm_input(rank, n, "float64", "sum")
            native_buf = python_buf.copy()
            backend.allreduce_async(python_buf).wait(timeout=30)
            table.allreduce_async(native_buf, "sum", dones.callback(key))
            dones.wait([key])
            assert dones.once(key) is None, dones.once(key)
            assert np.array_equal(python_buf.view("u8"), native_buf.view("u8")), n

    report.check("native", native)
    backend.barrier()
    victim = size - 1
    buf = np.ones(2 << 20, np.float32)  # 8 MiB: 4 blocks of many slot-fulls each
    if rank == victim:
        report.data["info"]["dies_at"] = time.time() + victim_after
        report.write()
        threading.Timer(victim_after, lambda: os._exit(0)).start()
        while True:
            backend.allreduce(buf)

    def fails() -> None:
        try:
            for _ in range(10_000):
                backend.allreduce(buf)
        except CommError as exc:
            report.data["info"].update(error=str(exc), failed_at=time.time())
        else:
            raise AssertionError("allreduce went on after a peer exited")

    report.check("dead-peer-fails", fails)


# ------------------------------------------------------------------ point-to-point

def _until(predicate: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {seconds}s"
        time.sleep(0.01)


def p2p(report: Report, backend) -> None:
    """What the conformance suite does not cover: sends and receives are not queued
    behind a collective, complete without wait(), reach this rank itself, and refuse
    tags Gloo cannot carry. Two ranks."""
    rank, peer = backend.rank, 1 - backend.rank

    def beside_a_collective() -> None:
        # Rank 0 starts an allreduce that rank 1 joins only after it received rank 0's
        # message: a send queued behind the allreduce would deadlock.
        buf = np.full(1000, rank + 1, np.float32)
        msg = np.arange(4096, dtype=np.float64)
        if rank == 0:
            handle = backend.allreduce_async(buf)
            backend.send_async(msg, 1, tag=3).wait(timeout=20)
            back = np.empty_like(msg)
            backend.recv_async(back, 1, tag=4).wait(timeout=20)
            assert np.array_equal(back, msg * 2)
        else:
            got = backend.recv_async(np.empty_like(msg), 0, tag=3).wait(timeout=20)
            assert np.array_equal(got, msg)
            backend.send_async(got * 2, 0, tag=4).wait(timeout=20)
            handle = backend.allreduce_async(buf)
        handle.wait(timeout=20)
        assert np.all(buf == 3), buf[:4]

    def done_without_wait() -> None:
        out = np.arange(1 << 16, dtype=np.int32) + rank
        into = np.zeros(1 << 16, np.int32)
        recv = backend.recv_async(into, peer, tag=7)
        send = backend.send_async(out, peer, tag=7)
        _until(lambda: recv.done() and send.done(), 20.0, "done()")
        assert recv.completion_time() is not None
        assert np.array_equal(recv.wait(timeout=5), np.arange(1 << 16, dtype=np.int32) + peer)
        send.wait(timeout=5)

    def to_itself() -> None:
        early = backend.send_async(np.arange(5, dtype=np.int64), rank, tag=1)
        got = backend.recv_async(np.zeros(5, np.int64), rank, tag=1).wait(timeout=5)
        assert np.array_equal(got, np.arange(5)) and early.done()
        recv = backend.recv_async(np.zeros(3, np.float32), rank, tag=2)
        backend.send_async(np.ones(3, np.float32), rank, tag=2).wait(timeout=5)
        assert np.array_equal(recv.wait(timeout=5), np.ones(3, np.float32))
        backend.send_async(np.ones(4, np.float32), rank, tag=2).wait(timeout=5)
        try:
            backend.recv_async(np.zeros(3, np.float32), rank, tag=2).wait(timeout=5)
        except CommError as exc:
            assert "16 bytes" in str(exc) and "12 bytes" in str(exc), str(exc)
        else:
            raise AssertionError("a 16-byte message was received into 12 bytes")

    def largest_tag() -> None:
        top = 2**31 - 1
        recv = backend.recv_async(np.zeros(2, np.float32), peer, tag=top)
        backend.send_async(np.full(2, rank, np.float32), peer, tag=top).wait(timeout=20)
        assert np.all(recv.wait(timeout=20) == peer)
        try:
            backend.send_async(np.zeros(2, np.float32), peer, tag=top + 1)
        except ValueError as exc:
            assert "tag" in str(exc), str(exc)
        else:
            raise AssertionError(f"tag {top + 1} was accepted")

    def transport() -> None:
        want = "tcp" if os.environ.get("TNT_GLOO_SHM") == "0" else "shm"
        got = (backend.p2p_transport(peer), backend.p2p_transport(rank))
        assert got == (want, "self"), got

    def larger_than_the_ring() -> None:
        # The rings hold 2 MiB (2 ranks): a 3 MiB message sent before its receive is posted
        # (streamed by the sending thread, held by the receiving one) between two small
        # ones on the same tag, and a 5 MiB one whose receive waits for it (in place).
        small = [np.full(10, k, np.float32) for k in range(2)]
        big = np.arange(3 << 18, dtype=np.float32)  # 3 MiB
        bigger = np.arange(5 << 17, dtype=np.float64) * 0.5  # 5 MiB
        if rank == 0:
            sends = [backend.send_async(m, 1, tag=9) for m in (small[0], big, small[1])]
            backend.barrier()  # rank 1 posts its receives after this
            got = backend.recv_async(np.empty_like(bigger), 1, tag=10).wait(timeout=20)
            assert np.array_equal(got, bigger)
            for h in sends:
                h.wait(timeout=20)
        else:
            backend.barrier()
            for want in (small[0], big, small[1]):
                got = backend.recv_async(np.empty_like(want), 0, tag=9).wait(timeout=20)
                assert np.array_equal(got, want), f"{want.nbytes} bytes"
            time.sleep(0.1)  # rank 0's receive waits
            backend.send_async(bigger, 0, tag=10).wait(timeout=20)

    report.check("transport", transport)
    report.check("larger-than-the-ring", larger_than_the_ring)
    report.check("beside-a-collective", beside_a_collective)
    report.check("done-without-wait", done_without_wait)
    report.check("to-itself", to_itself)
    report.check("largest-tag", largest_tag)
    backend.barrier()


def p2p_dead_peer(report: Report, backend) -> None:
    """The last rank exits while rank 0 waits for its message: CommError naming it, long
    before TNT_TIMEOUT_S; later operations fail at once."""
    victim = backend.size - 1
    backend.barrier()
    if backend.rank == victim:
        time.sleep(0.3)  # the receive is posted before the exit, or after: both must fail
        os._exit(0)
    if backend.rank != 0:
        return

    def fails() -> None:
        t0 = time.monotonic()
        try:
            backend.recv_async(np.zeros(1000, np.float32), victim, tag=5).wait()
        except CommError as exc:
            report.data["info"].update(error=str(exc), seconds=time.monotonic() - t0)
            assert exc.peer == victim and f"from {victim}" in str(exc), str(exc)
        else:
            raise AssertionError("a receive from a dead peer returned")

    def later_ops_fail_fast() -> None:
        t0 = time.monotonic()
        for call in (lambda: backend.send_async(np.ones(4, np.float32), victim),
                     lambda: backend.allreduce(np.ones(4, np.float32))):
            try:
                call()
            except CommError:
                pass
            else:
                raise AssertionError("an operation after the failure succeeded")
        assert time.monotonic() - t0 < 1.0, "failing fast took too long"

    report.check("fails", fails)
    report.check("later-ops-fail-fast", later_ops_fail_fast)


def p2p_peer_closes(report: Report, backend) -> None:
    """Rank 0 sends its last messages and closes. Rank 1 was not waiting for them: it
    still gets every one (a closed connection is no failure by itself); a receive posted
    after them fails at once, naming rank 0."""
    msgs = [np.full(1000 * (k + 1), k, np.float32) for k in range(3)]
    if backend.rank == 0:
        backend.recv_async(np.zeros(1, np.int32), 1).wait(timeout=20)
        for h in [backend.send_async(m, 1, tag=8) for m in msgs]:
            h.wait(timeout=20)
        tnt_core.shutdown()
        os._exit(0)
    backend.send_async(np.ones(1, np.int32), 0).wait(timeout=20)

    def gets_the_last_messages() -> None:
        time.sleep(0.5)  # rank 0 is gone by now
        for k, m in enumerate(msgs):
            got = backend.recv_async(np.empty_like(m), 0, tag=8).wait(timeout=20)
            assert np.array_equal(got, m), f"message {k}"

    def later_receive_fails() -> None:
        t0 = time.monotonic()
        try:
            backend.recv_async(np.zeros(4, np.float32), 0, tag=8).wait(timeout=20)
        except CommError as exc:
            report.data["info"]["error"] = str(exc)
            assert exc.peer == 0 and "rank 0" in str(exc), str(exc)
        else:
            raise AssertionError("a receive from a closed peer returned")
        assert time.monotonic() - t0 < 2.0, "failing took too long"

    report.check("gets-the-last-messages", gets_the_last_messages)
    report.check("later-receive-fails", later_receive_fails)


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


# ------------------------------------------------------------------ native hand-off

class NativeDone:
    """done() calls of native allreduces by key, with what the callback saw; every wait
    has a timeout."""

    def __init__(self) -> None:
        self.calls: dict[int, list[str | None]] = {}
        self.seen: dict[int, object] = {}
        self.cv = threading.Condition()

    def callback(self, key: int, look: Callable[[], object] | None = None):
        with self.cv:
            self.calls[key] = []

        def done(error: str | None) -> None:
            seen = look() if look is not None else None  # on the completing thread
            with self.cv:
                self.calls[key].append(error)
                self.seen[key] = seen
                self.cv.notify_all()
        return done

    def wait(self, keys, timeout: float = 30.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: all(self.calls[k] for k in keys), timeout), \
                f"no done() within {timeout}s for {[k for k in keys if not self.calls[k]]}"

    def once(self, key: int) -> str | None:
        with self.cv:
            calls = list(self.calls[key])
        assert len(calls) == 1, f"done() of {key} called {len(calls)} times: {calls}"
        return calls[0]


_RAW_CALLBACKS: list[object] = []  # ctypes callbacks the native side may still call
#: ``tnt_native_done_fn`` of tnt_native_comm.h, declared as a C consumer declares it
_DONE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)


def _raw_native(table, data: int | None, count: int, dtype: int, op: int, done) -> tuple[int, str]:
    """The table's function called with raw arguments (NativeComm checks them first)."""
    if done is None:
        callback = _DONE_FN()  # a NULL function pointer
    else:
        callback = _DONE_FN(lambda _arg, error: done(None if error is None else error.decode()))
    _RAW_CALLBACKS.append(callback)
    err = ctypes.create_string_buffer(256)
    raw = table._table
    rc = raw.allreduce_async(raw.self, data, count, dtype, op, callback, None, err, len(err))
    return int(rc), err.value.decode()


def _seen(handles: dict) -> tuple[bool, bool]:
    """(first done, last done) of the Python-path allreduces around a native one; the last
    may not even be issued yet."""
    return handles["first"].done(), "last" in handles and handles["last"].done()


def native(report: Report, runtime) -> None:
    """The table of tnt_core.native_comm(backend): results bitwise those of the Python
    path, program order with it, done() once, refusals, point-to-point (ABI 2) on the
    Python methods' streams, and after close."""
    backend = runtime.backend.inner  # the raw backend: no header exchange in between
    table = tnt_core.native_comm(runtime.backend)  # WatchedBackend hands out the inner's
    rank, size = backend.rank, backend.size
    report.data["info"].update(transport=backend.allreduce_transport, rank=rank)
    report.write()

    def results() -> None:
        assert table is not None and (table.rank, table.size) == (rank, size)
        dones = NativeDone()
        started = []
        for dtype in _SHM_DTYPES:
            for op in _UFUNCS:
                for n in (0, 1, 1001, 3000):  # 3000 > TNT_GLOO_BCUBE_MAX_BYTES: the ring
                    python_buf = _shm_input(rank, n, dtype, op)
                    native_buf = python_buf.copy()
                    backend.allreduce_async(python_buf, op).wait(timeout=30)
                    key = len(started)
                    table.allreduce_async(native_buf, op, dones.callback(key))
                    started.append((key, dtype, op, n, python_buf, native_buf))
        dones.wait([s[0] for s in started])
        for key, dtype, op, n, python_buf, native_buf in started:
            assert dones.once(key) is None, f"{dtype} {op} {n}: {dones.once(key)}"
            bits = f"u{np.dtype(dtype).itemsize}"
            diff = np.flatnonzero(python_buf.view(bits) != native_buf.view(bits))
            assert diff.size == 0, (f"{dtype} {op} n={n}: {diff.size} elements differ from the "
                                    f"Python path, e.g. index {diff[0]}")

    def order() -> None:
        for k in range(20):
            a = np.full(513, rank + 1 + k, np.float64)
            n = np.full(513, 10 * rank + k, np.float64)
            c = np.full(513, -rank - k, np.float64)
            dones = NativeDone()
            handles = {"first": backend.allreduce_async(a, "sum")}
            table.allreduce_async(n, "max", dones.callback(0, functools.partial(_seen, handles)))
            handles["last"] = backend.allreduce_async(c, "min")
            handles["last"].wait(timeout=30)
            dones.wait([0])
            assert dones.once(0) is None
            assert dones.seen[0] == (True, False), \
                f"round {k}: at the native done(), (first done, last done) = {dones.seen[0]}"
            assert np.all(a == sum(r + 1 + k for r in range(size))), (k, a[:2])
            assert np.all(n == 10 * (size - 1) + k), (k, n[:2])
            assert np.all(c == -(size - 1) - k), (k, c[:2])

    def refusals() -> None:
        buf = np.ones(4, np.float32)
        dones = NativeDone()
        f32 = 2
        for what, data, count, dtype, op in (("dtype 0", buf.ctypes.data, 4, 0, 0),
                                             ("dtype 6", buf.ctypes.data, 4, 6, 0),
                                             ("op 4", buf.ctypes.data, 4, f32, 4),
                                             ("op -1", buf.ctypes.data, 4, f32, -1),
                                             ("count -1", buf.ctypes.data, -1, f32, 0),
                                             ("NULL data", None, 4, f32, 0)):
            rc, message = _raw_native(table, data, count, dtype, op, dones.callback(len(dones.calls)))
            assert rc != 0, f"{what} was accepted"
            assert f"[rank {rank}: native allreduce]" in message, f"{what}: {message!r}"
        rc, message = _raw_native(table, buf.ctypes.data, 4, f32, 0, None)
        assert rc != 0 and "done" in message, f"no done callback: {rc} {message!r}"
        # an empty buffer needs no data pointer
        rc, message = _raw_native(table, None, 0, f32, 0, dones.callback(99))
        assert rc == 0, message
        dones.wait([99])
        assert dones.once(99) is None
        backend.barrier()
        assert all(not dones.calls[k] for k in dones.calls if k != 99), dones.calls
        assert np.all(buf == 1)

    def point_to_point() -> None:
        # ABI 2: the table's messages are the Python methods' (one stream per peer and tag)
        assert table.has_p2p and table.abi_version == tnt_core.NativeComm.ABI_VERSION
        right, left = (rank + 1) % size, (rank - 1) % size
        dones = NativeDone()
        sent = [np.arange(n, dtype=np.float64) * (rank + 1) for n in (0, 7, 1 << 16)]
        got = [np.full_like(s, -1.0) for s in sent]
        for k, buf in enumerate(sent):  # native sends, Python receives, then the reverse
            table.send_async(buf, right, 5, dones.callback(k))
        handles = [backend.recv_async(g, left, 5) for g in got]
        for h in handles:
            h.wait(timeout=30)
        dones.wait(range(len(sent)))
        assert all(dones.once(k) is None for k in range(len(sent)))
        for g, s in zip(got, sent):
            assert np.array_equal(g, s / (rank + 1) * (left + 1)), g[:4]
        back = [np.full_like(s, -1.0) for s in sent]
        for k, buf in enumerate(back):
            table.recv_async(buf, right, 6, dones.callback(10 + k))
        for buf in sent:
            backend.send_async(buf, left, 6).wait(timeout=30)
        dones.wait([10 + k for k in range(len(sent))])
        assert all(dones.once(10 + k) is None for k in range(len(sent)))
        for b, s in zip(back, sent):
            assert np.array_equal(b, s / (rank + 1) * (right + 1)), b[:4]
        # a message of another size fails that receive only; the communicator goes on
        small = np.zeros(3, np.float32)
        table.recv_async(small, left, 7, dones.callback(20))
        backend.send_async(np.ones(4, np.float32), right, 7).wait(timeout=30)
        dones.wait([20])
        error = dones.once(20)
        assert error and f"[rank {rank}: native recv from {left} tag 7 #" in error \
            and "does not match" in error, error
        # refusals, never a done: a peer that is no rank, a tag out of range
        for peer, tag in ((size, 0), (-1, 0), (right, -1), (right, tnt_core.NativeComm.MAX_TAG + 1)):
            try:
                table.send_async(np.ones(2), peer, tag, dones.callback(30 + len(dones.calls)))
            except tnt_core.TntError as exc:
                assert f"[rank {rank}: native send to {peer} tag {tag}]" in str(exc), str(exc)
            else:
                raise AssertionError(f"a send to {peer} with tag {tag} was accepted")
        backend.barrier()
        assert all(not dones.calls[k] for k in dones.calls if k >= 30), dones.calls

    report.check("results-match-the-python-path", results)
    report.check("program-order", order)
    report.check("refusals", refusals)
    report.check("point-to-point", point_to_point)

    def after_close() -> None:
        dones = NativeDone()
        assert backend.native_comm() is table.capsule, "one capsule per backend"
        backend.close()
        for attempt in range(2):
            try:
                table.allreduce_async(np.ones(3, np.float32), "sum", dones.callback(attempt))
            except tnt_core.TntError as exc:
                assert "closed" in str(exc) and f"rank {rank}" in str(exc), str(exc)
            else:
                raise AssertionError("a closed backend's table accepted an allreduce")
            backend._comm = None  # drop the communicator: only the capsule holds its state
            gc.collect()
        try:
            backend.native_comm()
        except CommError as exc:
            assert "closed" in str(exc), str(exc)
        else:
            raise AssertionError("native_comm() of a closed backend returned")
        time.sleep(0.1)
        assert not dones.calls[0] and not dones.calls[1], dones.calls

    report.check("refused-after-close", after_close)


#: what rank 0 starts and aborts in abort_ends_tcp_waits: settings, and the call
_ABORTED_TCP_OPS: dict[str, tuple[dict[str, str], Callable[[Any], Any]]] = {
    "ring": ({"algorithm": "ring"}, lambda b: b.allreduce(np.ones(1 << 20, np.float32))),
    "bcube": ({"algorithm": "bcube"}, lambda b: b.allreduce(np.ones(1 << 12, np.float32))),
    "broadcast": ({}, lambda b: b.broadcast(np.ones(1 << 20, np.float32), root=1)),
    "allgather": ({}, lambda b: b.allgather(np.ones(1 << 18, np.float32))),
    "barrier": ({}, lambda b: b.barrier()),
}


def abort_ends_tcp_waits(report: Report, backend) -> None:
    """Over TCP, rank 0 starts each collective (on a communicator of its own) that rank 1
    never joins, and aborts it: the abort must end rank 0's own wait at once, as when an
    elastic job's new generation drops a host whose link went down (its peer sends
    nothing; closing the connections wakes the peers, not this rank)."""
    from tnt_comm_gloo.backend import GlooBackend

    comms = {name: GlooBackend(backend._config, dataclasses.replace(backend._settings, **settings))
             for name, (settings, _) in _ABORTED_TCP_OPS.items()}
    if backend.rank == 0:
        seconds: dict[str, float] = {}
        for name, (_, call) in _ABORTED_TCP_OPS.items():
            comm = comms[name]

            def aborted(comm=comm, call=call, name=name) -> None:
                assert comm.allreduce_transport == "tcp", comm
                errors: list[BaseException] = []

                def run() -> None:
                    try:
                        call(comm)
                    except BaseException as exc:  # noqa: BLE001 - reported below
                        errors.append(exc)

                thread = threading.Thread(target=run, daemon=True)
                thread.start()
                time.sleep(0.2)
                t0 = time.monotonic()
                comm.abort("aborted by the test")
                thread.join(timeout=10.0)
                seconds[name] = time.monotonic() - t0
                assert not thread.is_alive(), f"{name}: still waiting 10 s after the abort"
                assert errors and isinstance(errors[0], CommError), f"{name}: {errors}"
                assert "aborted by the test" in str(errors[0]), str(errors[0])

            report.check(f"abort-ends-{name}", aborted)
        report.data["info"]["abort_s"] = seconds
    backend.barrier()  # rank 1 stays out until rank 0 is done
    for comm in comms.values():
        comm.close()


def native_failure(report: Report, runtime, variant: str) -> None:
    """A native allreduce fails (its peer exited, or this rank aborts the communicator):
    done() comes once, with an error naming rank and operation; later calls are refused.
    Over TCP the abort variant first aborts every other TCP collective too
    (abort_ends_tcp_waits)."""
    backend = runtime.backend.inner
    table = tnt_core.native_comm(backend)
    rank, victim = backend.rank, backend.size - 1
    dones = NativeDone()
    if variant == "abort" and os.environ.get("TNT_GLOO_SHM") == "0":
        abort_ends_tcp_waits(report, backend)
    backend.barrier()
    if variant == "kill" and rank == victim:
        report.data["info"]["exited"] = True
        report.write()
        os._exit(0)
    if variant == "abort" and rank != 0:
        # Rank 0 aborts an allreduce this rank never joins. (Joining late could even
        # succeed: over shared memory, rank 0's half is published before it aborts.)
        time.sleep(1.0)
        tnt_core.shutdown()
        return
    time.sleep(0.5 if variant == "kill" else 0.0)
    buf = np.ones(1 << 18, np.float32)
    t0 = time.monotonic()
    table.allreduce_async(buf, "sum", dones.callback(0))
    if variant == "abort" and rank == 0:
        time.sleep(0.3)
        backend._comm.abort("aborted by the test")

    def fails_once() -> None:
        dones.wait([0], timeout=30.0)
        report.data["info"]["seconds"] = time.monotonic() - t0
        error = dones.once(0)
        report.data["info"]["error"] = error
        assert error, "the failed allreduce's done() got no error"
        assert f"[rank {rank}: native allreduce #1]" in error, error

    def later_refused() -> None:
        try:
            table.allreduce_async(np.ones(4, np.float32), "sum", dones.callback(1))
        except tnt_core.TntError as exc:
            assert "earlier collective failed" in str(exc), str(exc)
        else:
            raise AssertionError("a failed communicator's table accepted an allreduce")
        # the Python path names the first failure: the native allreduce, or the abort
        first = "aborted by the test" if variant == "abort" and rank == 0 else "native allreduce #1"
        try:
            backend.allreduce(np.ones(4, np.float32))
        except CommError as exc:
            assert first in str(exc), str(exc)
        else:
            raise AssertionError("the Python path went on after the native allreduce failed")

    report.check("fails-once", fails_once)
    report.check("later-refused", later_refused)
    t1 = time.monotonic()
    tnt_core.shutdown()
    report.data["info"]["close_s"] = time.monotonic() - t1

    def still_once() -> None:
        assert len(dones.calls[0]) == 1 and not dones.calls[1], dones.calls

    report.check("done-still-once-after-close", still_once)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=("file-store", "float16", "dlpack", "timeout",
                                             "shm-reduce", "shm-kill", "shm-setup", "p2p",
                                             "p2p-dead-peer", "p2p-peer-closes", "native",
                                             "native-failure", "hierarchy"))
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--fake-cudart", default="")
    parser.add_argument("--hang", type=float, default=0.0)
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--after", type=float, default=0.0)
    parser.add_argument("--variant", default="")
    args = parser.parse_args()
    if args.scenario == "shm-setup":
        shm_setup(Report(args.report, int(os.environ["TNT_RANK"])), args.variant)
        tnt_core.shutdown()
        return 0
    if args.scenario == "hierarchy":
        report = Report(args.report, int(os.environ["TNT_RANK"]))
        hierarchy(report, args.after)
        t0 = time.monotonic()
        tnt_core.shutdown()
        report.data["info"]["close_s"] = time.monotonic() - t0
        report.write()
        return 0
    runtime = tnt_core.init()
    report = Report(args.report, runtime.rank)
    report.data["info"]["backend"] = runtime.backend.name
    if args.scenario == "file-store":
        file_store(report, runtime.backend)
    elif args.scenario == "float16":
        float16(report, runtime.backend)
    elif args.scenario == "dlpack":
        dlpack(report, runtime.backend, args.fake_cudart)
    elif args.scenario == "shm-reduce":
        shm_reduce(report, runtime.backend, args.chunk)
    elif args.scenario == "shm-kill":
        shm_kill(report, runtime.backend, args.after)
    elif args.scenario == "p2p":
        p2p(report, runtime.backend)
    elif args.scenario == "p2p-dead-peer":
        p2p_dead_peer(report, runtime.backend)
    elif args.scenario == "p2p-peer-closes":
        p2p_peer_closes(report, runtime.backend)
    elif args.scenario == "native":
        native(report, runtime)
    elif args.scenario == "native-failure":
        native_failure(report, runtime, args.variant)
        return 0  # shut down already, timed
    else:
        timeout(report, runtime.backend, args.hang)
    t0 = time.monotonic()
    tnt_core.shutdown()
    report.data["info"]["close_s"] = time.monotonic() - t0
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
