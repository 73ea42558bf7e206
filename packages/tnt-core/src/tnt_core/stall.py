"""The stall inspector: when a collective waits too long, say for whom and where they are.

A hung or slow rank shows on its peers only as a collective that does not return. Left
alone, the job says nothing until ``TNT_TIMEOUT_S`` (30 min by default) ends it. So, like
Horovod's stall inspector, every rank of a multi-rank job keeps a :class:`Ledger`:

* how many collectives it has entered (every rank enters them in the same order, so the
  count is a position comparable across ranks), which one it waits for and since when;
* where training is (epoch, step, phase), which the framework integration reports
  through :func:`report_position`.

The runtime wraps the backend in a :class:`WatchedBackend` that keeps the ledger: a counter
increment per collective, and two clock reads when a wait actually blocks. It also makes
the ranks agree on each collective before data moves (:mod:`tnt_core.agreement`). The
ledger's counters are a C struct (``include/tnt_stall_ledger.h``), handed with a backend's
native table (:mod:`tnt_core.native`) to compiled ops that start allreduces with no Python
in the step: they number theirs in the same count and mark their waits there, so one
ledger watches both paths. A daemon
thread (:class:`StallInspector`) publishes the ledger to the job's rendezvous store every few
seconds (a heartbeat: a rank that stopped publishing is stuck outside Python's reach, or
dead) and checks the local wait:

* after ``TNT_STALL_WARN_S`` (default 60 s; 0 turns the inspector off) in one collective,
  the lowest-numbered waiting rank logs which ranks have not entered it and where they
  were last seen;
* when the wait then fails at ``TNT_TIMEOUT_S``, the :class:`~tnt_core.CommError` carries
  the same diagnosis, and the store gets it under :data:`NOT_ARRIVED_KEY`, from which the
  launcher's last line names those ranks (part of the launcher contract).

Without a TCP rendezvous store (a plain ``mpiexec`` job), the warning still comes, from
every waiting rank, but cannot name the ranks it waits for.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import errors
from .agreement import DeferredHandle, Launcher, exchange_words, header, mismatch, plan_header, verdict
from .backend import CommBackend, Handle, check_buffer, check_op, check_timeout, wait_all
from .config import Config
from .errors import CollectiveMismatchError, CommError, TntError
from .rendezvous import connect_store

__all__ = ["Ledger", "WatchedBackend", "StallInspector", "report_position", "ledger",
           "ANY_RANK", "NOT_ARRIVED_KEY"]

log = logging.getLogger("tnt.stall")

#: ``extra=`` for a log record that every rank shows (the rank filter keeps only errors
#: of non-master ranks): the stall report comes from whichever rank waits
ANY_RANK = {"tnt_any_rank": True}

_KEY = "tnt/stall/{rank}"
#: store key a rank whose wait failed sets, for the launcher's verdict: JSON
#: ``{"ranks": [...], "text": "...", "seen": "..."}``: the ranks that did not arrive, a
#: sentence naming them, and one saying where they were last seen
NOT_ARRIVED_KEY = "tnt/stall/not-arrived"


#: ``LEDGER_ABI_VERSION`` and the struct of ``include/tnt_stall_ledger.h``
LEDGER_ABI_VERSION = 1
#: ``tnt_stall_op``: the collectives a rank can wait in, numbered from 1
_OPS = ("", "allreduce", "broadcast", "allgather", "barrier", "split")
_OP_CODES = {name: code for code, name in enumerate(_OPS)}


class _Counters(ctypes.Structure):
    """``tnt_stall_ledger``: the part of the ledger that compiled ops write too."""

    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("entered", ctypes.c_int64), ("waiting_for", ctypes.c_int64),
                ("waiting_since", ctypes.c_double), ("waiting_op", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class Ledger:
    """This rank's position, written on the collective path without a lock.

    The counters (collectives entered, the one waited in and since when) live in a C
    struct (``tnt_stall_ledger.h``) at :attr:`address`, so that compiled ops which start
    allreduces through a backend's native table number them in the same count and mark
    their waits, with no Python in their step (:attr:`tnt_core.NativeComm.ledger`). Stores
    are single machine words; the inspector reads a snapshot that may be one update old,
    which a diagnosis made after seconds of waiting can afford.
    """

    def __init__(self) -> None:
        self._counters = _Counters(LEDGER_ABI_VERSION, ctypes.sizeof(_Counters))
        #: the address of the ``tnt_stall_ledger`` struct (valid while this ledger lives)
        self.address: int = ctypes.addressof(self._counters)
        self.epoch: int | None = None
        self.step: int | None = None
        self.phase: str | None = None
        self.heartbeat_s = 10.0          # how often the inspector publishes this

    @property
    def entered(self) -> int:
        """Collectives entered so far, by the Python path and by compiled ops."""
        return int(self._counters.entered)

    @entered.setter
    def entered(self, value: int) -> None:
        self._counters.entered = value

    @property
    def waiting_for(self) -> int:
        """The collective waited for (1-based), 0: none."""
        return int(self._counters.waiting_for)

    @property
    def waiting_op(self) -> str:
        code = self._counters.waiting_op
        return _OPS[code] if 0 <= code < len(_OPS) else "collective"

    @property
    def waiting_since(self) -> float:
        """``time.monotonic()`` when the wait began."""
        return float(self._counters.waiting_since)

    def enter(self) -> int:
        counters = self._counters
        counters.entered += 1
        return int(counters.entered)

    @contextmanager
    def waiting(self, seq: int, op: str) -> Iterator[None]:
        counters = self._counters
        outer = counters.waiting_for
        if not outer:  # a nested wait (wait_all -> wait) keeps the outer one's start
            # the number last, as compiled ops do: a reader that sees it sees its start
            counters.waiting_since, counters.waiting_op = time.monotonic(), _OP_CODES[op]
            counters.waiting_for = seq
        try:
            yield
        finally:
            if not outer:
                counters.waiting_for = 0

    def record(self) -> dict[str, Any]:
        """What the heartbeat publishes (wall-clock times: readers may be other hosts)."""
        now_mono, now = time.monotonic(), time.time()
        waited = now_mono - self.waiting_since if self.waiting_for else 0.0
        return {"entered": self.entered, "waiting_for": self.waiting_for,
                "op": self.waiting_op, "waited_s": round(waited, 3), "t": now,
                "epoch": self.epoch, "step": self.step, "phase": self.phase,
                "every": self.heartbeat_s}


_ledger = Ledger()


def ledger() -> Ledger:
    """This process's ledger."""
    return _ledger


