"""tnt_core.native_comm against tables of each ABI version (tnt_native_comm.h), made here
in ctypes as a backend of that version would: a table of ABI 1 still works, without
point-to-point and without the allreduce of gathered pieces; one below ABI 1's size or
version is refused."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import tnt_core
from tnt_core._native import DONE_FN

_ALLREDUCE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int32, ctypes.c_int32, DONE_FN, ctypes.c_void_p,
                              ctypes.c_char_p, ctypes.c_int64)


class AbiOneTable(ctypes.Structure):
    """The struct of ABI 1, as the header of that release declared it."""

    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("self", ctypes.c_void_p), ("rank", ctypes.c_int32), ("size", ctypes.c_int32),
                ("allreduce_async", _ALLREDUCE)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class TableBackend:
    """A backend whose native_comm() is a capsule over ``table`` (kept alive here)."""

    name = "abi-fake"
    rank, size = 0, 2

    def __init__(self, version: int, struct_size: int | None = None) -> None:
        calls = self.calls = []

        def allreduce(_self, _data, _count, _dtype, _op, done, arg, _err, _errlen):
            calls.append("allreduce")
            done(arg, None)
            return 0

        self._fn = _ALLREDUCE(allreduce)
        self.table = AbiOneTable(version, struct_size or ctypes.sizeof(AbiOneTable), None,
                                 self.rank, self.size, self._fn)
        self._capsule = _new_capsule(ctypes.addressof(self.table), b"tnt_native_comm", None)

    def native_comm(self):
        return self._capsule


def test_a_table_of_abi_1_works_without_point_to_point():
    backend = TableBackend(1)
    table = tnt_core.native_comm(backend)
    assert table is not None and (table.abi_version, table.has_p2p) == (1, False)
    seen = []
    table.allreduce_async(np.ones(3, np.float32), "sum", seen.append)
    assert backend.calls == ["allreduce"] and seen == [None]
    with pytest.raises(tnt_core.TntError, match="ABI 1: it has no point-to-point"):
        table.recv_async(np.zeros(3, np.float32), 1, 0, seen.append)
    with pytest.raises(tnt_core.TntError, match="ABI 1: it has no abort"):
        table.abort("why")
    assert not table.has_gather
    with pytest.raises(tnt_core.TntError, match="ABI 1: it has no allreduce of gathered pieces"):
        table.allreduce_gather([(np.ones(2, np.float32), 0)], 1.0, np.zeros(3, np.float32), "sum",
                               seen.append)
    assert backend.calls == ["allreduce"] and seen == [None]


@pytest.mark.parametrize("version", [2, 3])
def test_a_table_that_says_a_later_abi_but_is_too_short_has_none_of_its_entries(version):
    table = tnt_core.native_comm(TableBackend(version))
    assert table is not None and not table.has_p2p and not table.has_gather


@pytest.mark.parametrize(("version", "size"), [(0, None), (1, 16)], ids=["version-0", "short"])
def test_a_table_below_abi_1_is_refused(version, size):
    with pytest.raises(tnt_core.TntError, match="this tnt-core takes ABI 1 to 3"):
        tnt_core.native_comm(TableBackend(version, size))
