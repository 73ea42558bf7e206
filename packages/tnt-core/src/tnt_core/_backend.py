"""The contract every communication backend keeps (docs/architecture.md, "The CommBackend
contract").

A backend moves bytes; policy (which backend, fusion, timeouts from the environment)
lives in tnt-core. Rules every backend keeps:

* collectives are issued in the same order on every rank and executed in that order;
* ``Handle.wait`` never spins a core (block in C with the GIL released, or sleep/poll
  with back-off);
* a dead peer or a wait past the timeout raises :class:`~tnt_core.CommError` naming the
  rank and the operation, never a hang;
* ``close`` is idempotent.

``tnt_core.testing`` checks all of this against a backend with real processes.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import UnsupportedOperationError

if TYPE_CHECKING:
    from ._config import Config

__all__ = [
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "BackendSpec",
    "CommBackend",
    "CompletedHandle",
    "Handle",
    "CAPABILITIES",
    "check_buffer",
    "check_op",
    "check_peer",
    "check_split_ranks",
    "check_timeout",
    "wait_all",
]

REDUCE_OPS: tuple[str, ...] = ("sum", "min", "max", "product")
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")
)


def check_op(op: str) -> str:
    """Return ``op`` if it is a reduction every backend supports, else raise ValueError."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(REDUCE_OPS)}")
    return op


#: the optional capabilities a backend may declare in :attr:`CommBackend.capabilities`
CAPABILITIES: tuple[str, ...] = ("p2p", "groups")


