"""The op library against a backend whose native table is of ABI 1 (allreduce only): the
gradient path keeps it, point-to-point falls back to the Python path with the reason, and
the op library itself refuses to make a channel over it. No ranks: a table made in ctypes
as a backend of ABI 1 makes it."""

from __future__ import annotations

import ctypes
import logging
from types import SimpleNamespace

import pytest

from tarantella import native_ops

_ALLREDUCE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_char_p, ctypes.c_int64)


class AbiOneTable(ctypes.Structure):
    """tnt_native_comm as ABI 1 declared it."""

    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("self", ctypes.c_void_p), ("rank", ctypes.c_int32), ("size", ctypes.c_int32),
                ("allreduce_async", _ALLREDUCE)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class AbiOneBackend:
    name = "abi-one"
    rank, size = 0, 2

    def __init__(self) -> None:
        self._fn = _ALLREDUCE(lambda *args: 1)  # never called here
        self.table = AbiOneTable(1, ctypes.sizeof(AbiOneTable), None, 0, 2, self._fn)
        self._capsule = _new_capsule(ctypes.addressof(self.table), b"tnt_native_comm", None)

    def native_comm(self):
        return self._capsule


@pytest.fixture
def runtime():
    if native_ops._load() is None:
        pytest.skip(f"the op library is not built: {native_ops._load_error}")
    return SimpleNamespace(backend=AbiOneBackend(),
                           config=SimpleNamespace(native_ops=True, timeout_s=5.0))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_gradients_keep_the_native_path_and_point_to_point_falls_back(runtime):
    assert native_ops.unavailable_reason(runtime) is None
    why = native_ops.p2p_unavailable_reason(runtime)
    assert why == "the 'abi-one' backend's native hand-off is ABI 1, without point-to-point (ABI 2)"
    lines = Lines()
    native_ops.logger.addHandler(lines)
    try:
        assert native_ops.point_to_point(runtime) is None
        assert native_ops.point_to_point(runtime) is None
    finally:
        native_ops.logger.removeHandler(lines)
    assert lines.lines == ["sends and receives between stages take the Python path "
                           f"(send_async/recv_async on numpy arrays): {why}"]


def test_the_op_library_refuses_a_channel_over_an_abi_1_table(runtime):
    _, lib = native_ops._load()
    table = native_ops.native_table(runtime.backend)
    err = ctypes.create_string_buffer(256)
    hook = native_ops._failure_hook(runtime.backend)
    assert lib.tnt_channel_create(table.address, 5.0, hook, None, err, len(err)) == 0
    assert err.value.decode() == ("the backend's native table is ABI 1 (32 bytes): it has no "
                                  "point-to-point (ABI 2)")
