"""The backend conformance checks, run inside every rank of a real multi-process job.

Run as ``python -m tnt_core.testing.conformance --report DIR`` under any launcher; each
rank writes ``DIR/rank<R>.json`` after every case, so a hang still tells which case hung.
The pytest side is :class:`tnt_core.testing.suite.BackendConformance`.

Inputs are functions of (rank, index) so every rank can compute the expected result of
a collective locally, and all checks are exact (small integers are exact in float16).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._backend import REDUCE_OPS, CommBackend
from .._config import Config
from .._errors import CommError, TntError
from .._native import DONE_FN, DTYPE_CODES, NativeComm, native_comm
from .._rendezvous import connect_store

__all__ = ["CASES", "CASE_NAMES", "DTYPES", "main"]

DTYPES = ("float32", "float64", "float16", "int32", "int64")
SIZES = (0, 1, 1001, (3, 5))
LARGE_BYTES = 64 * 1024 * 1024
_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def _input(op: str, rank: int, shape: int | tuple[int, ...], dtype: str) -> np.ndarray:
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64)
    if op == "product":
        values = (i + rank) % 2 + 1  # 1 or 2: products stay exact for few ranks
    elif op in ("min", "max"):
        values = (i * 7 + rank * 3) % 11 - 5
    else:
        values = i % 5 + rank + 1
    return values.astype(dtype).reshape(shape)


def _expected(op: str, size: int, shape: int | tuple[int, ...], dtype: str) -> np.ndarray:
    acc = _input(op, 0, shape, dtype)
    for r in range(1, size):
        acc = _REDUCE[op](acc, _input(op, r, shape, dtype))
    return acc


class Context:
    def __init__(self, backend: CommBackend, config: Config) -> None:
        self.backend = backend
        self.config = config
        self.rank, self.size = backend.rank, backend.size


def _make_allreduce_case(op: str, dtype: str) -> Callable[[Context], None]:
    def case(ctx: Context) -> None:
        for shape in SIZES:
            buf = _input(op, ctx.rank, shape, dtype)
            out = ctx.backend.allreduce_async(buf, op).wait()
            want = _expected(op, ctx.size, shape, dtype)
            assert out.shape == want.shape, f"shape {out.shape} != {want.shape}"
            assert out.dtype == np.dtype(dtype), f"dtype changed to {out.dtype}"
            assert np.array_equal(buf, want), f"shape {shape}: got {buf.ravel()[:8]}, want {want.ravel()[:8]}"
    return case


def case_allreduce_64mib(ctx: Context) -> None:
    n = LARGE_BYTES // 4
    pattern = (np.arange(n, dtype=np.int64) % 1024).astype(np.float32)
    buf = pattern * np.float32(ctx.rank + 1)
    ctx.backend.allreduce(buf)
    factor = np.float32(ctx.size * (ctx.size + 1) // 2)
    assert np.array_equal(buf, pattern * factor), "64 MiB sum differs from the expected values"


def case_broadcast_every_root(ctx: Context) -> None:
    for root in range(ctx.size):
        for dtype, n in (("float32", 1), ("int64", 100_003), ("float16", 7)):
            buf = (np.arange(n) % 97 + 10 * ctx.rank).astype(dtype)
            out = ctx.backend.broadcast(buf, root=root)
            want = (np.arange(n) % 97 + 10 * root).astype(dtype)
            assert np.array_equal(buf, want), f"broadcast from {root} ({dtype}) differs"
            assert np.shares_memory(out, buf), "broadcast must return the buffer it filled"


def case_allgather(ctx: Context) -> None:
    for dtype, shape in (("int32", (5,)), ("float64", (2, 3)), ("float32", (0,))):
        buf = (np.arange(int(np.prod(shape))).reshape(shape) + 100 * ctx.rank).astype(dtype)
        out = ctx.backend.allgather(buf)
        assert out.shape == (ctx.size, *shape), f"allgather shape {out.shape}"
        for r in range(ctx.size):
            want = (np.arange(int(np.prod(shape))).reshape(shape) + 100 * r).astype(dtype)
            assert np.array_equal(out[r], want), f"allgather row {r} differs ({dtype})"


def case_barrier(ctx: Context) -> None:
    """Ranks arrive staggered; after the barrier each sees every rank's arrival mark,
    written to the rendezvous store, a channel independent of the backend."""
    if not ctx.config.rendezvous:
        raise _Skip("needs TNT_RENDEZVOUS to observe arrivals independently")
    with connect_store(ctx.config) as store:
        for round_ in range(3):
            time.sleep(0.15 * ((ctx.rank + round_) % ctx.size))
            store.set(f"conformance/barrier/{round_}/{ctx.rank}", b"1")
            ctx.backend.barrier()
            keys = [f"conformance/barrier/{round_}/{r}" for r in range(ctx.size)]
            assert store.check(keys), f"round {round_}: barrier returned before every rank arrived"


def case_async_in_flight(ctx: Context) -> None:
    rng = np.random.default_rng(1234)  # same sizes on every rank
    specs = [(int(rng.integers(1, 100_000)), DTYPES[k % len(DTYPES)]) for k in range(64)]
    bufs = [_input("sum", ctx.rank, n, dt) for n, dt in specs]
    handles = [ctx.backend.allreduce_async(b) for b in bufs]
    handles[-1].wait()
    not_done = [k for k, h in enumerate(handles) if not h.done()]
    assert not not_done, f"handle 63 finished before earlier handles {not_done[:5]}: not in order"
    for k in reversed(range(len(handles))):
        out = handles[k].wait()
        n, dt = specs[k]
        assert np.shares_memory(out, bufs[k]), "wait() must return the reduced buffer"
        assert np.array_equal(bufs[k], _expected("sum", ctx.size, n, dt)), f"handle {k} wrong"


def case_bad_input(ctx: Context) -> None:
    """Bad arguments fail locally with a clear error and leave the backend usable."""
    strided = np.zeros(10, dtype=np.float32)[::2]
    bad_calls: tuple[tuple[Callable[[], object], type[Exception] | tuple[type[Exception], ...]], ...] = (
        (lambda: ctx.backend.allreduce_async(strided), (ValueError, TypeError)),
        (lambda: ctx.backend.allreduce_async(np.zeros(3, np.float32), op="mean"), ValueError),
        (lambda: ctx.backend.allreduce_async(np.zeros(3, np.uint8)), (TypeError, ValueError)),
        # a list, not an array: wrong on purpose, the backend must reject it
        (lambda: ctx.backend.allreduce_async([1.0, 2.0]), (TypeError, ValueError)),  # type: ignore[arg-type]
    )
    for bad, expected in bad_calls:
        try:
            bad()
        except expected as exc:
            assert str(exc), "error without a message"
        else:
            raise AssertionError(f"no error for bad input ({expected})")
    buf = np.ones(4, np.float32)
    ctx.backend.allreduce(buf)
    assert np.array_equal(buf, np.full(4, ctx.size, np.float32)), "backend broken after bad input"
    # a nonsense timeout is refused before the wait starts: it must not fail the communicator
    handle = ctx.backend.allreduce_async(np.ones(4, np.float32))
    for timeout in (-1, 0, float("nan")):
        try:
            handle.wait(timeout=timeout)
        except ValueError as exc:
            assert "timeout" in str(exc), f"the error for timeout={timeout} does not say timeout"
        else:
            raise AssertionError(f"Handle.wait(timeout={timeout}) was accepted")
    assert np.array_equal(handle.wait(), np.full(4, ctx.size, np.float32)), \
        "backend broken after a nonsense timeout"


class _Skip(Exception):
    pass


# -- point-to-point and groups (optional capabilities) ---------------------------------------

P2P_LARGE_BYTES = 4 * 1024 * 1024


def _need(ctx: Context, capability: str) -> None:
    if not ctx.backend.supports(capability):
        raise _Skip(f"the {ctx.backend.name!r} backend does not declare {capability!r}")
    if ctx.size < 2 and capability == "p2p":
        raise _Skip("needs two ranks")


def _msg(src: int, k: int, n: int, dtype: str) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) + 3 * src + 7 * k) % 101).astype(dtype)


def _ring(backend: CommBackend, k: int, n: int, dtype: str, *, recv_first: bool, tag: int = 0
          ) -> None:
    """Send to the right neighbour, receive from the left; check the left's message."""
    rank, size = backend.rank, backend.size
    left, right = (rank - 1) % size, (rank + 1) % size
    buf = np.full(n, -1, dtype=dtype)
    out = _msg(rank, k, n, dtype)
    if recv_first:
        r = backend.recv_async(buf, left, tag)
        s = backend.send_async(out, right, tag)
    else:
        s = backend.send_async(out, right, tag)
        r = backend.recv_async(buf, left, tag)
    got = r.wait()
    s.wait()
    assert got is buf or (buf.size and np.shares_memory(got, buf)), "recv must return its buffer"
    assert np.array_equal(buf, _msg(left, k, n, dtype)), f"ring message {k} ({dtype}, {n}) wrong"