def report_position(*, epoch: int | None = None, step: int | None = None,
                    phase: str | None = None) -> None:
    """Tell the stall inspector where training is; shown when a peer waits for this rank.

    A framework integration calls it at the start of every epoch and step (tnt-keras does,
    from a callback). Cheap: three attribute stores.
    """
    if epoch is not None:
        _ledger.epoch = epoch
    _ledger.step = step
    if phase is not None:
        _ledger.phase = phase


# -- the backend wrapper -------------------------------------------------------------------

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
    (:mod:`tnt_core.agreement`), and a failed wait explained by the :class:`StallInspector`.

    Attributes the contract does not name (a backend's own extras) are the wrapped
    backend's; :attr:`inner` is the backend itself.

    :param agree: exchange a header before each collective and raise
        :class:`~tnt_core.CollectiveMismatchError` when the ranks' calls differ (off only
        in tests of the raw transport).
    """

    def __init__(self, inner: CommBackend, ledger: Ledger | None = None, *,
                 agree: bool = True) -> None:
        self.inner = inner
        self.ledger = ledger or _ledger
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
        agreement sends its header asynchronously and the :class:`~tnt_core.agreement.
        Launcher` starts the allreduce once the header agreed."""
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


# -- the inspector ---------------------------------------------------------------------------

