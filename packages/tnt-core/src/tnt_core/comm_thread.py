"""An ordered communication thread and the handles it hands out.

Backends written in Python (MPI over mpi4py, the reference store backend) run every
collective on one thread, in submission order: that keeps the contract's "same order on
every rank" and lets MPI progress non-blocking operations inside its own calls.
``Handle.wait`` blocks on an event (a futex), so a waiting rank burns no core.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .backend import Handle
from .errors import CommError

__all__ = ["CommThread", "FutureHandle"]


class FutureHandle(Handle):
    """The result of one operation submitted to a :class:`CommThread`."""

    __slots__ = ("_event", "_result", "_error", "_operation", "_thread", "_buf", "_t")

    def __init__(self, thread: CommThread, operation: str, buf: np.ndarray | None) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._operation = operation
        self._thread = thread
        self._buf = buf  # owned until completion, as an MPI request owns its buffer
        self._t: float | None = None

    def _complete(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._t = time.perf_counter()
        self._event.set()

    def completion_time(self) -> float | None:
        return self._t

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        timeout = self._thread.timeout_s if timeout is None else timeout
        if not self._event.wait(timeout):
            err = CommError(
                f"did not complete within {timeout:g}s (TNT_TIMEOUT_S); a peer may be hung "
                "or dead", rank=self._thread.rank, operation=self._operation,
            )
            self._thread.fail(err)
            raise err
        if self._error is not None:
            raise self._error
        return self._result


class CommThread:
    """Runs submitted callables one after another on a daemon thread.

    After one operation fails, every later one fails at once with the first error: the
    ranks' collectives can no longer be matched, so going on would hang or corrupt data.
    """

    def __init__(self, name: str, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], FutureHandle] | None] = queue.SimpleQueue()
        self._failure: CommError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], operation: str, buf: np.ndarray | None = None) -> FutureHandle:
        """Queue ``fn``; its return value becomes the handle's result."""
        if self._closed:
            raise CommError("the backend is closed", rank=self.rank, operation=operation)
        if self._failure is not None:
            raise CommError(f"an earlier collective failed: {self._failure}", rank=self.rank,
                            operation=operation)
        handle = FutureHandle(self, operation, buf)
        self._queue.put((fn, handle))
        return handle

    def fail(self, error: CommError) -> None:
        if self._failure is None:
            self._failure = error

    @property
    def failure(self) -> CommError | None:
        return self._failure

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, handle = item
            if self._failure is not None:
                handle._complete(error=CommError(f"an earlier collective failed: {self._failure}",
                                                 rank=self.rank, operation=handle._operation))
                continue
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

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued operations; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
