"""The op library's point-to-point against native tables made in ctypes, with no ranks:

* a backend whose table is of ABI 1 (allreduce only): the gradient path keeps it,
  point-to-point falls back to the Python path with the reason, and the op library itself
  refuses to make a channel over it;
* a backend of ABI 2 whose receive never completes: the receive op fails at
  ``TNT_TIMEOUT_S`` with the process's CommError, after aborting the communicator through
  the table (whose abort then completes the receive);
* the gradient push: into the bucket for an ABI-2 table, handed over (held until the
  backend is done with it) to an ABI-3 table's allreduce of gathered pieces.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

import tnt_core
from tarantella.comm import native as native_ops

_ALLREDUCE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_char_p, ctypes.c_int64)


_DONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
_P2P = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_int32, ctypes.c_int64, _DONE, ctypes.c_void_p, ctypes.c_char_p,
                        ctypes.c_int64)
_ABORT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)


class AbiOneTable(ctypes.Structure):
    """tnt_native_comm as ABI 1 declared it."""

    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("self", ctypes.c_void_p), ("rank", ctypes.c_int32), ("size", ctypes.c_int32),
                ("allreduce_async", _ALLREDUCE)]


class AbiTwoTable(AbiOneTable):
    """tnt_native_comm of ABI 2: point-to-point appended."""

    _fields_ = [("send_async", _P2P), ("recv_async", _P2P), ("abort", _ABORT)]


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


class StuckBackend:
    """ABI 2: sends complete at once; a receive with tag 1 gets 0, 1, 2, ... at once, any
    other waits until abort() fails it."""

    name = "stuck"
    rank, size = 0, 2

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.pending: list[tuple[object, int]] = []
        self.completed = 0

        def send(_self, _data, _nbytes, _peer, _tag, done, arg, _err, _errlen):
            done(arg, None)
            return 0

        def recv(_self, data, nbytes, _peer, tag, done, arg, _err, _errlen):
            if tag == 1:
                ctypes.memmove(data, bytes(range(nbytes)), nbytes)
                done(arg, None)
            else:
                self.pending.append((done, arg))
            return 0

        def abort(_self, reason):
            self.aborted.append(reason.decode())
            for done, arg in self.pending:
                done(arg, b"[rank 0: native recv] aborted")
                self.completed += 1
            self.pending.clear()

        self._fns = (_ALLREDUCE(lambda *args: 1), _P2P(send), _P2P(recv), _ABORT(abort))
        self.table = AbiTwoTable(2, ctypes.sizeof(AbiTwoTable), None, 0, 2, *self._fns)
        self._capsule = _new_capsule(ctypes.addressof(self.table), b"tnt_native_comm", None)

    def native_comm(self):
        return self._capsule


@pytest.fixture
def library():
    if native_ops._load() is None:
        pytest.skip(f"the op library is not built: {native_ops._load_error}")


@pytest.fixture
def runtime(library):
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


def test_a_receive_that_never_completes_fails_at_the_timeout_and_aborts(library):
    runtime = SimpleNamespace(backend=StuckBackend(),
                              config=SimpleNamespace(native_ops=True, timeout_s=0.5))
    pp = native_ops.PointToPoint(runtime, runtime.backend)
    got = tf.function(lambda: pp.recv((2, 3), tf.uint8, 1, 1))()  # completes inside the call
    assert got.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert tf.function(lambda: pp.wait([pp.send(tf.ones(3), 1, 0)]))().numpy() == 1
    stuck = tf.function(lambda: pp.recv((4,), tf.float32, 1, 2))
    # traced before the clock starts, so that only the receive is timed: in one clean-clone
    # suite run the traced call took 18.7 s (alone, and beside 4 busy loops: 0.55 s)
    stuck.get_concrete_function()
    t0 = time.monotonic()
    with pytest.raises(tf.errors.OpError) as raised:
        stuck()
    seconds = time.monotonic() - t0
    want = ("rank 0: the receive from rank 1 (tag 2, 16 bytes) did not complete within 0.5s "
            "(TNT_TIMEOUT_S): rank 1 may be hung or dead, or never sent it")
    assert runtime.backend.aborted == [want] and runtime.backend.completed == 1
    assert 0.5 <= seconds < 5.0, seconds
    error = native_ops.original(raised.value)
    assert isinstance(error, tnt_core.CommError) and str(error) == want
    np.testing.assert_array_equal(got.numpy(), [[0, 1, 2], [3, 4, 5]])  # still its own buffer


def test_an_op_library_older_than_the_module_falls_back_in_one_line(monkeypatch):
    """A stale build (a symbol this module declares is missing) is a reason to keep the
    Python path, said once, not an AttributeError from deep inside the first step."""

    class Stale:
        def __getattr__(self, name):
            if name == "tnt_channel_create":
                raise AttributeError(f"_tnt_tf_ops.so: undefined symbol: {name}")
            return SimpleNamespace()

    monkeypatch.setattr(native_ops, "_loaded", None)
    monkeypatch.setattr(native_ops, "_load_error", None)
    monkeypatch.setattr(native_ops.tf, "load_op_library", lambda path: object())
    monkeypatch.setattr(native_ops.ctypes, "CDLL", lambda path: Stale())
    monkeypatch.setattr(native_ops, "_library_path", lambda: native_ops.Path("/x/_tnt_tf_ops.so"))
    assert native_ops._load() is None
    assert native_ops._load_error.startswith("_tnt_tf_ops.so is older than this tarantella")
    assert "undefined symbol: tnt_channel_create" in native_ops._load_error
    assert "reinstall tnt-keras" in native_ops._load_error


# -- the gradient push against an ABI-2 table (copied into the bucket) and an ABI-3 table
# (the gradients handed over, gathered by the backend) --------------------------------------

_GATHER = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                           ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                           ctypes.c_int32, ctypes.c_double, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_int32, ctypes.c_int32, _DONE, ctypes.c_void_p,
                           ctypes.c_char_p, ctypes.c_int64)


class AbiThreeTable(AbiTwoTable):
    """tnt_native_comm of ABI 3: the allreduce of gathered pieces appended."""

    _fields_ = [("allreduce_gather_async", _GATHER)]


class TwinBackend:
    """A rank whose one peer holds the same gradients: the sum over the ranks is twice this
    rank's buffer. ABI 2 reduces the bucket it is given in place; ABI 3 gathers the pieces
    itself, on a thread of its own a moment later (so the sources must outlive the push)."""

    name = "twin"
    rank, size = 0, 2

    def __init__(self, abi: int) -> None:
        self.calls: list[str] = []
        self.threads: list[threading.Thread] = []

        def allreduce(_self, data, count, _dtype, _op, done, arg, _err, _errlen):
            self.calls.append("allreduce")
            buf = np.ctypeslib.as_array(ctypes.cast(data, ctypes.POINTER(ctypes.c_float)), (count,))
            buf *= 2
            _DONE(done)(arg, None)
            return 0

        def gather(_self, srcs, counts, offsets, nparts, factor, out, count, _dtype, _op, done,
                   arg, _err, _errlen):
            self.calls.append("gather")
            pieces = [(srcs[i], counts[i], offsets[i]) for i in range(nparts)]

            def later() -> None:
                time.sleep(0.2)
                result = np.zeros(count, np.float32)
                for src, n, at in pieces:
                    piece = np.ctypeslib.as_array(ctypes.cast(src, ctypes.POINTER(ctypes.c_float)), (n,))
                    result[at:at + n] = piece * np.float32(factor)
                ctypes.memmove(out, (2 * result).ctypes.data, result.nbytes)
                done(arg, None)

            self.threads.append(threading.Thread(target=later))
            self.threads[-1].start()
            return 0

        p2p = _P2P(lambda *args: 1)
        self._fns = [_ALLREDUCE(allreduce), p2p, p2p, _ABORT(lambda *args: None)]
        if abi == 3:
            self._fns.append(_GATHER(gather))
        kind = AbiThreeTable if abi == 3 else AbiTwoTable
        self.table = kind(abi, ctypes.sizeof(kind), None, 0, 2, *self._fns)
        self._capsule = _new_capsule(ctypes.addressof(self.table), b"tnt_native_comm", None)

    def native_comm(self):
        return self._capsule


@pytest.mark.parametrize("abi, path", [(2, "allreduce"), (3, "gather")])
def test_the_push_copies_for_an_abi_2_table_and_hands_the_gradients_to_an_abi_3_one(library, abi, path):
    backend = TwinBackend(abi)
    runtime = SimpleNamespace(backend=backend, config=SimpleNamespace(native_ops=True, timeout_s=5.0))
    grads = [np.arange(6, dtype=np.float32).reshape(2, 3) + 1, np.full(5, -3, np.float32),
             np.linspace(0, 1, 7, dtype=np.float32)]
    plan = tnt_core.plan_buckets(grads, threshold_bytes=40, align_bytes=64)  # two buckets, padding
    reducer = native_ops.NativeReducer(runtime, plan)

    @tf.function
    def step():  # the gradients exist only inside the step, as a backward pass's do
        made = [tf.identity(tf.constant(g)) * 1.0 for g in grads]
        return reducer.reduce(made, tf.constant(0.5, tf.float64))

    out = step()
    for g, o in zip(grads, out):
        np.testing.assert_array_equal(o.numpy(), 2 * (g * np.float32(0.5)))
    assert backend.calls == [path] * len(plan.buckets)
    for t in backend.threads:
        t.join(5)
