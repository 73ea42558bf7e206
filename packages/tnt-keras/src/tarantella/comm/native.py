"""The native gradient path: tarantella's TensorFlow ops hand the buckets to the backend's
native table (``tnt_core.NativeComm``), with no Python and no GIL in the step.

The op library (``_tnt_tf_ops.so``, built from ``csrc/`` against TensorFlow's stable C API
only) has two ops: ``TntPushBucket`` copies a bucket's gradients in, scaled by the rank's
factor, and starts its allreduce when it is next in line; ``TntFinishReduce`` waits for
every bucket and outputs the reduced gradients as tensors wrapping the buckets (no copy
back). The bucket plan is tnt-core's, as on the Python path, so both reduce the same
buffers in the same order and give the same bits.

Python is called at two rare moments only, through C callbacks: before the first allreduce
(the ranks agree on the plan, as the Python path's ``FusedAllreducer`` does) and when a
collective fails (the error becomes the process's ``CommError``, which names the failing
rank at exit, with the stall inspector's diagnosis). The stall inspector sees the native
allreduces without Python: the op library numbers them in the job's stall ledger and marks
its waits there (``tnt_stall_ledger.h``, given with the table).

Where the backend offers no table (a third-party backend, the loopback example, MPI), or
``TNT_NATIVE_OPS=false``, or the library cannot load, :mod:`tarantella.comm.gradients` keeps the
``numpy_function`` path and logs once why.

Point-to-point (:func:`point_to_point`, for the pipeline's stages): three more ops over the
table's ``send_async``/``recv_async`` (ABI 2). ``TntSend`` starts sending a tensor and
returns a token at once (the op keeps the tensor until it is sent), ``TntRecv`` receives a
tensor of a given dtype and shape (blocking its TensorFlow thread until it is there, the
peer is known dead, or ``TNT_TIMEOUT_S`` passed), ``TntWaitSends`` waits for sends by their
tokens. Their messages are the backend's ``send_async``/``recv_async`` messages: one stream
per (peer, tag) whichever path sends or receives, tags in ``[0, 2**31)``, apart from every
collective's traffic. A table of ABI 1 has no point-to-point: :func:`point_to_point` returns
None and the caller keeps its Python path.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import tnt_core

from ..reporting.log import logger

__all__ = ["NativeReducer", "PointToPoint", "native_table", "p2p_unavailable_reason",
           "point_to_point", "unavailable_reason"]

_LIBRARY_NAME = "_tnt_tf_ops"
_AGREE_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_FAILED_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                              ctypes.c_int64)

_lock = threading.Lock()
#: the exceptions the native path recorded (plan disagreements, communication failures),
#: most recent last: TensorFlow re-raises them as its own OpError, which :func:`original`
#: maps back
_recorded: collections.deque[BaseException] = collections.deque(maxlen=16)
_loaded: tuple[Any, ctypes.CDLL] | None = None
_load_error: str | None = None
_told: set[str] = set()


def _library_path() -> Path | None:
    # the library is installed at the top of the package, beside tarantella/__init__.py
    here = Path(__file__).parent.parent / (_LIBRARY_NAME + ".so")
    if here.exists():
        return here
    # an editable install maps the built library from its build directory
    spec = importlib.util.find_spec(f"tarantella.{_LIBRARY_NAME}")
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and Path(origin).exists() else None


def _load() -> tuple[Any, ctypes.CDLL] | None:
    """The ops module and the C functions of the op library; None (reason in
    :data:`_load_error`) when it is missing or TensorFlow refuses it."""
    global _loaded, _load_error
    with _lock:
        if _loaded is not None or _load_error is not None:
            return _loaded
        path = _library_path()
        if path is None:
            _load_error = (f"tarantella's op library {_LIBRARY_NAME}.so is not installed (a "
                           "source checkout without the build?): reinstall tnt-keras")
            return None
        try:
            ops = tf.load_op_library(str(path))
            lib = ctypes.CDLL(str(path))
        except (tf.errors.OpError, OSError) as exc:
            _load_error = f"TensorFlow {tf.__version__} could not load {path.name}: {exc}"
            return None
        try:
            _declare(lib)
        except AttributeError as exc:  # a library built from older sources than this module
            _load_error = (f"{path.name} is older than this tarantella ({exc}): reinstall "
                           "tnt-keras so that its op library is rebuilt")
            return None
        _loaded = (ops, lib)
        return _loaded


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' signatures (an AttributeError names a missing one)."""
    lib.tnt_reducer_create.restype = ctypes.c_int64
    lib.tnt_reducer_create.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int32, ctypes.c_int32, ctypes.c_double,
        _AGREE_FN, _FAILED_FN, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
    lib.tnt_reducer_destroy.restype = None
    lib.tnt_reducer_destroy.argtypes = [ctypes.c_int64]
    lib.tnt_reducer_times.restype = ctypes.c_int32
    lib.tnt_reducer_times.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_double),
                                      ctypes.c_int32]
    lib.tnt_channel_create.restype = ctypes.c_int64
    lib.tnt_channel_create.argtypes = [ctypes.c_void_p, ctypes.c_double, _FAILED_FN,
                                       ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
    lib.tnt_channel_destroy.restype = None
    lib.tnt_channel_destroy.argtypes = [ctypes.c_int64]
    lib.tnt_channel_waited.restype = ctypes.c_double
    lib.tnt_channel_waited.argtypes = [ctypes.c_int64]


def unavailable_reason(runtime: tnt_core.Runtime,
                       backend: tnt_core.CommBackend | None = None) -> str | None:
    """Why gradients summed over ``backend`` (the job's by default, or a group of it) cannot
    take the native path, or None when they can."""
    backend = runtime.backend if backend is None else backend
    if not runtime.config.native_ops:
        return "TNT_NATIVE_OPS=false"
    if native_table(backend) is None:
        return (f"the {backend.name!r} backend offers no native hand-off "
                "(CommBackend.native_comm)")
    if _load() is None:
        return _load_error
    return None


#: backend -> its table; weak, so that a group of a dropped model goes with it (a reducer
#: keeps its table, and so its communicator, itself)
_tables: weakref.WeakKeyDictionary[Any, tnt_core.NativeComm | None] = weakref.WeakKeyDictionary()


def native_table(backend: tnt_core.CommBackend) -> tnt_core.NativeComm | None:
    """The backend's checked native table (made once per backend), or None. A group of
    ``split`` has its own communicator, and so its own table."""
    if backend not in _tables:
        _tables[backend] = tnt_core.native_comm(backend)
    return _tables[backend]


def tell_once(why: str | None, *, what: str = "gradients",
              python_path: str = "one tf.numpy_function per bucket") -> None:
    """One log line per process saying which path ``what`` takes, and why."""
    line = (f"{what} take the native path (tarantella's TensorFlow ops, no Python in the step)"
            if why is None else f"{what} take the Python path ({python_path}): {why}")
    if line not in _told:
        _told.add(line)
        # the backend's or the install's shortfall costs speed: said where users see it;
        # the path they chose (or got) is said at INFO
        quiet = why is None or why.startswith("TNT_NATIVE_OPS")
        (logger.info if quiet else logger.warning)(line)


_vector_reducers: dict[tuple[int, str, int], NativeReducer] = {}


def vector_reducer(runtime: tnt_core.Runtime, name: str, length: int) -> NativeReducer:
    """The reducer of a float64 vector summed every step (metric states, logs): one
    bucket, made once per (backend, name, length) and reused by every trace (the reducer
    holds the backend: its id stays its own)."""
    key = (id(runtime.backend), name, length)
    reducer = _vector_reducers.get(key)
    if reducer is None:
        plan = tnt_core.plan_buckets([((length,), np.float64)], 0, align_bytes=tnt_core.BUFFER_ALIGNMENT)
        reducer = _vector_reducers[key] = NativeReducer(runtime, plan, name=name)
    return reducer


def original(error: BaseException) -> BaseException | None:
    """The exception the native path recorded that TensorFlow re-raised as ``error`` (an
    OpError carrying its message), or None: the user gets the ``CommError`` or
    ``CollectiveMismatchError`` the Python path would raise."""
    message = getattr(error, "message", None) or str(error)
    for recorded in reversed(_recorded):
        if str(recorded) and str(recorded) in message:
            return recorded
    return None


def _write(out: int, size: int, text: str) -> None:
    data = text.encode(errors="replace")[: max(0, size - 1)] + b"\0"
    ctypes.memmove(out, data, len(data))


def _failure_hook(backend: tnt_core.CommBackend) -> Any:
    """The C hook through which the op library reports a communication failure: it becomes
    the process's CommError (with the stall inspector's diagnosis when a wait is marked),
    recorded for :func:`original`, and its wording goes back to C."""

    def failed(_arg: Any, message: bytes, out: int, outlen: int) -> None:
        text = message.decode(errors="replace")
        exc = tnt_core.CommError(text)  # the process's first CommError names the culprit
        if isinstance(backend, tnt_core.WatchedBackend):
            # a failed wait is still marked in the ledger: the stall inspector says who
            # did not arrive, here and in the launcher's last line
            exc = backend.explained(exc)
        _recorded.append(exc)
        _write(out, outlen, str(exc))

    return _FAILED_FN(failed)


class NativeReducer:
    """One bucket plan on the native path: the C reducer and the graph ops that feed it.

    :param backend: the communicator it reduces over (the job's by default, or a group).
    """

    def __init__(self, runtime: tnt_core.Runtime, plan: tnt_core.BucketPlan, *, op: str = "sum",
                 overlap: bool = True, name: str = "",
                 backend: tnt_core.CommBackend | None = None) -> None:
        backend = runtime.backend if backend is None else backend
        loaded = _load()
        table = native_table(backend)
        if loaded is None or table is None:
            raise tnt_core.TntError(unavailable_reason(runtime, backend)
                                    or "the native path is unavailable")
        self._ops, self._lib = loaded
        self.plan = plan
        self.name = name
        self._table = table  # keeps the backend's capsule, and so its communicator, alive

        def agree(_arg: Any, err: int, errlen: int) -> int:
            views = [np.lib.stride_tricks.as_strided(np.zeros(1, b.dtype), (b.size,), (0,))
                     for b in plan.buckets]
            try:
                agree_on_plan = getattr(backend, "agree_on_plan", None)
                if agree_on_plan is not None:
                    agree_on_plan(views, op)
                return 0
            except BaseException as exc:  # noqa: BLE001 - handed to C, raised by the step
                _recorded.append(exc)
                _write(err, errlen, str(exc))
                return 1

        self._hooks = (_AGREE_FN(agree), _failure_hook(backend))  # alive as long as the reducer
        buckets = plan.buckets
        dtypes = (ctypes.c_int32 * len(buckets))(*[tnt_core.NativeComm.DTYPE_CODES[b.dtype] for b in buckets])
        sizes = (ctypes.c_int64 * len(buckets))(*[b.size for b in buckets])
        err = ctypes.create_string_buffer(1024)
        self.id = int(self._lib.tnt_reducer_create(
            table.address, table.ledger or None, len(buckets), dtypes, sizes,
            tnt_core.NativeComm.OP_CODES[op], int(overlap), float(runtime.config.timeout_s or 0.0),
            self._hooks[0], self._hooks[1], None, err, len(err)))
        if self.id == 0:
            raise tnt_core.TntError(f"could not make the native gradient reducer: {err.value.decode()}")
        self._destroy = self._lib.tnt_reducer_destroy

    def __del__(self) -> None:
        destroy = getattr(self, "_destroy", None)
        if destroy is not None:
            destroy(self.id)

    def reduce(self, grads: Sequence[tf.Tensor], factor64: tf.Tensor) -> list[tf.Tensor]:
        """Graph ops: push every bucket as soon as its tensors exist, then finish."""
        tokens = []
        for bucket in self.plan.buckets:
            tokens.append(self._ops.tnt_push_bucket(
                [grads[i] for i in bucket.tensor_ids], factor64, reducer=self.id,
                bucket=bucket.index, offsets=list(bucket.offsets),
                name=f"tnt_push_{self.name}_bucket_{bucket.tensor_ids[0]}"))
        where = [self.plan.location(t) for t in range(self.plan.num_tensors)]
        specs = [self.plan.buckets[b].specs[p] for b, p in where]
        outs = self._ops.tnt_finish_reduce(
            tokens, out_types=[tf.as_dtype(s.dtype) for s in specs], reducer=self.id,
            buckets=[b for b, _ in where],
            offsets=[self.plan.buckets[b].offsets[p] for b, p in where],
            ranks=[len(s.shape) for s in specs], dims=[d for s in specs for d in s.shape],
            name=f"tnt_finish_{self.name}")
        outs = list(outs)
        for out, spec in zip(outs, specs):
            out.set_shape(spec.shape)
        return outs

    def record_timeline(self, timeline: tnt_core.Timeline, backprop_start: float | None) -> float:
        """The last step's buckets (pushed, issued, done) and backprop, on the timeline;
        returns when the last bucket was back."""
        n = 3 * len(self.plan.buckets)
        times = (ctypes.c_double * n)()
        got = self._lib.tnt_reducer_times(self.id, times, n)
        if got != n:
            return time.perf_counter()
        pushed = [times[3 * i] for i in range(len(self.plan.buckets))]
        if backprop_start is not None and pushed:
            timeline.complete("backprop", "backprop", backprop_start, max(pushed))
        for bucket in self.plan.buckets:
            i = bucket.index
            timeline.complete(f"allreduce bucket {i}", f"bucket {i}", times[3 * i + 1],
                              times[3 * i + 2] or time.perf_counter(), bytes=bucket.nbytes,
                              dtype=str(bucket.dtype), tensors=len(bucket.tensor_ids))
        return max(times[3 * i + 2] for i in range(len(self.plan.buckets)))


# -- point-to-point ---------------------------------------------------------------------------

#: the dtypes the point-to-point ops move (``TntSend``/``TntRecv``: bytes of any fixed size)
P2P_DTYPES = frozenset(tf.as_dtype(d) for d in (
    "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
    "uint32", "int64", "uint64", "bool", "complex64", "complex128"))


def p2p_unavailable_reason(runtime: tnt_core.Runtime,
                           backend: tnt_core.CommBackend | None = None) -> str | None:
    """Why sends and receives over ``backend`` (the job's by default, or a group of it)
    cannot take the native ops, or None when they can."""
    backend = runtime.backend if backend is None else backend
    why = unavailable_reason(runtime, backend)
    if why is not None:
        return why
    table = native_table(backend)
    if table is not None and not table.has_p2p:
        return (f"the {backend.name!r} backend's native hand-off is ABI {table.abi_version}, "
                f"without point-to-point (ABI {tnt_core.NativeComm.P2P_ABI_VERSION})")
    return None


#: backend -> its channel, made once (weak, as the tables)
_channels: weakref.WeakKeyDictionary[Any, PointToPoint] = weakref.WeakKeyDictionary()


def point_to_point(runtime: tnt_core.Runtime,
                   backend: tnt_core.CommBackend | None = None) -> PointToPoint | None:
    """Sends and receives over ``backend`` (the job's by default, or a group of it) as
    TensorFlow ops, or None when they cannot take the native path: then the caller keeps
    its Python path, and one log line per process says why."""
    backend = runtime.backend if backend is None else backend
    channel = _channels.get(backend)
    if channel is None:
        why = p2p_unavailable_reason(runtime, backend)
        tell_once(why, what="sends and receives between stages",
                  python_path="send_async/recv_async on numpy arrays")
        if why is not None:
            return None
        channel = _channels[backend] = PointToPoint(runtime, backend)
    return channel


class PointToPoint:
    """Sends and receives over a backend's native table as graph ops: no Python, no GIL
    and no copy into numpy on the way. Use :func:`point_to_point` (None where the backend
    cannot). Inside a ``tf.function`` the ops run when their inputs exist, in no order of
    their own: order a receive after the sends its peer waits for (control dependencies on
    their tokens; a send returns at once), and messages of one (peer, tag) in the order
    they must match. A receive blocks the TensorFlow thread it runs on until its message is
    there (TensorFlow's C API has no asynchronous kernel that can finish after it returned),
    so receives scheduled before the sends that feed their peers could hold every thread of
    TensorFlow's pool.

    Failures (a dead peer, a message of another size, ``TNT_TIMEOUT_S``) fail the op with
    the process's ``CommError`` as its message; :func:`original` maps TensorFlow's
    exception back to it (Keras' methods of tarantella's models raise it).
    """

    def __init__(self, runtime: tnt_core.Runtime, backend: tnt_core.CommBackend) -> None:
        loaded = _load()
        table = native_table(backend)
        if loaded is None or table is None or not table.has_p2p:
            raise tnt_core.TntError(p2p_unavailable_reason(runtime, backend)
                                    or "native point-to-point is unavailable")
        self._ops, self._lib = loaded
        self.backend = backend
        self._table = table  # keeps the backend's capsule, and so its communicator, alive
        self._hook = _failure_hook(backend)
        err = ctypes.create_string_buffer(1024)
        self.id = int(self._lib.tnt_channel_create(table.address,
                                                   float(runtime.config.timeout_s or 0.0),
                                                   self._hook, None, err, len(err)))
        if self.id == 0:
            raise tnt_core.TntError(f"could not make the native point-to-point channel: "
                                    f"{err.value.decode()}")
        self._destroy = self._lib.tnt_channel_destroy

    def __del__(self) -> None:
        destroy = getattr(self, "_destroy", None)
        if destroy is not None:
            destroy(self.id)

    def _check(self, operation: str, peer: int, tag: int) -> tuple[int, int]:
        peer, tag = tnt_core.check_peer(peer, self.backend.size, operation, tag)
        if tag > tnt_core.NativeComm.MAX_TAG:
            raise ValueError(f"{operation}: tag must be <= {tnt_core.NativeComm.MAX_TAG}, got {tag}")
        return peer, tag

    def _dtype(self, operation: str, dtype: Any) -> tf.DType:
        try:
            dtype = tf.as_dtype(dtype)
        except TypeError:
            dtype = None
        if dtype not in P2P_DTYPES:
            raise TypeError(f"{operation}: the dtype must be one of "
                            f"{sorted(d.name for d in P2P_DTYPES)}, got {dtype!r}")
        return dtype

    def send(self, tensor: Any, peer: int, tag: int) -> tf.Tensor:
        """Start sending ``tensor`` to rank ``peer`` of the backend with ``tag``; returns
        at once an int64 scalar token for :meth:`wait`. Messages to one (peer, tag) arrive
        in the order sent."""
        peer, tag = self._check("send", peer, tag)
        tensor = tf.convert_to_tensor(tensor)
        self._dtype("send", tensor.dtype)
        return self._ops.tnt_send(tensor, channel=self.id, peer=peer, tag=tag,
                                  name=f"tnt_send_to_{peer}_tag_{tag}")

    def recv(self, shape: Sequence[int], dtype: Any, peer: int, tag: int) -> tf.Tensor:
        """Receive the next message from rank ``peer`` with ``tag`` as a tensor of
        ``shape`` and ``dtype`` (a message of another byte size fails it). Blocks its
        TensorFlow thread until the message is there."""
        peer, tag = self._check("recv", peer, tag)
        dtype = self._dtype("recv", dtype)
        dims = tf.TensorShape(shape)
        if not dims.is_fully_defined():
            raise ValueError(f"recv: the shape must be fully known, got {dims}")
        out = self._ops.tnt_recv(dtype=dtype, shape=dims.as_list(), channel=self.id, peer=peer,
                                 tag=tag, name=f"tnt_recv_from_{peer}_tag_{tag}")
        out.set_shape(dims)
        return out

    @property
    def waited(self) -> float:
        """Seconds this channel's receives and waits for sends have spent blocked since
        it was made."""
        return float(self._lib.tnt_channel_waited(self.id))

    def wait(self, tokens: Sequence[tf.Tensor]) -> tf.Tensor:
        """Block until the sends of ``tokens`` (from :meth:`send`) are done, or raise their
        failure: before a step returns, when a send's failure must be that step's. Returns
        their number (an int64 scalar, for control dependencies)."""
        tokens = [tf.convert_to_tensor(t, tf.int64) for t in tokens]
        if not tokens:
            return tf.constant(0, tf.int64)
        return self._ops.tnt_wait_sends(tokens, channel=self.id, name="tnt_wait_sends")
