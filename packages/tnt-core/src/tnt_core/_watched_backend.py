"""The job's backend as the runtime hands it out: every collective counted and agreed on.

In a multi-rank job the runtime wraps the plugin's backend in a :class:`WatchedBackend`.
It keeps the rank's :class:`~tnt_core._stall_ledger.Ledger` (a counter increment per
collective, and two clock reads when a wait actually blocks), makes the ranks agree on
each collective before data moves (the headers of ``_agreement``), and lets the stall
inspector (``_stall_inspector``) explain a wait that failed.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import _errors as errors
from . import _stall_ledger
from ._agreement import DeferredHandle, Launcher, exchange_words, header, mismatch, plan_header, verdict
from ._backend import CommBackend, Handle, check_buffer, check_op, check_timeout, wait_all
from ._errors import CollectiveMismatchError, CommError
from ._stall_ledger import Ledger

__all__ = ["WatchedBackend", "WatchedHandle"]

log = logging.getLogger("tnt.stall")

class WatchedHandle(Handle):
    """An operation of the wrapped backend, entered as collective number ``seq``."""

    __slots__ = ("inner", "seq", "op", "backend")

    def __init__(self, inner: Handle, seq: int, op: str, backend: WatchedBackend) -> None:
        self.inner, self.seq, self.op, self.backend = inner, seq, op, backend

    def wait(self, timeout: float | None = None) -> np.ndarray:
        check_timeout(timeout)
        if self.inner.done():
            return self.inner.wait(timeout)
        with self.backend.waiting(self.seq, self.op):
            return self.inner.wait(timeout)

    def done(self) -> bool:
        return self.inner.done()

    def completion_time(self) -> float | None:
        return self.inner.completion_time()

    @classmethod
    def wait_all(cls, handles: Sequence[Handle], timeout: float | None = None) -> list[np.ndarray]:
        check_timeout(timeout)
        watched = [h for h in handles if isinstance(h, WatchedHandle)]
        inner = [h.inner if isinstance(h, WatchedHandle) else h for h in handles]
        first = next((h for h in watched if not h.inner.done()), None)
        if first is None:
            return wait_all(inner, timeout)
        with first.backend.waiting(first.seq, first.op):
            return wait_all(inner, timeout)


class WatchedBackend(CommBackend):
    """The job's backend as the runtime hands it out: the same collectives, each counted
    in the :class:`Ledger`, checked for agreement between the ranks before data moves
    (``_agreement``), and a failed wait explained by the :class:`StallInspector`.

    Attributes the contract does not name (a backend's own extras) are the wrapped
    backend's; :attr:`inner` is the backend itself.

    :param agree: exchange a header before each collective and raise
        :class:`~tnt_core.CollectiveMismatchError` when the ranks' calls differ (off only
        in tests of the raw transport).
    """

    def __init__(self, inner: CommBackend, ledger: Ledger | None = None, *,
                 agree: bool = True) -> None:
        self.inner = inner
        self.ledger = ledger or _stall_ledger.ledger()
        self.name = inner.name
        self.rank, self.size = inner.rank, inner.size
        self.local_rank, self.local_size = inner.local_rank, inner.local_size
        self.agree = agree
        # buffers whose allreduces were agreed on once, as a plan: id -> (weak ref, op)
        self._agreed: dict[int, tuple[weakref.ref[np.ndarray], str]] = {}
        # starts the allreduce_async calls whose header is in flight, in program order
        self._launcher = Launcher(f"tnt-agreement-{inner.name}")
        #: set by the inspector: explains a failed wait for collective ``seq`` that lasted
        #: the given seconds
        self.explain: Callable[[int, float], str | None] = lambda seq, waited: None

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class lacks; "inner" itself must not recurse
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @contextmanager
    def waiting(self, seq: int, op: str) -> Iterator[None]:
        """Mark the wait in the ledger; a CommError leaving it gets the diagnosis."""
        with self.ledger.waiting(seq, op):
            try:
                yield
            except CommError as exc:
                raise self._explained(exc, seq) from exc

    def explained(self, exc: CommError) -> CommError:
        """``exc``, the failure of the wait this rank's ledger is in, with the stall
        inspector's diagnosis added (and the launcher told who did not arrive); ``exc``
        itself outside a wait. For compiled ops, which mark their waits in the ledger
        from C and report a failure while still marked there."""
        seq = self.ledger.waiting_for
        return self._explained(exc, seq) if seq else exc

    def _explained(self, exc: CommError, seq: int) -> CommError:
        waited = time.monotonic() - self.ledger.waiting_since if self.ledger.waiting_for else 0.0
        try:
            why = self.explain(seq, waited)
        except Exception:  # a diagnosis must never hide the failure itself
            log.debug("stall diagnosis failed", exc_info=True)
            why = None
        if not why:
            return exc
        explained = CommError(f"{exc.args[0] if exc.args else exc}; {why}")
        explained.rank, explained.operation, explained.peer = exc.rank, exc.operation, exc.peer
        first = errors._first_comm_error  # noqa: SLF001 - what the at-exit attribution reads
        if first and first[0] is exc:
            first[0] = explained
        return explained

    # -- agreement -----------------------------------------------------------------------

    def _agree(self, words: np.ndarray) -> CollectiveMismatchError | None:
        """The header exchange before a collective; the error every rank raises if they
        differ. On the wire it is an allreduce of its own, so it gets its own number in the
        ledger: the numbers stay those of the backend's operations, which the backend's
        CommErrors name (``allreduce #7``)."""
        seq = self.ledger.enter()
        with self.waiting(seq, "allreduce"):
            return mismatch(self.inner, words, seq, self.rank)

    def agree_on_plan(self, buffers: Sequence[np.ndarray], op: str = "sum") -> None:
        """Agree once on a fixed sequence of allreduces over ``buffers`` (the fused
        gradient buckets, reused every step); their later allreduces skip the header."""
        check_op(op)
        if not self.agree:
            return
        self._drain()
        error = self._agree(plan_header(buffers, op))
        if error is not None:
            raise error
        for buf in buffers:
            self._agreed[id(buf)] = (weakref.ref(buf, self._forget(id(buf))), op)

    def _forget(self, key: int) -> Callable[[weakref.ref[np.ndarray]], None]:
        """The callback that drops an agreed buffer once it is freed (its id may be reused)."""
        def forget(_ref: weakref.ref[np.ndarray]) -> None:
            self._agreed.pop(key, None)
        return forget

    def _needs_header(self, buf: Any, op: str) -> bool:
        if not self.agree:
            return False
        agreed = self._agreed.get(id(buf))
        return agreed is None or agreed[0]() is not buf or agreed[1] != op

    def _refusal(self, buf: Any, operation: str, *, op: str | None = None, root: Any = None,
                 writeable: bool = True) -> Exception | None:
        """What this rank can refuse alone, before any exchange: the error to raise (from
        the public method, so the traceback ends at the user's call), or None."""
        try:
            if op is not None:
                check_op(op)
            if root is not None:
                if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
                    raise TypeError(f"broadcast root must be a rank number, got {type(root).__name__}")
                if not 0 <= root < self.size:
                    raise ValueError(f"broadcast root {root} is not a rank of this job "
                                     f"(0..{self.size - 1})")
            # a DLPack tensor (host or device) is the backend's to accept or refuse
            if isinstance(buf, np.ndarray) or not hasattr(buf, "__dlpack__"):
                check_buffer(buf, operation, writeable=writeable)
        except (TypeError, ValueError) as exc:
            return exc.with_traceback(None)
        return None

    def _header_error(self, kind: str, buf: Any = None, *, op: str | None = None,
                      root: Any = None, writeable: bool = True) -> Exception | None:
        """The local checks, then the header exchange: the error to raise, or None."""
        refused = self._refusal(buf, kind, op=op, root=root, writeable=writeable) \
            if kind != "barrier" else None
        if refused is not None:
            return refused
        return self._agree(header(kind, buf, op=op, root=None if root is None else int(root)))

    # -- the collectives -------------------------------------------------------------------

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        """Returns at once, as the contract says, header or not: a call that needs the
        agreement sends its header asynchronously and the ``Launcher`` of ``_agreement``
        starts the allreduce once the header agreed."""
        ledger, launcher = self.ledger, self._launcher
        # the gradient path calls this per bucket: agreed buffers cost a dict lookup here
        if self._needs_header(buf, op):
            refused = self._refusal(buf, "allreduce", op=op)
            if refused is not None:
                raise refused
            words = header("allreduce", buf, op=op)
            header_seq, seq = ledger.enter(), ledger.enter()
            handle = DeferredHandle(header_seq, self.waiting)
            exchange = self.inner.allreduce_async(exchange_words(words), "max") \
                if launcher.idle else None
            launcher.defer(header_seq, functools.partial(
                self._start_agreed, handle, exchange, words, buf, op, header_seq, seq))
            return handle
        seq = ledger.enter()
        if not launcher.idle:  # an earlier call still waits for its agreement: after it
            handle = DeferredHandle(seq, self.waiting)
            launcher.defer(seq, functools.partial(
                self._start_agreed, handle, None, None, buf, op, seq, seq))
            return handle
        return WatchedHandle(self.inner.allreduce_async(buf, op), seq, "allreduce", self)

    def _start_agreed(self, handle: DeferredHandle, exchange: Handle | None,
                      words: np.ndarray | None, buf: Any, op: str, header_seq: int,
                      seq: int) -> None:
        """A launcher job: send the header if the caller could not, wait for the agreement,
        start the allreduce (or fail the handle with the reason it was not started)."""
        try:
            if self._launcher.closed:
                raise CommError("the backend was closed before this allreduce started",
                                rank=self.rank, operation=f"allreduce #{seq}")
            if words is not None:
                if exchange is None:
                    exchange = self.inner.allreduce_async(exchange_words(words), "max")
                error = verdict(self.inner, words, exchange.wait(), header_seq, self.rank)
                if error is not None:
                    handle.resolve(error=error)
                    return
            handle.resolve(WatchedHandle(self.inner.allreduce_async(buf, op), seq, "allreduce", self))
        except BaseException as exc:  # noqa: BLE001 - the caller's wait raises it
            handle.resolve(error=exc)

    def _drain(self) -> None:
        """A blocking collective goes out after the deferred ones (program order)."""
        if not self._launcher.idle:
            self._launcher.drain(self.waiting)

    def allreduce(self, buf: np.ndarray, op: str = "sum") -> np.ndarray:
        self._drain()
        if self.agree:
            error = self._header_error("allreduce", buf, op=op)
            if error is not None:
                raise error
        with self.waiting(self.ledger.enter(), "allreduce"):
            return self.inner.allreduce(buf, op)

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        self._drain()
        if self.agree:
            error = self._header_error("broadcast", buf, root=root)
            if error is not None:
                raise error
        with self.waiting(self.ledger.enter(), "broadcast"):
            return self.inner.broadcast(buf, root)

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        self._drain()
        if self.agree:
            error = self._header_error("allgather", buf, writeable=False)
            if error is not None:
                raise error
        with self.waiting(self.ledger.enter(), "allgather"):
            return self.inner.allgather(buf)

    def barrier(self) -> None:
        self._drain()
        if self.agree:  # the header exchange completes once every rank entered: a barrier
            error = self._header_error("barrier")
            if error is not None:
                raise error
            return
        with self.waiting(self.ledger.enter(), "barrier"):
            self.inner.barrier()

    # -- point-to-point and groups (optional; the inner backend's capabilities) -----------

    @property
    def capabilities(self) -> frozenset[str]:  # type: ignore[override]
        return self.inner.capabilities

    def supports(self, capability: str) -> bool:
        return self.inner.supports(capability)

    def native_comm(self) -> Any:
        """The inner backend's table. Its allreduces skip the header: the consumer agrees
        once on its plan (:meth:`agree_on_plan`, which also drains the launcher) and issues
        them only while no Python-path collective is being launched (the step's
        collectives complete before its gradients go out). They do not skip the ledger:
        :func:`tnt_core.native_comm` hands the consumer :attr:`ledger`'s C struct with the
        table, to number them and mark its waits in (``tnt_stall_ledger.h``), and the
        consumer reports a failed wait through :meth:`explained`."""
        return self.inner.native_comm()

    def send_async(self, buf: np.ndarray, dest: int, tag: int = 0) -> Handle:
        """Not a collective: no header, not counted in the ledger."""
        return self.inner.send_async(buf, dest, tag)

    def recv_async(self, buf: np.ndarray, src: int, tag: int = 0) -> Handle:
        return self.inner.recv_async(buf, src, tag)

    def split(self, ranks: Sequence[int]) -> CommBackend | None:
        """A collective of this communicator (counted, and agreed on like a barrier); the
        group's backend comes wrapped, with a ledger of its own: its collectives are
        numbered among its members only."""
        self._drain()
        if self.agree:
            error = self._header_error("barrier")
            if error is not None:
                raise error
        with self.waiting(self.ledger.enter(), "split"):
            group = self.inner.split(ranks)
        return None if group is None else WatchedBackend(group, Ledger(), agree=self.agree)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def close(self) -> None:
        # queued launches fail their handles; one waiting for its header ends with the
        # backend's close (which finishes or fails what it was given)
        self._launcher.stop()
        self.inner.close()
        self._launcher.join(5.0)

    def __repr__(self) -> str:
        return repr(self.inner)