def case_p2p_ring(ctx: Context) -> None:
    """Ring exchange of every dtype and size (0 bytes to 4 MiB), recv posted before and
    after the send."""
    _need(ctx, "p2p")
    k = 0
    for dtype in DTYPES:
        for n in (0, 1, 1001, P2P_LARGE_BYTES // np.dtype(dtype).itemsize):
            k += 1
            _ring(ctx.backend, k, n, dtype, recv_first=k % 2 == 0)


def case_p2p_order(ctx: Context) -> None:
    """Several messages on one (peer, tag) arrive in order; tags may be received out of
    their send order; receives posted late find their messages."""
    _need(ctx, "p2p")
    b, rank, size = ctx.backend, ctx.rank, ctx.size
    left, right = (rank - 1) % size, (rank + 1) % size
    sends = [b.send_async(_msg(rank, k, 257, "int32"), right, tag=5) for k in range(6)]
    sends += [b.send_async(_msg(rank, 100 + t, 33, "float64"), right, tag=t) for t in (1, 2, 3)]
    time.sleep(0.05)
    # tags in reverse order of sending
    for t in (3, 2, 1):
        got = np.empty(33, np.float64)
        b.recv_async(got, left, tag=t).wait()
        assert np.array_equal(got, _msg(left, 100 + t, 33, "float64")), f"tag {t} wrong message"
    bufs = [np.empty(257, np.int32) for _ in range(6)]
    recvs = [b.recv_async(buf, left, tag=5) for buf in bufs]
    for k in reversed(range(6)):  # waiting out of order does not reorder the messages
        recvs[k].wait()
    for k, buf in enumerate(bufs):
        assert np.array_equal(buf, _msg(left, k, 257, "int32")), f"message {k} on tag 5 out of order"
    for h in sends:
        h.wait()
    bad_calls: tuple[Callable[[], object], ...] = (
        lambda: b.send_async(np.zeros(2, np.float32), size, 0),
        lambda: b.recv_async(np.zeros(2, np.float32), -1, 0),
        lambda: b.send_async(np.zeros(2, np.float32), right, -3),
        lambda: b.recv_async(np.zeros(2, np.uint8), left, 0),
    )
    for bad in bad_calls:
        try:
            bad()
        except (TypeError, ValueError) as exc:
            assert str(exc), "error without a message"
        else:
            raise AssertionError("a bad peer, tag or buffer was accepted")
    ctx.backend.barrier()


def case_groups(ctx: Context) -> None:
    """Split into evens and odds (two splits); collectives and p2p inside each group see
    only its members; non-members get None; closing a group leaves the job's open."""
    _need(ctx, "groups")
    b, rank = ctx.backend, ctx.rank
    evens, odds = list(range(0, ctx.size, 2)), list(range(1, ctx.size, 2))
    groups = [b.split(evens), b.split(odds) if odds else None]
    for members, group in zip((evens, odds), groups):
        if rank not in members:
            assert group is None, f"rank {rank} is not in {members} but got a group"
            continue
        assert group is not None, f"rank {rank} is in {members} but got None"
        assert (group.rank, group.size) == (members.index(rank), len(members)), \
            f"group rank/size {group.rank}/{group.size} for members {members}"
        buf = np.array([rank + 1, 1], dtype=np.int64)
        group.allreduce(buf)
        assert buf.tolist() == [sum(r + 1 for r in members), len(members)], f"group allreduce {buf}"
        root_buf = np.array([rank], dtype=np.int32)
        group.broadcast(root_buf, root=len(members) - 1)
        assert root_buf[0] == members[-1], f"group broadcast gave {root_buf[0]}"
        gathered = group.allgather(np.array([rank], dtype=np.int32))
        assert gathered.ravel().tolist() == members, f"group allgather {gathered.ravel()}"
        group.barrier()
        if group.size > 1 and group.supports("p2p"):
            _ring(group, 1, 1000, "float32", recv_first=True, tag=9)
        group.close()
        group.close()
    buf = np.ones(3, np.float32)
    b.allreduce(buf)
    assert np.array_equal(buf, np.full(3, ctx.size, np.float32)), "parent broken after group close"
    try:
        b.split([0, 0])
    except ValueError:
        pass
    else:
        raise AssertionError("split([0, 0]) was accepted")


def case_p2p_size_mismatch(ctx: Context) -> None:
    """A message larger or smaller than the receive buffer raises on the receiver."""
    _need(ctx, "p2p")
    b, rank, size = ctx.backend, ctx.rank, ctx.size
    left, right = (rank - 1) % size, (rank + 1) % size
    for tag, (sent, room) in ((11, (10, 5)), (12, (5, 10))):
        s = b.send_async(np.ones(sent, np.float32), right, tag)
        try:
            b.recv_async(np.zeros(room, np.float32), left, tag).wait()
        except (CommError, ValueError) as exc:
            assert "byte" in str(exc) or "size" in str(exc), f"unclear size error: {exc}"
        else:
            raise AssertionError(f"a {sent}-element message was received into {room} elements")
        try:
            s.wait(timeout=5.0)
        except CommError:
            pass  # the transport may fail the send too


def case_p2p_recv_timeout(ctx: Context) -> None:
    """A receive nobody sends fails with CommError within the timeout (last p2p case: a
    backend may leave the communicator failed afterwards, as after a collective's timeout)."""
    _need(ctx, "p2p")
    handle = ctx.backend.recv_async(np.zeros(4, np.float32), (ctx.rank - 1) % ctx.size, tag=77)
    t0 = time.monotonic()
    try:
        handle.wait(timeout=1.0)
    except CommError as exc:
        assert "recv" in str(exc) and f"rank {ctx.rank}" in str(exc), f"unclear: {exc}"
    else:
        raise AssertionError("a receive nobody sent returned")
    took = time.monotonic() - t0
    assert took < 6.0, f"the timed-out receive took {took:.1f}s for a 1 s timeout"


# -- the native hand-off (optional: CommBackend.native_comm) ---------------------------------
#
# A backend that offers the C table (tnt_core/include/tnt_native_comm.h) must reduce
# through it as through allreduce_async, keep one order with the Python path, call done
# exactly once per accepted call, refuse (never call done) bad arguments and a closed
# communicator. A backend without a table returns None from native_comm(): these cases
# check that and pass.

NATIVE_WAIT_S = 60.0


class _NativeDone:
    """The done() calls of native allreduces, by key; every wait has a timeout."""

    def __init__(self) -> None:
        self.calls: dict[int, list[str | None]] = {}
        self._cv = threading.Condition()

    def callback(self, key: int) -> Callable[[str | None], None]:
        with self._cv:
            self.calls[key] = []

        def done(error: str | None) -> None:
            with self._cv:
                self.calls[key].append(error)
                self._cv.notify_all()
        return done

    def wait(self, keys: Sequence[int], timeout: float = NATIVE_WAIT_S) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: all(self.calls[k] for k in keys), timeout):
                late = [k for k in keys if not self.calls[k]]
                raise AssertionError(f"native allreduces {late[:5]} got no done() within {timeout:g}s")

    def assert_once_ok(self, keys: Sequence[int]) -> None:
        with self._cv:
            for k in keys:
                calls = self.calls[k]
                assert len(calls) == 1, f"done() of native allreduce {k} was called {len(calls)} times"
                assert calls[0] is None, f"native allreduce {k} failed: {calls[0]}"


