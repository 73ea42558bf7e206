"""The rank runtime: one per process, started lazily, stopped at exit.

It reads the launcher environment, asks the plugins for backends, picks one and keeps it
for the life of the process. Backend choice is a hook, never an if/elif over names.
"""

from __future__ import annotations

import atexit
import difflib
import sys
import threading
from collections.abc import Iterable, Sequence

import pluggy

from .backend import BackendSpec, CommBackend
from .config import Config
from .errors import ConfigError, PluginError
from .launch_env import detect_mpi_launch
from .log import configure_logging, logger
from .peer_failure import install_excepthook
from .plugins import get_plugin_manager
from .stall import StallInspector, WatchedBackend, start_inspector

__all__ = [
    "Runtime",
    "list_backends",
    "select_backend",
    "unknown_backend_hint",
    "init",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_size",
    "get_master_rank",
    "is_master_rank",
]

MASTER_RANK = 0


def list_backends(pm: pluggy.PluginManager | None = None) -> list[BackendSpec]:
    """Every backend declared by installed plugins, highest priority first."""
    pm = pm or get_plugin_manager()
    specs: dict[str, BackendSpec] = {}
    for result in pm.hook.tnt_comm_backends():
        for spec in result or ():
            if not isinstance(spec, BackendSpec):
                raise PluginError(
                    f"a tnt plugin returned {spec!r} from tnt_comm_backends; "
                    "it must return a list of tnt_core.BackendSpec"
                )
            if spec.name in specs and specs[spec.name] is not spec:
                raise PluginError(
                    f"two installed plugins declare a backend named {spec.name!r}; "
                    "uninstall one, or block it with TNT_DISABLE_PLUGINS"
                )
            specs[spec.name] = spec
    return sorted(specs.values(), key=lambda s: (-s.priority, s.name))


def _names(specs: Iterable[BackendSpec]) -> str:
    return ", ".join(s.name for s in specs) or "none"


def unknown_backend_hint(name: str, installed: Sequence[str]) -> str:
    """What to say after "unknown backend NAME": the installed backend it likely means (the
    same name in other case, or a close spelling: ``Gloo``, ``glo``), else what to install."""
    listing = ", ".join(installed) or "none"
    by_case = {n.lower(): n for n in installed}
    close = difflib.get_close_matches(name.lower(), list(by_case), n=1, cutoff=0.6)
    if close:
        return f"did you mean {by_case[close[0]]}? installed: {listing}"
    return (f"installed: {listing}. Install the package that provides it, e.g. "
            f"pip install tnt-comm-{name.lower()}")


def _script() -> str:
    """The script this process runs, as its command line named it (for a message)."""
    arg = sys.argv[0] if sys.argv else ""
    return arg if arg.endswith(".py") else "script.py"


def select_backend(config: Config, name: str | None = None,
                   pm: pluggy.PluginManager | None = None) -> BackendSpec:
    """``name`` (or ``TNT_BACKEND``) if given, else the available backend of highest priority."""
    specs = list_backends(pm)
    name = name or config.backend
    if name:
        config = config.with_overrides(backend=name)
        for spec in specs:
            if spec.name == name:
                if not spec.is_available(config):
                    available = _names(s for s in specs if s.is_available(config))
                    launch = detect_mpi_launch()
                    if launch is not None and not config.launched and (launch.size or 0) != 1:
                        # under mpiexec/srun without tnt run: no TNT_SIZE, no store
                        raise PluginError(
                            f"backend {name!r} needs `tnt run` to start the job; this process "
                            f"was started by an MPI launcher ({launch.launcher}), which only the "
                            f"mpi backend can join. Run `tnt run -n N --backend {name} -- "
                            f"script.py`, or use TNT_BACKEND=mpi (available: {available})"
                        )
                    raise PluginError(
                        f"backend {name!r} is installed but cannot serve this job "
                        f"(rank {config.rank} of {config.size}); available: {available}"
                    )
                return spec
        raise PluginError(f"unknown backend {name!r} (TNT_BACKEND / --backend); "
                          + unknown_backend_hint(name, [s.name for s in specs]))
    for spec in specs:
        if spec.is_available(config):
            return spec
    if config.size > 1 and not config.rendezvous and detect_mpi_launch() is None:
        # TNT_SIZE set by hand (or left over): the backends decline for want of a store
        raise PluginError(
            f"TNT_SIZE={config.size} asks for a job of {config.size} ranks, but this process "
            "was not started by a launcher (no rendezvous store: TNT_RENDEZVOUS is not set); "
            f"start it with `tnt run -n {config.size} -- {_script()}`"
        )
    raise PluginError(
        f"no communication backend can run a job of {config.size} ranks; installed: "
        f"{_names(specs)}. Install one: pip install tnt-comm-gloo (or tnt-comm-mpi)"
    )


class Runtime:
    """The process's view of the job: rank, size and the chosen backend."""

    def __init__(self, config: Config, backend: CommBackend, spec: BackendSpec,
                 plugin_manager: pluggy.PluginManager) -> None:
        self.config = config
        #: the job's communicator; in a multi-rank job a :class:`~tnt_core.stall.WatchedBackend`
        #: around the plugin's backend (its ``inner``), which counts collectives for the
        #: stall inspector
        self.backend = backend
        self.backend_spec = spec
        self.plugin_manager = plugin_manager
        self.stall_inspector: StallInspector | None = None
        self._stopped = False

    # ranks come from the backend: under mpiexec MPI knows them, not the environment
    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    @property
    def local_rank(self) -> int:
        return self.backend.local_rank

    @property
    def local_size(self) -> int:
        return self.backend.local_size

    @property
    def master_rank(self) -> int:
        return MASTER_RANK

    @property
    def is_master(self) -> bool:
        return self.rank == MASTER_RANK

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        """Run ``tnt_runtime_stopping`` hooks, then close the backend. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.plugin_manager.hook.tnt_runtime_stopping(runtime=self)
        finally:
            if self.stall_inspector is not None:
                self.stall_inspector.stop()
            self.backend.close()

    def __repr__(self) -> str:
        return f"<Runtime rank {self.rank}/{self.size} backend {self.backend.name!r}>"


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
