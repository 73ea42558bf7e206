"""Driving an MPI request to completion without burning a core.

MPI libraries progress non-blocking collectives only inside MPI calls, and MPICH's own
``MPI_Wait`` busy-polls: a rank waiting for a late peer then uses a whole core, which halves
the speed of the peer it waits for when ranks share cores. The communication thread instead
calls ``MPI_Test`` in a loop of two phases:

1. *spin* for a multiple (:data:`SPIN_FACTOR`) of the time the operation typically takes
   (from the median bandwidth of the last :data:`WINDOW` operations of at least 64 KiB),
   plus ``spin_min_s``, at most ``spin_max_s``: data moves at full speed, as with
   ``MPI_Wait``. On a loaded machine a thread that sleeps mid-transfer may get its core back
   only milliseconds later, and the peer waits for it meanwhile, so the spin phase errs on
   the long side, and the median follows the machine's load. One late peer now and then
   does not move the median; a peer that is always late makes every spin phase as long as
   ``spin_max_s``. That is the normal case in training with overlap: a bucket's allreduce
   starts during backprop and waits for the peer's backprop, so the cap is short (1 ms):
   a longer spin burns the core the rank's own backprop (or, with ranks sharing cores, the
   peer's) needs.
   While a caller is blocked waiting for the result (``waited()``), the rank has nothing
   else to compute, so the cap is ``spin_waited_max_s`` instead: the short cap would cut
   into a large transfer that outlasts it;
2. then *back off*: sleep between tests, growing by 25 % from 20 us up to ``max_sleep_s``.
   A rank waiting for a late peer sleeps almost all the time.

While spinning, the thread holds the GIL only between two ``MPI_Test`` calls (mpi4py
releases it inside each): a caller thread that needs it gets it at once.

The measurements behind these caps: docs/performance_results.md, "Measurements behind the
code's choices".

A wait past the timeout, a failure reported by another thread (``Handle.wait`` timed out)
or a close all end the loop with :class:`tnt_core.CommError`.

Settings (environment, read once per backend): ``TNT_MPI_SPIN_US`` (default 200),
``TNT_MPI_MAX_SPIN_MS`` (1), ``TNT_MPI_MAX_WAITED_SPIN_MS`` (50),
``TNT_MPI_MAX_SLEEP_US`` (1000). A rank waiting ``T`` seconds for a late peer spins at
most ``TNT_MPI_MAX_WAITED_SPIN_MS`` of it, and only as long as the typical transfer of the
operation's size takes (times :data:`SPIN_FACTOR`).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tnt_core import CommError, Variable

from . import settings as mpi_settings

__all__ = ["PollSettings", "Poller"]

_MIN_SLEEP_S = 20e-6
#: tests in a row between two looks at the clock while spinning (a test takes ~0.3 µs)
_SPIN_BATCH = range(16)
#: growth of the sleep between tests: slow, so that the first milliseconds after the spin
#: phase still test often (a peer that is only a little late, or a multi-step algorithm
#: whose next step waits for this rank); about 18 steps from 20 us to 1 ms
_BACKOFF = 1.25
#: starting guess of the bandwidth of a collective, bytes/s; replaced by measurements
_INITIAL_BANDWIDTH = 1e9
#: spin for this many times the typical duration of the operation
SPIN_FACTOR = 4.0
#: completed operations the typical bandwidth is the median of
WINDOW = 16
#: the median is recomputed after this many new operations
RELEARN = 4


def _env_float(env: Mapping[str, str], var: Variable, scale: float) -> float:
    """A poller setting (declared in :mod:`tnt_comm_mpi.settings`) in seconds."""
    return float(var.read(env)) * scale


@dataclass(frozen=True)
class PollSettings:
    spin_min_s: float = mpi_settings.TNT_MPI_SPIN_US.default * 1e-6
    spin_max_s: float = mpi_settings.TNT_MPI_MAX_SPIN_MS.default * 1e-3
    max_sleep_s: float = mpi_settings.TNT_MPI_MAX_SLEEP_US.default * 1e-6
    spin_waited_max_s: float = mpi_settings.TNT_MPI_MAX_WAITED_SPIN_MS.default * 1e-3

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PollSettings:
        env = os.environ if environ is None else environ
        spin_min = _env_float(env, mpi_settings.TNT_MPI_SPIN_US, 1e-6)
        spin_max = max(spin_min, _env_float(env, mpi_settings.TNT_MPI_MAX_SPIN_MS, 1e-3))
        sleep = max(_MIN_SLEEP_S, _env_float(env, mpi_settings.TNT_MPI_MAX_SLEEP_US, 1e-6))
        waited = max(spin_max, _env_float(env, mpi_settings.TNT_MPI_MAX_WAITED_SPIN_MS, 1e-3))
        return cls(spin_min, spin_max, sleep, waited)


class Poller:
    """Waits for MPI requests on the communication thread (never on another thread).

    :param abort: returns an exception to end the wait with (failure elsewhere, closing),
        or None to go on waiting. Called a few times per millisecond at most.
    :param waited: True while a caller is blocked on the result (then spinning costs the
        rank nothing it would otherwise compute).
    """

    def __init__(self, settings: PollSettings, rank: int,
                 abort: Callable[[], BaseException | None],
                 waited: Callable[[], bool] = lambda: False) -> None:
        self.settings = settings
        self.rank = rank
        self._abort = abort
        self._waited = waited
        self._bandwidth = _INITIAL_BANDWIDTH  # median bytes/s of recent operations
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._unlearned = 0

    def spin_budget(self, nbytes: int, waited: bool = False) -> float:
        s = self.settings
        return min(s.spin_waited_max_s if waited else s.spin_max_s, self._typical(nbytes))

    def _typical(self, nbytes: int) -> float:
        """The spin phase before its cap: a multiple of the operation's typical duration."""
        return self.settings.spin_min_s + SPIN_FACTOR * nbytes / self._bandwidth

    def wait(self, request: Any, operation: str, nbytes: int, timeout_s: float) -> None:
        """Return once ``request`` completed; CommError on timeout or abort."""
        clock = time.perf_counter
        start = clock()
        test = request.Test
        if test():
            return
        s, typical = self.settings, self._typical(nbytes)
        spin_end = start + min(s.spin_max_s, typical)
        waited_end = start + min(s.spin_waited_max_s, typical)
        deadline = start + timeout_s
        waited = self._waited
        sleep, max_sleep = time.sleep, self.settings.max_sleep_s
        delay = _MIN_SLEEP_S
        checks = 0
        spin_batch = _SPIN_BATCH
        while True:
            now = clock()
            if now < spin_end or (now < waited_end and waited()):
                # spin: MPI progresses inside the test. The clock and the other checks
                # are looked at once per batch of tests: the fewer Python steps between
                # two tests, the sooner MPI moves the next chunk
                for _ in spin_batch:
                    if test():
                        break
                else:
                    checks += 1
                    if checks & 0x3F == 0 and (error := self._abort()) is not None:
                        raise error
                    delay = _MIN_SLEEP_S
                    continue
                break
            if (error := self._abort()) is not None:
                raise error
            if now > deadline:
                raise CommError(
                    f"did not complete within {timeout_s:g}s (TNT_TIMEOUT_S); a peer is dead, "
                    "hung, or did not call the same collective", rank=self.rank, operation=operation,
                )
            sleep(delay)
            delay = min(delay * _BACKOFF, max_sleep)
            if test():
                break
        self._learn(nbytes, clock() - start)

    def _learn(self, nbytes: int, seconds: float) -> None:
        """Track the median bandwidth of recent operations big enough to time (updated
        every :data:`RELEARN` of them: it only sizes the spin phase, and on the caller's
        path every microsecond counts)."""
        if nbytes < (64 << 10) or seconds <= 0:
            return
        recent = self._recent
        recent.append(nbytes / seconds)
        self._unlearned += 1
        if self._unlearned >= RELEARN or len(recent) < RELEARN:
            self._unlearned = 0
            ordered = sorted(recent)
            self._bandwidth = ordered[len(ordered) // 2]