@dataclass
class _Peer:
    rank: int
    record: dict[str, Any] | None  # None: never published


def _place(peer: _Peer, now: float) -> str:
    """Where ``peer`` was last seen: ``epoch 2, step 5, fit, outside any collective, after
    #26; alive, heartbeat 1s ago`` (epochs 1-based, as Keras prints them)."""
    rec = peer.record
    if rec is None:
        return "never reported (did it start?)"
    parts = []
    if rec.get("epoch") is not None:
        parts.append(f"epoch {rec['epoch'] + 1}")
    if rec.get("step") is not None:
        parts.append(f"step {rec['step']}")
    if rec.get("phase"):
        parts.append(str(rec["phase"]))
    if not rec.get("entered"):
        parts.append("before its first collective")
    elif rec.get("waiting_for"):
        parts.append(f"waiting in {rec['op']} #{rec['waiting_for']}")
    else:
        parts.append(f"outside any collective, after #{rec['entered']}")
    age = max(0.0, now - float(rec.get("t", now)))
    if age <= 1.5 * float(rec.get("every", 10.0)) + 1.0:
        heart = f"alive, heartbeat {age:.0f}s ago"
    else:  # its inspector thread stopped publishing: the process is gone or frozen
        heart = f"silent for {age:.0f}s (dead, or frozen holding Python's lock)"
    return f"{', '.join(parts)}; {heart}"


def _where(peer: _Peer, now: float) -> str:
    return f"rank {peer.rank} ({_place(peer, now)})"