def _native_table(backend: CommBackend) -> NativeComm | None:
    """The checked table, or None after checking that the backend says it has none."""
    table = native_comm(backend)
    if table is None:
        assert backend.native_comm() is None, "native_comm() returned a table, then None"
    return table


#: callbacks of raw calls: a backend that wrongly accepted one may still call it
_RAW_CALLBACKS: list[Any] = []


def _raw_native_call(table: NativeComm, buf: np.ndarray, count: int, dtype: int, op: int,
                     done: Callable[[str | None], None]) -> tuple[int, str]:
    """The table's allreduce_async called with raw codes, which NativeComm would not pass."""
    callback = DONE_FN(lambda _arg, error: done(None if error is None else error.decode()))
    _RAW_CALLBACKS.append(callback)
    err = ctypes.create_string_buffer(256)
    raw = table._table  # noqa: SLF001 - the raw function is what this checks
    rc = raw.allreduce_async(raw.self, buf.ctypes.data, count, dtype, op, callback, None, err,
                             len(err))
    return int(rc), err.value.decode(errors="replace")


def case_native_allreduce(ctx: Context) -> None:
    """Every reduction and dtype through the table, all in flight at once, gives what
    allreduce_async gives; done() comes once each; bad codes are refused locally."""
    table = _native_table(ctx.backend)
    if table is None:
        return
    assert (table.rank, table.size) == (ctx.rank, ctx.size), "the table's rank and size"
    dones = _NativeDone()
    started: list[tuple[np.ndarray, str, int | tuple[int, ...], str]] = []
    for op in REDUCE_OPS:
        for dtype in DTYPES:
            for shape in SIZES:
                buf = _input(op, ctx.rank, shape, dtype)
                table.allreduce_async(buf, op, dones.callback(len(started)))
                started.append((buf, op, shape, dtype))
    keys = range(len(started))
    dones.wait(keys)
    for buf, op, dims, dtype in started:
        want = _expected(op, ctx.size, dims, dtype)
        assert np.array_equal(buf, want), \
            f"native {op} {dtype} {dims}: got {buf.ravel()[:8]}, want {want.ravel()[:8]}"
    buf = np.ones(4, np.float32)
    refused = dones.callback(-1)
    for count, dtype_code, op_code, what in ((4, 0, 0, "dtype 0"), (4, 99, 0, "dtype 99"),
                                              (4, DTYPE_CODES[np.dtype("float32")], 17, "op 17"),
                                              (-1, DTYPE_CODES[np.dtype("float32")], 0, "count -1")):
        rc, message = _raw_native_call(table, buf, count, dtype_code, op_code, refused)
        assert rc != 0, f"a native allreduce with {what} was accepted"
        assert message, f"the refusal of {what} has no message"
    ctx.backend.barrier()  # every rank is past its refusals: a late done() would show now
    assert not dones.calls[-1], f"done() was called for a refused call: {dones.calls[-1]}"
    dones.assert_once_ok(keys)
    assert np.array_equal(buf, np.ones(4, np.float32)), "a refused call touched the buffer"


