"""The rank runtime: one per process, started lazily, stopped at exit.

It reads the launcher environment, asks the plugins for backends, picks one and keeps it
for the life of the process. Backend choice is a hook, never an if/elif over names.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Iterable

import pluggy

from .backend import BackendSpec, CommBackend
from .config import Config
from .elastic import (
    GenerationWatcher,
    Membership,
    join_membership,
    latest_generation,
    read_membership,
)
from .errors import CommError, ConfigError, PluginError
from .launch_env import detect_mpi_launch
from .log import configure_logging, logger
from .peer_failure import install_excepthook
from .plugins import get_plugin_manager
from .rendezvous import StoreClient, connect_store
from .stall import StallInspector, WatchedBackend, ledger, start_inspector

__all__ = [
    "Runtime",
    "list_backends",
    "select_backend",
    "init",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_size",
    "get_master_rank",
    "is_master_rank",
    "rejoin",
    "membership_changed",
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
        raise PluginError(
            f"unknown backend {name!r} (TNT_BACKEND / --backend); installed: {_names(specs)}. "
            f"Install the package that provides it, e.g. pip install tnt-comm-{name}"
        )
    for spec in specs:
        if spec.is_available(config):
            return spec
    raise PluginError(
        f"no communication backend can run a job of {config.size} ranks; installed: "
        f"{_names(specs)}. Install one: pip install tnt-comm-gloo (or tnt-comm-mpi)"
    )


def _start_backend(config: Config, name: str | None,
                   pm: pluggy.PluginManager) -> tuple[CommBackend, BackendSpec]:
    """The chosen backend's communicator for ``config``, wrapped for the stall inspector
    in a multi-rank job."""
    spec = select_backend(config, name, pm)
    logger.debug("starting backend %r for rank %d of %d", spec.name, config.rank, config.size)
    comm = spec.factory(config)
    if not isinstance(comm, CommBackend):
        raise PluginError(
            f"backend {spec.name!r} factory returned {type(comm).__name__}, "
            "not a tnt_core.CommBackend"
        )
    if comm.size > 1:
        comm = WatchedBackend(comm)
    return comm, spec


def _in_membership(config: Config, membership: Membership) -> Config:
    """``config`` for this process's place in ``membership``."""
    member = config.rank if config.member_id is None else config.member_id
    rank = membership.rank_of(member)
    if rank is None:
        raise CommError(f"this process (rank {config.rank} of generation {config.generation}) "
                        f"is no longer part of the elastic job: {membership.describe_change()}",
                        rank=config.rank, operation="rejoin")
    return config.with_overrides(rank=rank, size=membership.size,
                                 local_rank=membership.local_rank(rank),
                                 local_size=membership.local_size(rank),
                                 generation=membership.generation, member_id=member)


def _store_client(config: Config) -> StoreClient:
    return connect_store(config, connect_timeout=10.0)


