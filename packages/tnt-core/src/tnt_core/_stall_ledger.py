"""The stall ledger: how far this rank has got, in numbers every rank can compare.

A hung or slow rank shows on its peers only as a collective that does not return. To say
for whom a collective waits and where they are, every rank of a multi-rank job keeps a
:class:`Ledger`:

* how many collectives it has entered (every rank enters them in the same order, so the
  count is a position comparable across ranks), which one it waits for and since when;
* where training is (epoch, step, phase), which the framework integration reports
  through :func:`report_position`.

The counters are a C struct (``include/tnt_stall_ledger.h``), handed with a backend's
native table (:class:`tnt_core.NativeComm`) to compiled ops that start allreduces with no
Python in the step: they number theirs in the same count and mark their waits there, so
one ledger watches both paths. The backend wrapper that keeps it on the Python path is
:class:`tnt_core.WatchedBackend`; the thread that publishes it and reads the peers' is the
stall inspector (``_stall_inspector``).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Ledger", "ledger", "report_position", "LEDGER_ABI_VERSION"]

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