def case_native_gather(ctx: Context) -> None:
    """The allreduce of gathered pieces (ABI 3, when the table has it): pieces given out of
    order, with gaps, scaled by 1, a fraction (an integer for integer types) and 0 (zeros
    also where the source holds NaN), over several transport chunks, gives the reduction of
    the buffers a caller would have filled; ``out``'s old contents do not matter; pieces
    that overlap or leave the buffer are refused with a message, no done() and ``out``
    untouched."""
    table = _native_table(ctx.backend)
    if table is None or not table.has_gather:
        return
    n = 300_001  # float64: 2.4 MB, several chunks of a shared-memory transport
    cuts = [(0, 100), (150, 40_000), (40_001, 250_000), (260_000, n)]  # gaps between them
    dones = _NativeDone()
    started: list[tuple[str, str, float, np.ndarray]] = []
    for dtype in DTYPES:
        integer = np.dtype(dtype).kind == "i"
        for op in ("sum", "max"):
            for factor in ((1.0, 3.0, 0.0) if integer else (1.0, 0.5, 0.0)):
                source = _input(op, ctx.rank, n, dtype)
                if factor == 0.0 and not integer:
                    source[::7] = np.nan  # a rank without samples may hold anything
                pieces = [(source[a:b].copy(), a) for a, b in reversed(cuts)]
                out = np.full(n, 7, dtype)
                table.allreduce_gather(pieces, factor, out, op, dones.callback(len(started)))
                started.append((dtype, op, factor, out))
    keys = range(len(started))
    dones.wait(keys)
    dones.assert_once_ok(keys)
    for dtype, op, factor, out in started:
        filled = []
        for r in range(ctx.size):
            buf = np.zeros(n, dtype)
            source = _input(op, r, n, dtype)
            for a, b in cuts:
                buf[a:b] = 0 if factor == 0.0 else source[a:b] * np.dtype(dtype).type(factor)
            filled.append(buf)
        want = filled[0]
        for buf in filled[1:]:
            want = _REDUCE[op](want, buf)
        assert np.array_equal(out, want), \
            f"native gather {op} {dtype} x{factor:g}: got {out[:6]}, want {want[:6]}"
    out = np.full(8, 7, np.float32)
    refused = dones.callback(-1)
    for pieces, what in (([(np.ones(4, np.float32), 0), (np.ones(4, np.float32), 2)], "overlapping pieces"),
                         ([(np.ones(4, np.float32), 6)], "a piece past the end")):
        try:
            table.allreduce_gather(pieces, 1.0, out, "sum", refused)
        except TntError as exc:
            assert str(exc), f"the refusal of {what} has no message"
        else:
            raise AssertionError(f"a native gather with {what} was accepted")
    ctx.backend.barrier()
    assert not dones.calls[-1], f"done() was called for a refused gather: {dones.calls[-1]}"
    assert np.array_equal(out, np.full(8, 7, np.float32)), "a refused gather touched out"


