"""An ordered communication thread and the handles it hands out.

Backends written in Python (MPI over mpi4py, the reference store backend) run every
collective on one thread, in submission order: that keeps the contract's "same order on
every rank" and lets MPI progress non-blocking operations inside its own calls.
``Handle.wait`` blocks on a condition variable (a futex), so a waiting rank burns no core.

Handing an operation to another thread and its result back costs two thread wake-ups,
which are slow on a virtual machine (docs/performance_results.md, "Measurements behind the
code's choices"). So, with ``run_in_waiter=True``:

* a thread that waits for an operation nobody has started yet has nothing else to do: it
  runs the queued operations up to its own itself, in order, whenever none is running,
  and the communication thread steps aside while it does (a caller waiting for several
  operations in a row is then woken once, not once per operation);
* :func:`tnt_core.wait_all` waits for a batch of handles as one such wait;
* a blocking collective (:meth:`CommThread.call`) with nothing queued runs right away on
  the caller's thread, and the communication thread is never woken. Waking it for an
  operation the caller then runs itself is not free either: the woken thread takes the
  GIL that the caller released inside the library call, and the caller sleeps until it
  gets it back.

At most one operation runs at a time and the order stays the submission order, so a
backend whose library allows calls from any thread, one at a time
(``MPI_THREAD_SERIALIZED``), keeps its guarantees. Operations nobody waits for stay with
the communication thread: that is what overlaps them with the caller's work.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._backend import Handle, check_timeout
from ._errors import CommError

__all__ = ["CommThread", "FutureHandle"]


class FutureHandle(Handle):
    """The result of one operation submitted to a :class:`CommThread`."""

    __slots__ = ("_event", "_result", "_error", "_operation", "_thread", "_buf", "_t", "_fn",
                 "_seq")

    def __init__(self, thread: CommThread, operation: str, buf: np.ndarray | None,
                 fn: Callable[[], Any], seq: int = 0) -> None:
        self._seq = seq  # position in the thread's submission order
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
        checked = check_timeout(timeout)
        timeout = thread.timeout_s if checked is None else checked
        if not self._event.is_set() and not thread._wait_for(self, timeout):
            self._timed_out(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    @classmethod
    def wait_all(cls, handles: Sequence[Handle], timeout: float | None = None) -> list[Any]:
        """Wait for handles of one thread as one batch: a waiter that runs the queue runs
        it up to the last of them in one go, instead of handing the rest back to the
        thread after each (a wake-up each) and taking the next one over again."""
        check_timeout(timeout)
        futures = [h for h in handles if isinstance(h, FutureHandle)]
        if len(futures) == len(handles) and len({id(h._thread) for h in futures}) == 1:
            last = max(futures, key=lambda h: h._seq)
            thread = last._thread
            limit = thread.timeout_s if timeout is None else timeout
            if not last._event.is_set() and not thread._wait_for(last, limit):
                last._timed_out(limit)
        return [handle.wait(timeout) for handle in handles]

    def _timed_out(self, timeout: float) -> None:
        err = CommError(
            f"did not complete within {timeout:g}s (TNT_TIMEOUT_S); a peer may be hung "
            "or dead", rank=self._thread.rank, operation=self._operation,
        )
        self._thread.fail(err)
        raise err


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
        self._lock = threading.Lock()  # entered directly where speed counts (no Python frames)
        self._cond = threading.Condition(self._lock)
        self._pending: deque[FutureHandle] = deque()
        self._busy = False  # an operation is running (on the thread or in a waiter)
        self._waiters = 0  # threads blocked in Handle.wait
        self._runners = 0  # ... of which run queued operations themselves
        self._submitted = 0
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
        with self._cond:
            self._submitted += 1
            handle = FutureHandle(self, operation, buf, fn, self._submitted)
            self._pending.append(handle)
            if self._waiters:  # a waiter may be the one to run it
                self._cond.notify_all()
            else:
                self._cond.notify()
        return handle

    def call(self, fn: Callable[[], Any], operation: str, buf: np.ndarray | None = None) -> Any:
        """Run ``fn`` as the next operation and return its result (a blocking collective).

        With ``run_in_waiter`` and nothing queued or running, ``fn`` runs right here without
        waking the thread; otherwise it is queued behind the others and waited for.
        """
        inline = False
        if self.run_in_waiter:
            with self._lock:
                if not (self._busy or self._pending or self._closed or self._failure is not None):
                    self._busy = inline = True
                    self._waiters += 1
        if not inline:
            return self.submit(fn, operation, buf).wait()
        try:
            return self._invoke(fn, operation)
        finally:
            with self._lock:
                self._waiters -= 1
                self._busy = False
                if self._pending or self._closed or self._waiters:
                    self._cond.notify_all()

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

    def _execute(self, handle: FutureHandle) -> None:
        fn = handle._fn
        assert fn is not None  # cleared only on completion, and a handle is claimed once
        try:
            result = self._invoke(fn, handle._operation)
        except CommError as exc:
            handle._complete(error=exc)
        except BaseException:  # Ctrl+C in a waiter running it: the handle still completes
            handle._complete(error=self._failure)
            if threading.current_thread() is not self._thread:
                raise  # the caller's own interrupt; the thread itself goes on
        else:
            handle._complete(result=result)

    def _invoke(self, fn: Callable[[], Any], operation: str) -> Any:
        """``fn()``; any exception is a failed collective: recorded, raised as CommError."""
        if self._failure is not None:
            raise CommError(f"an earlier collective failed: {self._failure}", rank=self.rank,
                            operation=operation)
        try:
            return fn()
        except CommError as exc:
            self.fail(exc)
            raise
        except (KeyboardInterrupt, SystemExit) as exc:
            self._failed(exc, operation)  # abandoned half-way: nothing after it may run
            raise
        except BaseException as exc:  # anything else: still a failed collective
            raise self._failed(exc, operation) from exc

    def _failed(self, exc: BaseException, operation: str) -> CommError:
        err = CommError(f"{type(exc).__name__}: {exc}", rank=self.rank, operation=operation)
        self.fail(err)
        return err

    def _claim(self) -> FutureHandle | None:
        # with the lock held: the next operation, if nothing runs now
        if self._busy or not self._pending:
            return None
        self._busy = True
        return self._pending.popleft()

    def _run_claimed(self, handle: FutureHandle, waiting: bool) -> None:
        """With the lock held: run ``handle`` without it, then wake the threads that wait
        (``waiting``: the caller is one of them)."""
        self._cond.release()
        try:
            self._execute(handle)
        finally:
            self._cond.acquire()
            self._busy = False
            if self._waiters > waiting:  # their operation may be done, or theirs to run now
                self._cond.notify_all()

    def _wait_for(self, target: FutureHandle, timeout: float) -> bool:
        """Block until ``target`` is done (False after ``timeout`` seconds).

        With ``run_in_waiter`` (and the thread's own timeout: running operations inline
        honours no other), the waiting thread runs the queued operations up to ``target``
        itself whenever none is running; the communication thread steps aside meanwhile,
        so a caller that waits for several operations in a row is woken once, not once
        per operation.
        """
        runs = self.run_in_waiter and timeout >= self.timeout_s
        deadline = time.monotonic() + timeout
        cond = self._cond
        with cond:
            self._waiters += 1
            self._runners += runs
            try:
                while not target._event.is_set():
                    handle = self._claim() if runs else None
                    if handle is not None:
                        self._run_claimed(handle, True)
                        continue
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    cond.wait(remaining)
                return True
            finally:
                self._waiters -= 1
                self._runners -= runs
                if self._pending and not self._busy and not self._runners:
                    cond.notify_all()  # the rest of the queue goes back to the thread

    def _loop(self) -> None:
        cond = self._cond
        with cond:
            while True:
                # a waiting caller runs the queue itself: it has nothing else to do
                handle = None if self._runners else self._claim()
                if handle is not None:
                    self._run_claimed(handle, False)
                elif self._closed and not self._pending and not self._busy:
                    return
                else:
                    cond.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued operations; idempotent."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
