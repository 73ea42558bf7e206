"""The native hand-off: the optional C function table through which compiled framework ops
give buffers to a backend with no Python and no GIL in the step.

The table is declared in ``include/tnt_native_comm.h`` (shipped with this package; builders
of backends and of framework ops compile against it, :func:`include_dir`). A backend that
offers it returns it from :meth:`CommBackend.native_comm` as a PyCapsule named
:data:`CAPSULE_NAME`; one that does not returns None, and frameworks keep the Python path.
This module checks a capsule (:func:`native_comm`) and calls the table from Python, which
the conformance suite uses; a framework's op library calls it from C. With the table it
gets the job's stall ledger (``include/tnt_stall_ledger.h``, :attr:`NativeComm.ledger`),
in which it numbers the allreduces it starts and marks its waits, so that the stall
inspector sees them as it sees the Python path's.

ABI versions only append fields (the header says which version added what): ABI 1 has
``allreduce_async``, ABI 2 adds point-to-point (``send_async``, ``recv_async``, ``abort``).
A table of either is accepted; :attr:`NativeComm.has_p2p` says whether it has the second.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from ._backend import REDUCE_OPS, SUPPORTED_DTYPES, check_op
from ._errors import TntError
from ._stall_ledger import Ledger

__all__ = ["ABI_VERSION", "CAPSULE_NAME", "DTYPE_CODES", "GATHER_ABI_VERSION", "MAX_TAG",
           "OP_CODES", "P2P_ABI_VERSION", "NativeComm", "include_dir", "native_comm"]

CAPSULE_NAME = "tnt_native_comm"
#: the version this tnt-core writes and reads (``TNT_NATIVE_COMM_ABI_VERSION``)
ABI_VERSION = 3
#: the first version with point-to-point (``TNT_NATIVE_COMM_ABI_P2P``)
P2P_ABI_VERSION = 2
#: the first version with the allreduce of gathered pieces (``TNT_NATIVE_COMM_ABI_GATHER``)
GATHER_ABI_VERSION = 3
#: the largest point-to-point tag of the table (``TNT_NATIVE_MAX_TAG``)
MAX_TAG = 2**31 - 1
#: ``tnt_native_dtype``: tnt_core.SUPPORTED_DTYPES numbered from 1
DTYPE_CODES: dict[np.dtype, int] = {d: i + 1 for i, d in enumerate(SUPPORTED_DTYPES)}
#: ``tnt_native_op``: tnt_core.REDUCE_OPS numbered from 0
OP_CODES: dict[str, int] = {op: i for i, op in enumerate(REDUCE_OPS)}

DONE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
_ALLREDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_int32, ctypes.c_int32, DONE_FN, ctypes.c_void_p,
                                 ctypes.c_char_p, ctypes.c_int64)


_SEND_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_int32, ctypes.c_int64, DONE_FN, ctypes.c_void_p,
                            ctypes.c_char_p, ctypes.c_int64)
_RECV_FN = _SEND_FN
_ABORT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
_GATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                              ctypes.c_int32, ctypes.c_double, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int32, ctypes.c_int32, DONE_FN, ctypes.c_void_p,
                              ctypes.c_char_p, ctypes.c_int64)


class _TableV1(ctypes.Structure):
    """ABI 1: what every version starts with."""

    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("self", ctypes.c_void_p), ("rank", ctypes.c_int32), ("size", ctypes.c_int32),
                ("allreduce_async", _ALLREDUCE_FN)]


class _Table(_TableV1):
    """ABI 2: point-to-point appended (read only when :attr:`NativeComm.has_p2p`)."""

    _fields_ = [("send_async", _SEND_FN), ("recv_async", _RECV_FN), ("abort", _ABORT_FN)]


class _TableV3(_Table):
    """ABI 3: the allreduce of gathered pieces appended (read only when
    :attr:`NativeComm.has_gather`)."""

    _fields_ = [("allreduce_gather_async", _GATHER_FN)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def include_dir() -> str:
    """The directory holding ``tnt_native_comm.h``."""
    return str(Path(__file__).parent / "include")


class NativeComm:
    """A backend's checked function table. Keeps the capsule (and so the communicator)
    alive; :attr:`address` is what a framework's op library is given, with :attr:`ledger`.

    The class also carries the ABI a consumer that calls the table from C needs on its
    Python side (``tnt_native_comm.h``): :attr:`ABI_VERSION`, :attr:`P2P_ABI_VERSION`,
    :attr:`MAX_TAG`, the ``tnt_native_dtype`` and ``tnt_native_op`` codes
    (:attr:`DTYPE_CODES`, :attr:`OP_CODES`) and the headers' directory
    (:meth:`include_dir`).

    :param ledger: the stall ledger the consumer numbers its allreduces and marks its
        waits in (the :class:`~tnt_core.WatchedBackend`'s), kept alive with the table; None
        when the backend keeps none.
    """

    #: the ABI version this tnt-core writes and reads
    ABI_VERSION: ClassVar[int] = ABI_VERSION
    #: the first ABI version with point-to-point
    P2P_ABI_VERSION: ClassVar[int] = P2P_ABI_VERSION
    #: the first ABI version with the allreduce of gathered pieces
    GATHER_ABI_VERSION: ClassVar[int] = GATHER_ABI_VERSION
    #: the largest point-to-point tag
    MAX_TAG: ClassVar[int] = MAX_TAG
    #: numpy dtype -> ``tnt_native_dtype``
    DTYPE_CODES: ClassVar[Mapping[np.dtype, int]] = MappingProxyType(DTYPE_CODES)
    #: reduction name -> ``tnt_native_op``
    OP_CODES: ClassVar[Mapping[str, int]] = MappingProxyType(OP_CODES)

    @staticmethod
    def include_dir() -> str:
        """The directory holding ``tnt_native_comm.h`` and ``tnt_stall_ledger.h``, for
        builds of backends and framework ops (``python -c "import tnt_core;
        print(tnt_core.NativeComm.include_dir())"``)."""
        return include_dir()

    def __init__(self, capsule: Any, backend_name: str, ledger: Ledger | None = None) -> None:
        self.capsule = capsule
        self._ledger = ledger
        #: the address of the job's ``tnt_stall_ledger`` struct (``tnt_stall_ledger.h``),
        #: 0 when there is none (one rank, or a backend the runtime did not wrap)
        self.ledger: int = ledger.address if ledger is not None else 0
        self.address: int = _get_pointer(capsule, CAPSULE_NAME.encode())
        head = _TableV1.from_address(self.address)
        #: the producer's ABI version and struct size
        self.abi_version, self.struct_size = int(head.abi_version), int(head.struct_size)
        #: whether the table has point-to-point (ABI 2: send_async, recv_async, abort)
        self.has_p2p = (self.abi_version >= P2P_ABI_VERSION
                        and self.struct_size >= ctypes.sizeof(_Table))
        self._table = _Table.from_address(self.address) if self.has_p2p else head
        #: whether the table has allreduce_gather_async (ABI 3)
        self.has_gather = (self.abi_version >= GATHER_ABI_VERSION
                           and self.struct_size >= ctypes.sizeof(_TableV3)
                           and bool(ctypes.cast(_TableV3.from_address(self.address)
                                                .allreduce_gather_async, ctypes.c_void_p).value))
        if self.has_gather:
            self._table = _TableV3.from_address(self.address)
        self.rank, self.size = int(head.rank), int(head.size)
        self._pending: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._next = 0
        self.backend_name = backend_name

    def allreduce_async(self, buf: np.ndarray, op: str,
                        done: Callable[[str | None], None]) -> None:
        """Call the table's ``allreduce_async`` on ``buf`` (kept alive until ``done``);
        ``done(error)`` runs on whatever thread the backend completes it on. Counted in
        the stall ledger, as a compiled consumer counts its own. For tests and tools: the
        step's path is in C."""
        check_op(op)
        code = _writable_code(buf)
        key, callback = self._keep(buf, done)  # alive until the backend is done with them
        self._start_allreduce(key, lambda err: self._table.allreduce_async(
            self._table.self, buf.ctypes.data, buf.size, code, OP_CODES[op], callback, None,
            err, len(err)))

    def allreduce_gather(self, pieces: Sequence[tuple[np.ndarray, int]], factor: float,
                         out: np.ndarray, op: str, done: Callable[[str | None], None]) -> None:
        """Call the table's ``allreduce_gather_async``: the input is each ``(array,
        offset)`` of ``pieces`` (of ``out``'s dtype) times ``factor`` at its element
        offset, zeros elsewhere; the result goes to ``out``. Everything is kept alive until
        ``done``. For tests and tools, as :meth:`allreduce_async`; raises TntError without
        ABI 3."""
        check_op(op)
        if not self.has_gather:
            raise TntError(f"the {self.backend_name!r} backend's native table is ABI "
                           f"{self.abi_version}: it has no allreduce of gathered pieces "
                           f"(ABI {GATHER_ABI_VERSION})")
        code = _writable_code(out)
        arrays = [np.ascontiguousarray(a, out.dtype) for a, _ in pieces]
        n = len(arrays)
        srcs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
        counts = (ctypes.c_int64 * n)(*[a.size for a in arrays])
        offsets = (ctypes.c_int64 * n)(*[int(o) for _, o in pieces])
        key, callback = self._keep((out, arrays), done)
        self._start_allreduce(key, lambda err: self._table.allreduce_gather_async(
            self._table.self, srcs, counts, offsets, n, float(factor), out.ctypes.data, out.size,
            code, OP_CODES[op], callback, None, err, len(err)))

    def _start_allreduce(self, key: int, call: Callable[[Any], int]) -> None:
        """``call(err)`` starts an allreduce through the table: counted in the stall
        ledger; a refusal forgets ``key``'s buffers and raises TntError with the reason."""
        err = ctypes.create_string_buffer(512)
        if self._ledger is not None:
            self._ledger.enter()
        rc = call(err)
        if rc != 0:
            with self._lock:
                self._pending.pop(key, None)
            raise TntError(f"the {self.backend_name!r} backend refused a native allreduce: "
                           f"{err.value.decode(errors='replace') or f'code {rc}'}")

    def _keep(self, buf: Any, done: Callable[[str | None], None]) -> tuple[int, Any]:
        """A C callback that runs ``done`` and keeps ``buf`` and itself alive until then."""
        with self._lock:
            key, self._next = self._next, self._next + 1

        def finished(_arg: Any, error: bytes | None) -> None:
            with self._lock:
                self._pending.pop(key, None)
            done(None if error is None else error.decode(errors="replace"))

        callback = DONE_FN(finished)
        with self._lock:
            self._pending[key] = (buf, callback)
        return key, callback

    def _p2p(self, which: str, buf: np.ndarray, peer: int, tag: int,
             done: Callable[[str | None], None]) -> None:
        if not self.has_p2p:
            raise TntError(f"the {self.backend_name!r} backend's native table is ABI "
                           f"{self.abi_version}: it has no point-to-point (ABI {P2P_ABI_VERSION})")
        send = which == "send"
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous \
                or not (send or buf.flags.writeable):
            raise TypeError(f"the native {which} takes a {'' if send else 'writable '}"
                            "C-contiguous numpy array")
        key, callback = self._keep(buf, done)
        err = ctypes.create_string_buffer(512)
        entry = self._table.send_async if send else self._table.recv_async
        rc = entry(self._table.self, buf.ctypes.data, buf.nbytes, peer, tag, callback, None, err,
                   len(err))
        if rc != 0:
            with self._lock:
                self._pending.pop(key, None)
            raise TntError(f"the {self.backend_name!r} backend refused a native {which}: "
                           f"{err.value.decode(errors='replace') or f'code {rc}'}")

    def send_async(self, buf: np.ndarray, peer: int, tag: int,
                   done: Callable[[str | None], None]) -> None:
        """Call the table's ``send_async`` on ``buf`` (kept alive until ``done``). For tests
        and tools, as :meth:`allreduce_async`; raises TntError without point-to-point."""
        self._p2p("send", buf, peer, tag, done)

    def recv_async(self, buf: np.ndarray, peer: int, tag: int,
                   done: Callable[[str | None], None]) -> None:
        """Call the table's ``recv_async`` into ``buf`` (kept alive until ``done``)."""
        self._p2p("recv", buf, peer, tag, done)

    def abort(self, reason: str) -> None:
        """Call the table's ``abort``: the communicator fails with ``reason``."""
        if not self.has_p2p:
            raise TntError(f"the {self.backend_name!r} backend's native table is ABI "
                           f"{self.abi_version}: it has no abort (ABI {P2P_ABI_VERSION})")
        self._table.abort(self._table.self, reason.encode(errors="replace"))


def _writable_code(buf: Any) -> int:
    """The ``tnt_native_dtype`` of ``buf``, an array a native allreduce may write."""
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise TypeError("the native allreduce takes a writable C-contiguous numpy array")
    code = DTYPE_CODES.get(buf.dtype)
    if code is None:
        raise TypeError(f"the native allreduce takes {', '.join(map(str, SUPPORTED_DTYPES))}, "
                        f"not {buf.dtype}")
    return code


def native_comm(backend: Any) -> NativeComm | None:
    """The backend's native table, checked against this ABI, or None when it offers none.
    A table of ABI 1 (no point-to-point) is accepted: :attr:`NativeComm.has_p2p` is False.

    Raises :class:`~tnt_core.TntError` for a capsule this ABI cannot use (another name, a
    version or size below ABI 1's, ranks that are not the backend's): that is the backend's
    bug, and the Python path would hide it.
    """
    method = getattr(backend, "native_comm", None)
    capsule = method() if callable(method) else None
    if capsule is None:
        return None
    name = getattr(backend, "name", type(backend).__name__)
    if not _is_valid(capsule, CAPSULE_NAME.encode()):
        raise TntError(f"the {name!r} backend's native_comm() returned {type(capsule).__name__}, "
                       f"not a PyCapsule named {CAPSULE_NAME!r}")
    ledger = getattr(backend, "ledger", None)  # a WatchedBackend's: the stall inspector's
    table = NativeComm(capsule, name, ledger if isinstance(ledger, Ledger) else None)
    if table.abi_version < 1 or table.struct_size < ctypes.sizeof(_TableV1):
        raise TntError(f"the {name!r} backend's native table is ABI {table.abi_version} "
                       f"({table.struct_size} bytes); this tnt-core takes ABI 1 to {ABI_VERSION} "
                       f"(at least {ctypes.sizeof(_TableV1)} bytes): upgrade one to match the other")
    if (table.rank, table.size) != (backend.rank, backend.size):
        raise TntError(f"the {name!r} backend's native table says rank {table.rank} of "
                       f"{table.size}, the backend rank {backend.rank} of {backend.size}")
    return table