def case_native_order(ctx: Context) -> None:
    """Native and Python-path allreduces interleaved: one order on every rank (buffers of
    one shape, different reductions: a rank that swapped two would mix their values). As a
    framework's op library would, the Python path's buffers are agreed on as a plan first
    when the backend exchanges headers (WatchedBackend.agree_on_plan)."""
    table = _native_table(ctx.backend)
    if table is None:
        return
    pattern = "PNPNNPPNPN"
    ops = [REDUCE_OPS[k % len(REDUCE_OPS)] for k in range(len(pattern))]
    bufs = [_input(op, ctx.rank, 1001, "float64") + k for k, op in enumerate(ops)]
    agree = getattr(ctx.backend, "agree_on_plan", None)
    if agree is not None:
        for path, buf, op in zip(pattern, bufs, ops):
            if path == "P":
                agree([buf], op)
    dones = _NativeDone()
    handles = {}
    for k, (path, buf, op) in enumerate(zip(pattern, bufs, ops)):
        if path == "P":
            handles[k] = ctx.backend.allreduce_async(buf, op)
        else:
            table.allreduce_async(buf, op, dones.callback(k))
    for handle in handles.values():
        handle.wait(NATIVE_WAIT_S)
    native = [k for k, path in enumerate(pattern) if path == "N"]
    dones.wait(native)
    dones.assert_once_ok(native)
    for k, (buf, op) in enumerate(zip(bufs, ops)):
        acc = _input(op, 0, 1001, "float64") + k
        for r in range(1, ctx.size):
            acc = _REDUCE[op](acc, _input(op, r, 1001, "float64") + k)
        assert np.array_equal(buf, acc), \
            f"{'native' if pattern[k] == 'N' else 'Python-path'} allreduce {k} ({op}) got " \
            f"{buf[:4]}, want {acc[:4]}: not issued in one order on every rank"


