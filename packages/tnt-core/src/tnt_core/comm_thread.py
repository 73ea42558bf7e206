"""An ordered communication thread and the handles it hands out.

Backends written in Python (MPI over mpi4py, the reference store backend) run every
collective on one thread, in submission order: that keeps the contract's "same order on
every rank" and lets MPI progress non-blocking operations inside its own calls.
``Handle.wait`` blocks on an event (a futex), so a waiting rank burns no core.

Handing an operation to another thread and its result back costs two thread wake-ups;
on a virtual machine each one takes 30 µs or more (measured here: a null operation took
83 µs from submit to the end of wait). A thread that waits for an operation nobody has
started yet has nothing else to do, so with ``run_in_waiter=True`` it runs the queued
operations up to its own itself, in order, while the thread is idle: at most one
operation runs at a time and the order stays the submission order, so a backend whose
library allows calls from any thread, one at a time (``MPI_THREAD_SERIALIZED``), keeps
its guarantees.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .backend import Handle
from .errors import CommError

__all__ = ["CommThread", "FutureHandle"]


class FutureHandle(Handle):
    """The result of one operation submitted to a :class:`CommThread`."""

    __slots__ = ("_event", "_result", "_error", "_operation", "_thread", "_buf", "_t", "_fn")

    def __init__(self, thread: CommThread, operation: str, buf: np.ndarray | None,
                 fn: Callable[[], Any]) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._operation = operation
        self._thread = thread
        self._buf = buf  # owned until completion, as an MPI request owns its buffer
        self._t: float | None = None
        self._fn: Callable[[], Any] | None = fn

    def _complete(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._fn = None
        self._t = time.perf_counter()
        self._event.set()

    def completion_time(self) -> float | None:
        return self._t

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        thread = self._thread
        timeout = thread.timeout_s if timeout is None else timeout
        if not self._event.is_set():
            with thread._waiting():
                # running operations inline honours only the thread's own timeout
                if thread.run_in_waiter and timeout >= thread.timeout_s:
                    thread._run_until(self)
                finished = self._event.wait(timeout)
            if not finished:
                err = CommError(
                    f"did not complete within {timeout:g}s (TNT_TIMEOUT_S); a peer may be hung "
                    "or dead", rank=thread.rank, operation=self._operation,
                )
                thread.fail(err)
                raise err
        if self._error is not None:
            raise self._error
        return self._result


class CommThread:
    """Runs submitted callables one after another on a daemon thread.

    After one operation fails, every later one fails at once with the first error: the
    ranks' collectives can no longer be matched, so going on would hang or corrupt data.

    :param run_in_waiter: a thread blocked in ``Handle.wait`` runs the queued operations up
        to its own while the communication thread is idle (see the module docstring).
    """

    def __init__(self, name: str, rank: int, timeout_s: float, *, run_in_waiter: bool = False) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.run_in_waiter = run_in_waiter
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[FutureHandle] = deque()
        self._busy = False  # an operation is running (on the thread or in a waiter)
        self._waiters = 0
        self._failure: CommError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], operation: str, buf: np.ndarray | None = None) -> FutureHandle:
        """Queue ``fn``; its return value becomes the handle's result."""
        if self._closed:
            raise CommError("the backend is closed", rank=self.rank, operation=operation)
        if self._failure is not None:
            raise CommError(f"an earlier collective failed: {self._failure}", rank=self.rank,
                            operation=operation)
        handle = FutureHandle(self, operation, buf, fn)
        with self._cond:
            self._pending.append(handle)
            self._cond.notify()
        return handle

    def fail(self, error: CommError) -> None:
        if self._failure is None:
            self._failure = error

    @property
    def failure(self) -> CommError | None:
        return self._failure

    @property
    def has_waiters(self) -> bool:
        """True while some thread is blocked waiting for an operation of this thread (or
        runs one in its place): the rank has nothing else to do, so a backend may poll for
        completion eagerly instead of sparing the CPU for the caller."""
        return self._waiters > 0

    # -- running operations ------------------------------------------------------------------

    def _waiting(self) -> _Waiting:
        return _Waiting(self)

    def _execute(self, handle: FutureHandle) -> None:
        if self._failure is not None:
            handle._complete(error=CommError(f"an earlier collective failed: {self._failure}",
                                             rank=self.rank, operation=handle._operation))
            return
        fn = handle._fn
        assert fn is not None  # cleared only on completion, and a handle is claimed once
        try:
            handle._complete(result=fn())
        except CommError as exc:
            self.fail(exc)
            handle._complete(error=exc)
        except BaseException as exc:  # anything else: still a failed collective
            err = CommError(f"{type(exc).__name__}: {exc}", rank=self.rank,
                            operation=handle._operation)
            err.__cause__ = exc
            self.fail(err)
            handle._complete(error=err)

    def _claim(self) -> FutureHandle | None:
        # with the lock held: the next operation, if nothing runs now
        if self._busy or not self._pending:
            return None
        self._busy = True
        return self._pending.popleft()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _run_until(self, target: FutureHandle) -> None:
        """In a waiting thread: run queued operations, in order, until ``target`` is done or
        the communication thread is busy (then the caller blocks on the event)."""
        while not target._event.is_set():
            with self._cond:
                handle = self._claim()
            if handle is None:
                return
            try:
                self._execute(handle)
            finally:
                self._release()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (handle := self._claim()) is None:
                    if self._closed and not self._pending and not self._busy:
                        return
                    self._cond.wait()
            try:
                self._execute(handle)
            finally:
                self._release()

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued operations; idempotent."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class _Waiting:
    """Counts a thread as waiting (see :attr:`CommThread.has_waiters`) while inside."""

    __slots__ = ("_thread",)

    def __init__(self, thread: CommThread) -> None:
        self._thread = thread

    def __enter__(self) -> None:
        with self._thread._cond:
            self._thread._waiters += 1

    def __exit__(self, *exc: object) -> None:
        with self._thread._cond:
            self._thread._waiters -= 1