class StallInspector:
    """The daemon thread of one rank: heartbeat to the store, and the stall check.

    :param store_factory: opens this thread's own store client (None: no store, the
        warning cannot name peers).
    """

    def __init__(self, backend: WatchedBackend, config: Config, warn_s: float,
                 store_factory: Callable[[], Any] | None) -> None:
        self.backend = backend
        self.ledger = backend.ledger
        self.rank, self.size = backend.rank, backend.size
        self.warn_s = warn_s
        self.timeout_s = config.timeout_s
        # several beats within the warning time and within the timeout, so that a peer's
        # record read then is younger than the wait it explains
        self.interval = max(0.5, min(10.0, warn_s / 4, self.timeout_s / 4))
        self.ledger.heartbeat_s = self.interval
        self._store_factory = store_factory
        self._store: Any = None
        self._stop = threading.Event()
        self._warned_for = 0
        self._last_diagnosis: tuple[int, str] | None = None
        self._lock = threading.Lock()
        backend.explain = self.explain
        self._thread = threading.Thread(target=self._run, name="tnt-stall-inspector", daemon=True)

    def start(self) -> StallInspector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except (CommError, OSError):  # the store may be gone with the launcher
                pass

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        if self._store_factory is not None:
            try:
                self._store = self._store_factory()
            except (TntError, OSError) as exc:
                log.debug("stall inspector without the store: %s", exc)
        self._publish()  # at once: a rank that hangs before its first beat is still seen
        next_beat = time.monotonic() + self.interval
        tick = min(1.0, self.interval)
        while not self._stop.wait(tick):
            now = time.monotonic()
            if now >= next_beat:
                self._publish()
                next_beat = now + self.interval
            seq = self.ledger.waiting_for
            if seq and seq != self._warned_for and now - self.ledger.waiting_since >= self.warn_s:
                self._warned_for = seq
                self._publish()
                self._warn(seq, now - self.ledger.waiting_since)

    def _publish(self) -> None:
        if self._store is None:
            return
        try:
            self._store.set(_KEY.format(rank=self.rank), json.dumps(self.ledger.record()).encode())
        except (CommError, OSError) as exc:  # the launcher ended: the job is ending anyway
            log.debug("stall heartbeat failed: %s", exc)
            self._store = None

    def _peers(self) -> list[_Peer] | None:
        store = self._store
        if store is None:
            return None
        peers = []
        try:
            for rank in range(self.size):
                key = _KEY.format(rank=rank)
                record = json.loads(store.get(key)) if store.check([key]) else None
                peers.append(_Peer(rank, record))
        except (CommError, OSError, ValueError) as exc:
            log.debug("stall inspector cannot read the store: %s", exc)
            return None
        return peers

    def diagnose(self, seq: int) -> tuple[str, bool, list[_Peer]] | None:
        """The ranks that have not entered collective ``seq`` and where they were last
        seen; whether this rank is the lowest one waiting (the one that reports); and
        those ranks."""
        peers = self._peers()
        if peers is None:
            return None
        now = time.time()
        missing = [p for p in peers if p.rank != self.rank
                   and (p.record is None or p.record["entered"] < seq)]
        lower_waiting = any(p.rank < self.rank and p.record is not None
                            and p.record.get("waiting_for") == seq
                            and p.record.get("waited_s", 0) > 0
                            for p in peers)
        if missing:
            text = ("not arrived: " + "; ".join(_where(p, now) for p in missing))
        else:
            text = ("every rank has entered it (a slow transport, or ranks that disagree on "
                    "the order of collectives)")
        with self._lock:
            self._last_diagnosis = (seq, text)
        return text, not lower_waiting, missing

    def _warn(self, seq: int, waited: float) -> None:
        op = self.ledger.waiting_op or "collective"
        head = (f"stall: rank {self.rank} has waited {waited:.0f}s in {op} #{seq} "
                f"(TNT_STALL_WARN_S={self.warn_s:g}; the job ends at TNT_TIMEOUT_S="
                f"{self.timeout_s:g}s)")
        result = self.diagnose(seq)
        if result is None:
            log.warning("%s; the ranks it waits for are unknown without tnt run's rendezvous "
                        "store", head, extra=ANY_RANK)
            return
        text, reporter, _ = result
        if reporter:
            log.warning("%s; %s", head, text, extra=ANY_RANK)

    def explain(self, seq: int, waited: float) -> str | None:
        """For a wait on ``seq`` that failed after ``waited`` seconds: the diagnosis, fresh
        if the store answers; the ranks that did not arrive also go to the store for the
        launcher. None for a wait that failed fast: the backend's error (a peer that
        closed its connection) says what happened, and its peers' records may be older."""
        if waited < min(self.warn_s, 0.5 * self.timeout_s):
            return None
        result = self.diagnose(seq)
        if result is not None:
            text, _, missing = result
            if missing:
                self._tell_launcher(seq, missing)
            return text
        with self._lock:
            last = self._last_diagnosis
        return last[1] if last and last[0] == seq else None


    def _tell_launcher(self, seq: int, missing: list[_Peer]) -> None:
        op = self.ledger.waiting_op or "collective"
        names = ", ".join(str(p.rank) for p in missing)
        now = time.time()
        several = len(missing) > 1
        text = (f"rank{'s' if several else ''} {names} did not arrive at {op} #{seq} "
                f"within {self.timeout_s:g}s (hung or too slow?)")
        seen = "last seen: " + "; ".join(_where(p, now) for p in missing)
        record = {"ranks": [p.rank for p in missing], "text": text, "seen": seen}
        store = self._store
        if store is None:
            return
        try:
            store.set(NOT_ARRIVED_KEY, json.dumps(record).encode())
        except (CommError, OSError) as exc:
            log.debug("cannot leave the stall verdict in the store: %s", exc)


def start_inspector(backend: WatchedBackend, config: Config, warn_s: float) -> StallInspector | None:
    """The inspector of a multi-rank job (None for one rank or ``warn_s`` 0)."""
    if warn_s <= 0 or backend.size < 2:
        return None
    factory = None
    if config.rendezvous and config.rendezvous_key and not config.rendezvous.startswith("file:"):
        def factory() -> Any:
            return connect_store(config.with_overrides(rank=backend.rank), connect_timeout=10.0)
    return StallInspector(backend, config, warn_s, factory).start()