def _assert_native_refused(table: NativeComm, done: Callable[[str | None], None]) -> None:
    try:
        table.allreduce_async(np.ones(3, np.float32), "sum", done)
    except TntError as exc:
        assert str(exc), "the refusal has no message"
    else:
        raise AssertionError("a closed communicator's native table accepted an allreduce")


def case_native_after_close(ctx: Context) -> None:
    """A group's table works, then refuses (TntError, done() never called) once the group
    is closed, and still once the group's backend is dropped: the capsule keeps what the
    table needs."""
    table = _native_table(ctx.backend)
    if table is None:
        return
    if not ctx.backend.supports("groups"):
        raise _Skip("the backend has a native table but no 'groups' to close one mid-suite")
    group = ctx.backend.split(list(range(ctx.size)))
    assert group is not None, "split over every rank returned None"
    group_table = native_comm(group)
    assert group_table is not None, "the group of a backend with a native table has none"
    dones = _NativeDone()
    buf = np.full(7, ctx.rank + 1, np.int64)
    group_table.allreduce_async(buf, "sum", dones.callback(0))
    dones.wait([0])
    dones.assert_once_ok([0])
    assert np.all(buf == ctx.size * (ctx.size + 1) // 2), f"group native allreduce gave {buf}"
    group.close()
    _assert_native_refused(group_table, dones.callback(1))
    del group  # now only the capsule holds what the table needs
    gc.collect()
    _assert_native_refused(group_table, dones.callback(2))
    time.sleep(0.1)
    assert not dones.calls[1] and not dones.calls[2], "done() was called for a refused call"
    buf = np.ones(3, np.float32)
    ctx.backend.allreduce(buf)
    assert np.array_equal(buf, np.full(3, ctx.size, np.float32)), "parent broken after group close"


CASES: dict[str, Callable[[Context], None]] = {
    **{f"allreduce-{op}-{dt}": _make_allreduce_case(op, dt) for op in REDUCE_OPS for dt in DTYPES},
    "allreduce-64MiB": case_allreduce_64mib,
    "broadcast-every-root": case_broadcast_every_root,
    "allgather": case_allgather,
    "barrier": case_barrier,
    "async-in-flight": case_async_in_flight,
    "bad-input": case_bad_input,
    "native-allreduce": case_native_allreduce,
    "native-gather": case_native_gather,
    "native-order": case_native_order,
    "native-after-close": case_native_after_close,
    "p2p-ring": case_p2p_ring,
    "p2p-order": case_p2p_order,
    "groups": case_groups,
    "p2p-size-mismatch": case_p2p_size_mismatch,
    "p2p-recv-timeout": case_p2p_recv_timeout,
}
CASE_NAMES = (*CASES, "close-idempotent")


class _Report:
    def __init__(self, directory: Path, rank: int, size: int, backend: str) -> None:
        self.path = directory / f"rank{rank}.json"
        self.data: dict[str, Any] = {"rank": rank, "size": size, "backend": backend, "cases": {}}
        self.write()

    def record(self, name: str, status: str, detail: str = "", seconds: float = 0.0) -> None:
        self.data["cases"][name] = {"status": status, "detail": detail, "seconds": round(seconds, 4)}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def _run_suite(report_dir: Path, only: list[str] | None) -> int:
    import tnt_core

    runtime = tnt_core.init()
    ctx = Context(runtime.backend, runtime.config)
    report = _Report(report_dir, ctx.rank, ctx.size, runtime.backend.name)
    failed = 0
    for name, case in CASES.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            case(ctx)
            report.record(name, "ok", seconds=time.perf_counter() - t0)
        except _Skip as skip:
            report.record(name, "skip", str(skip))
        except CommError:
            failed += 1
            report.record(name, "fail", traceback.format_exc(), time.perf_counter() - t0)
            break  # collectives can no longer be matched across ranks
        except Exception:  # noqa: BLE001 - every failing case is reported, by name
            failed += 1
            report.record(name, "fail", traceback.format_exc(), time.perf_counter() - t0)
    try:
        ctx.backend.close()
        ctx.backend.close()
        report.record("close-idempotent", "ok")
    except Exception:  # noqa: BLE001 - reported as the case's failure
        failed += 1
        report.record("close-idempotent", "fail", traceback.format_exc())
    tnt_core.shutdown()
    return 1 if failed else 0


def _run_dead_peer(report_dir: Path) -> int:
    """The last rank leaves right after start-up; the others must get CommError, not hang."""
    import tnt_core

    runtime = tnt_core.init()
    backend = runtime.backend
    report = _Report(report_dir, backend.rank, backend.size, backend.name)
    backend.barrier()
    if backend.rank == backend.size - 1:
        report.record("dead-peer", "ok", "exited early on purpose")
        os._exit(0)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        for _ in range(3):  # a transport may need a round trip to notice
            backend.allreduce(np.ones(1 << 18, dtype=np.float32))
    except CommError as exc:
        report.record("dead-peer", "ok", f"CommError: {exc}", time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - the wrong error is the failure reported
        report.record("dead-peer", "fail", f"{type(exc).__name__} instead of CommError: {exc}",
                      time.monotonic() - t0)
    else:
        report.record("dead-peer", "fail", "allreduce with a dead peer returned normally",
                      time.monotonic() - t0)
    try:
        tnt_core.shutdown()  # closing after a failure must not hang either
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        report.record("close-after-failure", "fail", repr(exc))
    else:
        report.record("close-after-failure", "ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, type=Path, help="directory for rank<R>.json")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--dead-peer", action="store_true", help="run the dead-peer scenario")
    args = parser.parse_args(argv)
    args.report.mkdir(parents=True, exist_ok=True)
    if args.dead_peer:
        return _run_dead_peer(args.report)
    return _run_suite(args.report, [c for c in args.only.split(",") if c] or None)


if __name__ == "__main__":
    raise SystemExit(main())
