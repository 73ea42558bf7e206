"""The rank runtime's life: one per process, started lazily, stopped at exit.

:func:`init` reads the launcher environment, asks the plugins for backends
(``_backend_choice``), starts the chosen one, wraps it for the stall inspector in a
multi-rank job, and keeps the :class:`~tnt_core.Runtime` for the life of the process.
"""

from __future__ import annotations

import atexit
import threading

from ._backend import CommBackend
from ._backend_choice import select_backend
from ._config import Config
from ._errors import ConfigError, PluginError
from ._log import configure_logging, logger
from ._peer_failure import install_excepthook
from ._plugins import get_plugin_manager
from ._runtime import MASTER_RANK, Runtime
from ._stall_inspector import start_inspector
from ._watched_backend import WatchedBackend

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_size",
    "get_master_rank",
    "is_master_rank",
]


_lock = threading.RLock()
_runtime: Runtime | None = None
_atexit_registered = False  # shutdown() is registered once per process, not per init()


def init(backend: str | None = None) -> Runtime:
    """Start the runtime (idempotent) and return it.

    :param backend: a backend name overriding ``TNT_BACKEND``. Asking for another
        backend than the one already running is an error.
    """
    global _runtime, _atexit_registered
    with _lock:
        if _runtime is not None and not _runtime.stopped:
            if backend and backend != _runtime.backend_spec.name:
                raise ConfigError(
                    f"the runtime already runs backend {_runtime.backend_spec.name!r}; "
                    f"cannot switch to {backend!r} in the same process"
                )
            return _runtime
        config = Config.from_env()
        configure_logging(config)
        pm = get_plugin_manager()
        spec = select_backend(config, backend, pm)
        logger.debug("starting backend %r for rank %d of %d", spec.name, config.rank, config.size)
        comm = spec.factory(config)
        if not isinstance(comm, CommBackend):
            raise PluginError(
                f"backend {spec.name!r} factory returned {type(comm).__name__}, "
                "not a tnt_core.CommBackend"
            )
        if comm.rank != config.rank:  # e.g. under mpiexec, MPI knows the rank
            configure_logging(config, rank=comm.rank)
        if comm.size > 1:
            comm = WatchedBackend(comm)
        runtime = Runtime(config, comm, spec, pm)
        if isinstance(comm, WatchedBackend):
            runtime.stall_inspector = start_inspector(comm, config, config.stall_warn_s)
        _runtime = runtime
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        if config.launched and comm.size > 1:
            install_excepthook()  # a peer's failure ends this rank with its own exit code
        pm.hook.tnt_runtime_started(runtime=runtime)
        return runtime


def is_initialized() -> bool:
    with _lock:
        return _runtime is not None and not _runtime.stopped


def shutdown() -> None:
    """Stop the runtime if it runs. Called at exit; a later ``init()`` starts a new one."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.stop()


def get_rank() -> int:
    """This process's rank (starts the runtime if needed)."""
    return init().rank


def get_size() -> int:
    """The number of ranks in the job."""
    return init().size


def get_master_rank() -> int:
    """The rank that writes checkpoints and prints progress: always 0."""
    return MASTER_RANK


def is_master_rank() -> bool:
    """True on the master rank."""
    return init().is_master
