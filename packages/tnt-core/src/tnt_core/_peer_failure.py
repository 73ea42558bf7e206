"""How a rank ends when it fails because a peer failed: one line, and a reserved exit code.

When one rank fails, its peers fail too, at their next collective, with a
:class:`~tnt_core.CommError` ("rank 1 (pid N) closed its communicator", "did not arrive
within 30s", "Connection closed by peer"). Those are *secondary* failures: their cause is
elsewhere, and they often end their process before the rank that failed first has finished
printing its traceback. So that the launcher can name the rank that failed first, whatever
the order in which the processes exit, a rank started by a launcher (``TNT_SIZE`` set)
that dies of an uncaught exception after a collective failed in it:

* prints the ``CommError`` as one line, not its traceback (all of it with
  ``TNT_LOG_LEVEL=DEBUG``);
* runs its at-exit handlers (the backend is closed), then exits with
  :data:`PEER_FAILURE_EXIT_CODE` instead of Python's 1.

``tnt run`` takes a rank that exits with this code for a consequence and names another
rank: one that failed with any other code, else one that is still running (hung). This is
part of the launcher contract (docs/architecture.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType

from . import _errors as errors
from ._errors import CommError

__all__ = ["PEER_FAILURE_EXIT_CODE", "comm_error_of", "install_excepthook"]

#: exit code of a rank that failed because a peer failed (``EX_TEMPFAIL`` of sysexits.h)
PEER_FAILURE_EXIT_CODE = 75

_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], None]
_lock = threading.Lock()
_installed = False


def comm_error_of(exc: BaseException) -> CommError | None:
    """The :class:`CommError` ``exc`` is, or was raised from or while handling; else the
    first one made in this process (a framework may re-raise it as its own type); else None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CommError):
            return e
        todo += [e.__cause__, e.__context__]
    return errors._first_comm_error[0] if errors._first_comm_error else None  # noqa: SLF001


def _excepthook(previous: _Hook) -> _Hook:
    def hook(exc_type: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        comm = comm_error_of(exc) if isinstance(exc, Exception) else None
        if comm is None:
            previous(exc_type, exc, tb)
            return
        try:
            if logging.getLogger("tnt").isEnabledFor(logging.DEBUG):
                previous(exc_type, exc, tb)
            line = traceback.format_exception_only(type(comm), comm)[-1].rstrip()
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            atexit._run_exitfuncs()  # noqa: SLF001 - what Python's own exit would run
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            os._exit(PEER_FAILURE_EXIT_CODE)

    return hook


def install_excepthook() -> None:
    """Make an uncaught exception after a failed collective end this process as a peer's
    consequence (see the module's doc). Idempotent; keeps the hook installed before it."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        sys.excepthook = _excepthook(sys.excepthook)