def check_peer(peer: Any, size: int, operation: str, tag: Any) -> tuple[int, int]:
    """Return ``(peer, tag)`` if ``peer`` is a rank in ``[0, size)`` and ``tag`` a
    non-negative int, else raise TypeError/ValueError saying what to pass."""
    for what, value in (("peer rank", peer), ("tag", tag)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{operation}: the {what} must be an int, got {type(value).__name__}")
    if not 0 <= int(peer) < size:
        raise ValueError(f"{operation}: rank {peer} is not a rank of this communicator (0..{size - 1})")
    if int(tag) < 0:
        raise ValueError(f"{operation}: tag must be >= 0, got {tag}")
    return int(peer), int(tag)


def check_split_ranks(ranks: Any, size: int) -> tuple[int, ...]:
    """Return ``ranks`` as a tuple if it is a non-empty sequence of distinct ranks in
    ``[0, size)``, else raise TypeError/ValueError."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"split needs a sequence of ranks, got {type(ranks).__name__}")
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"split: ranks must be ints, got {type(r).__name__}")
        if not 0 <= int(r) < size:
            raise ValueError(f"split: rank {r} is not a rank of this communicator (0..{size - 1})")
        out.append(int(r))
    if not out:
        raise ValueError("split needs at least one rank")
    if len(set(out)) != len(out):
        raise ValueError(f"split: ranks {out} name a rank twice")
    return tuple(out)


def check_timeout(timeout: float | None) -> float | None:
    """Return ``timeout`` if it is None or a positive, finite number of seconds, else raise.

    Checked before a wait starts: a wait that times out fails the communicator (the
    collective may have half-run), so a nonsensical value must not get that far.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not 0 < float(timeout) < float("inf"):
        raise ValueError(
            f"timeout must be a positive, finite number of seconds, got {timeout}; pass None to "
            "wait up to TNT_TIMEOUT_S, and poll with Handle.done() instead of a zero timeout"
        )
    return float(timeout)


def check_buffer(buf: Any, operation: str, *, writeable: bool = True) -> np.ndarray:
    """Validate a host buffer handed to a collective; errors say what to pass instead."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(
            f"{operation} needs a numpy.ndarray, got {type(buf).__name__}; "
            "convert with numpy.asarray(...) (GPU tensors: pass an object exposing DLPack "
            "to a backend that supports device buffers)"
        )
    if buf.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{operation} does not support dtype {buf.dtype}; use one of {names}")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{operation} needs a C-contiguous buffer (it is reduced in place); "
            "pass numpy.ascontiguousarray(buf) and use the returned array"
        )
    if writeable and not buf.flags.writeable:
        raise ValueError(f"{operation} reduces in place but the buffer is read-only; pass a copy")
    return buf


class Handle(abc.ABC):
    """An operation in flight. Keeps its buffer alive until :meth:`wait` returns it."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block (without spinning) until the operation is done; return the buffer.

        ``timeout`` (seconds) defaults to the backend's ``TNT_TIMEOUT_S``; past it,
        :class:`~tnt_core.CommError` is raised.
        """

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the operation has completed (successfully or not)."""

    def completion_time(self) -> float | None:
        """When the operation completed, in ``time.perf_counter()`` seconds, if the backend
        records it (timelines use it); None if unknown or not yet done."""
        return None

    @classmethod
    def wait_all(cls, handles: Sequence[Handle], timeout: float | None = None) -> list[np.ndarray]:
        """Wait for every handle (all of this class), in order; their buffers.

        The first failure is raised, after every handle before it completed. A backend
        overrides this when waiting for a batch can be cheaper than one ``wait`` after
        another (e.g. one thread wake-up instead of one per handle); call it through
        :func:`tnt_core.wait_all`.
        """
        return [handle.wait(timeout) for handle in handles]


def wait_all(handles: Sequence[Handle], timeout: float | None = None) -> list[np.ndarray]:
    """Wait for ``handles`` as a batch, like ``MPI_Waitall``: their buffers, in order.

    Handles of one backend go to its :meth:`Handle.wait_all`; a mixed list is waited for
    one handle after another.
    """
    check_timeout(timeout)
    if handles and all(type(h) is type(handles[0]) for h in handles):
        return type(handles[0]).wait_all(handles, timeout)
    return [handle.wait(timeout) for handle in handles]


class CompletedHandle(Handle):
    """A handle for an operation that finished when it was issued (e.g. size-1 jobs)."""

    __slots__ = ("_buf", "_t")

    def __init__(self, buf: np.ndarray) -> None:
        self._buf = buf
        self._t = time.perf_counter()

    def completion_time(self) -> float | None:
        return self._t

    def wait(self, timeout: float | None = None) -> np.ndarray:
        check_timeout(timeout)
        return self._buf

    def done(self) -> bool:
        return True


class CommBackend(abc.ABC):
    """A communicator over all ranks of the job.

    Subclasses set ``name``, ``rank``, ``size``, ``local_rank`` and ``local_size`` in
    ``__init__`` and implement the abstract collectives. The blocking ``allreduce`` is
    derived from ``allreduce_async``.

    Point-to-point (:meth:`send_async`, :meth:`recv_async`) and groups (:meth:`split`) are
    optional: a backend lists what it implements in :attr:`capabilities`; the defaults
    raise :class:`~tnt_core.UnsupportedOperationError`.
    """

    name: str = "abstract"
    #: the optional capabilities implemented, a subset of :data:`CAPABILITIES`
    capabilities: frozenset[str] = frozenset()
    rank: int
    size: int
    local_rank: int
    local_size: int

    @abc.abstractmethod
    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        """Start reducing ``buf`` over all ranks, in place. Nonblocking."""

    def allreduce(self, buf: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``buf`` over all ranks, in place; return it."""
        return self.allreduce_async(buf, op).wait()

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``buf`` on every rank with the ``root`` rank's ``buf``; return it."""

    @abc.abstractmethod
    def allgather(self, buf: np.ndarray) -> np.ndarray:
        """Return an array of shape ``(size, *buf.shape)`` holding every rank's ``buf``.

        All ranks pass buffers of the same shape and dtype.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the communicator. Idempotent."""

    def abort(self, reason: str) -> None:  # noqa: B027 - optional: close() ends what abort would
        """Fail every operation in flight, and every later one, with
        :class:`~tnt_core.CommError` saying ``reason`` (optional). An elastic job calls it
        when the membership changes, so that a collective waiting for a rank that left
        returns at once instead of at ``TNT_TIMEOUT_S``. Default: nothing (the backend's
        own failure detection must then notice the departed peer)."""

    def native_comm(self) -> Any:
        """The native hand-off (optional): a PyCapsule named ``tnt_native_comm`` holding the
        C function table of ``tnt_core/include/tnt_native_comm.h``, through which compiled
        framework ops start allreduces with no Python in the step; None (the default) when
        the backend has none, and frameworks keep the Python path.
        :func:`tnt_core.native_comm` checks what a backend returns."""
        return None

    # -- optional: point-to-point and groups -----------------------------------------------

    def supports(self, capability: str) -> bool:
        """True if this backend implements ``capability`` (``"p2p"`` or ``"groups"``)."""
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; use one of {', '.join(CAPABILITIES)}")
        return capability in self.capabilities

    def _unsupported(self, capability: str, operation: str) -> UnsupportedOperationError:
        what = {"p2p": "point-to-point messages", "groups": "groups (split)"}[capability]
        return UnsupportedOperationError(
            f"{operation}: the {self.name!r} backend does not support {what}; pipelining needs "
            "a backend that does (gloo, mpi; see docs/plugins.md), picked with TNT_BACKEND / "
            f"`tnt run --backend`. Check with backend.supports({capability!r})."
        )

    def send_async(self, buf: np.ndarray, dest: int, tag: int = 0) -> Handle:
        """Start sending ``buf`` to rank ``dest``; messages to one (peer, tag) arrive in the
        order sent. ``buf`` must not change until the handle's ``wait`` returns."""
        raise self._unsupported("p2p", "send")

    def recv_async(self, buf: np.ndarray, src: int, tag: int = 0) -> Handle:
        """Start receiving the next message from rank ``src`` with ``tag`` into ``buf``. A
        message of another byte size than ``buf`` raises on this rank (CommError or
        ValueError) instead of truncating."""
        raise self._unsupported("p2p", "recv")

    def split(self, ranks: Sequence[int]) -> CommBackend | None:
        """A communicator over ``ranks`` (their order gives the group ranks).

        Collective: every rank of this communicator calls it, with the same list. Members
        get the group's backend, others None. Closing the group leaves this one open.
        """
        raise self._unsupported("groups", "split")

    def __enter__(self) -> CommBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} rank {self.rank}/{self.size}>"


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin returns from ``tnt_comm_backends``: how to build one backend.

    :param name: the name users pass to ``TNT_BACKEND`` / ``tnt run --backend``.
    :param factory: ``factory(config) -> CommBackend``; called once per process.
    :param priority: without ``TNT_BACKEND`` the available backend of highest priority
        wins; the built-in ``local`` backend has priority 0.
    :param available: a bool, or ``available(config) -> bool`` deciding whether this
        backend can serve the job described by ``config`` (e.g. an MPI backend only when
        started by ``mpiexec``); evaluated lazily.
    :param description: one line shown when backends are listed.
    """

    name: str
    factory: Callable[[Config], CommBackend]
    priority: int = 0
    available: bool | Callable[[Config], bool] = True
    description: str = ""
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    def is_available(self, config: Config) -> bool:
        if callable(self.available):
            try:
                return bool(self.available(config))
            except Exception:  # noqa: BLE001 - a broken probe means "not available", not a crash
                return False
        return bool(self.available)
