"""The rank runtime's life: one per process, started lazily, stopped at exit.

:func:`init` reads the launcher environment, asks the plugins for backends
(``_backend_choice``), starts the chosen one, wraps it for the stall inspector in a
multi-rank job, and keeps the :class:`~tnt_core.Runtime` for the life of the process.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading

import pluggy

from ._backend import BackendSpec, CommBackend
from ._backend_choice import start_backend
from ._config import Config
from ._elastic import Membership, join_membership, latest_generation
from ._errors import CommError, ConfigError, handled
from ._log import configure_logging
from ._peer_failure import install_excepthook
from ._plugins import get_plugin_manager
from ._runtime import MASTER_RANK, Runtime, in_membership, store_client
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
    "membership_changed",
    "rejoin",
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
        membership = None
        # only a process started for a running job is given its member id by tnt run
        late = config.elastic and config.member_id is not None
        pm = get_plugin_manager()
        if config.elastic and config.launched:
            comm, spec, config, membership = _start_elastic(config, backend, pm)
        else:
            comm, spec = start_backend(config, backend, pm)
        if comm.rank != config.rank:  # e.g. under mpiexec, MPI knows the rank
            configure_logging(config, rank=comm.rank)
        runtime = Runtime(config, comm, spec, pm, membership, starter=start_backend)
        runtime.joined_late = late
        if isinstance(comm, WatchedBackend):
            runtime.stall_inspector = start_inspector(comm, config, config.stall_warn_s)
        runtime.watch_membership()
        _runtime = runtime
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        if config.launched and comm.size > 1:
            install_excepthook()  # a peer's failure ends this rank with its own exit code
        pm.hook.tnt_runtime_started(runtime=runtime)
        return runtime


def _start_elastic(config: Config, name: str | None, pm: pluggy.PluginManager
                   ) -> tuple[CommBackend, BackendSpec, Config, Membership]:
    """An elastic job's process at start: its place in the newest generation (a
    replacement may start after further changes; a change while connecting starts over
    with the newer generation)."""
    started_late = config.member_id is not None  # by tnt run, for the running job
    member = config.rank if config.member_id is None else config.member_id
    with store_client(config) as store:
        store.interrupt = None  # its own waits are for the generations it asks for
        while True:
            membership = join_membership(store, member, config.timeout_s)
            config = in_membership(config.with_overrides(member_id=member), membership)
            if started_late and config.rank not in membership.joined:
                # it holds no state, in whichever generation it lands (its own may be gone)
                membership = dataclasses.replace(
                    membership, joined=tuple(sorted((*membership.joined, config.rank))))
            configure_logging(config)
            try:  # alone in its generation: the local backend (a named one needs peers)
                comm, spec = start_backend(config, "local" if config.size == 1 else name, pm)
            except CommError:
                if latest_generation(store) == membership.generation:
                    raise
                handled()  # the newer generation is joined: this failure explains nothing later
                continue
            return comm, spec, config, membership


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


def rejoin(timeout: float | None = None) -> CommBackend:
    """After a :class:`~tnt_core.CommError` in an elastic job: the backend over the job's
    next membership generation (:meth:`Runtime.rejoin`)."""
    return init().rejoin(timeout)


def membership_changed() -> bool:
    """True once an elastic job's membership changed and this rank has not rejoined
    (:meth:`Runtime.membership_changed`); never in a job that is not elastic."""
    return init().membership_changed()