class Runtime:
    """The process's view of the job: rank, size and the chosen backend."""

    def __init__(self, config: Config, backend: CommBackend, spec: BackendSpec,
                 plugin_manager: pluggy.PluginManager,
                 membership: Membership | None = None) -> None:
        self.config = config
        #: the job's communicator; in a multi-rank job a :class:`~tnt_core.stall.WatchedBackend`
        #: around the plugin's backend (its ``inner``), which counts collectives for the
        #: stall inspector
        self.backend = backend
        self.backend_spec = spec
        self.plugin_manager = plugin_manager
        self.stall_inspector: StallInspector | None = None
        #: an elastic job's current generation (None: not an elastic job)
        self.membership = membership
        #: a newer generation the watcher saw (the backend was aborted for it)
        self.pending_membership: Membership | None = None
        self._watcher: GenerationWatcher | None = None
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

    @property
    def generation(self) -> int:
        """The elastic job's membership generation this runtime's backend spans (0: as
        started, and always in a job that is not elastic)."""
        return self.config.generation

    # -- elastic jobs ------------------------------------------------------------------------

    def watch_membership(self) -> None:
        """Abort the current backend as soon as a newer generation is published."""
        if self.membership is None or not self.config.rendezvous:
            return
        # weak: the watcher thread may outlive the runtime (it is a daemon blocked in the
        # store at exit) and must not keep the communicator alive
        runtime, backend = weakref.ref(self), weakref.ref(self.backend)
        config, generation = self.config, self.generation

        def changed(newer: Membership) -> None:
            owner, comm = runtime(), backend()
            if owner is not None:
                owner.pending_membership = newer
            if comm is not None:
                logger.info("elastic: %s; aborting the communicator of generation %d",
                            newer.describe_change(), generation)
                comm.abort(f"the elastic job's membership changed ({newer.describe_change()}); "
                           "call tnt_core.rejoin() for the new communicator")

        self._watcher = GenerationWatcher(lambda: _store_client(config), generation,
                                          changed).start()

    def membership_changed(self) -> bool:
        """True once a generation newer than this runtime's is published (its backend
        is then aborted: every collective fails until :meth:`rejoin`). Does not block."""
        return self.pending_membership is not None

    def rejoin(self, timeout: float | None = None) -> CommBackend:
        """Wait for the elastic job's next membership generation and return a backend over it.

        What a rank calls when a collective failed with :class:`~tnt_core.CommError` (a
        peer died, or the watcher aborted the backend because the membership changed).
        Waits up to ``timeout`` seconds (default ``TNT_TIMEOUT_S``) for ``tnt run`` to
        publish the generation after this one, takes the newest, closes the old backend
        and starts the same backend plugin over the new members. :attr:`rank`,
        :attr:`size`, :attr:`local_rank`, :attr:`local_size` and :attr:`membership`
        answer for the new generation afterwards; its ``joined`` ranks start with no
        state and must get it from rank 0, a survivor.

        :raises ConfigError: the job is not elastic.
        :raises CommError: no new generation within ``timeout``, or this process is not
            part of it (evicted: ``tnt run`` is about to end it).
        """
        if self.membership is None:
            raise ConfigError("tnt_core.rejoin() needs an elastic job: start it with "
                              "`tnt run --min-np M` (or --max-restarts R)")
        wait = self.config.timeout_s if timeout is None else timeout
        store = _store_client(self.config)
        store.interrupt = None  # its own waits are for the generations it asks for
        try:
            try:
                read_membership(store, self.generation + 1, wait)
            except CommError:
                raise CommError(f"no new membership generation within {wait:g}s after "
                                f"generation {self.generation}", rank=self.rank,
                                operation="rejoin") from None
            while True:
                newest = read_membership(store, latest_generation(store), wait)
                try:
                    self._bind(newest)
                    return self.backend
                except CommError:
                    if latest_generation(store) == newest.generation:
                        raise
                    # another change while connecting: the newest generation is the one
        finally:
            store.close()

    def _bind(self, membership: Membership) -> None:
        config = _in_membership(self.config, membership)
        self._retire()
        ledger().entered = 0  # every member of a generation numbers its collectives from 0
        name = "local" if config.size == 1 else (
            None if self.backend_spec.name == "local" else self.backend_spec.name)
        self.backend, self.backend_spec = _start_backend(config, name, self.plugin_manager)
        self.config, self.membership, self.pending_membership = config, membership, None
        configure_logging(config, rank=config.rank)
        if isinstance(self.backend, WatchedBackend):
            self.stall_inspector = start_inspector(self.backend, config, config.stall_warn_s)
        self.watch_membership()
        logger.info("elastic: rank %d of %d in %s", config.rank, config.size,
                    membership.describe_change())

    def _retire(self) -> None:
        """Stop watching the old generation and close its backend (aborted first: a
        collective with a departed rank must not hold the close up)."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self.stall_inspector is not None:
            self.stall_inspector.stop()
            self.stall_inspector = None
        try:
            self.backend.abort("this rank moves to a new membership generation")
            self.backend.close()
        except CommError as exc:
            logger.debug("closing the old generation's backend: %s", exc)

    def stop(self) -> None:
        """Run ``tnt_runtime_stopping`` hooks, then close the backend. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.plugin_manager.hook.tnt_runtime_stopping(runtime=self)
        finally:
            if self._watcher is not None:
                self._watcher.stop()
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
        membership = None
        pm = get_plugin_manager()
        if config.elastic and config.launched:
            comm, spec, config, membership = _start_elastic(config, backend, pm)
        else:
            comm, spec = _start_backend(config, backend, pm)
        if comm.rank != config.rank:  # e.g. under mpiexec, MPI knows the rank
            configure_logging(config, rank=comm.rank)
        runtime = Runtime(config, comm, spec, pm, membership)
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
    member = config.rank if config.member_id is None else config.member_id
    with _store_client(config) as store:
        store.interrupt = None  # its own waits are for the generations it asks for
        while True:
            membership = join_membership(store, member, config.timeout_s)
            config = _in_membership(config.with_overrides(member_id=member), membership)
            configure_logging(config)
            try:
                comm, spec = _start_backend(config, name, pm)
            except CommError:
                if latest_generation(store) == membership.generation:
                    raise
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
